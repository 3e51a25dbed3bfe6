"""``python -m bench.replica_kill``: one of two pickers killed under load; routing quality after.

The demo (``demo.topology.Topology``, a real Envoy) runs pool ``a`` with two
pickers (``--picker-replicas 2``, ``demo/configs/recommended.yaml``) sharing
learned state through a real ``redis-server``, on simulated engines that
report ``prompt_tokens_details.cached_tokens`` (vLLM's
``--enable-prompt-tokens-details``). ``WORKERS`` closed-loop clients stream
chat requests whose system prompts fall in ``GROUPS`` shared prefixes, so the
prefix-cache hit rate (cached over prompt tokens) shows how well requests are
routed. At ``KILL_AT`` one picker gets SIGKILL; a second run of the same
length kills nothing (the same-run baseline).

Reported per ``WINDOW`` of send time: requests, failures, hit rate, p90 TTFT
(the first content chunk, seen by the client); then the time from the kill
until a window's hit rate is at least 0.95 x and its p90 TTFT at most 1.05 x
the pre-kill windows' level (``recovery``), and the post-kill level over the
pre-kill one for both runs (ratios).
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
RECOMMENDED = ROOT / "demo/configs/recommended.yaml"
WORKERS = 16
GROUPS = 8
DURATION = 8.0
KILL_AT = 4.0
WARMUP = 1.0
WINDOW = 0.5
TOLERANCE = 0.05


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
            {"role": "system", "content": f"group {i % GROUPS} " + "be brief. " * 60},
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


def drive(top: Topology, kill: bool) -> list[Outcome]:
    """``WORKERS`` closed-loop clients for ``DURATION``; pool ``a``'s second picker killed at
    ``KILL_AT`` if ``kill``."""
    port = int(top.url.rsplit(":", 1)[1].rstrip("/"))
    start = time.monotonic()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def worker() -> None:
        while time.monotonic() - start < DURATION:
            with lock:
                i = next(counter)
            outcome = one(port, i, start)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for thread in threads:
        thread.start()
    time.sleep(KILL_AT)
    if kill:
        pool = next(p for p in top.pools if "llama-3-8b" in p.models)
        top.services[f"lwepp-{pool.name}-1"].process.kill()
    for thread in threads:
        thread.join()
    return outcomes


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


def recovery(ws: list[Window]) -> float | None:
    """Seconds from ``KILL_AT`` to the end of the first window starting at or after it whose
    hit rate and p90 TTFT are within ``TOLERANCE`` of the pre-kill level (None: never)."""
    hit, ttft = level([w for w in ws if WARMUP <= w.start < KILL_AT])
    for w in ws:
        if w.start < KILL_AT:
            continue
        if w.hit_rate >= (1 - TOLERANCE) * hit and w.p90_ttft <= (1 + TOLERANCE) * ttft:
            return w.start + WINDOW - KILL_AT
    return None


def report(label: str, outcomes: list[Outcome]) -> list[str]:
    """The per-window table and the summary lines of one run."""
    ws = windows(outcomes)
    lines = [f"## {label}", "| from s | requests | failures | hit rate | p90 TTFT ms |"]
    lines.append("|---:|---:|---:|---:|---:|")
    lines += [
        f"| {w.start:.1f} | {w.requests} | {w.failures} | {w.hit_rate:.3f} "
        f"| {w.p90_ttft * 1e3:.1f} |"
        for w in ws
    ]
    before = level([w for w in ws if WARMUP <= w.start < KILL_AT])
    after = level([w for w in ws if w.start >= KILL_AT])
    back = recovery(ws)
    lines.append(
        f"requests {len(outcomes)}, failures {sum(not o.ok for o in outcomes)}; "
        f"hit rate {before[0]:.3f} before, {after[0]:.3f} after ({after[0] / before[0]:.3f}x); "
        f"p90 TTFT {before[1] * 1e3:.1f} ms before, {after[1] * 1e3:.1f} ms after "
        f"({after[1] / before[1]:.3f}x); back within {TOLERANCE:.0%}: "
        + (f"{back:.1f} s after {KILL_AT:.0f} s" if back is not None else "never")
    )
    return lines


def run(kill: bool) -> list[Outcome]:
    """One fresh demo (two pickers per pool, the recommended config) and one drive of it."""
    with (
        tempfile.TemporaryDirectory() as work,
        Topology(
            Path(work),
            ROOT / "demo/pods.yaml",
            picker_config=RECOMMENDED,
            picker_replicas=2,
            simulator_args=["--time-scale", "0.05", "--enable-prompt-tokens-details"],
            model_rewrites=None,
        ) as top,
    ):
        return drive(top, kill)


def main() -> None:
    lines = report("no kill (baseline)", run(kill=False))
    lines += report(f"one picker killed at {KILL_AT:.0f} s", run(kill=True))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
