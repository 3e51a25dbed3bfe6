"""Clients that send what ordinary HTTP libraries will not: raw HTTP/1.1 and prior-knowledge HTTP/2.

The bad-input and fault tests need a client that can trickle a body, cut a
request off half-way, send 61 KiB of headers or bytes that are no UTF-8, and
speak HTTP/2 without TLS. ``h11`` and ``h2`` frame the messages (the same
state machines the simulator's h2c port uses); these functions move the
bytes, with a deadline on every read.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamEnded, StreamReset

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Answer:
    """What a client got: a status, headers (last value wins, names lower case) and the body.

    ``status`` 0 means the connection ended without an answer; ``reset`` names
    how (an HTTP/2 stream reset, a closed connection).
    """

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    reset: str = ""

    def excerpt(self, limit: int = 110) -> str:
        """The body for a table cell: one line, cut at ``limit`` characters."""
        text = self.body.decode("utf-8", "replace").strip().replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= limit else text[: limit - 1] + "…"


def _recv(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def http1(
    port: int,
    path: str,
    body: bytes | Iterable[bytes] = b"",
    headers: Mapping[str, str] | None = None,
    *,
    method: str = "POST",
    gap: float = 0.0,
    timeout: float = 30.0,
    raw_headers: bytes = b"",
) -> Answer:
    """One HTTP/1.1 request on a fresh connection; the body as one piece or chunked.

    ``body`` as bytes goes with ``Content-Length``; an iterable of pieces goes
    ``Transfer-Encoding: chunked``, ``gap`` seconds apart (a slow client).
    ``raw_headers`` are written as they are, unchecked (h11 would refuse what
    they are for: oversized or broken headers).
    """
    deadline = time.monotonic() + timeout
    pieces = [body] if isinstance(body, bytes) else list(body)
    fields = [("host", "gateway"), ("content-type", "application/json")]
    fields += list((headers or {}).items())
    if isinstance(body, bytes):
        fields.append(("content-length", str(len(body))))
    else:
        fields.append(("transfer-encoding", "chunked"))
    client = h11.Connection(h11.CLIENT)
    head = client.send(h11.Request(method=method, target=path, headers=fields)) or b""
    if raw_headers:
        head = head[:-2] + raw_headers + b"\r\n"
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            for i, piece in enumerate(pieces):
                if i and gap:
                    time.sleep(gap)
                sock.sendall(client.send(h11.Data(data=piece)) or b"")
            sock.sendall(client.send(h11.EndOfMessage()) or b"")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed; read what it said
        return _read_h1(client, sock, deadline)


def _read_h1(client: h11.Connection, sock: socket.socket, deadline: float) -> Answer:
    status, headers, body = 0, {}, bytearray()
    while time.monotonic() < deadline:
        event = client.next_event()
        if event is h11.NEED_DATA:
            data = _recv(sock, deadline)
            client.receive_data(data)
            if not data and status == 0:
                return Answer(0, reset="connection closed without an answer")
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return Answer(status, headers, bytes(body))
    raise TimeoutError(f"no complete answer within the deadline (status {status})")


@contextlib.contextmanager
def cut_off(port: int, path: str, head_body: bytes, declared: int) -> Iterator[None]:
    """Send headers announcing ``declared`` body bytes and only ``head_body``; hang up on exit."""
    client = h11.Connection(h11.CLIENT)
    fields = [("host", "gateway"), ("content-type", "application/json")]
    fields.append(("content-length", str(declared)))
    head = client.send(h11.Request(method="POST", target=path, headers=fields)) or b""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(head + head_body)
        yield


def read_then_hang_up(
    port: int, path: str, body: bytes, *, after: bytes = b"data:", timeout: float = 30.0
) -> bytes:
    """Start a streamed answer, read until ``after`` has arrived, then close the connection."""
    deadline = time.monotonic() + timeout
    client = h11.Connection(h11.CLIENT)
    fields = [("host", "gateway"), ("content-type", "application/json")]
    fields.append(("content-length", str(len(body))))
    head = client.send(h11.Request(method="POST", target=path, headers=fields)) or b""
    received = b""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(head + body)
        while after not in received:
            data = _recv(sock, deadline)
            if not data:
                raise AssertionError(f"the stream ended before {after!r}: {received[:300]!r}")
            received += data
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    return received


def http2(
    port: int,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    *,
    method: str = "POST",
    timeout: float = 30.0,
) -> Answer:
    """One request over cleartext HTTP/2 with prior knowledge (RFC 9113 section 3.3)."""
    deadline = time.monotonic() + timeout
    connection = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
    connection.initiate_connection()
    stream = connection.get_next_available_stream_id()
    fields: list[tuple[str, str]] = [
        (":method", method),
        (":path", path),
        (":scheme", "http"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        *(headers or {}).items(),
    ]
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        connection.send_headers(stream, fields, end_stream=not body)
        if body:
            _send_h2_body(connection, sock, stream, body, deadline)
        sock.sendall(connection.data_to_send())
        status, answer_headers, received = 0, dict[str, str](), bytearray()
        while time.monotonic() < deadline:
            data = _recv(sock, deadline)
            if not data:
                return Answer(status, answer_headers, bytes(received), "connection closed")
            for event in connection.receive_data(data):
                if isinstance(event, ResponseReceived):
                    answer_headers = {_str(k): _str(v) for k, v in event.headers}
                    status = int(answer_headers.pop(":status"))
                elif isinstance(event, DataReceived):
                    received += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, StreamEnded):
                    return Answer(status, answer_headers, bytes(received))
                elif isinstance(event, StreamReset):
                    return Answer(status, answer_headers, bytes(received), f"RST_STREAM {event}")
            sock.sendall(connection.data_to_send())
    raise TimeoutError("no complete HTTP/2 answer within the deadline")


def _send_h2_body(
    connection: H2Connection, sock: socket.socket, stream: int, body: bytes, deadline: float
) -> None:
    """Send ``body`` within the peer's flow-control windows, reading window updates as needed."""
    sent = 0
    while sent < len(body):
        window = min(
            connection.local_flow_control_window(stream), connection.max_outbound_frame_size
        )
        if window <= 0:
            sock.sendall(connection.data_to_send())
            connection.receive_data(_recv(sock, deadline))
            continue
        piece = body[sent : sent + window]
        sent += len(piece)
        connection.send_data(stream, piece, end_stream=sent == len(body))
        sock.sendall(connection.data_to_send())


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
