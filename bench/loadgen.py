"""A compact HTTP/1.1 load generator: keep-alive connections, closed or open loop.

Why not an HTTP client library: each request here costs a few tens of
microseconds of Python (one ``write`` of pre-built bytes, a scan for the end
of the headers, a ``Content-Length`` count), a small fraction of what an
ext_proc hop costs, so the generator is not what limits the gateway; and it
needs nothing installed. ``bench/overhead.py`` measures its ceiling against
Envoy answering by itself (a ``direct_response`` route) in the same run.

Two ways to load a server:

``closed_loop(concurrency)``
    ``concurrency`` connections, each sending its next request as soon as the
    last one's answer is complete: latency under a fixed number of requests in
    flight (what a client with a connection pool of that size sees).
``open_loop(rate)``
    Requests start on a fixed schedule, ``rate`` per second, whatever the
    server's answers do; each is timed from its *scheduled* start, so a server
    that falls behind shows it as latency instead of silently slowing the
    schedule down ("coordinated omission"). A request waits for an idle
    connection from a pool that opens more, up to ``max_connections``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

CRLF2: Final = b"\r\n\r\n"


def request(host: str, port: int, method: str, path: str, body: bytes | None = None) -> bytes:
    """The bytes of one HTTP/1.1 keep-alive request, built once and sent many times."""
    head = f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body or b"")


def post(host: str, port: int, path: str, body: bytes) -> bytes:
    """A JSON POST (``request``)."""
    return request(host, port, "POST", path, body)


@dataclass(slots=True)
class Result:
    """What one load run saw: every latency (seconds), status counts, failures."""

    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    """Connections that failed or closed before a whole response arrived."""

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def ok(self) -> int:
        return sum(n for status, n in self.statuses.items() if 200 <= status < 300)

    @property
    def failed(self) -> int:
        """Requests that did not end in a 2xx answer."""
        return self.completed - self.ok + self.errors

    @property
    def rate(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile latency in seconds (nearest rank), NaN if none."""
        return percentile(self.latencies, q)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q``% at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def take_response(buffer: bytearray) -> int | None:
    """The status of the whole response at the start of ``buffer``, which it then removes;
    None (and ``buffer`` untouched) while the response is incomplete.

    Just enough HTTP/1.1 for a proxy's answers: a status line, headers, then a
    body framed by ``Content-Length`` or by chunked transfer coding, or none.
    """
    end = buffer.find(CRLF2)
    if end < 0:
        return None
    head = bytes(buffer[:end]).lower()
    status = int(head[9:12])
    start = end + 4
    length_at = head.find(b"\r\ncontent-length:")
    if length_at >= 0:
        line_end = head.find(b"\r\n", length_at + 2)
        length = int(head[length_at + 17 : line_end if line_end >= 0 else None])
        if len(buffer) < start + length:
            return None
        del buffer[: start + length]
        return status
    if b"\r\ntransfer-encoding: chunked" in head:
        position = start
        while True:
            size_end = buffer.find(b"\r\n", position)
            if size_end < 0:
                return None
            size = int(bytes(buffer[position:size_end]).split(b";")[0], 16)
            position = size_end + 2 + size + 2
            if len(buffer) < position:
                return None
            if size == 0:
                del buffer[:position]
                return status
    del buffer[:start]  # no body (a 204, or a 304)
    return status


class _Connection(asyncio.Protocol):
    """One keep-alive connection that carries one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        status = take_response(self.buffer)
        if status is not None and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(status)

    async def request(self, data: bytes) -> int:
        """Send one request and wait for its whole response; the response's status."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _connect(host: str, port: int) -> _Connection:
    _, connection = await asyncio.get_running_loop().create_connection(_Connection, host, port)
    return connection


def _record(result: Result, status: int, latency: float) -> None:
    result.latencies.append(latency)
    result.statuses[status] = result.statuses.get(status, 0) + 1


async def closed_loop(
    host: str, port: int, request: bytes, *, concurrency: int, seconds: float
) -> Result:
    """``concurrency`` connections, each back to back for ``seconds``."""
    result = Result()
    connections = [await _connect(host, port) for _ in range(concurrency)]
    clock = time.perf_counter
    start = clock()
    deadline = start + seconds

    async def run(connection: _Connection) -> None:
        while (sent := clock()) < deadline:
            try:
                status = await connection.request(request)
            except ConnectionError:
                result.errors += 1
                if connection.closed:
                    connection = await _connect(host, port)
                continue
            _record(result, status, clock() - sent)

    try:
        await asyncio.gather(*(run(c) for c in connections))
    finally:
        result.seconds = clock() - start
        for connection in connections:
            connection.close()
    return result


async def open_loop(
    host: str,
    port: int,
    request: bytes,
    *,
    rate: float,
    seconds: float,
    max_connections: int = 64,
    patience: float = 5.0,
) -> Result:
    """Requests scheduled ``rate`` per second for ``seconds``, each timed from its schedule.

    A request whose answer takes longer than ``patience`` seconds counts as an error.
    """
    result = Result()
    idle: list[_Connection] = [await _connect(host, port) for _ in range(min(8, max_connections))]
    opened = len(idle)
    available = asyncio.Condition()
    clock = time.perf_counter
    loop_start = clock()
    tasks: set[asyncio.Task[None]] = set()

    async def one(scheduled: float) -> None:
        nonlocal opened
        async with available:
            while not idle and opened >= max_connections:
                await available.wait()
            connection = idle.pop() if idle else None
            if connection is None:
                opened += 1
        try:
            if connection is None:
                connection = await _connect(host, port)
            status = await asyncio.wait_for(connection.request(request), patience)
        except (ConnectionError, TimeoutError, OSError):
            result.errors += 1
            if connection is not None:
                connection.close()
            async with available:
                opened -= 1
                available.notify()
            return
        _record(result, status, clock() - scheduled)
        async with available:
            idle.append(connection)
            available.notify()

    total = int(rate * seconds)
    interval = 1.0 / rate
    try:
        for i in range(total):
            scheduled = loop_start + i * interval
            delay = scheduled - clock()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        result.seconds = clock() - loop_start
        for connection in idle:
            connection.close()
    return result
