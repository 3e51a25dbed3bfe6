"""``python -m bench.replica_kill``: one of two pickers killed under load; requests lost and
routing quality after.

The demo (``demo.topology.Topology``, a real Envoy) runs pool ``a`` with two
pickers (``--picker-replicas 2``, ``demo/configs/recommended.yaml``) sharing
learned state through a real ``redis-server``, on simulated engines that
report ``prompt_tokens_details.cached_tokens`` (vLLM's
``--enable-prompt-tokens-details``) and whose KV caches hold ``KV_CAPACITY``
tokens each: fewer than ``GROUPS`` shared prefixes of ``PREFIX_TOKENS``, so the
prefix-cache hit rate (cached over prompt tokens) shows how well requests are
routed: a picker that spreads a group over both engines thrashes their caches.
``WORKERS`` closed-loop clients stream chat requests. At ``KILL_AT`` one picker
gets SIGKILL.

Four runs of the same length (``MODES``): the shared pickers without a kill
(the same-run baseline), and killed; as controls, the kill with each replica on
its own view (no store) and with round-robin pickers (the floor a prefix-blind
picker gets on this workload, so a loss of routing quality would show).

Reported per ``WINDOW`` of send time: requests, failures, hit rate, p90 TTFT
(the first content chunk, seen by the client); the streams Envoy had open on the
killed picker just before the kill (its admin ``rq_active`` for that host), the
failures among requests sent before and after the kill, and the picker
cluster's retries; then the time from the kill until a window's hit rate is at
least 0.95 x and its p90 TTFT at most 1.05 x the no-kill run's level after
``KILL_AT``, and so in every later window (``recovery``); the same against the run's own
pre-kill level (fresh demos settle at different levels: one engine may end up with more
groups than its cache holds).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
RECOMMENDED = ROOT / "demo/configs/recommended.yaml"
WORKERS = 16
GROUPS = 12
PREFIX_TOKENS = 300
"""Each group's system prompt, in the simulator's tokens (``"be brief. "`` is three)."""
KV_CAPACITY = 2048
"""Each engine's KV cache in tokens: six groups' prefixes, half of ``GROUPS``."""
DURATION = 8.0
KILL_AT = 4.0
WARMUP = 1.0
WINDOW = 0.5
TOLERANCE = 0.05
MODES = ("no kill", "shared", "own view", "round-robin")
"""The runs: the baseline, the kill with the shared store, and the two controls."""


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent (seconds from the start), whether served, its numbers."""

    sent: float
    ok: bool
    ttft: float = 0.0
    prompt: int = 0
    cached: int = 0


def one(port: int, i: int, start: float) -> Outcome:
    """Stream one chat request of prefix group ``i % GROUPS`` through the gateway."""
    body = {
        "model": "llama-3-8b",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {
                "role": "system",
                "content": f"group {i % GROUPS} " + "be brief. " * (PREFIX_TOKENS // 3),
            },
            {"role": "user", "content": f"q{i}"},
        ],
    }
    sent = time.monotonic()
    ttft, usage = 0.0, dict[str, Any]()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"content-type": "application/json"},
            )
            response = connection.getresponse()
            if response.status != 200:
                response.read()
                return Outcome(sent - start, False)
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not ttft and chunk.get("choices"):
                    ttft = time.monotonic() - sent
                usage = chunk.get("usage") or usage
        finally:
            connection.close()
    except OSError:
        return Outcome(sent - start, False)
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        sent - start, True, ttft, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0)
    )


def admin(top: Topology, path: str) -> str:
    """One page of Envoy's admin interface."""
    with urllib.request.urlopen(top.admin_url + path, timeout=5) as page:
        return str(page.read().decode())


def host_stat(top: Topology, cluster: str, port: int, stat: str) -> int:
    """One host's statistic from the admin ``/clusters`` page (``rq_active``: streams open)."""
    key = f"{cluster}::127.0.0.1:{port}::{stat}::"
    for line in admin(top, "/clusters").splitlines():
        if line.startswith(key):
            return int(line[len(key) :])
    return 0


def cluster_stats(top: Topology, cluster: str, *names: str) -> dict[str, int]:
    """Counters of one cluster (``upstream_rq_retry`` ...) from the admin ``/stats`` page."""
    wanted = {f"cluster.{cluster}.{n}": n for n in names}
    result = dict.fromkeys(names, 0)
    for line in admin(top, "/stats").splitlines():
        name, _, value = line.partition(": ")
        if name in wanted:
            result[wanted[name]] = int(value)
    return result


@dataclass
class Run:
    """One drive: every request's outcome; for a kill, what Envoy had on the killed host."""

    outcomes: list[Outcome]
    in_flight: int = 0
    """Streams open on the killed picker just before the kill (Envoy's ``rq_active``)."""
    killed_at: float = KILL_AT
    """When the SIGKILL went, from the start (just after ``KILL_AT``: the admin page is read
    first); a request sent before it may have been in flight on the killed picker."""
    stats: dict[str, int] = field(default_factory=dict)
    """The picker cluster's retry and ejection counters at the end."""


STATS = (
    "upstream_rq_retry",
    "upstream_rq_retry_success",
    "outlier_detection.ejections_enforced_total",
)


