"""What each ``--request-metrics`` level costs the picker, against ``off`` in the same run.

``python -m bench.request_metrics [--rounds N] [--seconds S] [--instructions]`` answers
two questions:

1. **Through the real Envoy**: one gateway (the demo's topology: one simulator,
   BBR, one Envoy) with three pools that differ only in their picker's level,
   ``off``, ``request`` and ``response`` (which makes Envoy stream the
   response body through that picker). Streamed completions of ``TOKENS``
   tokens, closed loop at ``CONCURRENCY``, go to each pool in turn, each round
   in a shuffled order. Per level: the picker's CPU time per request (from
   ``/proc``: its own work, which a busy machine disturbs least), and the
   client's p50 time to first token, inter-chunk gap and whole duration.
2. **Instructions** (``--instructions``; valgrind, the same count every run):
   one whole stream of each kind, parsed from bytes and every reply serialised
   as in ``bench.instructions``: a request alone (headers and a 4 KB body) at
   ``off`` and ``request``; the same followed by a streamed response of
   ``TOKENS`` chunks, through a picker at ``off`` (a gateway that streams the
   response anyway, as the llm-d router's charts do) and at ``response``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client import CollectorRegistry

from bench import hooks
from bench.instructions import WIRE, WireStream, collected
from bench.streams import HEADERS, cpu_seconds
from demo.topology import Topology, free_ports
from lwepp.metrics import PickerMetrics
from lwepp.picking import RoundRobin
from lwepp.request_metrics import LEVELS, Level, install
from lwepp.server import EndpointPickerService
from serving.logs import configure_logging
from serving.testing import request_headers, response_body, response_headers
from wire.extproc import BodyMode, ProcessingRequest

TOKENS: Final = 32
CONCURRENCY: Final = 4


@dataclass
class Samples:
    """One level's requests over every round: client timings, and the picker's CPU."""

    ttft: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    cpu: float = 0.0

    def row(self, level: str, base: Samples) -> str:
        def ms(values: list[float]) -> float:
            return statistics.median(values) * 1e3

        cpu, base_cpu = self.cpu / len(self.duration), base.cpu / len(base.duration)
        cells = [f"{cpu * 1e6:,.0f}", f"{cpu / base_cpu:.2f}×"]
        for mine, theirs in ((self.ttft, base.ttft), (self.gap, base.gap)):
            cells += [f"{ms(mine):.2f}", f"{ms(mine) - ms(theirs):+.2f}"]
        cells += [f"{ms(self.duration):.1f}", f"{ms(self.duration) / ms(base.duration):.3f}×"]
        return f"| {level} | {len(self.duration)} | " + " | ".join(cells) + " |"


def pod_file(directory: Path) -> Path:
    """One simulated replica per level, each its own pool (and model)."""
    lines = ["pods:"]
    for level, port in zip(LEVELS, free_ports(len(LEVELS)), strict=True):
        lines += [f"- name: {level}-0", "  address: 127.0.0.1", f"  ports: [{port}]"]
        lines += [
            f"  labels: {{pool: at-{level}, model: model-{level}}}"
        ]  # YAML reads off as false
    path = directory / "pods.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def one(http: aiohttp.ClientSession, url: str, level: str, into: Samples) -> None:
    body = {"model": f"model-{level}", "prompt": "Say something.", "max_tokens": TOKENS}
    started = last = time.perf_counter()
    first = None
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as answer:
        if answer.status != 200:
            raise SystemExit(f"request_metrics: {level} answered {answer.status}")
        async for _chunk in answer.content.iter_any():
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                into.gap.append(now - last)
            last = now
    into.ttft.append((first or last) - started)
    into.duration.append(time.perf_counter() - started)


async def closed_loop(url: str, level: str, seconds: float, into: Samples) -> None:
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession() as http:

        async def client() -> None:
            while time.perf_counter() < deadline:
                await one(http, url, level, into)

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))


def live(rounds: int, seconds: float, seed: int) -> dict[str, Samples]:
    samples: dict[str, Samples] = {level: Samples() for level in LEVELS}
    with tempfile.TemporaryDirectory() as work:
        pods = pod_file(Path(work))
        args = {f"at-{lv}": [f"--request-metrics={lv}"] for lv in LEVELS}
        with Topology(Path(work), pods, picker_args=args, demo_flags=False) as gateway:
            pids = {level: gateway.services[f"lwepp-at-{level}"].process.pid for level in LEVELS}
            order, rng = list(LEVELS), random.Random(seed)
            for number in range(rounds):
                print(f"request_metrics: round {number + 1}/{rounds}", file=sys.stderr)
                rng.shuffle(order)
                for level in order:
                    before = cpu_seconds(pids[level])
                    asyncio.run(closed_loop(gateway.url, level, seconds, samples[level]))
                    samples[level].cpu += cpu_seconds(pids[level]) - before
    return samples


def live_table(samples: dict[str, Samples]) -> str:
    lines = [
        "| level | requests | picker CPU µs/request | vs off | TTFT p50 (ms) | vs off | "
        "inter-chunk p50 (ms) | vs off | duration p50 (ms) | vs off |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(lines + [samples[lv].row(lv, samples["off"]) for lv in LEVELS])


# --- instructions -------------------------------------------------------------------


SSE_EVENT: Final = b'data: {"choices":[{"index":0,"text":" word"}]}\n\n'
STREAM_KINDS: Final[dict[str, tuple[Level, bool]]] = {
    "request alone, off (today's round-robin)": ("off", False),
    "request alone, request": ("request", False),
    "request + streamed response, off": ("off", True),
    "request + streamed response, response": ("response", True),
}


def wire(response: bool) -> list[bytes]:
    """A stream in bytes: ``bench.instructions``' request, then maybe a streamed response."""
    if not response:
        return list(WIRE)
    both = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)  # the response comes
    answer = [request_headers(HEADERS, body_modes=both), ProcessingRequest.FromString(WIRE[1])]
    answer += [response_headers({":status": "200", "content-type": "text/event-stream"})]
    answer += [response_body(SSE_EVENT, end_of_stream=False) for _ in range(TOKENS)]
    answer.append(response_body(b"data: [DONE]\n\n"))
    return [message.SerializeToString() for message in answer]


