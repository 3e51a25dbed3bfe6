"""Whole ext_proc streams per second on one core: each service beside a do-nothing server.

Every stream is what Envoy sends for a JSON POST in FULL_DUPLEX_STREAMED mode:
request headers (15 headers), then one 4 KB body chunk ending the stream. The
server under test runs in its own process pinned to CPU 0; the client runs
here, pinned to CPU 1, and sends pre-serialised bytes so it stays cheap.

The baseline is a do-nothing server answering with the same message shapes
(an empty headers reply and the body sent back), written two ways: with
``context.read()/write()`` (what ``serving.server`` uses) and as an async
generator. The figure that matters is the server's CPU time per stream,
read from /proc, which does not depend on the client keeping up.

``measure_workers`` drives ``python -m lwepp --workers N`` instead, over
several connections (the workers share the port by connection), and reports
streams per second and how many streams each worker served.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson

from pods.file import dump_pods
from pods.model import Pod
from serving.testing import request_body, request_headers
from wire.extproc import BodyMode
from wire.stream import EXT_PROC_SERVICE

KINDS = ("noop-rw", "noop-gen", "noop-sync", "lwepp", "bbr", "onehop")
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


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process ``pid`` has used so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, streams: int, concurrency: int, connections: int = 1) -> int:
    """Send ``streams`` whole streams, ``concurrency`` at a time, over ``connections``;
    return how many were answered (at least one reply; a failed call raises).

    Each connection is a channel with a subchannel pool of its own: grpc would
    otherwise share one TCP connection between channels to the same address,
    and SO_REUSEPORT workers are handed connections, not streams.
    """
    headers = request_headers(
        HEADERS, body_modes=(BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
    ).SerializeToString()
    body = request_body(chat_body()).SerializeToString()
    channels = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(connections)
    ]
    try:
        calls = [
            channel.stream_stream(
                f"/{EXT_PROC_SERVICE}/Process",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            for channel in channels
        ]
        remaining, answered = streams, 0

        async def worker(index: int) -> None:
            nonlocal remaining, answered
            process = calls[index % len(calls)]
            while remaining > 0:
                remaining -= 1
                call = process()
                await call.write(headers)
                await call.write(body)
                await call.done_writing()
                replies = 0
                while await call.read() is not grpc.aio.EOF:
                    replies += 1
                answered += replies > 0

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return answered
    finally:
        for channel in channels:
            await channel.close()


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
    keeps its median round by server CPU per stream. (The best round would
    compare each kind's luckiest moment: with a few rounds, one lucky round of
    the baseline moved a ratio by 0.2.)
    """
    servers = {kind: _start(kind) for kind in kinds}
    runs: dict[str, list[Result]] = {kind: [] for kind in kinds}
    affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {1})
        for _, port in servers.values():
            asyncio.run(drive(port, 200, concurrency))  # warm up
        for _ in range(rounds):
            for kind, (server, port) in servers.items():
                cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
                answered = asyncio.run(drive(port, streams, concurrency))
                seconds = time.perf_counter() - t0
                if answered != streams:  # a rate over streams not served would flatter it
                    raise RuntimeError(f"{kind}: {answered} of {streams} streams answered")
                runs[kind].append(Result(kind, streams, seconds, cpu_seconds(server.pid) - cpu0))
    finally:
        os.sched_setaffinity(0, affinity)
        for server, _ in servers.values():
            server.terminate()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
    return [_median(runs[kind]) for kind in kinds]


def _median(results: list[Result]) -> Result:
    """The middle round by server CPU per stream (the lower middle of an even count)."""
    ordered = sorted(results, key=lambda r: r.server_cpu / r.streams)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True, slots=True)
class WorkersResult:
    """``python -m lwepp --workers N`` driven over several connections."""

    workers: int
    streams: int
    seconds: float
    served: tuple[int, ...]
    """Streams each worker counted (``llm_d_epp_request_total`` on its own metrics page)."""
    cpu_per_pick: tuple[float, ...] = ()
    """Each worker's CPU seconds (user + system) over the picks it served in the measured
    rounds: one core's picks per second is its inverse, whatever the client takes."""

    @property
    def per_second(self) -> float:
        return self.streams / self.seconds


def _pod_file(directory: Path) -> Path:
    """Eight pods for the picker to name; nothing connects to them."""
    path = directory / "pods.yaml"
    path.write_text(dump_pods(Pod(f"pod-{i}", f"10.0.0.{i + 1}", (8000,)) for i in range(8)))
    return path


def start_workers(
    pods: Path, workers: int, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    """``python -m lwepp --workers N`` (and ``extra`` flags) on free ports; the process and
    each worker's ``listening`` line (ports, pid, worker index)."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "lwepp", "--pods", str(pods), "--workers", str(workers)),
            *("--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"),
            "--grace=2",
            "--secure-serving=false",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    listening: list[dict[str, Any]] = []
    for line in process.stderr:
        event = orjson.loads(line)
        if event.get("event") == "listening":
            listening.append(event)
            if len(listening) == workers:
                break
    else:
        raise RuntimeError(f"lwepp --workers {workers} exited with {process.wait()}")
    return process, listening


def requests_served(metrics_port: int) -> int:
    """``llm_d_epp_request_total`` (every series) as one worker's metrics page reports it."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as page:
        lines = page.read().decode().splitlines()
    counted = [line for line in lines if line.startswith("llm_d_epp_request_total{")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in counted))


def stop_workers(process: subprocess.Popen[str]) -> None:
    """SIGTERM the supervisor, which stops its workers and waits for them."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stderr is not None:
        process.stderr.close()


def measure_workers(
    counts: tuple[int, ...] = (1, 2),
    streams: int = 2000,
    concurrency: int = 16,
    connections: int = 8,
    rounds: int = 3,
    extra: Sequence[str] = (),
) -> list[WorkersResult]:
    """Streams per second from LWEPP with each number of workers, nothing pinned.

    The client runs here, on the same CPUs as the workers: on a two-CPU
    machine one worker and the client each have a core, while two workers
    share them with the client. Each count keeps its best round.
    """
    results = []
    with tempfile.TemporaryDirectory() as directory:
        pods = _pod_file(Path(directory))
        for workers in counts:
            process, listening = start_workers(pods, workers, extra)
            try:
                port = int(listening[0]["grpc_port"])
                asyncio.run(drive(port, 200, concurrency, connections))  # warm up
                pids = [int(w["pid"]) for w in listening]
                cpu0 = [cpu_seconds(pid) for pid in pids]
                picks0 = [requests_served(int(w["metrics_port"])) for w in listening]
                best = math.inf
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    asyncio.run(drive(port, streams, concurrency, connections))
                    best = min(best, time.perf_counter() - t0)
                served = tuple(requests_served(int(w["metrics_port"])) for w in listening)
                cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
                picks = [n - n0 for n, n0 in zip(served, picks0, strict=True)]
                per_pick = tuple(c / max(n, 1) for c, n in zip(cpu, picks, strict=True))
            finally:
                stop_workers(process)
            results.append(WorkersResult(workers, streams, best, served, per_pick))
    return results


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
