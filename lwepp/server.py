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
                       we send back, so chunks are held (at most 10 MiB) and,
                       at the end, the held headers reply goes out followed
                       by the body. In other modes each chunk is acknowledged.
response_headers       With ``report_served`` (GIE's conformance tests), report
                       the endpoint the gateway says served the request
                       (``envoy.lb`` metadata) as a response header; add
                       whatever the choice's followup adds.
response_body chunks   Passed on, and to the choice's followup.
anything else          Acknowledge unchanged.
=====================  =====================================================

The headers reply names the endpoint twice, as the protocol requires: the
request header ``x-gateway-destination-endpoint`` (which an ORIGINAL_DST
cluster routes on) and the same value in dynamic metadata ``envoy.lb``; it
also clears the route cache so Envoy routes again with the new header.

The choice itself is the ``Strategy``'s (``lwepp.picking``): round-robin, or
the filter/scorer pipeline. What it returns may carry a ``Followup``, which
this service calls as the response passes (headers, body chunks, end); that
is the whole seam.

Refusals are ImmediateResponses with an HTTP status and an OpenAI-style
JSON error body, made in one place (``refuse``): 503 when no endpoint may
serve the request (the protocol's rule), 413 for a body over the cap, 431
when the routing headers would take the request's headers past Envoy's
limits (Envoy would refuse the mutation and answer 500), 500 for a bug
(logged with the request id).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Final

import structlog

from lwepp.metrics import ERROR_CODES, MODEL_HEADER, PickerMetrics
from lwepp.picking import (
    SUBSET_NAMESPACE,
    TEST_SELECTION_HEADER,
    Admitted,
    Followup,
    Pool,
    RequestControl,
    RequestInfo,
    Strategy,
    allowed_entries,
    candidates,
)
from pods.model import Endpoint
from wire import extproc
from wire.exchange import (
    MAX_BODY_BYTES,
    Exchange,
    Half,
    Refusal,
    check_headers_fit,
    header_value_problem,
)
from wire.extproc import BodyMode, HttpBody, ProcessingRequest, ProcessingResponse
from wire.stream import Stream

log = structlog.get_logger()

DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
SERVED_REPORT: Final = "x-conformance-test-served-endpoint"
ECHO_SET_HEADER: Final = "X-Echo-Set-Header"

GONE: Final = (("x-llm-d-request-dropped-reason", "rejected-no-endpoints"),)
"""What the router adds to its 503 for a pool without endpoints."""

UNCHANGED_RESPONSE_HEADERS: Final = extproc.headers_response("response")
"""The reply to response headers when nothing is reported or added: go on unchanged."""

MODES: Final = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
"""Body modes assumed when Envoy sends no ``protocol_config``: GIE's full-duplex request."""


class PickerState(Exchange):
    """What one stream remembers: the two halves, the request headers message (its metadata
    names the candidates), the candidates, the choice's followup, and what the request
    controls let through (when the service runs some)."""

    __slots__ = ("admitted", "candidates", "first", "followup")

    def __init__(self, limit: int) -> None:
        super().__init__(MODES, limit)
        self.first: ProcessingRequest | None = None
        self.candidates: tuple[Endpoint, ...] = ()
        self.followup: Followup | None = None
        self.admitted: Admitted | None = None


class EndpointPickerService:
    """The ext_proc handler: reads one stream top to bottom, answering each phase."""

    def __init__(
        self,
        pool: Pool,
        strategy: Strategy,
        metrics: PickerMetrics,
        max_body_bytes: int = MAX_BODY_BYTES,
        *,
        test_selection: bool = False,
        report_served: bool = False,
        controls: Sequence[RequestControl] = (),
    ) -> None:
        """Two switches for GIE's conformance tests, both off unless asked for.

        ``test_selection``: honour GIE's ``test-epp-endpoint-selection`` header,
        with which a client narrows the candidates (GIE's lwepp always does; its
        conformance tests pin replicas with it). Off, the header is ignored: a
        client cannot choose its replica.

        ``report_served``: tell the client which replica served it, the way GIE's
        lwepp does for its conformance tests: ``X-Echo-Set-Header`` on the request
        (the conformance echo server copies it into its response) and
        ``x-conformance-test-served-endpoint`` and ``x-went-into-resp-headers`` on
        the response. Off, no response names a replica's address.

        ``controls``: the request controls (``lwepp.picking.RequestControl``)
        that admit each request before its choice, in order.
        """
        self.pool = pool
        self.strategy = strategy
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.test_selection = test_selection
        self.report_served = report_served
        self.controls = tuple(controls)
        self.reads_response_body = any(c.reads_response_body for c in self.controls)
        """Whether a control's followup reads the response body (``RequestControl``)."""
        self.hears_response = (
            report_served
            or strategy.hears_response
            or any(c.hears_response or c.reads_response_body for c in self.controls)
        )
        """Whether this picker needs the response headers: for the report, or a followup.

        When it does not, the gateway may skip sending them (Envoy's
        ``response_header_mode: SKIP``; ``demo.envoy.picker_filter``), which
        saves each request one exchange with the picker before its response
        reaches the client. The picker tells its gateway in its ``listening``
        log line (``response_headers``). A picker that hears the response
        must get the headers: they end its in-flight counts.
        """
        # Speed, behind three names: a reply depends on the endpoint (or the report)
        # alone, and building its Struct is the costliest step of a stream, so each is
        # built once and reused; so are the counters' children. Bounded: pods come and go.
        self.routing_reply = functools.lru_cache(maxsize=4096)(
            functools.partial(routing_reply, report=report_served)
        )
        self.served_reply = functools.lru_cache(maxsize=4096)(served_endpoint_reply)
        self.request_counter = functools.lru_cache(maxsize=4096)(metrics.requests.labels)
        self.attempt_counter = functools.lru_cache(maxsize=4096)(metrics.attempts.labels)

    async def __call__(self, stream: Stream) -> None:
        state = PickerState(self.max_body_bytes)
        while (message := await stream.recv()) is not None:
            try:
                if self.controls and completes(message, state):
                    await self.admit(message, state)  # may rewrite, queue or refuse it
                match extproc.kind(message):
                    case "request_headers":
                        replies = self.on_request_headers(message, state)
                    case "request_body":
                        replies = self.on_request_body(message.request_body, state)
                    case "request_trailers":
                        replies = [
                            *self.finish_request(state, end_of_stream=False),
                            extproc.trailers_response("request"),
                        ]
                    case "response_headers":
                        replies = self.on_response_headers(message, state)
                    case "response_body":
                        replies = self.on_response_body(message.response_body, state)
                    case "response_trailers":
                        self.end_response(state)
                        replies = [extproc.trailers_response("response")]
                    case other:
                        raise Refusal(
                            500, f"unexpected message {other!r}", reason="unexpected_message"
                        )
            except Refusal as refusal:
                await stream.send(self.refuse(state, refusal))
                return
            except Exception:
                log.exception("request failed", request_id=state.request_id)
                internal = Refusal(500, "endpoint picker: internal error", reason="internal")
                await stream.send(self.refuse(state, internal))
                return
            for reply in replies:
                await stream.send(reply)

    def refuse(self, state: PickerState, refusal: Refusal) -> ProcessingResponse:
        """The one place a refusal becomes an HTTP answer (an ``ImmediateResponse``)."""
        labels = self.metrics.labels(state.request.headers)
        self.metrics.errors.labels(*labels, ERROR_CODES.get(refusal.status, "Internal")).inc()
        if refusal.status == 503:  # no endpoint could be picked: a failed scheduling attempt
            self.metrics.attempts.labels("failure", labels[1], "", "", "").inc()
        log.info(
            "request refused",
            status=refusal.status,
            reason=refusal.reason,
            request_id=state.request_id,
        )
        return refusal.answer()

    # --- request side ----------------------------------------------------------

    async def admit(self, message: ProcessingRequest, state: PickerState) -> None:
        """Run the request controls on the whole request, before the message that makes it
        whole is answered with the choice (``RequestControl``)."""
        if message.WhichOneof("request") == "request_headers":
            state.first, headers, body = (
                message,
                extproc.header_pairs(message.request_headers),
                None,
            )
        else:
            headers, body = state.request.headers, b"".join(state.request.chunks)
            if message.WhichOneof("request") == "request_body":
                body += message.request_body.body
        await self.admit_request(state, headers, body)
        if state.first is not None:  # the pool as it is now, as the router: it may have waited
            state.candidates = self.candidates_for(state.first, headers)

    async def admit_request(
        self, state: PickerState, headers: Sequence[tuple[str, str]], body: bytes | None
    ) -> None:
        """The request controls, in order, on the whole request (``body`` None: it has none):
        what they let through is ``state.admitted``, which the choice then sees (a composing
        handler calls this too, before ``destination``). Let through untouched, the request
        goes on as with no control: nothing is kept."""
        asked = admitted = Admitted(RequestInfo(headers, body))
        for control in self.controls:
            admitted = await control.admit(admitted)
        state.admitted = None if admitted is asked else admitted

    def on_request_headers(
        self, message: ProcessingRequest, state: PickerState
    ) -> list[ProcessingResponse]:
        """Work out the candidates now; pick now unless the body is coming to us."""
        state.use_modes(message)
        state.request.headers = extproc.header_pairs(message.request_headers)
        state.first = message
        if not self.controls:  # else once they admit it (``admit``)
            state.candidates = self.candidates_for(message, state.request.headers)
        if message.request_headers.end_of_stream or not state.request.streamed:
            return [self.route(state)]
        state.request.held = True
        return []

    def on_request_body(self, chunk: HttpBody, state: PickerState) -> list[ProcessingResponse]:
        if not state.request.held:
            return [pass_chunk(state.request, chunk)]
        state.request.hold(chunk.body)
        return self.finish_request(state) if chunk.end_of_stream else []

    def finish_request(
        self, state: PickerState, *, end_of_stream: bool = True
    ) -> list[ProcessingResponse]:
        """The held headers reply, then the body we kept, now that the body has ended.

        When trailers end it, the body sent back does not end the stream: the
        trailers that follow do (``end_of_stream=False``).
        """
        if not state.request.held:
            return []
        state.request.held = False
        body = state.request.take()
        if state.admitted is not None and state.admitted.body is not None:
            body = state.admitted.body  # a control changed it: this is what goes upstream
        chunks = extproc.streamed_body_responses("request", body, end_of_stream=end_of_stream)
        return [self.route(state, body), *chunks]

    def candidates_for(
        self, message: ProcessingRequest, headers: Sequence[tuple[str, str]]
    ) -> tuple[Endpoint, ...]:
        """The endpoints the request may go to now; 503 if none (with the llm-d router's
        ``x-llm-d-request-dropped-reason`` when the pool has none at all)."""
        endpoints = self.pool.endpoints
        if not endpoints:
            raise Refusal(503, "no ready endpoint in the pool", reason="no_endpoints", headers=GONE)
        test_header = (
            extproc.first_header(headers, TEST_SELECTION_HEADER) if self.test_selection else None
        )
        allowed = allowed_entries(extproc.filter_metadata(message, SUBSET_NAMESPACE), test_header)
        found = candidates(endpoints, allowed)
        if not found:
            raise Refusal(
                503,
                f"no ready endpoint matches the allowed subset {','.join(allowed or [])!r}",
                reason="no_candidates",
            )
        return found

    def route(self, state: PickerState, body: bytes | None = None) -> ProcessingResponse:
        """Ask the strategy (given the body, when it was held), then route to its choice."""
        endpoint = self.destination(state, body)
        if state.admitted is None or state.admitted.body is None:
            return self.routing_reply(endpoint)
        length = ("content-length", str(len(state.admitted.body)))  # the body a control set
        return extproc.headers_response(
            "request",
            [*routing_headers(endpoint, self.report_served), length],
            clear_route_cache=True,
            dynamic_metadata={extproc.LB_NAMESPACE: {DESTINATION: endpoint}},
        )

    def destination(self, state: PickerState, body: bytes | None = None) -> str:
        """The strategy's choice as the destination header's value, counted in the metrics.

        Several endpoints travel as one ordered list, ``ip:port,ip:port`` (GIE
        protocol v0.4.0): the proxy uses the first and walks the list on retries.
        The headers this adds must fit Envoy's limits with the client's own
        (``check_headers_fit``): a client near them gets 431, not Envoy's 500.
        """
        admitted = state.admitted
        request = RequestInfo(state.request.headers, body) if admitted is None else admitted.request
        chosen = self.strategy.choose(request, state.candidates)
        if not chosen.endpoints:
            raise Refusal(503, "no endpoint accepted the request", reason="no_pick")
        state.followup = chosen.followup
        primary = chosen.endpoints[0]
        if len(chosen.endpoints) == 1:
            endpoint = primary.hostport
        else:
            endpoint = ",".join(e.hostport for e in chosen.endpoints)
        check_headers_fit(
            "request", state.request.headers, routing_headers(endpoint, self.report_served)
        )
        target = (
            None
            if admitted is None
            else extproc.first_header(admitted.request.headers, MODEL_HEADER)
        )
        labels = self.metrics.labels(state.request.headers, target)
        self.request_counter(*labels).inc()
        self.attempt_counter(
            "success", labels[1], primary.pod, self.metrics.namespace, str(primary.port)
        ).inc()
        return endpoint

    # --- response side ----------------------------------------------------------

    def on_response_headers(
        self, message: ProcessingRequest, state: PickerState
    ) -> list[ProcessingResponse]:
        """Report the served endpoint (if asked to), with the headers the followups add."""
        if state.followup is None and state.admitted is None:
            if not self.report_served:
                return [UNCHANGED_RESPONSE_HEADERS]
            return [self.served_reply(served_report(message))]
        pairs = extproc.header_pairs(message.response_headers)
        first, served = dict(reversed(pairs)), served_endpoint(message)
        added = [pair for f in followups(state) for pair in f.headers(served, first)]
        # The body comes to us only in a body mode other than NONE, and only if there is one.
        if message.response_headers.end_of_stream or state.response.mode == BodyMode.NONE:
            self.end_response(state)
        if not self.report_served:
            return [extproc.headers_response("response", added)]
        return [served_endpoint_reply(served_report(message), tuple(added))]

    def on_response_body(self, chunk: HttpBody, state: PickerState) -> list[ProcessingResponse]:
        if state.admitted is not None and state.admitted.followups and state.response.streamed:
            body = chunk.body
            for followup in followups(state):
                sent = followup.chunk(body)  # a control may rewrite what goes on, or hold it
                body = body if sent is None else sent
            if chunk.end_of_stream:
                self.end_response(state)
            return extproc.streamed_body_responses(
                "response", body, end_of_stream=chunk.end_of_stream
            )
        if state.followup is not None or state.admitted is not None:
            for followup in followups(state):
                followup.chunk(chunk.body)
            if chunk.end_of_stream:
                self.end_response(state)
        return [pass_chunk(state.response, chunk)]

    @staticmethod
    def end_response(state: PickerState) -> None:
        """Tell the followups, once, that the response is over."""
        if state.followup is None and state.admitted is None:
            return
        ending = list(followups(state))
        state.followup, state.admitted = None, None
        for followup in ending:
            followup.end()


def followups(state: PickerState) -> Iterator[Followup]:
    """The response's listeners: the request controls' (in their order), then the choice's."""
    if state.admitted is not None:
        yield from state.admitted.followups
    if state.followup is not None:
        yield state.followup


def completes(message: ProcessingRequest, state: PickerState) -> bool:
    """Whether ``message`` makes the request whole for its choice: headers that end it or
    that are answered at once (a body not streamed to us), or the end of a held body."""
    match message.WhichOneof("request"):
        case "request_headers":
            state.use_modes(message)
            return message.request_headers.end_of_stream or not state.request.streamed
        case "request_body":
            return state.request.held and message.request_body.end_of_stream
        case "request_trailers":
            return state.request.held
    return False


def routing_headers(endpoint: str, report: bool = False) -> list[tuple[str, str]]:
    """The request headers that name ``endpoint`` (``ip:port``, or a list); with ``report``,
    also the one that asks GIE's conformance echo server to name it in its response."""
    if not report:
        return [(DESTINATION, endpoint)]
    return [(DESTINATION, endpoint), (ECHO_SET_HEADER, f"{SERVED_REPORT}:{endpoint}")]


def routing_reply(endpoint: str, report: bool = False) -> ProcessingResponse:
    """The headers reply that sends the request to ``endpoint`` (``ip:port``, or a list)."""
    return extproc.headers_response(
        "request",
        routing_headers(endpoint, report),
        clear_route_cache=True,
        dynamic_metadata={extproc.LB_NAMESPACE: {DESTINATION: endpoint}},
    )


def served_report(message: ProcessingRequest) -> str:
    """What to report as the served endpoint: the ``ip:port``, or GIE's failure string.

    A value no header can carry (the gateway's to set, so never expected) is
    reported as a failure too, rather than handed to Envoy, which would fail
    the response.
    """
    if extproc.LB_NAMESPACE not in message.metadata_context.filter_metadata:
        return "fail: missing envoy lb metadata"
    served = served_endpoint(message)
    if served is None:
        return "fail: missing destination endpoint served metadata"
    if header_value_problem(served):
        return "fail: destination endpoint served metadata is no header value"
    return served


def served_endpoint(message: ProcessingRequest) -> str | None:
    """The ``ip:port`` the gateway reports in ``envoy.lb`` metadata, or None if it did not.

    The protocol has the data plane put it under ``x-gateway-destination-endpoint-served``.
    Read straight from the ``Struct``: converting the namespace to a dict
    (``extproc.filter_metadata``) costs more than the rest of the response side together.
    """
    entries = message.metadata_context.filter_metadata
    if extproc.LB_NAMESPACE not in entries:
        return None
    value = entries[extproc.LB_NAMESPACE].fields.get(SERVED)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)


def served_endpoint_reply(report: str, extra: Sequence[tuple[str, str]] = ()) -> ProcessingResponse:
    """Report, as a response header, the endpoint the gateway says served the request.

    ``report`` is ``served_report``'s; ``extra`` headers follow it.
    """
    return extproc.headers_response(
        "response", [(SERVED_REPORT, report), ("x-went-into-resp-headers", "true"), *extra]
    )


def pass_chunk(half: Half, chunk: HttpBody) -> ProcessingResponse:
    """Let a body chunk through unchanged.

    In FULL_DUPLEX_STREAMED mode Envoy forwards only what the processor sends
    back, so the chunk is returned; in the other modes an empty answer means
    "continue with it as it is".
    """
    if half.streamed:
        return extproc.body_response(
            half.phase, streamed_body=chunk.body, end_of_stream=chunk.end_of_stream
        )
    return extproc.body_response(half.phase)
