"""Whole ext_proc streams per second on one core: each service beside a do-nothing server.

Every stream is what Envoy sends for a JSON POST in FULL_DUPLEX_STREAMED mode:
request headers (15 headers), then one 4 KB body chunk ending the stream. The
server under test runs in its own process pinned to CPU 0; the client runs
here, pinned to CPU 1, and sends pre-serialised bytes so it stays cheap.

The baseline is a do-nothing server answering with the same message shapes
(an empty headers reply and the body sent back), written two ways: with
``context.read()/write()`` (what ``protos.server`` uses) and as an async
generator. The figure that matters is the server's CPU time per stream,
read from /proc, which does not depend on the client keeping up.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
import orjson

from protos.extproc import BodyMode
from protos.server import EXT_PROC_SERVICE
from protos.testing import request_body, request_headers

KINDS = ("noop-rw", "noop-gen", "lwepp", "bbr")
HEADERS = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gateway.example.com"),
    (":scheme", "http"),
    ("content-type", "application/json"),
    ("content-length", "4096"),
    ("accept", "application/json"),
    ("user-agent", "openai-python/1.99.0"),
    ("x-request-id", "0b7e2a4c-5d1f-4c7e-9a51-8f1b2c3d4e5f"),
    ("x-forwarded-proto", "http"),
    ("x-envoy-expected-rq-timeout-ms", "300000"),
    ("authorization", "Bearer sk-0123456789abcdef"),
    ("accept-encoding", "gzip, deflate"),
    ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("x-client", "bench"),
]


def chat_body(size: int = 4096) -> bytes:
    """A chat-completions body padded to ``size`` bytes."""
    filler = "lorem ipsum dolor sit amet " * (size // 27 + 1)
    body: dict[str, Any] = {
        "model": "llama-3-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": filler},
        ],
        "max_tokens": 64,
        "stream": False,
    }
    data = orjson.dumps(body)
    body["messages"][1]["content"] = filler[: len(filler) - (len(data) - size)]
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Result:
    kind: str
    streams: int
    seconds: float
    server_cpu: float

    @property
    def per_second(self) -> float:
        return self.streams / self.seconds

    @property
    def cpu_us_per_stream(self) -> float:
        return self.server_cpu / self.streams * 1e6


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, streams: int, concurrency: int) -> None:
    headers = request_headers(
        HEADERS, body_modes=(BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
    ).SerializeToString()
    body = request_body(chat_body()).SerializeToString()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        remaining = streams

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                call = process()
                await call.write(headers)
                await call.write(body)
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _start(kind: str) -> tuple[subprocess.Popen[str], int]:
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.server", kind],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    assert server.stdout is not None
    return server, int(server.stdout.readline())


def measure(
    kinds: list[str], streams: int = 2000, concurrency: int = 16, rounds: int = 3
) -> list[Result]:
    """Drive one server of each kind (all on CPU 0) from CPU 1, in interleaved rounds.

    Interleaving spreads the machine's drift over every kind alike; each kind
    keeps its best round (the least server CPU per stream).
    """
    servers = {kind: _start(kind) for kind in kinds}
    best: dict[str, Result] = {}
    try:
        os.sched_setaffinity(0, {1})
        for _, port in servers.values():
            asyncio.run(_drive(port, 200, concurrency))  # warm up
        for _ in range(rounds):
            for kind, (server, port) in servers.items():
                cpu0, t0 = _cpu_seconds(server.pid), time.perf_counter()
                asyncio.run(_drive(port, streams, concurrency))
                seconds = time.perf_counter() - t0
                result = Result(kind, streams, seconds, _cpu_seconds(server.pid) - cpu0)
                if kind not in best or result.server_cpu < best[kind].server_cpu:
                    best[kind] = result
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
    return [best[kind] for kind in kinds]


def table(results: list[Result]) -> str:
    base = next(r for r in results if r.kind == "noop-rw")
    lines = [
        "| server | streams/s | server CPU µs/stream | streams per core-second"
        " | vs do-nothing (read/write) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        per_core = 1e6 / r.cpu_us_per_stream
        ratio = base.cpu_us_per_stream / r.cpu_us_per_stream
        lines.append(
            f"| {r.kind} | {r.per_second:,.0f} | {r.cpu_us_per_stream:,.0f} | "
            f"{per_core:,.0f} | {ratio:.2f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure(sys.argv[1:] or list(KINDS))))
