"""The floor benchmark: the Node.js do-nothing hop answers as the Python one, and the arithmetic."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator, Sequence

import grpc
import pytest

from bench import floor
from bench.rig import GRPC_JS, NODE_NOOP
from bench.streams import HEADERS, chat_body
from serving.testing import (
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
)
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse
from wire.stream import EXT_PROC_SERVICE

FULL_DUPLEX = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)


def _port(server: subprocess.Popen[str]) -> int:
    """The port a server prints as its first line."""
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line.strip().isdigit(), f"{server.args!r}: no port printed (exit {server.poll()})"
    return int(line)


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, int]]:
    """The do-nothing hops, running: Python on grpc.aio (``bench.server passthrough``) and on
    grpc's synchronous server (``passthrough-sync``), and Node.js."""
    assert GRPC_JS.is_dir(), f"no grpc-js at {GRPC_JS}: make node-grpc"
    commands = {
        "python": [sys.executable, "-m", "bench.server", "passthrough"],
        "python-sync": [sys.executable, "-m", "bench.server", "passthrough-sync"],
        "node": ["node", str(NODE_NOOP), str(GRPC_JS)],
    }
    servers: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, argv in commands.items():
            servers[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        yield {name: _port(server) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.terminate()
            server.wait()
            assert server.stdout is not None
            server.stdout.close()


async def _talk(port: int, messages: Sequence[ProcessingRequest]) -> list[bytes]:
    """Send ``messages`` on one stream; every reply, serialised."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        return [reply.SerializeToString() async for reply in call]


STREAMS = {
    "headers and a 4 KB body": [
        request_headers(HEADERS, body_modes=FULL_DUPLEX),
        request_body(chat_body()),
    ],
    "a body in three chunks, 200 KB": [
        request_headers(HEADERS, body_modes=FULL_DUPLEX),
        request_body(b"a" * 100, end_of_stream=False),
        request_body(b"b" * 200_000, end_of_stream=False),
        request_body(b"c", end_of_stream=True),
    ],
    "a GET: headers that end the request": [
        request_headers(HEADERS, end_of_stream=True, body_modes=FULL_DUPLEX)
    ],
    "a body ended by trailers": [
        request_headers(HEADERS, body_modes=FULL_DUPLEX),
        request_body(b"x" * 70_000, end_of_stream=False),
        request_trailers(),
    ],
    "an empty body": [request_headers(HEADERS, body_modes=FULL_DUPLEX), request_body(b"")],
    "trailers, then the response": [
        request_headers(HEADERS, end_of_stream=True, body_modes=FULL_DUPLEX),
        request_trailers(),
        response_headers({":status": "200"}),
        response_body(b"{}"),
    ],
}


@pytest.mark.parametrize("messages", list(STREAMS.values()), ids=list(STREAMS))
def test_every_hop_answers_byte_for_byte_as_the_python_one(
    ports: dict[str, int], messages: list[ProcessingRequest]
) -> None:
    """Same replies, same bytes: the do-nothing hops differ only in their server loop and
    runtime, so the benchmark's differences between them are the servers' costs alone."""
    python = asyncio.run(_talk(ports["python"], messages))
    assert python  # a reply to compare
    assert asyncio.run(_talk(ports["python-sync"], messages)) == python
    assert asyncio.run(_talk(ports["node"], messages)) == python


def test_report_gives_added_latency_and_multiples_of_the_peer() -> None:
    """Each case's added p50 is its median less the upstream's, in ms; the multiple is of
    sglang-router's added p50; the allowance is 1.5× that, less Envoy's own; cases that
    answered anything but 2xx are named."""
    p50 = {}
    for n in floor.CONCURRENCY:
        p50["direct", n] = [0.001, 0.001, 0.002]
        p50["plain", n] = [0.0012, 0.0012, 0.0022]  # 0.2 ms added
        p50["noop-picker", n] = [0.0019, 0.0019, 0.0029]  # 0.9
        p50["sglang-router", n] = [0.0012, 0.00125, 0.0022]  # 0.25
    failed = {("plain", 1): (0, 100), ("noop-picker", 8): (3, 400)}
    table = floor.report(p50, {"noop-node": "no grpc-js"}, failed)
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table.splitlines()[2:5]}
    plain = [cell.strip() for cell in rows["Envoy → upstream (plain proxy)"]]
    assert plain == ["0.200", "0.80", "0.200", "0.80"]
    noop = [cell.strip() for cell in rows["+ do-nothing hop, picker's mode"]]
    assert noop == ["0.900", "3.60", "0.900", "3.60"]
    assert "allows 0.375 ms over the upstream; Envoy alone takes 0.200, leaving a hop 0.175 ms" in (
        table
    )
    assert "Left out: noop-node (no grpc-js)" in table
    assert "Not 2xx: noop-picker at c=8, 3 of 400 requests" in table
    assert "plain at c=1" not in table
