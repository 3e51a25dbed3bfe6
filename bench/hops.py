"""Two hops against two do-nothing hops, settled: many rounds in shuffled order, with intervals.

``make bench-overhead`` measures every piece of the gateway path in 9 rounds;
one of its targets, the two-hop gateway's added p50 over two do-nothing hops
in the same processing modes (≤ 1.1×), is a ratio of two numbers that each
move by tens of percent between rounds on a shared machine. This settles that
one comparison. ``python -m bench.hops [--rounds N] [--seconds S] [--seed N]``
starts, with ``bench.rig.Rig``, three of that part's cases: Envoy with
BBR and LWEPP (round-robin), Envoy with two do-nothing hops (``bench.server
passthrough``, each in its service's mode), and the upstream alone. Each round
runs closed-loop load at concurrency 1 and 8 on every case, in a seeded
random order, so no case always follows another. It prints, per concurrency:

- each gateway's added p50 over the upstream (the median over rounds), their
  ratio, and a 95% bootstrap interval of that ratio (rounds resampled);
- the median of the paired differences (same round);
- the Python processes' CPU time per request (``/proc``, summed over the two
  processes of each gateway), the services' own work, which a busy machine
  disturbs least: at concurrency 8 the hops' core is saturated, and the
  latency ratio follows this one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import streams
from bench.overhead import LATENCY_BODY_BYTES, closed_run
from bench.report import progress
from bench.rig import CASES, Placement, Rig

_CASES: Final = {case.key: case for case in CASES}
TWO_HOPS: Final = _CASES["bbr+lwepp"]
TWO_NOOPS: Final = _CASES["noop-both"]
UPSTREAM: Final = _CASES["direct"]
"""The three cases of ``bench.overhead`` this compares, as that part runs them."""
CONCURRENCY: Final = (1, 8)
TARGET: Final = 1.1
"""The two hops' added p50 over the two do-nothing hops' (``bench.overhead.COMPARISONS``)."""


@dataclass
class Samples:
    """One case at one concurrency: each round's p50, and the CPU and requests of all rounds."""

    p50: list[float] = field(default_factory=list)
    cpu: float = 0.0
    requests: int = 0


def interval(
    ours: Sequence[float], base: Sequence[float], rng: random.Random, draws: int = 2000
) -> tuple[float, float]:
    """95% bootstrap interval of median(ours) / median(base), rounds resampled in pairs."""
    n = len(ours)
    ratios = []
    for _ in range(draws):
        picked = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(ours[i] for i in picked) / statistics.median(base[i] for i in picked)
        )
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def measure(rig: Rig, rounds: int, seconds: float, seed: int) -> dict[tuple[str, int], Samples]:
    """Every case at every concurrency once per round, in a shuffled order."""
    body = streams.chat_body(LATENCY_BODY_BYTES)
    rng = random.Random(seed)
    samples = {(c.key, n): Samples() for c in rig.cases for n in CONCURRENCY}
    runs = [(case, n) for case in rig.cases for n in CONCURRENCY]
    for number in range(rounds):
        progress(f"hops: round {number + 1}/{rounds}")
        rng.shuffle(runs)
        for case, concurrency in runs:
            pids = [rig.servers[k].process.pid for k in (case.bbr, case.picker) if k is not None]
            before = sum(map(streams.cpu_seconds, pids))
            run = closed_run(rig.envoys[case.key], body, concurrency, seconds)
            if run.failed:
                raise SystemExit(f"hops: {run.failed} requests failed on {case.key}")
            into = samples[case.key, concurrency]
            into.p50.append(run.p50)
            into.cpu += sum(map(streams.cpu_seconds, pids)) - before
            into.requests += run.requests
    return samples


def report(samples: dict[tuple[str, int], Samples], seed: int) -> str:
    """The Markdown table: added p50, ratio with interval, paired difference, CPU per request."""
    rng = random.Random(seed)
    lines = [
        "| concurrency | two hops added p50 (ms) | two do-nothing hops (ms) | ratio "
        f"(target ≤ {TARGET}) | 95% interval | paired median (ms) | CPU per request, "
        "two hops / two do-nothing (µs) |",
        "|---:|---:|---:|---:|---|---:|---|",
    ]
    for n in CONCURRENCY:
        upstream = samples[UPSTREAM.key, n].p50
        hops, noops = (samples[c.key, n] for c in (TWO_HOPS, TWO_NOOPS))
        ours = [a - b for a, b in zip(hops.p50, upstream, strict=True)]
        base = [a - b for a, b in zip(noops.p50, upstream, strict=True)]
        ratio = statistics.median(ours) / statistics.median(base)
        low, high = interval(ours, base, rng)
        paired = statistics.median(a - b for a, b in zip(ours, base, strict=True))
        cpu = [s.cpu / s.requests * 1e6 for s in (hops, noops)]
        lines.append(
            f"| {n} | {statistics.median(ours) * 1e3:.3f} | {statistics.median(base) * 1e3:.3f}"
            f" | {ratio:.3f} | {low:.3f}–{high:.3f} | {paired * 1e3:.3f} "
            f"| {cpu[0]:.0f} / {cpu[1]:.0f} ({cpu[0] / cpu[1]:.3f}×) |"
        )
    return "\n".join(lines)


def round_options(
    argv: Sequence[str] | None, module: str, doc: str, rounds: int, minutes: int, least: int
) -> argparse.Namespace:
    """``--rounds`` (default ``rounds``, about ``minutes``; at least ``least``), ``--seconds``
    per run and ``--seed``: the options of the benchmarks that run their cases in rounds."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"rounds ({rounds}: about {minutes} minutes)"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per run (2)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    args = parser.parse_args(argv)
    if args.rounds < least or args.seconds <= 0:
        parser.error(f"--rounds must be at least {least} and --seconds above 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = round_options(argv, "bench.hops", __doc__, rounds=30, minutes=6, least=2)
    with tempfile.TemporaryDirectory() as work:
        rig = Rig(Path(work), Placement.detect(), cases=(TWO_HOPS, TWO_NOOPS, UPSTREAM))
        try:
            rig.start()
            samples = measure(rig, args.rounds, args.seconds, args.seed)
        finally:
            rig.close()
    print(report(samples, args.seed))


if __name__ == "__main__":
    main()
