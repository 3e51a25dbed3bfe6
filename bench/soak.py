"""``make soak``: a steady mix of good, bad and cancelled requests through the demo gateway.

``python -m bench.soak [--minutes N] [--rate R] [--work-dir DIR]`` (``make
soak``: ``SOAK_MINUTES``, default 10) starts the demo's process topology on
free ports (Envoy, BBR, one LWEPP per pool running
``demo/configs/prefix-aware.yaml``, simulated replicas), sends ``R`` requests
a second on a fixed schedule for ``N`` minutes, and reports what matters
for a service that sits on every request:

- **good requests that did not get 200** (target 0): completions and chats,
  streamed or not, with prompts that share prefixes (the prefix index works);
- **bad requests answered otherwise than expected** (target 0): bad JSON,
  CR/LF in ``model``, unknown models, arrays;
- **cancelled requests**: clients that hang up half-way through the body, or
  after the first event of a streamed answer;
- **resident memory growth per service after warm-up** (target ≤ 5%), open
  file descriptors and asyncio tasks, read from each service's
  ``/debug/runtime`` (Envoy's and the simulator's memory from ``/proc``);
- **error log lines** per service (target 0).

The schedule is open-loop (``bench.loadgen``'s reasoning): a gateway that
falls behind shows it as late answers, not as a slower soak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from demo.topology import Topology, free_ports

PICKER_CONFIG: Final = Path(__file__).resolve().parent.parent / "demo/configs/prefix-aware.yaml"
SERVICES: Final = ("bbr", "lwepp-a", "lwepp-b")
"""The services whose memory, descriptors and tasks are watched (``/debug/runtime``)."""

MODELS: Final = {"a": "llama-3-8b", "b": "qwen-2.5-7b"}
PREFIXES: Final = tuple(
    f"You are assistant number {i}. Answer briefly, politely and in English. " * 3 for i in range(8)
)
"""Shared prompt prefixes (system prompts), so the prefix-aware picker has work to do."""

ERROR_LEVELS: Final = frozenset({"error", "critical", "exception", "fatal"})


def error_lines(log: Path) -> list[str]:
    """The lines of a service log that report an error: JSON lines at level error or worse,
    and anything that is not a JSON line at all (a traceback, gRPC's own complaints).

    Envoy's log (``[time][level][component]`` text) counts its ``[error]`` and
    ``[critical]`` lines.
    """
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        if line.startswith("[") and "][" in line:  # Envoy's format
            if "][error][" in line or "][critical][" in line:
                found.append(line)
            continue
        try:
            event = json.loads(line)
        except ValueError:
            found.append(line)
            continue
        if not isinstance(event, dict) or event.get("level") in ERROR_LEVELS:
            found.append(line)
    return found


def write_pods(path: Path) -> Path:
    """Two pools of two replicas, on free ports: pool a FailClose, pool b FailOpen."""
    ports = iter(free_ports(4))
    lines = ["pods:"]
    for pool, model in MODELS.items():
        for replica in range(2):
            lines += [
                f"- name: {pool}-{replica}",
                "  address: 127.0.0.1",
                f"  ports: [{next(ports)}]",
                f"  labels: {{pool: {pool}, model: {model}}}",
            ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- what the services hold ------------------------------------------------------------


def runtime(metrics_port: int) -> dict[str, Any]:
    """A service's ``/debug/runtime``: rss_bytes, open_fds, asyncio_tasks, threads."""
    url = f"http://127.0.0.1:{metrics_port}/debug/runtime"
    with urllib.request.urlopen(url, timeout=5) as page:
        state: dict[str, Any] = json.load(page)
    return state


def rss_of(pid: int) -> int:
    """Resident memory of any process, from ``/proc`` (Envoy, the simulator)."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot(topology: Topology) -> dict[str, dict[str, Any]]:
    """Every watched service's runtime state, plus Envoy's and the simulator's memory."""
    state = {name: runtime(topology.services[name].listening["metrics_port"]) for name in SERVICES}
    for name in ("envoy", "simulator"):
        state[name] = {"rss_bytes": rss_of(topology.services[name].process.pid)}
    return state


# --- the requests ------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What the soak sent and saw, by kind."""

    sent: Counter[str] = field(default_factory=Counter)
    good_failed: Counter[str] = field(default_factory=Counter)
    """Good requests that did not get a complete 200, by what they got instead."""
    bad_unexpected: Counter[str] = field(default_factory=Counter)
    late: int = 0
    """Requests that started more than a second after their scheduled time."""


BAD: Final = (
    ("bad JSON", b'{"model": "llama-3-8b", "prompt": ', 400),
    ("CR/LF in model", b'{"model": "llama-3-8b\\r\\nx: y", "prompt": "hi"}', 400),
    ("unknown model", b'{"model": "gpt-9", "prompt": "hi"}', 404),
    ("an array", b'[{"model": "llama-3-8b"}]', 400),
)


def good_body(rng: random.Random, *, stream: bool) -> tuple[str, bytes]:
    """A completion or chat for one of the two models, sharing one of the prefixes."""
    model = rng.choice(list(MODELS.values()))
    prompt = rng.choice(PREFIXES) + f"Question {rng.randrange(10**6)}: say hi."
    body: dict[str, Any] = {"model": model, "max_tokens": 8, "stream": stream}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", json.dumps(body).encode()
    body["prompt"] = prompt
    return "/v1/completions", json.dumps(body).encode()


async def send_good(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    stream = rng.random() < 0.4
    path, body = good_body(rng, stream=stream)
    tally.sent["good, streamed" if stream else "good"] += 1
    try:
        async with session.post(url + path, data=body) as response:
            data = await response.read()
            if response.status != 200:
                tally.good_failed[f"{response.status} {data[:80]!r}"] += 1
            elif stream and b"data: [DONE]" not in data:
                tally.good_failed["200 but the stream ended before [DONE]"] += 1
    except (aiohttp.ClientError, TimeoutError) as error:
        tally.good_failed[f"{type(error).__name__}: {error}"] += 1


async def send_bad(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    what, body, expected = rng.choice(BAD)
    tally.sent[f"bad: {what}"] += 1
    try:
        async with session.post(url + "/v1/completions", data=body) as response:
            await response.read()
            if response.status != expected:
                tally.bad_unexpected[f"{what}: {response.status}"] += 1
    except (aiohttp.ClientError, TimeoutError) as error:
        tally.bad_unexpected[f"{what}: {type(error).__name__}"] += 1


async def hang_up_mid_body(port: int, rng: random.Random, tally: Tally) -> None:
    """Announce a body, send part of it, close the connection."""
    tally.sent["cancelled mid-body"] += 1
    _, body = good_body(rng, stream=False)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body[: len(body) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def hang_up_mid_stream(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    """Start a long streamed completion, read its first line, close the connection."""
    tally.sent["cancelled mid-stream"] += 1
    path, body = good_body(rng, stream=True)
    data = json.loads(body)
    data["max_tokens"] = 200
    try:
        async with session.post(url + path, data=json.dumps(data).encode()) as response:
            await response.content.readline()
            response.close()  # the connection goes, mid-stream
    except (aiohttp.ClientError, TimeoutError) as error:
        tally.good_failed[f"stream to cancel: {type(error).__name__}"] += 1


async def load(port: int, seconds: float, rate: float, seed: int, tally: Tally) -> None:
    """Requests on a fixed schedule, ``rate`` a second: 65% good, 15% bad, 20% cancelled."""
    rng = random.Random(seed)
    url = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        for i in range(int(seconds * rate)):
            due = started + i / rate
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            elif wait < -1:
                tally.late += 1
            roll = rng.random()
            if roll < 0.65:
                job = send_good(session, url, rng, tally)
            elif roll < 0.80:
                job = send_bad(session, url, rng, tally)
            elif roll < 0.90:
                job = hang_up_mid_body(port, rng, tally)
            else:
                job = hang_up_mid_stream(session, url, rng, tally)
            task = asyncio.create_task(job)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


# --- the run ----------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    """What one soak measured."""

    minutes: float
    rate: float
    tally: Tally
    idle_before: dict[str, dict[str, Any]]
    warm: dict[str, dict[str, Any]]
    end: dict[str, dict[str, Any]]
    idle_after: dict[str, dict[str, Any]]
    error_lines: dict[str, list[str]]
    peak: dict[str, dict[str, int]]

    @property
    def good_not_200(self) -> int:
        return sum(self.tally.good_failed.values())

    def growth(self, service: str) -> float:
        """Resident memory at the end over after warm-up, minus one (0.05 is 5% growth)."""
        return float(self.end[service]["rss_bytes"] / self.warm[service]["rss_bytes"] - 1)

    def markdown(self) -> str:
        t = self.tally
        good = t.sent["good"] + t.sent["good, streamed"]
        lines = [
            f"Soak: {self.minutes:g} min at {self.rate:g} requests/s "
            f"({sum(t.sent.values())} requests; {t.late} started over a second late)",
            "",
            "| sent | count |",
            "|---|---:|",
            *(f"| {kind} | {count} |" for kind, count in sorted(t.sent.items())),
            "",
            f"- good requests that did not get 200: **{self.good_not_200}** of {good}"
            + (f" ({dict(t.good_failed)})" if t.good_failed else ""),
            f"- bad requests answered otherwise than expected: {sum(t.bad_unexpected.values())}"
            + (f" ({dict(t.bad_unexpected)})" if t.bad_unexpected else ""),
            "",
            "| service | RSS after warm-up | at the end | growth | fds idle before → after "
            "(peak) | asyncio tasks idle before → after (peak) | error log lines |",
            "|---|---:|---:|---:|---|---|---:|",
        ]
        for name in (*SERVICES, "envoy", "simulator"):
            fds = tasks = "—"
            if name in SERVICES:
                before, after, peak = self.idle_before[name], self.idle_after[name], self.peak[name]
                fds = f"{before['open_fds']} → {after['open_fds']} ({peak['open_fds']})"
                tasks = (
                    f"{before['asyncio_tasks']} → {after['asyncio_tasks']} "
                    f"({peak['asyncio_tasks']})"
                )
            lines.append(
                f"| {name} | {self.warm[name]['rss_bytes'] / 2**20:.1f} MiB | "
                f"{self.end[name]['rss_bytes'] / 2**20:.1f} MiB | {self.growth(name):+.1%} | "
                f"{fds} | {tasks} | {len(self.error_lines.get(name, []))} |"
            )
        return "\n".join(lines)


async def _sample_until(
    topology: Topology, stop: asyncio.Event, peak: dict[str, dict[str, int]]
) -> None:
    """Every 2 s, the highest descriptors and tasks each service held."""
    while not stop.is_set():
        state = await asyncio.to_thread(snapshot, topology)
        for name in SERVICES:
            for key in ("open_fds", "asyncio_tasks"):
                peak[name][key] = max(peak[name][key], state[name][key])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2)


def idle(topology: Topology, baseline: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The services' state once their tasks are back to ``baseline``'s (or 10 s have passed)."""
    deadline = time.monotonic() + 10
    while True:
        state = snapshot(topology)
        settled = baseline is None or all(
            state[n]["asyncio_tasks"] <= baseline[n]["asyncio_tasks"] for n in SERVICES
        )
        if settled or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


async def _soak(topology: Topology, minutes: float, rate: float, seed: int) -> Report:
    seconds = minutes * 60
    warmup = min(120.0, max(15.0, seconds * 0.2))
    tally = Tally()
    idle_before = idle(topology, None)
    peak = {n: {"open_fds": 0, "asyncio_tasks": 0} for n in SERVICES}
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_until(topology, stop, peak))
    traffic = asyncio.create_task(load(topology.port, seconds, rate, seed, tally))
    await asyncio.sleep(warmup)
    warm = await asyncio.to_thread(snapshot, topology)
    await traffic
    end = await asyncio.to_thread(snapshot, topology)
    stop.set()
    await sampler
    idle_after = await asyncio.to_thread(idle, topology, idle_before)
    errors = {name: error_lines(service.log) for name, service in topology.services.items()}
    return Report(minutes, rate, tally, idle_before, warm, end, idle_after, errors, peak)


def soak(
    work_dir: Path,
    minutes: float,
    rate: float = 12.0,
    seed: int = 0,
    picker_config: Path | None = PICKER_CONFIG,
) -> Report:
    """Run the gateway, soak it for ``minutes``, stop it; return what was measured.

    ``picker_config`` is what every picker runs (None: plain round-robin).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    pods = write_pods(work_dir / "pods.yaml")
    with Topology(
        work_dir,
        pods,
        fail_open=["b"],
        picker_config=picker_config,
        simulator_args=["--time-scale", "0.1"],
    ) as topology:
        return asyncio.run(_soak(topology, minutes, rate, seed))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=float(os.environ.get("SOAK_MINUTES", "10")),
        help="how long to send (default: $SOAK_MINUTES, else 10)",
    )
    parser.add_argument("--rate", type=float, default=12.0, help="requests a second (12)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (0)")
    parser.add_argument("--work-dir", type=Path, default=Path("run/soak"), help="logs")
    parser.add_argument(
        "--picker-config",
        default=str(PICKER_CONFIG),
        metavar="FILE",
        help="the pickers' EndpointPickerConfig (default: demo/configs/prefix-aware.yaml; "
        "'none': round-robin)",
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0:
        parser.error("--minutes and --rate must be above 0")
    config = None if args.picker_config == "none" else Path(args.picker_config)
    report = soak(args.work_dir, args.minutes, args.rate, args.seed, config)
    print(report.markdown())
    for name, lines in report.error_lines.items():
        for line in lines[:5]:
            print(f"{name}: {line}", file=sys.stderr)
    grew = [n for n in SERVICES if report.growth(n) > 0.05]
    failed = report.good_not_200 or grew or any(report.error_lines.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
