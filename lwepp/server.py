"""The LWEPP ext_proc service: one stream per HTTP request, one endpoint per stream.

What Envoy sends and what the picker answers (GIE endpoint-picker protocol,
following GIE's lwepp except where ``docs/differences.md`` says otherwise):

=====================  =====================================================
Envoy sends            LWEPP answers
=====================  =====================================================
request_headers        If the headers end the request, or Envoy does not
                       stream the body to us: pick now and reply. Otherwise
                       hold the reply: the pick waits for the whole body, as
                       in GIE (a body-aware picker needs it).
request_body chunks    In FULL_DUPLEX_STREAMED mode Envoy forwards only what
                       we send back, so chunks are kept (at most 10 MiB) and,
                       at the end, the held headers reply goes out followed
                       by the body. In other modes each chunk is acknowledged.
response_headers       Report the endpoint the gateway says served the
                       request (``envoy.lb`` metadata) as a response header.
anything else          Acknowledge unchanged.
=====================  =====================================================

The headers reply names the endpoint twice, as the protocol requires: the
request header ``x-gateway-destination-endpoint`` (which an ORIGINAL_DST
cluster routes on) and the same value in dynamic metadata ``envoy.lb``; it
also clears the route cache so Envoy routes again with the new header.

Refusals are ImmediateResponses with an HTTP status: 503 when no endpoint may
serve the request (the protocol's rule), 413 for a body over the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from lwepp.picking import (
    SUBSET_NAMESPACE,
    TEST_SELECTION_HEADER,
    PickRequest,
    Pool,
    Strategy,
    allowed_entries,
    candidates,
)
from pods.model import Endpoint
from protos import extproc
from protos.extproc import BodyMode, ProcessingRequest, ProcessingResponse
from protos.server import Stream

log = structlog.get_logger()

DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
SERVED_REPORT: Final = "x-conformance-test-served-endpoint"
ECHO_SET_HEADER: Final = "X-Echo-Set-Header"
MAX_BODY_BYTES: Final = 10 * 1024 * 1024


class Refusal(Exception):
    """A request the picker answers with an HTTP error instead of an endpoint."""

    def __init__(
        self, status: int, reason: str, message: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.headers = headers


@dataclass(slots=True)
class RequestState:
    """What one stream remembers between messages."""

    headers: list[tuple[str, str]] = field(default_factory=list)
    candidates: tuple[Endpoint, ...] = ()
    body_mode: int | None = None
    response_body_mode: int | None = None
    deferred: bool = False
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    exchange: Any = None
    """What a hosted pipeline keeps from the pick for the response side (``lwepp/hooked.py``)."""


class Metrics:
    """The picker's Prometheus metrics, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("lwepp_requests", "ext_proc streams handled", registry=registry)
        self.picks = Counter(
            "lwepp_picks", "requests sent to each endpoint", ["endpoint"], registry=registry
        )
        self.errors = Counter(
            "lwepp_errors", "requests refused or failed, by reason", ["reason"], registry=registry
        )
        self.endpoints = Gauge("lwepp_endpoints", "endpoints in the pool now", registry=registry)


