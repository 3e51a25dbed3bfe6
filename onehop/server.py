"""One hop for a single gateway: BBR's job and the pool's pick in the same ext_proc stream.

GIE's topology calls Python twice per request: BBR (a filter of its own)
reads the body and sets ``X-Gateway-Model-Name``; Envoy matches the routes
again; the matched pool's endpoint picker (a second filter, a second gRPC
stream) names the endpoint. Each hop costs a stream's worth of gRPC and
Python whatever the service does (``make bench-overhead``), so a gateway
that runs both services itself, on one machine, can do both in one stream.

``OneHop`` is that stream. It keeps GIE's two services' rules, reusing their
code, through each package's API alone (``bbr`` and ``lwepp`` list it),
rather than restating it:

``request_headers``
    Kept, with the message (its ``envoy.lb.subset_hint`` metadata names the
    candidates). In ``FULL_DUPLEX_STREAMED`` the answer is held until the
    body ends, as both services hold it; otherwise it goes now, unchanged.
    Headers that end the request (no body) are routed at once.
``request_body``
    Held (at most ``--max-body-bytes``); at its end BBR's request chain runs
    (``BodyBasedRouter.read_request``: not a JSON object is 400). The model
    it found names the pool (``--pool NAME=MODEL,...``); that pool's picker
    (``EndpointPickerService``) runs its request controls (its model rewrite
    may change the body sent on; flow control may hold or refuse the request
    here) and chooses among its candidates, given the request's headers as
    BBR changed them and the body. One answer carries
    both services' header changes, the ``envoy.lb`` metadata and
    ``clear_route_cache``; in full duplex the body follows it. A model no
    pool serves is answered with BBR's changes alone, so Envoy's routes
    answer it (404) as they do behind two hops.
``request_trailers``
    End a streamed body whose last chunk had no ``end_of_stream``, as in both.
``response_*``
    The picker's: the served-endpoint report and the pick's followup.

Refusals and errors become an ``ImmediateResponse`` in one place
(``OneHop.refusal``): counted by the pool's picker once a pool was chosen
(``llm_d_epp_request_error_total``), by BBR before (``bbr_errors_total``).

What is lost against two hops: Envoy's own route match between the services
(the one hop maps models to pools itself, from its flags, which must agree
with the routes), a pool-by-pool failure mode (the one service is BBR, which
fails closed, so every pool does), and separate scaling of the two services.
Neither service knows of the other, or of this package: ``onehop`` stands
above both, the one place that imports both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, final

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from bbr import BodyBasedRouter
from lwepp import (
    DESTINATION,
    MODEL_HEADER,
    EndpointPickerService,
    PickerState,
    pass_chunk,
    routing_headers,
)
from wire import extproc
from wire.exchange import MAX_BODY_BYTES, Refusal, check_headers_fit
from wire.extproc import ProcessingRequest, ProcessingResponse
from wire.stream import Stream

log = structlog.get_logger()

ANY_MODEL: Final = "*"
"""``--pool NAME=*``: the pool for any model no other pool names (one pool, one machine)."""


class OneHopState(PickerState):
    """A picker's stream state (the headers message among it), plus the pool's picker, once
    chosen."""

    __slots__ = ("picker",)

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.picker: EndpointPickerService | None = None


@final
class OneHop:
    """The ext_proc handler (``wire.stream.Handler``): BBR's chain, then the model's pool's pick.

    ``router`` runs the request chain (its response chain is not run here: GIE's
    BBR has no response plugin by default, and the picker owns the response);
    ``pickers`` maps each model name to its pool's picker service; the pool of
    ``ANY_MODEL`` takes the models no other names, and requests that name none.
    """

    def __init__(
        self,
        router: BodyBasedRouter,
        pickers: Mapping[str, EndpointPickerService],
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.router = router
        self.pickers = dict(pickers)
        self.max_body_bytes = max_body_bytes
        self.hears_response = any(picker.hears_response for picker in self.pickers.values())
        """Whether some pool's picker needs the response headers (``EndpointPickerService``'s)."""
        self.reads_response_body = any(p.reads_response_body for p in self.pickers.values())
        """Whether some pool's picker reads the response body (its request controls)."""

    async def __call__(self, stream: Stream) -> None:
        state = OneHopState(self.max_body_bytes)
        while (message := await stream.recv()) is not None:
            picker = state.picker
            try:
                match extproc.kind(message):
                    case "request_headers":
                        replies = await self.request_headers(message, state)
                    case "request_body":
                        replies = await self.request_body(message.request_body, state)
                    case "request_trailers":
                        finished = (
                            await self.finish(state, end_of_stream=False)
                            if state.request.held
                            else []
                        )
                        replies = [*finished, extproc.trailers_response("request")]
                    case "response_headers" if picker is not None:
                        replies = picker.on_response_headers(message, state)
                    case "response_body" if picker is not None:
                        replies = picker.on_response_body(message.response_body, state)
                    case "response_headers":  # no pool chose: Envoy's own answer (a 404)
                        replies = [extproc.headers_response("response")]
                    case "response_body":
                        replies = [pass_chunk(state.response, message.response_body)]
                    case "response_trailers":
                        EndpointPickerService.end_response(state)
                        replies = [extproc.trailers_response("response")]
                    case other:
                        raise ValueError(f"unexpected ext_proc message {other!r}")
            except Exception as error:
                await stream.send(self.refusal(state, error))  # the exchange ends here
                return
            for reply in replies:
                await stream.send(reply)

    def refusal(self, state: OneHopState, error: Exception) -> ProcessingResponse:
        """The one place an error becomes an HTTP answer: the pool's picker counts a refusal
        once it was chosen, BBR before that (and every unexpected error, as a 500)."""
        if state.picker is not None and isinstance(error, Refusal):
            return state.picker.refuse(state, error)
        return self.router.refusal(state, error)

    async def request_headers(
        self, message: ProcessingRequest, state: OneHopState
    ) -> list[ProcessingResponse]:
        """Keep the headers; route now if no body follows, else answer or hold as BBR does."""
        self.router.metrics.requests.inc()
        state.use_modes(message)
        state.first = message
        state.request.headers = extproc.header_pairs(message.request_headers)
        if message.request_headers.end_of_stream:
            return [await self.route(state, [], [], None, headers=True)]
        if state.request.streamed:
            state.request.held = True
            return []
        return [extproc.headers_response("request")]

    async def request_body(self, chunk: Any, state: OneHopState) -> list[ProcessingResponse]:
        """Hold a chunk; at the end of the body, run BBR's chain and pick."""
        state.request.hold(chunk.body)
        if state.request.streamed and not chunk.end_of_stream:
            return []
        return await self.finish(state, end_of_stream=True)

    async def finish(self, state: OneHopState, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """BBR's chain on the whole body, then the pick, in one answer (then the body, streamed).

        In full duplex the answer is the held headers reply and the body
        follows it (Envoy forwards only what we send back); with a buffered
        body it is the body reply, carrying the body only if BBR (or a
        request control) changed it.
        """
        half = state.request
        message = self.router.read_request(state)
        set_headers, remove = message.header_changes()
        check_headers_fit("request", half.headers, set_headers, remove)  # as BBR: 431
        held, half.held = half.held, False
        if not half.streamed:
            new_body = message.raw if message.body_mutated else None
            return [await self.route(state, set_headers, remove, message.raw, new_body=new_body)]
        if not held:  # a body without headers before it, which Envoy never sends
            return extproc.streamed_body_responses(
                "request", message.raw, end_of_stream=end_of_stream
            )
        answer = await self.route(state, set_headers, remove, message.raw, headers=True)
        body = upstream_body(state) or message.raw
        return [
            answer,
            *extproc.streamed_body_responses("request", body, end_of_stream=end_of_stream),
        ]

    async def route(
        self,
        state: OneHopState,
        set_headers: list[tuple[str, str]],
        remove: list[str],
        body: bytes | None,
        *,
        headers: bool = False,
        new_body: bytes | None = None,
    ) -> ProcessingResponse:
        """Pick in the model's pool, if one serves it; answer with every header change.

        ``body`` is what the pool's request controls and strategy see (None:
        the request had none). The controls run after BBR's chain named the
        pool and before its pick (``EndpointPickerService.admit_request``): they
        may hold the request (flow control), refuse it, or change its body,
        which then goes upstream with its length. The answer is a ``headers``
        reply, or else a body reply replacing the body with ``new_body`` when
        given. Either way it clears the route cache, so Envoy matches the
        routes again, by model, and the pool's ORIGINAL_DST cluster follows
        the destination header.
        """
        half = state.request
        half.headers = with_changes(half.headers, set_headers, remove)
        model = extproc.first_header(half.headers, MODEL_HEADER) or ANY_MODEL
        picker = self.pickers.get(model) or self.pickers.get(ANY_MODEL)
        metadata = None
        if picker is not None and state.first is not None:
            state.picker = picker
            if picker.controls:
                await picker.admit_request(state, half.headers, body)
            state.candidates = picker.candidates_for(state.first, half.headers)  # then, as it is
            endpoint = picker.destination(state, body)
            set_headers = [*set_headers, *routing_headers(endpoint, picker.report_served)]
            if (changed := upstream_body(state)) is not None:  # its length replaces BBR's
                set_headers = [(n, v) for n, v in set_headers if n.lower() != "content-length"]
                set_headers.append(("content-length", str(len(changed))))
                new_body = changed if not headers else new_body  # streamed: ``finish`` sends it
            metadata = {extproc.LB_NAMESPACE: {DESTINATION: endpoint}}
        if headers:
            return extproc.headers_response(
                "request", set_headers, remove, clear_route_cache=True, dynamic_metadata=metadata
            )
        answer = extproc.body_response(
            "request", set_headers, remove, clear_route_cache=True, body=new_body
        )
        if metadata is not None:
            answer.dynamic_metadata.CopyFrom(extproc.struct(metadata))
        return answer


def upstream_body(state: OneHopState) -> bytes | None:
    """The body a request control set to go upstream instead (None: unchanged)."""
    return state.admitted.body if state.admitted is not None else None


def with_changes(
    headers: Sequence[tuple[str, str]],
    set_headers: Sequence[tuple[str, str]],
    remove: Iterable[str],
) -> list[tuple[str, str]]:
    """``headers`` as Envoy has them after the mutation (a set overwrites; names lower-cased)."""
    if not set_headers and not remove:
        return list(headers)
    gone = {name.lower() for name, _ in set_headers} | {name.lower() for name in remove}
    kept = [(name, value) for name, value in headers if name.lower() not in gone]
    return [*kept, *((name.lower(), value) for name, value in set_headers)]


# --- one metrics page over several pools ------------------------------------------------


class Registries:
    """A collector over several registries: each pool's picker keeps its own metrics (their
    names collide across pools), and the one ``/metrics`` page shows them all, each family once
    with every pool's samples (a sample two registries share, the build's ``*_info``, once)."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for registry in self.registries:
            for family in registry.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        merged.samples.append(sample)
        yield from families.values()
