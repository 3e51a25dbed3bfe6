"""The conformance echo over cleartext HTTP/2 (h2c), on the ``h2`` protocol state machine.

GIE's ``InferencePoolAppProtocol`` conformance test routes one pool
(``appProtocol: kubernetes.io/h2c``) to port 3001 of its echo pods, where
echo-basic speaks HTTP/2 without TLS; a request that reaches that port over
HTTP/1.1 gets 400 ``Expected h2c request``. A 200 from it therefore proves the
gateway honoured the pool's app protocol. aiohttp speaks HTTP/1.1 only, so
the simulator serves such ports with this small server instead:

- HTTP/2 with *prior knowledge* (the client starts with the HTTP/2 connection
  preface, as Envoy does for an upstream configured for HTTP/2). The
  HTTP/1.1 ``Upgrade: h2c`` dance is not implemented: such a request gets the
  same 400 as any other HTTP/1.1 request.
- Every request, whatever its path, gets the echo JSON of
  ``Replica.echo_body`` (``proto`` ``HTTP/2.0``) and the same identity and
  ``X-Echo-Set-Header`` headers as the HTTP/1.1 replicas. There is no OpenAI
  API here, as there is none on echo-basic's h2c port.

``h2`` does the framing, HPACK and flow control; this module only moves bytes
between it and the socket and answers each request once its stream has
ended.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Final

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

if TYPE_CHECKING:
    from simulator.server import Replica

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first (RFC 9113 section 3.4)."""

NOT_H2C: Final = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 20\r\n"
    b"connection: close\r\n\r\nExpected h2c request"
)
"""echo-basic's answer to a request that is not HTTP/2 on its h2c port."""


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class H2cEcho(asyncio.Protocol):
    """One client connection: requests in, echo responses out, as ``h2`` frames them."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self._h2 = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self._transport: asyncio.Transport | None = None
        self._start: bytes | None = b""  # bytes before the preface is confirmed; then None
        self._requests: dict[int, list[tuple[str, str]]] = {}
        self._unsent: dict[int, bytes] = {}  # response bodies waiting for flow-control window

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._start is not None:  # still telling HTTP/2 from HTTP/1.1
            self._start += data
            seen = min(len(self._start), len(PREFACE))
            if self._start[:seen] != PREFACE[:seen]:
                self._close(NOT_H2C)
                return
            if len(self._start) < len(PREFACE):
                return
            data, self._start = self._start, None
            self._h2.initiate_connection()  # our SETTINGS frame
        try:
            events = self._h2.receive_data(data)
        except ProtocolError:
            self._close(self._h2.data_to_send())
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
                self._respond(event.stream_id, self._requests.pop(event.stream_id))
            elif isinstance(event, StreamReset):
                self._requests.pop(event.stream_id, None)
                self._unsent.pop(event.stream_id, None)
            elif isinstance(event, WindowUpdated):
                for stream_id in list(self._unsent):
                    self._send_body(stream_id)
            elif isinstance(event, ConnectionTerminated):
                self._close(self._h2.data_to_send())
                return
        self._flush()

    def _respond(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        pseudo = {name: value for name, value in headers if name.startswith(":")}
        regular = [(name, value) for name, value in headers if not name.startswith(":")]
        body = orjson.dumps(
            self._replica.echo_body(
                pseudo.get(":method", ""),
                pseudo.get(":path", ""),
                pseudo.get(":authority", ""),
                "HTTP/2.0",
                regular,
            )
        )
        response = [(":status", "200"), ("content-type", "application/json")]
        # HTTP/2 header names are lower case (RFC 9113 section 8.2.1).
        response += [(name.lower(), value) for name, value in self._replica.stamp_headers(regular)]
        response.append(("content-length", str(len(body))))
        self._h2.send_headers(stream_id, response)
        self._unsent[stream_id] = body
        self._send_body(stream_id)

    def _send_body(self, stream_id: int) -> None:
        """Send as much of the body as flow control allows; the rest waits for a WINDOW_UPDATE."""
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
        if self._transport is not None and (pending := self._h2.data_to_send()):
            self._transport.write(pending)

    def _close(self, last: bytes) -> None:
        if self._transport is not None:
            if last:
                self._transport.write(last)
            self._transport.close()


async def serve_h2c_echo(replica: Replica, sock: socket.socket) -> asyncio.Server:
    """Serve the echo on an already bound socket; close the returned server to stop."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: H2cEcho(replica), sock=sock)
