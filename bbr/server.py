"""The BBR ext_proc service: read the body, run the plugins, let the gateway route on the result.

Envoy opens one ext_proc stream per HTTP exchange. What it sends, and what
BBR answers (as GIE's BBR at 670c0a21 except where marked *ours*):

``request_headers``
    Kept (one value per name, the last winning). If no body follows
    (``end_of_stream``), or the body is not streamed to us, answered at once,
    unchanged. In ``FULL_DUPLEX_STREAMED`` the answer is *held*: Envoy keeps
    the request until we answer its headers, and the header we add (the
    model) is only known once the body is read.
``request_body``
    Chunks are collected, at most ``--max-body-bytes`` (*ours*: GIE has no
    cap; more is answered 413). At the end of the body, it is parsed once (if
    a plugin needs it: not a JSON object is 400) and the request chain runs.
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

Errors become an ``ImmediateResponse`` in one place, ``BodyBasedRouter.refusal``:
a ``BBRError`` with its own status and text; anything else (a bug, in a plugin
or here) is logged with the request id and answered 500. Either way the
stream then ends normally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import structlog
from prometheus_client import CollectorRegistry

from bbr.message import BBRError, Message
from bbr.plugins import DEFAULT_PLUGINS, Factory, Metrics, PluginSpec, build_chains
from protos import extproc
from protos.extproc import BodyMode, Phase, ProcessingRequest, ProcessingResponse
from protos.server import EXT_PROC_SERVICE, Stream

MAX_BODY_BYTES: Final = 10 * 1024 * 1024
"""Default ``--max-body-bytes``: the most of a body BBR holds (10 MiB)."""

HEALTH_SERVICES: Final = ("", EXT_PROC_SERVICE)
"""Health names reported SERVING (GIE's BBR answers SERVING for any name)."""

REQUEST_ID: Final = "x-request-id"

log = structlog.get_logger()


@final
class BodyBasedRouter:
    """The ext_proc handler (``protos.server.Handler``): one call per stream."""

    def __init__(
        self,
        registry: CollectorRegistry,
        specs: Sequence[PluginSpec] = DEFAULT_PLUGINS,
        *,
        streaming: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
        plugin_types: Mapping[str, Factory] | None = None,
    ) -> None:
        """Make the plugins of ``specs`` (raises ``ConfigError``); metrics go to ``registry``."""
        self.metrics: Final = Metrics(registry)
        self.request_chain, self.response_chain = build_chains(specs, self.metrics, plugin_types)
        self.streaming: Final = streaming
        self.max_body_bytes: Final = max_body_bytes

    async def __call__(self, stream: Stream) -> None:
        exchange = Exchange(self)
        while (message := await stream.recv()) is not None:
            exchange.use_modes(message)
            try:
                match extproc.kind(message):
                    case "request_headers":
                        replies = exchange.request_headers(message.request_headers)
                    case "request_body":
                        replies = exchange.request_body(message.request_body)
                    case "request_trailers":
                        replies = exchange.trailers(exchange.request)
                    case "response_headers":
                        replies = exchange.response_headers(message.response_headers)
                    case "response_body":
                        replies = exchange.response_body(message.response_body)
                    case "response_trailers":
                        replies = exchange.trailers(exchange.response)
                    case other:
                        raise ValueError(f"unexpected ext_proc message {other!r}")
            except Exception as error:
                # Envoy ends the exchange after an ImmediateResponse, and so do we.
                await stream.send(self.refusal(exchange, error))
                return
            for reply in replies:
                await stream.send(reply)

    def refusal(self, exchange: Exchange, error: Exception) -> ProcessingResponse:
        """The one place an error becomes an HTTP answer (an ``ImmediateResponse``)."""
        if isinstance(error, BBRError):
            exchange.log.debug("refused", status=error.status, error=error.message)
        else:
            exchange.log.error("unexpected error", exc_info=error)
            what = "; ".join(getattr(error, "__notes__", ())) or type(error).__name__
            error = BBRError(500, f"unexpected error: {what}")
        self.metrics.errors.labels(reason=error.code).inc()
        return extproc.immediate_response(error.status, str(error))


@final
class Half:
    """One direction of the exchange, request or response: its headers, body so far, and mode."""

    __slots__ = ("chunks", "flowing", "headers", "held", "phase", "size", "streaming")

    def __init__(self, phase: Phase, streaming: bool) -> None:
        self.phase: Final = phase
        self.streaming = streaming
        """FULL_DUPLEX_STREAMED: Envoy forwards only the body we send back."""
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.held = False
        """Our headers answer waits for the end of the body."""
        self.flowing = False
        """Chunks go back as they arrive, untouched (responses no plugin will read)."""

    def keep(self, headers: Any) -> None:
        """Envoy's headers, one value per (lower-case) name, the last winning, as in GIE."""
        self.headers = {name.lower(): value for name, value in extproc.header_pairs(headers)}

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)

    def take(self) -> bytes:
        body = b"".join(self.chunks)
        self.chunks = []
        return body