class EndpointPickerService:
    """The ext_proc handler: reads one stream top to bottom, answering each phase."""

    def __init__(
        self,
        pool: Pool,
        picker: Strategy,
        metrics: Metrics,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.pool = pool
        self.picker = picker
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        metrics.endpoints.set_function(lambda: len(pool.endpoints))
        # The reply depends on the endpoint alone, so each is built once and reused:
        # building a Struct for the metadata is the costliest step of a pick. The
        # same goes for the served-endpoint report and each endpoint's counter.
        self._routing_replies: dict[str, ProcessingResponse] = {}
        self._served_replies: dict[str, ProcessingResponse] = {}
        self._pick_counters: dict[str, Any] = {}

    async def __call__(self, stream: Stream) -> None:
        state = RequestState()
        self.metrics.requests.inc()
        while (message := await stream.recv()) is not None:
            try:
                match extproc.kind(message):
                    case "request_headers":
                        replies = self.on_request_headers(message, state)
                    case "request_body":
                        replies = self.on_request_body(message, state)
                    case "request_trailers":
                        replies = [
                            *self.finish_request(state),
                            extproc.trailers_response("request"),
                        ]
                    case "response_headers":
                        replies = self.on_response_headers(message, state)
                    case "response_body":
                        replies = self.on_response_body(message, state)
                    case "response_trailers":
                        replies = self.on_response_trailers(state)
                    case other:
                        raise Refusal(500, "unexpected_message", f"unexpected message {other!r}")
            except Refusal as refusal:
                await self.refuse(stream, state, refusal)
                return
            except Exception:
                log.exception("request failed", request_id=_request_id(state))
                internal = Refusal(500, "internal", "endpoint picker: internal error")
                await self.refuse(stream, state, internal)
                return
            for reply in replies:
                await stream.send(reply)

    # --- request side ----------------------------------------------------------

    def on_request_headers(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        """Work out the candidates now; pick now unless the body is coming to us."""
        state.headers = extproc.header_pairs(message.request_headers)
        modes = extproc.body_modes(message)
        if modes is not None:
            state.body_mode, state.response_body_mode = modes
        state.candidates = self.candidates_for(message, state.headers)
        # Without protocol_config (older Envoy) assume full-duplex, as GIE does.
        body_comes_back = state.body_mode in (None, BodyMode.FULL_DUPLEX_STREAMED)
        if message.request_headers.end_of_stream or not body_comes_back:
            return [self.pick(state)]
        state.deferred = True
        return []

    def on_request_body(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        chunk = message.request_body
        if not state.deferred:
            return [pass_chunk("request", chunk, state.body_mode)]
        state.size += len(chunk.body)
        if state.size > self.max_body_bytes:
            raise Refusal(
                413,
                "body_too_large",
                f"request body exceeds the endpoint picker's limit of {self.max_body_bytes} bytes",
            )
        state.chunks.append(chunk.body)
        return self.finish_request(state) if chunk.end_of_stream else []

    def finish_request(self, state: RequestState) -> list[ProcessingResponse]:
        """The held headers reply, then the body we kept, now that the body has ended."""
        if not state.deferred:
            return []
        state.deferred = False
        body, state.chunks = b"".join(state.chunks), []
        return [self.pick(state, body), *extproc.streamed_body_responses("request", body)]

    def candidates_for(
        self, message: ProcessingRequest, headers: Sequence[tuple[str, str]]
    ) -> tuple[Endpoint, ...]:
        endpoints = self.pool.endpoints
        if not endpoints:
            raise Refusal(503, "no_endpoints", "no ready endpoint in the pool")
        allowed = allowed_entries(
            extproc.filter_metadata(message, SUBSET_NAMESPACE),
            extproc.first_header(headers, TEST_SELECTION_HEADER),
        )
        found = candidates(endpoints, allowed)
        if not found:
            raise Refusal(
                503,
                "no_candidates",
                f"no ready endpoint matches the allowed subset {','.join(allowed or [])!r}",
            )
        return found

    def pick(self, state: RequestState, body: bytes | None = None) -> ProcessingResponse:
        """Ask the picker (given the body, when it was held), then route to its choice."""
        return self.route(self.picker.pick(PickRequest(state.headers, body), state.candidates))

    def route(self, chosen: Sequence[Endpoint]) -> ProcessingResponse:
        """The headers reply sending the request to ``chosen[0]``, the others being fallbacks.

        Several endpoints travel as one ordered list, ``ip:port,ip:port`` (GIE
        protocol v0.4.0): the proxy uses the first and walks the list on retries.
        """
        if not chosen:
            raise Refusal(503, "no_pick", "no endpoint accepted the request")
        first = chosen[0].hostport
        counter = self._pick_counters.get(first)
        if counter is None:
            counter = _remember(self._pick_counters, first, self.metrics.picks.labels(first))
        counter.inc()
        endpoint = ",".join(e.hostport for e in chosen) if len(chosen) > 1 else first
        reply = self._routing_replies.get(endpoint)
        if reply is None:
            reply = _remember(self._routing_replies, endpoint, routing_reply(endpoint))
        return reply

    async def refuse(self, stream: Stream, state: RequestState, refusal: Refusal) -> None:
        self.metrics.errors.labels(refusal.reason).inc()
        log.info(
            "request refused",
            status=refusal.status,
            reason=refusal.reason,
            request_id=_request_id(state),
        )
        reply = extproc.immediate_response(refusal.status, refusal.message, refusal.headers)
        await stream.send(reply)

    # --- response side ----------------------------------------------------------

    def on_response_headers(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        """Report the served endpoint; a hosted pipeline adds its hooks' headers (``hooked``)."""
        served = served_report(message)
        reply = self._served_replies.get(served)
        if reply is None:
            reply = _remember(self._served_replies, served, served_endpoint_reply(message))
        return [reply]

    def on_response_body(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        return [pass_chunk("response", message.response_body, state.response_body_mode)]

    def on_response_trailers(self, state: RequestState) -> list[ProcessingResponse]:
        return [extproc.trailers_response("response")]


def routing_reply(endpoint: str) -> ProcessingResponse:
    """The headers reply that sends the request to ``endpoint`` (``ip:port``)."""
    return extproc.headers_response(
        "request",
        [
            (DESTINATION, endpoint),
            # GIE's conformance echo server copies this into a response header.
            (ECHO_SET_HEADER, f"{SERVED_REPORT}:{endpoint}"),
        ],
        clear_route_cache=True,
        dynamic_metadata={extproc.LB_NAMESPACE: {DESTINATION: endpoint}},
    )


# --- response side ---------------------------------------------------------------


def served_report(message: ProcessingRequest) -> str:
    """What to report as the served endpoint: the ``ip:port``, or GIE's failure string.

    The protocol has the data plane put it in ``envoy.lb`` metadata under
    ``x-gateway-destination-endpoint-served``. Read straight from the
    ``Struct``: converting the namespace to a dict (``extproc.filter_metadata``)
    cost more than the rest of the response side together.
    """
    if extproc.LB_NAMESPACE not in message.metadata_context.filter_metadata:
        return "fail: missing envoy lb metadata"
    served = served_endpoint(message)
    return "fail: missing destination endpoint served metadata" if served is None else served


def served_endpoint(message: ProcessingRequest) -> str | None:
    """The ``ip:port`` the gateway reports in ``envoy.lb`` metadata, or None if it did not."""
    entries = message.metadata_context.filter_metadata
    if extproc.LB_NAMESPACE not in entries:
        return None
    value = entries[extproc.LB_NAMESPACE].fields.get(SERVED)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)


def served_endpoint_reply(
    message: ProcessingRequest, extra: Sequence[tuple[str, str]] = ()
) -> ProcessingResponse:
    """Report, as a response header, the endpoint the gateway says served the request.

    The failure strings are GIE's (``served_report``). ``extra`` headers
    follow the report.
    """
    return extproc.headers_response(
        "response",
        [(SERVED_REPORT, served_report(message)), ("x-went-into-resp-headers", "true"), *extra],
    )


def _remember(cache: dict[str, Any], key: str, value: Any) -> Any:
    """Keep ``value`` under ``key``; endpoints come and go, so the cache stays bounded."""
    if len(cache) > 4096:
        cache.clear()
    cache[key] = value
    return value


def pass_chunk(phase: extproc.Phase, chunk: Any, body_mode: int | None) -> ProcessingResponse:
    """Let a body chunk through unchanged.

    In FULL_DUPLEX_STREAMED mode Envoy forwards only what the processor sends
    back, so the chunk is returned; in the other modes an empty answer means
    "continue with it as it is".
    """
    if body_mode == BodyMode.FULL_DUPLEX_STREAMED:
        return extproc.body_response(
            phase, streamed_body=chunk.body, end_of_stream=chunk.end_of_stream
        )
    return extproc.body_response(phase)


def _request_id(state: RequestState) -> str | None:
    return extproc.first_header(state.headers, "x-request-id")
