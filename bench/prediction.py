"""``python -m bench.prediction``: what ``predicted-latency-producer`` gets right and wrong.

Runs every routing workload (``bench.routing``: shared prefix at its target
rate, multi-turn, the two trace slices, the mixed pool) under the
``predicted-latency`` picker, in virtual time, and compares, for every request
after the warm-up, the TTFT the producer predicted for the endpoint it was
sent to with the TTFT it then had (pick to first chunk). Printed per
workload: the bias (median of predicted - actual), the median and p90 of the
absolute error, the median relative error, and the share of requests
predicted within ±25%::

    python -m bench.prediction            # full sizes, about a minute
    python -m bench.prediction --quick    # smoke size
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench import routing, workloads
from bench.report import percentile
from bench.workloads import Arrival
from lwepp.plugins.predicted_latency import PredictedLatencyProducer
from simulator.profiles import Profile

STRATEGY = "predicted-latency"


@contextlib.contextmanager
def recording(found: list[PredictedLatencyProducer]) -> Iterator[None]:
    """Every ``predicted-latency-producer`` the routing benchmark builds records its errors
    into ``found`` (``routing.router`` wrapped for the duration)."""
    original: Callable[..., Any] = routing.router

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        for hook in getattr(getattr(made, "pipeline", None), "picked", ()):
            if isinstance(hook, PredictedLatencyProducer):
                hook.record_errors = True
                found.append(hook)
        return made

    routing.router = wrapped
    try:
        yield
    finally:
        routing.router = original


def errors(
    workload: str, arrivals: Sequence[Arrival], profile: Profile, profiles: Sequence[Profile] = ()
) -> list[tuple[float, float]]:
    """(predicted, actual) TTFT of each measured request of one run."""
    found: list[PredictedLatencyProducer] = []
    with recording(found):
        routing.simulate(workload, arrivals, STRATEGY, profile, profiles=profiles)
    pairs = [(p, a) for producer in found for _, p, a in producer.errors if not math.isnan(p)]
    return pairs[int(len(pairs) * routing.WARMUP) :]


def summary(pairs: Sequence[tuple[float, float]]) -> str:
    """Bias, absolute and relative error, share within ±25% (milliseconds)."""
    if not pairs:
        return "no predictions"
    diff = [p - a for p, a in pairs]
    absolute = sorted(abs(d) for d in diff)
    relative = sorted(abs(p - a) / a for p, a in pairs if a > 0)
    within = sum(r <= 0.25 for r in relative) / len(relative) if relative else math.nan
    return (
        f"{len(pairs):5d} {statistics.median(diff) * 1e3:+9.1f} "
        f"{statistics.median(absolute) * 1e3:9.1f} {percentile(absolute, 90) * 1e3:9.1f} "
        f"{statistics.median(relative):8.0%} {within:8.0%}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prediction", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = routing.QUICK if args.quick else routing.FULL
    profile = routing.profile_for(sizes)
    runs: list[tuple[str, Sequence[Arrival], Sequence[Profile]]] = [
        (
            f"shared-prefix at {sizes.target_rate:g}/s",
            workloads.shared_prefix(sizes.shared, sizes.target_rate, sizes.shared_count, args.seed),
            (),
        ),
        ("multi-turn", workloads.multi_turn(sizes.chat, args.seed), ()),
    ]
    mooncake, azure = routing.TRACES / routing.MOONCAKE_FILE, routing.TRACES / routing.AZURE_FILE
    if mooncake.exists() and azure.exists():
        records = workloads.read_mooncake(mooncake, sizes.mooncake_start, sizes.mooncake_count)
        runs.append(
            (
                "mooncake",
                workloads.mooncake(records, sizes.mooncake_block_tokens, sizes.mooncake_replay),
                (),
            )
        )
        rows = workloads.read_azure(azure, sizes.azure_start, sizes.azure_count)
        runs.append(("azure-code", workloads.azure(rows, sizes.azure_replay, args.seed), ()))
    mixed = routing.mixed_pool(sizes)
    runs.append(("mixed-pool", workloads.multi_turn(sizes.mixed, args.seed), mixed))
    print(
        f"{'workload':26} {'n':>5} {'bias ms':>9} {'|err| p50':>9} {'|err| p90':>9} "
        f"{'rel p50':>8} {'±25%':>8}"
    )
    for name, arrivals, profiles in runs:
        print(f"{name:26} {summary(errors(name, arrivals, profile, profiles))}")


if __name__ == "__main__":
    main()
