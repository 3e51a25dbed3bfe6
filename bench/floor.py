"""The floor of an ext_proc gateway: Envoy and one hop that does nothing, in Python and in Node.js.

The one-hop gateway's target is an added p50 at concurrency 1 within 1.5× of
sglang-router's, a proxy with the router inside it. Envoy calling an ext_proc
service costs two gRPC exchanges per request (the headers, then the body),
whatever the service computes. ``python -m bench.floor [--rounds N] [--seconds
S] [--seed N]`` measures how much of that is Python's, with
``bench.rig.Rig``, each case its own process as there:

- ``plain``: Envoy alone in front of the upstream;
- ``noop-picker``: Envoy and a do-nothing hop in Python (``bench.server
  passthrough``, grpc.aio: the server loop of the services);
- ``noop-sync``: the same hop on grpc's synchronous server, a thread per
  stream (``bench.server passthrough-sync``), the other loop grpc offers;
- ``noop-node``: the same do-nothing hop in Node.js (``bench/noop_extproc.js``
  on grpc-js, decoding only the fields it needs): the hop with the cheapest
  gRPC server this machine can run;
- ``one-hop``: the one-hop gateway, round-robin (``onehop``);
- ``sglang-router`` and ``vllm-router``, round_robin, in front of the same
  upstream; and the upstream alone (``direct``).

Each round runs closed-loop load at concurrency 1 and 8 on every case in a
seeded random order. It prints each case's added p50 over the upstream (the
median over rounds) and its ratio to sglang-router's, and the allowance the
1.5× target leaves a hop: 1.5 × sglang-router's added p50, less what Envoy
alone adds.

It needs ``node`` and grpc-js (``make node-grpc``; ``make bench-floor``
installs it) and the peers (``make peers``); a case that cannot start is
left out, with why.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from bench import streams
from bench.hops import round_options
from bench.overhead import LATENCY_BODY_BYTES, closed_run
from bench.report import progress
from bench.rig import CASES, GRPC_JS, Case, Placement, Rig

_CASES: Final = {case.key: case for case in CASES}
NODE_HOP: Final = Case("noop-node", "+ do-nothing hop in Node.js", picker="noop-node-picker")
SYNC_HOP: Final = Case(
    "noop-sync", "+ do-nothing hop, grpc's synchronous server", picker="noop-sync-picker"
)
FLOOR_CASES: Final = (
    _CASES["plain"],
    _CASES["noop-picker"],
    SYNC_HOP,
    NODE_HOP,
    _CASES["one-hop"],
    _CASES["direct"],
    _CASES["sglang-router"],
    _CASES["vllm-router"],
)
CONCURRENCY: Final = (1, 8)
TARGET: Final = 1.5
"""The one-hop gateway's added p50 over sglang-router's, at concurrency 1 (the issue's)."""
PEER: Final = "sglang-router"


def measure(
    rig: Rig, rounds: int, seconds: float, seed: int
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], tuple[int, int]]]:
    """Each case's p50 (seconds) at each concurrency, one per round, in a shuffled order; and
    its failed and total requests over all rounds."""
    body = streams.chat_body(LATENCY_BODY_BYTES)
    rng = random.Random(seed)
    keys = [(c.key, n) for c in rig.cases for n in CONCURRENCY]
    p50: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    failed = dict.fromkeys(keys, (0, 0))
    runs = [(case, n) for case in rig.cases for n in CONCURRENCY]
    for number in range(rounds):
        progress(f"floor: round {number + 1}/{rounds}")
        rng.shuffle(runs)
        for case, concurrency in runs:
            run = closed_run(rig.envoys[case.key], body, concurrency, seconds)
            p50[case.key, concurrency].append(run.p50)
            bad, total = failed[case.key, concurrency]
            failed[case.key, concurrency] = (bad + run.failed, total + run.requests)
    return p50, failed


def added(p50: Mapping[tuple[str, int], list[float]], concurrency: int) -> dict[str, float]:
    """Each case's added p50 over the upstream (ms): median over rounds, less ``direct``'s."""
    upstream = statistics.median(p50["direct", concurrency])
    return {
        key: (statistics.median(values) - upstream) * 1e3
        for (key, n), values in p50.items()
        if n == concurrency and key != "direct"
    }


def report(
    p50: Mapping[tuple[str, int], list[float]],
    missing: Mapping[str, str],
    failed: Mapping[tuple[str, int], tuple[int, int]] | None = None,
) -> str:
    """The table: added p50 per case and concurrency, each as a multiple of the peer's; then
    any case whose requests did not all answer 2xx (``failed``: failed and total, per case
    and concurrency), since a fast failure would flatter its p50."""
    by = {n: added(p50, n) for n in CONCURRENCY}
    cases = [case for case in FLOOR_CASES if (case.key, 1) in p50 and case.key != "direct"]
    lines = [
        "| case | " + " | ".join(f"added p50 c={n} (ms) | × {PEER}" for n in CONCURRENCY) + " |",
        "|---|" + "---:|---:|" * len(CONCURRENCY),
    ]
    for case in cases:
        cells = []
        for n in CONCURRENCY:
            peer = by[n].get(PEER)
            ratio = f"{by[n][case.key] / peer:.2f}" if peer and peer > 0 else "n/a"
            cells += [f"{by[n][case.key]:.3f}", ratio]
        lines.append(f"| {case.label} | " + " | ".join(cells) + " |")
    if PEER in by[1] and "plain" in by[1]:
        allowance = TARGET * by[1][PEER] - by[1]["plain"]
        lines += [
            "",
            f"At concurrency 1 the {TARGET}× target allows {TARGET * by[1][PEER]:.3f} ms over the"
            f" upstream; Envoy alone takes {by[1]['plain']:.3f}, leaving a hop {allowance:.3f} ms.",
        ]
    lines += [
        f"Not 2xx: {key} at c={n}, {bad} of {total} requests"
        for (key, n), (bad, total) in (failed or {}).items()
        if bad
    ]
    lines += [f"Left out: {key} ({why})" for key, why in missing.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = round_options(argv, "bench.floor", __doc__, rounds=10, minutes=5, least=1)
    cases: tuple[Case, ...] = FLOOR_CASES
    missing: dict[str, str] = {}
    if not GRPC_JS.is_dir():
        cases = tuple(case for case in cases if case is not NODE_HOP)
        missing[NODE_HOP.key] = f"no grpc-js at {GRPC_JS}: make node-grpc"
    with tempfile.TemporaryDirectory() as work:
        rig = Rig(Path(work), Placement.detect(), cases=cases)
        try:
            rig.start()
            p50, failed = measure(rig, args.rounds, args.seconds, args.seed)
        finally:
            rig.close()
    print(report(p50, {**missing, **rig.missing}, failed))


if __name__ == "__main__":
    main()