@final
class Exchange:
    """What one stream remembers between messages, and how each message is answered."""

    __slots__ = ("log", "request", "response", "router")

    def __init__(self, router: BodyBasedRouter) -> None:
        self.router: Final = router
        self.log: Any = log
        self.request: Final = Half("request", router.streaming)
        self.response: Final = Half("response", router.streaming)

    def use_modes(self, message: ProcessingRequest) -> None:
        """Take each direction's body mode from Envoy's ``protocol_config``, when it is sent."""
        if (modes := extproc.body_modes(message)) is not None:
            self.request.streaming = modes[0] == BodyMode.FULL_DUPLEX_STREAMED
            self.response.streaming = modes[1] == BodyMode.FULL_DUPLEX_STREAMED

    # --- the request ---

    def request_headers(self, headers: Any) -> list[ProcessingResponse]:
        """Keep the headers and bind the request id to this stream's logs."""
        self.router.metrics.requests.inc()
        self.request.keep(headers)
        if request_id := self.request.headers.get(REQUEST_ID):
            self.log = log.bind(request_id=request_id)
        return self.answer_or_hold(self.request, headers.end_of_stream)

    def request_body(self, body: Any) -> list[ProcessingResponse]:
        """Collect a chunk; at the end of the body, run the request chain."""
        self.request.add(body.body)
        if self.request.size > self.router.max_body_bytes:
            limit = self.router.max_body_bytes
            raise BBRError(413, f"request body exceeds the {limit}-byte limit (--max-body-bytes)")
        if self.request.streaming and not body.end_of_stream:
            return []
        return self.finish_request(end_of_stream=True)

    def finish_request(self, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """Parse once (if a plugin needs it), run the chain, send its changes on."""
        message = Message("request", self.request.headers, self.request.take())
        chain = self.router.request_chain
        if chain.needs_parsed_body:
            message.parse()  # raises BBRError(400) unless the body is a JSON object
        chain.run(message)
        if self.request.streaming or message.body_mutated:
            message.set_content_length()
        self.router.metrics.success.inc()
        self.log.debug("request processed", body_bytes=len(message.raw))
        return self.changed(self.request, message, end_of_stream)

    # --- the response ---

    def response_headers(self, headers: Any) -> list[ProcessingResponse]:
        """Keep the headers; with no response plugin, let a streamed body flow through."""
        self.response.keep(headers)
        self.response.flowing = self.response.streaming and not self.router.response_chain
        return self.answer_or_hold(self.response, headers.end_of_stream)

    def response_body(self, body: Any) -> list[ProcessingResponse]:
        """Collect a chunk (or pass it on); at the end of the body, run the response chain."""
        half = self.response
        if half.flowing:
            return extproc.streamed_body_responses(
                "response", body.body, end_of_stream=body.end_of_stream
            )
        half.add(body.body)
        if half.size > self.router.max_body_bytes:
            half.flowing = half.streaming  # too large to hold: the rest streams through
            return self.unchanged(half, half.take(), body.end_of_stream)
        if half.streaming and not body.end_of_stream:
            return []
        return self.finish_response(end_of_stream=True)

    def finish_response(self, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """Run the response chain on a JSON object body; pass anything else unchanged."""
        message = Message("response", self.response.headers, self.response.take())
        chain = self.router.response_chain
        if not chain:
            return self.unchanged(self.response, message.raw, end_of_stream)
        try:
            if chain.needs_parsed_body:
                message.parse()
        except BBRError:
            return self.unchanged(self.response, message.raw, end_of_stream)  # SSE, say
        chain.run(message)
        if message.body_mutated:
            message.set_content_length()
        return self.changed(self.response, message, end_of_stream)

    # --- both ---

    def trailers(self, half: Half) -> list[ProcessingResponse]:
        """Trailers end a streamed body whose last chunk had no ``end_of_stream``."""
        finish = self.finish_request if half.phase == "request" else self.finish_response
        replies = finish(end_of_stream=False) if half.held else []
        return [*replies, extproc.trailers_response(half.phase)]

    @staticmethod
    def answer_or_hold(half: Half, end_of_stream: bool) -> list[ProcessingResponse]:
        """Answer headers now, unchanged; or, when the body streams to us, after it."""
        if half.streaming and not half.flowing and not end_of_stream:
            half.held = True
            return []
        return [extproc.headers_response(half.phase)]

    @staticmethod
    def changed(half: Half, message: Message, end_of_stream: bool) -> list[ProcessingResponse]:
        """The answer carrying the chain's header changes, and the body if streamed or new."""
        half.held = False
        set_headers, remove = message.header_changes()
        if half.streaming:
            return [
                extproc.headers_response(half.phase, set_headers, remove, clear_route_cache=True),
                *extproc.streamed_body_responses(
                    half.phase, message.raw, end_of_stream=end_of_stream
                ),
            ]
        new_body = message.raw if message.body_mutated else None
        return [
            extproc.body_response(
                half.phase, set_headers, remove, clear_route_cache=True, body=new_body
            )
        ]

    @staticmethod
    def unchanged(half: Half, body: bytes, end_of_stream: bool) -> list[ProcessingResponse]:
        """Let the body through as it came, after the held headers answer (if streamed)."""
        half.held = False
        if half.streaming:
            return [
                extproc.headers_response(half.phase),
                *extproc.streamed_body_responses(half.phase, body, end_of_stream=end_of_stream),
            ]
        return [extproc.body_response(half.phase)]