def picker(level: Level, registry: CollectorRegistry | None = None) -> EndpointPickerService:
    registry = registry or CollectorRegistry()
    metrics = PickerMetrics(registry)
    strategy, controls = install(level, RoundRobin(), metrics.labels, registry)
    return EndpointPickerService(hooks.pool(), strategy, metrics, controls=controls)


def run_one(kind: str, streams: int) -> None:
    """In the process valgrind watches: warm up, then the counted streams in ``reduce``."""
    configure_logging("warning")
    level, response = STREAM_KINDS[kind]
    handler, messages, loop = picker(level), wire(response), asyncio.new_event_loop()

    def call() -> Any:
        return loop.run_until_complete(handler(WireStream(messages)))

    for _ in range(100):
        call()
    functools.reduce(lambda _acc, _i: call(), range(streams), None)


def instructions(streams: int = 300) -> list[tuple[str, float]]:
    rows = []
    for kind in STREAM_KINDS:
        command = [sys.executable, "-m", "bench.request_metrics", "--one", kind, str(streams)]
        rows.append((kind, collected(command) / streams))
    return rows


def instructions_table(rows: Sequence[tuple[str, float]]) -> str:
    lines = ["| stream | instructions | vs today's round-robin |", "|---|---:|---:|"]
    lines += [f"| {kind} | {n:,.0f} | {n / rows[0][1]:.2f}× |" for kind, n in rows]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["--one"]:
        run_one(argv[1], int(argv[2]))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.request_metrics")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instructions", action="store_true")
    args = parser.parse_args(argv)
    print(live_table(live(args.rounds, args.seconds, args.seed)), flush=True)
    if args.instructions:
        print()
        print(instructions_table(instructions()))


if __name__ == "__main__":
    main(sys.argv[1:])
