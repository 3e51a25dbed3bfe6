"""The conformance echo's h2c port: cleartext HTTP/2, as echo-basic serves it.

GIE's ``InferencePoolAppProtocol`` conformance test routes one pool
(``appProtocol: kubernetes.io/h2c``) to port 3001 of its echo pods, where
echo-basic speaks HTTP/2 without TLS, and refuses plain HTTP/1.1 with 400
``Expected h2c request``. A 200 from that port with the served report
``IP:3001`` therefore proves the gateway honoured the pool's app protocol.
aiohttp speaks HTTP/1.1 only, so the simulator serves such ports with this
small server instead.

What it answers is what the echo-basic image GIE's ``base.yaml`` pins
(gateway-api commit 47c3435c, whose h2c port runs Go's ``x/net`` h2c
handler around an echo that lets only HTTP/2 and ``Upgrade: h2c`` through):

- **HTTP/2 with prior knowledge** (the connection opens with the HTTP/2
  preface, RFC 9113 section 3.3, as Envoy's upstream for an h2c pool does):
  the echo, with ``proto`` ``HTTP/2.0``.
- **An upgrade** (RFC 7540 section 3.2: ``Upgrade: h2c``, ``HTTP2-Settings``
  named in ``Connection``, and one ``HTTP2-Settings`` header in unpadded
  base64url): ``101 Switching Protocols``, then HTTP/2 on the same
  connection. The upgrading request is answered on stream 1; its echo says
  ``HTTP/1.1``, the version it was sent in (Go hands the handler the
  original request). A missing or malformed ``HTTP2-Settings`` gets 500.
- **Any other HTTP/1.1 request whose ``Upgrade`` header is ``h2c``**: the echo,
  over HTTP/1.1 (the echo's own check lets it through).
- **Anything else**: 400 ``Expected h2c request``; the connection stays open.

Every echo reports echo-basic's ``httpPort``, which is its HTTP port
(``HTTP_PORT``, 3000 in GIE's manifests) on the h2c port too: here, the
pod's HTTP port (``serve_pods`` passes it). There is no OpenAI API on this
port, as there is none on echo-basic's.

``h2`` frames HTTP/2 and ``h11`` frames HTTP/1.1 (both of the python-hyper
family: state machines that do no I/O); this module moves bytes between
them and the socket, and answers each request once it has ended.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import socket
from collections.abc import Sequence
from typing import Final

import h11
import orjson
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError

from simulator.echo import EchoBasic

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client with prior knowledge sends first (RFC 9113 section 3.4)."""

NOT_H2C: Final = b"Expected h2c request"
"""echo-basic's answer (with 400) to a request that is neither HTTP/2 nor ``Upgrade: h2c``."""

Headers = Sequence[tuple[str, str]]


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _tokens(headers: Headers, name: str) -> set[str]:
    """The comma-separated tokens of every ``name`` header, lower case (a header list's tokens
    compare case-insensitively, as Go's ``httpguts.HeaderValuesContainsToken``)."""
    values = [value for key, value in headers if key.lower() == name]
    return {token.strip().lower() for value in values for token in value.split(",")}


def _first(headers: Headers, name: str) -> str:
    """The first ``name`` header's value, or "" (Go's ``Header.Get``)."""
    return next((value for key, value in headers if key.lower() == name), "")


def wants_upgrade(headers: Headers) -> bool:
    """An RFC 7540 section 3.2 upgrade request: ``h2c`` in ``Upgrade``, ``HTTP2-Settings`` in
    ``Connection`` (x/net's ``isH2CUpgrade``)."""
    return "h2c" in _tokens(headers, "upgrade") and "http2-settings" in _tokens(
        headers, "connection"
    )


def upgrade_settings(headers: Headers) -> bytes | None:
    """The client's SETTINGS payload from its one ``HTTP2-Settings`` header, or None when there is
    not exactly one or it is not unpadded base64url (Go's ``RawURLEncoding``)."""
    values = [value for key, value in headers if key.lower() == "http2-settings"]
    if len(values) != 1 or "=" in values[0]:
        return None
    text = values[0].strip()
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