def drive(top: Topology, kill: bool) -> Run:
    """``WORKERS`` closed-loop clients for ``DURATION``; pool ``a``'s second picker killed at
    ``KILL_AT`` if ``kill``."""
    port = int(top.url.rsplit(":", 1)[1].rstrip("/"))
    pool = next(p for p in top.pools if "llama-3-8b" in p.models)
    victim = top.services[f"lwepp-{pool.name}-1"]
    start = time.monotonic()
    run = Run([])
    lock = threading.Lock()
    counter = iter(range(10**9))

    def worker() -> None:
        while time.monotonic() - start < DURATION:
            with lock:
                i = next(counter)
            outcome = one(port, i, start)
            with lock:
                run.outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for thread in threads:
        thread.start()
    time.sleep(KILL_AT)
    if kill:
        port_of = victim.listening["grpc_port"]
        run.in_flight = host_stat(top, f"lwepp-{pool.name}", port_of, "rq_active")
        victim.process.kill()
        run.killed_at = time.monotonic() - start
    for thread in threads:
        thread.join()
    run.stats = cluster_stats(top, f"lwepp-{pool.name}", *STATS)
    return run


@dataclass(frozen=True)
class Window:
    """One ``WINDOW`` of send time."""

    start: float
    requests: int
    failures: int
    hit_rate: float
    p90_ttft: float


def windows(outcomes: list[Outcome]) -> list[Window]:
    """The outcomes in windows of ``WINDOW`` seconds by send time."""
    result = []
    for k in range(int(DURATION / WINDOW)):
        low = k * WINDOW
        inside = [o for o in outcomes if low <= o.sent < low + WINDOW]
        served = [o for o in inside if o.ok]
        prompt = sum(o.prompt for o in served)
        ttfts = sorted(o.ttft for o in served)
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else 0.0
        result.append(
            Window(
                low,
                len(inside),
                len(inside) - len(served),
                sum(o.cached for o in served) / prompt if prompt else 0.0,
                p90,
            )
        )
    return result


def level(ws: list[Window]) -> tuple[float, float]:
    """Mean hit rate and mean p90 TTFT over ``ws``."""
    return statistics.fmean(w.hit_rate for w in ws), statistics.fmean(w.p90_ttft for w in ws)


def recovery(ws: list[Window], baseline: tuple[float, float]) -> float | None:
    """Seconds from ``KILL_AT`` to the end of the first window starting at or after it whose
    hit rate and p90 TTFT are within ``TOLERANCE`` of ``baseline`` (the no-kill run's level
    over the same windows) and stay so in every later window (None: never)."""
    hit, ttft = baseline
    after = [w for w in ws if w.start >= KILL_AT]
    good = [
        w.hit_rate >= (1 - TOLERANCE) * hit and w.p90_ttft <= (1 + TOLERANCE) * ttft for w in after
    ]
    for k, w in enumerate(after):
        if all(good[k:]):
            return w.start + WINDOW - KILL_AT
    return None


def report(label: str, run: Run, baseline: tuple[float, float] | None) -> list[str]:
    """The per-window table and the summary lines of one run."""
    ws = windows(run.outcomes)
    lines = [f"## {label}", "| from s | requests | failures | hit rate | p90 TTFT ms |"]
    lines.append("|---:|---:|---:|---:|---:|")
    lines += [
        f"| {w.start:.1f} | {w.requests} | {w.failures} | {w.hit_rate:.3f} "
        f"| {w.p90_ttft * 1e3:.1f} |"
        for w in ws
    ]
    before = level([w for w in ws if WARMUP <= w.start < KILL_AT])
    after = level([w for w in ws if w.start >= KILL_AT])
    failed = [o for o in run.outcomes if not o.ok]
    lines.append(
        f"requests {len(run.outcomes)}, failures {len(failed)} "
        f"({sum(o.sent < run.killed_at for o in failed)} sent before the kill at "
        f"{run.killed_at:.3f} s, {sum(o.sent >= run.killed_at for o in failed)} after); "
        "streams open on the killed picker "
        f"at the kill {run.in_flight}; " + ", ".join(f"{k} {v}" for k, v in run.stats.items())
    )
    lines.append(
        f"hit rate {before[0]:.3f} before, {after[0]:.3f} after; "
        f"p90 TTFT {before[1] * 1e3:.1f} ms before, {after[1] * 1e3:.1f} ms after"
    )
    if baseline is not None:
        for name, level_ in (("the no-kill run", baseline), ("its own pre-kill level", before)):
            back = recovery(ws, level_)
            lines.append(
                f"after the kill vs {name}: hit rate {after[0] / level_[0]:.3f}x, "
                f"p90 TTFT {after[1] / level_[1]:.3f}x; within {TOLERANCE:.0%} from then on: "
                + (f"{back:.1f} s after the kill" if back is not None else "never")
            )
    return lines


def run(mode: str) -> Run:
    """One fresh demo (two pickers per pool, as ``mode`` says) and one drive of it."""
    with (
        tempfile.TemporaryDirectory() as work,
        Topology(
            Path(work),
            ROOT / "demo/pods.yaml",
            picker_config=None if mode == "round-robin" else RECOMMENDED,
            picker_replicas=2,
            shared_store=mode != "own view",
            simulator_args=[
                *("--time-scale", "0.05", "--enable-prompt-tokens-details"),
                *("--kv-capacity", str(KV_CAPACITY)),
            ],
            model_rewrites=None,
        ) as top,
    ):
        return drive(top, kill=mode != "no kill")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_kill", description=__doc__)
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"runs, comma-separated (default {MODES})"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    baseline: tuple[float, float] | None = None
    lines: list[str] = []
    for mode in modes:
        result = run(mode)
        ws = windows(result.outcomes)
        if mode == "no kill":
            baseline = level([w for w in ws if w.start >= KILL_AT])
        lines += report(mode, result, None if mode == "no kill" else baseline)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
