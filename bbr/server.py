"""The BBR ext_proc service: read the body, run the plugins, let the gateway route on the result.

Envoy opens one ext_proc stream per HTTP exchange. What it sends, and what
BBR answers (as GIE's BBR at 670c0a21 except where marked *ours*):

``request_headers``
    Kept. If no body follows (``end_of_stream``), or the body is not streamed
    to us, answered at once, unchanged. In ``FULL_DUPLEX_STREAMED`` the answer
    is *held*: Envoy keeps the request until we answer its headers, and the
    header we add (the model) is only known once the body is read.
``request_body``
    Chunks are held, at most ``--max-body-bytes`` (*ours*: GIE has no cap;
    more is answered 413). At the end of the body, it is parsed once (if a
    plugin needs it: not a JSON object is 400) and the request chain runs.
    Then, in ``FULL_DUPLEX_STREAMED``, the held headers answer goes out with
    the header changes, ``Content-Length`` and ``clear_route_cache``, followed
    by the body as ``streamed_response`` chunks of at most 62,000 bytes: in
    this mode Envoy forwards only what we send back. Otherwise (``BUFFERED``)
    one ``request_body`` answer carries the header changes,
    ``clear_route_cache``, and the body only if a plugin changed it.
``request_trailers``
    Answered unchanged. With full duplex Envoy requires trailers to be sent
    to us, and when they follow, the body's last chunk has no
    ``end_of_stream``: the trailers end it, so the held answer goes first
    (*ours*: GIE waits for an end of body that never comes).
``response_headers``, ``response_body``, ``response_trailers``
    The same with the response chain, except that a response that is not a
    JSON object passes unchanged, and one larger than the cap passes
    unchanged, streamed on. With no response plugins a streamed response
    flows straight through, chunk by chunk (*ours*: GIE holds it to the
    end, delaying every token of a streamed completion).

``clear_route_cache`` is what makes the routing work: Envoy matches routes
before BBR runs; clearing the cache makes it match them again, now with
``X-Gateway-Model-Name`` set.

Which body mode a direction uses comes from Envoy's ``protocol_config`` on the
first message (Envoy 1.34 and later); an older proxy sends none, and then
``--streaming`` says whether to expect full duplex (GIE's chart sets it).

Header changes are checked before they go (``Message.set_header``, then
``check_headers_fit`` on the whole): a value Envoy would refuse is a 400
naming the header and the field, headers grown past Envoy's limits a 431.
Envoy would otherwise refuse the mutation and answer 500 with no body.

Errors become an ``ImmediateResponse`` in one place, ``BodyBasedRouter.refusal``:
a ``Refusal`` with its own status and message, as an OpenAI-style JSON error
(GIE's BBR answers plain text); anything else (a bug, in a plugin
or here) is logged with the request id and answered 500. Either way the
stream then ends normally.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, final

import structlog
from prometheus_client import CollectorRegistry

from bbr.message import Message
from bbr.plugins import DEFAULT_PLUGINS, BBRMetrics, Chains, PluginSpec, build_chains
from plugin_api import Factory
from wire import extproc
from wire.exchange import MAX_BODY_BYTES, Exchange, Half, Refusal, check_headers_fit
from wire.extproc import BodyMode, HttpBody, HttpHeaders, ProcessingResponse
from wire.stream import EXT_PROC_SERVICE, Stream

HEALTH_SERVICES: Final = ("", EXT_PROC_SERVICE)
"""Health names reported SERVING (GIE's BBR answers SERVING for any name)."""

log = structlog.get_logger()


class RouteState(Exchange):
    """What one stream remembers: the two halves, and whether the response flows through."""

    __slots__ = ("flowing",)

    def __init__(self, modes: tuple[int, int], limit: int) -> None:
        super().__init__(modes, limit)
        self.flowing = False
        """Response chunks go back as they arrive, untouched (no plugin will read them)."""


@final
class BodyBasedRouter:
    """The ext_proc handler (``wire.stream.Handler``): one call per stream."""

    def __init__(
        self,
        registry: CollectorRegistry,
        specs: Sequence[PluginSpec] | Chains = DEFAULT_PLUGINS,
        *,
        streaming: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
        plugin_types: Mapping[str, Factory] | None = None,
    ) -> None:
        """Make the plugins of ``specs``, ``--plugin`` flags or a configuration's ``chains``
        (raises ``ConfigError``); metrics go to ``registry``."""
        self.metrics: Final = BBRMetrics(registry)
        self.plugins: Final[list[object]] = []
        """Every plugin made, in configuration order (for what feeds them: ``bbr.assembly``)."""
        if callable(specs):
            self.request_chain, self.response_chain = specs(self.metrics, self.plugins)
        else:
            self.request_chain, self.response_chain = build_chains(
                specs, self.metrics, plugin_types, self.plugins
            )
        self.background: Final[list[Callable[[], Coroutine[Any, Any, None]]]] = []
        """What keeps the plugins' data current while BBR serves (added by ``bbr.assembly``)."""
        mode = BodyMode.FULL_DUPLEX_STREAMED if streaming else BodyMode.BUFFERED
        self.modes: Final = (mode, mode)
        self.max_body_bytes: Final = max_body_bytes

    async def __call__(self, stream: Stream) -> None:
        state = RouteState(self.modes, self.max_body_bytes)
        while (message := await stream.recv()) is not None:
            state.use_modes(message)
            try:
                match extproc.kind(message):
                    case "request_headers":
                        replies = self.request_headers(message.request_headers, state)
                    case "request_body":
                        replies = self.request_body(message.request_body, state)
                    case "request_trailers":
                        replies = self.trailers(state.request, state)
                    case "response_headers":
                        replies = self.response_headers(message.response_headers, state)
                    case "response_body":
                        replies = self.response_body(message.response_body, state)
                    case "response_trailers":
                        replies = self.trailers(state.response, state)
                    case other:
                        raise ValueError(f"unexpected ext_proc message {other!r}")
            except Exception as error:
                # Envoy ends the exchange after an ImmediateResponse, and so do we.
                await stream.send(self.refusal(state, error))
                return
            for reply in replies:
                await stream.send(reply)

    def refusal(self, state: Exchange, error: Exception) -> ProcessingResponse:
        """The one place an error becomes an HTTP answer (an ``ImmediateResponse``)."""
        if isinstance(error, Refusal):
            log.debug(
                "refused", status=error.status, error=error.message, request_id=state.request_id
            )
        else:
            log.error("unexpected error", exc_info=error, request_id=state.request_id)
            what = "; ".join(getattr(error, "__notes__", ())) or type(error).__name__
            error = Refusal(500, f"unexpected error: {what}")
        self.metrics.errors.labels(reason=error.code).inc()
        return error.answer()

    # --- the request ---

    def request_headers(self, headers: HttpHeaders, state: RouteState) -> list[ProcessingResponse]:
        """Keep the headers; answer now, or after the body when it streams to us."""
        self.metrics.requests.inc()
        state.request.headers = extproc.header_pairs(headers)
        return answer_or_hold(state.request, headers.end_of_stream)

    def request_body(self, body: HttpBody, state: RouteState) -> list[ProcessingResponse]:
        """Hold a chunk; at the end of the body, run the request chain."""
        state.request.hold(body.body)
        if state.request.streamed and not body.end_of_stream:
            return []
        return self.finish_request(state, end_of_stream=True)

    def finish_request(self, state: RouteState, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """Run the chain on the held body, send its changes on."""
        return changed(state.request, self.read_request(state), end_of_stream)

    def read_request(self, state: Exchange) -> Message:
        """Parse the held request body once (if a plugin needs it) and run the request chain."""
        half = state.request
        message = Message("request", half.headers, half.take())
        if self.request_chain.needs_body:
            message.parse()  # raises Refusal(400) unless the body is a JSON object
        self.request_chain.run(message)
        if half.streamed or message.body_mutated:
            message.set_content_length()
        self.metrics.success.inc()
        if log.is_enabled_for(logging.DEBUG):  # off, its arguments cost a header scan
            log.debug("request processed", body_bytes=len(message.raw), request_id=state.request_id)
        return message

    # --- the response ---

    def response_headers(self, headers: HttpHeaders, state: RouteState) -> list[ProcessingResponse]:
        """Keep the headers; with no response plugin, let a streamed body flow through."""
        state.response.headers = extproc.header_pairs(headers)
        state.flowing = state.response.streamed and not self.response_chain
        if state.flowing:
            return [extproc.headers_response("response")]
        return answer_or_hold(state.response, headers.end_of_stream)

    def response_body(self, body: HttpBody, state: RouteState) -> list[ProcessingResponse]:
        """Hold a chunk (or pass it on); at the end of the body, run the response chain."""
        half = state.response
        if state.flowing:
            return extproc.streamed_body_responses(
                "response", body.body, end_of_stream=body.end_of_stream
            )
        if not half.fits(body.body):
            state.flowing = half.streamed  # too large to hold: the rest streams through
            return unchanged(half, half.take() + body.body, body.end_of_stream)
        half.hold(body.body)
        if half.streamed and not body.end_of_stream:
            return []
        return self.finish_response(state, end_of_stream=True)

    def finish_response(
        self, state: RouteState, *, end_of_stream: bool
    ) -> list[ProcessingResponse]:
        """Run the response chain on a JSON object body; pass anything else unchanged."""
        half = state.response
        message = Message("response", dict(half.headers), half.take())
        chain = self.response_chain
        if not chain:
            return unchanged(half, message.raw, end_of_stream)
        try:
            if chain.needs_body:
                message.parse()
        except Refusal:
            return unchanged(half, message.raw, end_of_stream)  # SSE, say
        chain.run(message)
        if message.body_mutated:
            message.set_content_length()
        return changed(half, message, end_of_stream)

    # --- both ---

    def trailers(self, half: Half, state: RouteState) -> list[ProcessingResponse]:
        """Trailers end a streamed body whose last chunk had no ``end_of_stream``."""
        finish = self.finish_request if half.phase == "request" else self.finish_response
        replies = finish(state, end_of_stream=False) if half.held else []
        return [*replies, extproc.trailers_response(half.phase)]


def answer_or_hold(half: Half, end_of_stream: bool) -> list[ProcessingResponse]:
    """Answer headers now, unchanged; or, when the body streams to us, after it."""
    if half.streamed and not end_of_stream:
        half.held = True
        return []
    return [extproc.headers_response(half.phase)]


def changed(half: Half, message: Message, end_of_stream: bool) -> list[ProcessingResponse]:
    """The answer carrying the chain's header changes, and the body if streamed or new.

    Streamed, the changes ride on the held headers answer; with no headers
    held (a body Envoy sent without headers first, which it never does)
    there is nothing to answer but the body.
    """
    set_headers, remove = message.header_changes()
    check_headers_fit(half.phase, half.headers, set_headers, remove)  # Envoy's limits: 431
    held, half.held = half.held, False
    if half.streamed:
        answer = extproc.headers_response(half.phase, set_headers, remove, clear_route_cache=True)
        return [
            *([answer] if held else []),
            *extproc.streamed_body_responses(half.phase, message.raw, end_of_stream=end_of_stream),
        ]
    new_body = message.raw if message.body_mutated else None
    return [
        extproc.body_response(
            half.phase, set_headers, remove, clear_route_cache=True, body=new_body
        )
    ]


def unchanged(half: Half, body: bytes, end_of_stream: bool) -> list[ProcessingResponse]:
    """Let the body through as it came, after the held headers answer (if streamed)."""
    held, half.held = half.held, False
    if half.streamed:
        return [
            *([extproc.headers_response(half.phase)] if held else []),
            *extproc.streamed_body_responses(half.phase, body, end_of_stream=end_of_stream),
        ]
    return [extproc.body_response(half.phase)]