class H2cEcho(asyncio.Protocol):
    """One client connection: HTTP/2 from the preface on, or HTTP/1.1 until it upgrades."""

    def __init__(self, echo: EchoBasic, http_port: int) -> None:
        self._echo_basic = echo
        self._http_port = http_port
        self._transport: asyncio.Transport | None = None
        self._start: bytes | None = b""  # bytes while it may still be the preface; then None
        self._h1 = h11.Connection(h11.SERVER)
        self._h1_request: h11.Request | None = None
        self._h2: H2Connection | None = None  # set once the connection speaks HTTP/2
        self._requests: dict[int, list[tuple[str, str]]] = {}
        self._unsent: dict[int, bytes] = {}  # response bodies waiting for flow-control window

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._start is not None:  # still telling HTTP/2 with prior knowledge from HTTP/1.1
            self._start += data
            seen = min(len(self._start), len(PREFACE))
            prior_knowledge = self._start[:seen] == PREFACE[:seen]
            if prior_knowledge and len(self._start) < len(PREFACE):
                return
            data, self._start = self._start, None
            if prior_knowledge:
                self._h2 = _server()
                self._h2.initiate_connection()  # our SETTINGS frame
        if self._h2 is not None:
            self._h2_received(data)
        else:
            self._h1_received(data)

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # --- the echo -----------------------------------------------------------------------

    def _echo(
        self, method: str, path: str, host: str, proto: str, headers: Headers
    ) -> tuple[list[tuple[str, str]], bytes]:
        """The echo's response headers and JSON body, over either protocol."""
        body = orjson.dumps(
            self._echo_basic.body(method, path, host, proto, headers, http_port=self._http_port)
        )
        stamp = self._echo_basic.stamp_headers(headers)
        response = [("content-type", "application/json")]
        response += [(name.lower(), value) for name, value in stamp]
        response.append(("content-length", str(len(body))))
        return response, body

    # --- HTTP/1.1 -----------------------------------------------------------------------

    def _h1_received(self, data: bytes) -> None:
        self._h1.receive_data(data)
        while True:
            try:
                event = self._h1.next_event()
            except h11.RemoteProtocolError as error:
                # Not HTTP/1.1 at all: answer the status h11 suggests if we still can, then close.
                with contextlib.suppress(h11.LocalProtocolError):
                    self._h1_respond(error.error_status_hint, [("content-length", "0")], b"")
                self._close()
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._h1_request = event
            elif isinstance(event, h11.EndOfMessage) and self._h1_request is not None:
                request, self._h1_request = self._h1_request, None
                if self._h1_answer(request):
                    return  # the connection now speaks HTTP/2
                if self._h1.our_state is h11.MUST_CLOSE:
                    self._close()
                    return
                self._h1.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return
            # Data: the echo ignores request bodies.

    def _h1_answer(self, request: h11.Request) -> bool:
        """Answer one HTTP/1.1 request; True when it upgraded the connection to HTTP/2."""
        headers = [(_text(name), _text(value)) for name, value in request.headers.raw_items()]
        method, path = _text(request.method), _text(request.target)
        proto = f"HTTP/{_text(request.http_version)}"
        host = _first(headers, "host")
        if wants_upgrade(headers):
            settings = upgrade_settings(headers)
            if settings is None:
                self._h1_respond(500, [("content-length", "0")], b"")
                return False
            switching = [("connection", "Upgrade"), ("upgrade", "h2c")]
            self._h1_send(
                h11.InformationalResponse(
                    status_code=101, headers=switching, reason=b"Switching Protocols"
                )
            )
            rest, _ = self._h1.trailing_data
            self._h2 = _server()
            self._h2.initiate_upgrade_connection(base64.urlsafe_b64encode(settings))
            self._h2_respond(1, *self._echo(method, path, host, proto, headers))
            self._h2_received(rest)
            return True
        if _first(headers, "upgrade") == "h2c":
            self._h1_respond(200, *self._echo(method, path, host, proto, headers))
        else:
            plain = [("content-type", "text/plain; charset=utf-8")]
            self._h1_respond(400, [*plain, ("content-length", str(len(NOT_H2C)))], NOT_H2C)
        return False

    def _h1_respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._h1_send(h11.Response(status_code=status, headers=list(headers)))
        if body:
            self._h1_send(h11.Data(data=body))
        self._h1_send(h11.EndOfMessage())

    def _h1_send(self, event: h11.Event) -> None:
        data = self._h1.send(event)
        if data and self._transport is not None:
            self._transport.write(data)

    # --- HTTP/2 -------------------------------------------------------------------------

    def _h2_received(self, data: bytes) -> None:
        assert self._h2 is not None
        try:
            events = self._h2.receive_data(data) if data else []
        except ProtocolError:
            self._flush()
            self._close()
            return
        for event in events:
            if isinstance(event, RequestReceived):
                self._requests[event.stream_id] = [
                    (_text(name), _text(value)) for name, value in event.headers
                ]
            elif isinstance(event, DataReceived):
                # The echo ignores the body; hand the window back so the client can go on.
                self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamEnded) and event.stream_id in self._requests:
                self._h2_answer(event.stream_id, self._requests.pop(event.stream_id))
            elif isinstance(event, StreamReset):
                self._requests.pop(event.stream_id, None)
                self._unsent.pop(event.stream_id, None)
            elif isinstance(event, WindowUpdated):
                for stream_id in list(self._unsent):
                    self._send_body(stream_id)
            elif isinstance(event, ConnectionTerminated):
                self._flush()
                self._close()
                return
        self._flush()

    def _h2_answer(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        pseudo = {name: value for name, value in headers if name.startswith(":")}
        regular = [(name, value) for name, value in headers if not name.startswith(":")]
        method, path = pseudo.get(":method", ""), pseudo.get(":path", "")
        echo = self._echo(method, path, pseudo.get(":authority", ""), "HTTP/2.0", regular)
        self._h2_respond(stream_id, *echo)

    def _h2_respond(self, stream_id: int, headers: Headers, body: bytes) -> None:
        assert self._h2 is not None
        self._h2.send_headers(stream_id, [(":status", "200"), *headers])
        self._unsent[stream_id] = body
        self._send_body(stream_id)

    def _send_body(self, stream_id: int) -> None:
        """Send as much of the body as flow control allows; the rest waits for a WINDOW_UPDATE."""
        assert self._h2 is not None
        body = self._unsent.pop(stream_id)
        while body:
            room = min(
                self._h2.local_flow_control_window(stream_id), self._h2.max_outbound_frame_size
            )
            if room <= 0:
                self._unsent[stream_id] = body
                return
            self._h2.send_data(stream_id, body[:room])
            body = body[room:]
        self._h2.end_stream(stream_id)

    def _flush(self) -> None:
        pending = self._h2.data_to_send() if self._h2 is not None else b""
        if pending and self._transport is not None:
            self._transport.write(pending)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _server() -> H2Connection:
    # HTTP/2 header names are lower case (RFC 9113 section 8.2.1); h2 checks what we send.
    return H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))


async def serve_h2c_echo(echo: EchoBasic, sock: socket.socket, http_port: int) -> asyncio.Server:
    """Serve the echo on an already bound socket, reporting ``http_port`` as echo-basic's
    ``httpPort``; close the returned server to stop."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: H2cEcho(echo, http_port), sock=sock)
