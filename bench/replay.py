"""Replay a trace of your own through the routing part's engines: does a picker beat round-robin?

``make bench-routing`` judges the pickers on the traces it ships. Traffic
differs, and a configuration that wins there can lose on yours, so this
runs any trace in Mooncake's format (one JSON object a line: ``timestamp``
in ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks), Bailian's (the same fields with ``chat_id``, ``parent_chat_id``,
``type`` and ``turn``; ``timestamp`` in seconds, 16-token blocks), Azure's
CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``, 2023 or 2024) or
BurstGPT's (``Timestamp,Model,Request tokens,Response tokens,...``), plain
or compressed (``.gz``, ``.xz``, ``.bz2``), through the same virtual-time
path (``bench.routing.simulate``: LWEPP's real pick path, 8 simulated
Llama-3.1-8B engines on L4s), scaled as the benchmark scales its own
(``bench.routing.FULL``), and prints each picker's TTFT against
round-robin's and the oracle envelope's::

    python -m bench.replay conversation_trace.jsonl --start 3000 --count 1000
    python -m bench.replay my-trace.jsonl --config my-picker.yaml
    python -m bench.replay qwen_traceA_blksz_16.jsonl --start 20000
    python -m bench.replay BurstGPT_1.csv --time-scale auto

Traces differ in rate as much as in content. The arrival gaps are scaled
by the benchmark's factor (0.1 for a CSV, 0.5 for Mooncake) unless
``--time-scale`` gives another; ``auto``, Bailian's default, scales them
to offer the engines 5,000 prompt tokens a second, about what the
benchmark's factors give Mooncake's conversation trace. ``--engines N``
replays on a pool of N engines instead of 8 (a pool of your size: with 2
replicas, a picker has less to choose from); the default factor and
``auto`` then keep each engine's share of the load the benchmark's (gaps ×
8/N; 625 prompt tokens a second an engine), and ``--time-scale F`` is taken
as given. The first line printed gives the rate that results.
Round-robin's p50 far above the others', or all pickers at the same TTFT,
says the engines are saturated or idle there, where no picker can be
judged.

Each configuration file runs as an EndpointPickerConfig (the pipeline that
``python -m lwepp --config`` runs). Numbers depend only on the trace, the
slice and the seed: the same arguments give the same table on any machine.

One run's p90 is one realization: a pick that breaks a tie the other way
early can move a slice's p90 by several percent. A Mooncake or Bailian
slice is the same run for every ``--seed``, since nothing in it is random;
``--step-jitter F`` times each engine step ±F at random (the seed's), so
that ``--seed 0..N`` gives N runs whose mean judges two pickers closer than
one run can (``python -m bench.replay TRACE --step-jitter 0.1 --seed N``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Final

from bench import workloads
from bench.routing import (
    BASELINE,
    BOUND,
    DROP_IN,
    ENGINES,
    FULL,
    ORACLES,
    Outcome,
    envelope,
    profile_for,
    simulate,
)
from bench.workloads import BAILIAN, Arrival, Replay
from serving.logs import configure_logging
from simulator.engine import Scheduling

WORKLOAD = "replay"
"""The workload name every run of a replay carries."""
PICKERS = ("round-robin", BASELINE, *DROP_IN, "precise", "prefix-aware", "predicted-latency")
"""What runs unless ``--picker`` names others (llm-d's default, the configurations the README
gives users, precise, prefix-aware and predicted latency); the oracles always run, for the
envelope."""


AUTO_TOKENS_PER_SECOND: Final = 5000.0
"""What ``--time-scale auto`` offers the engines, in prompt tokens a second: about what the
benchmark's factors give Mooncake's conversation trace (4,900 to 5,400 on its slices)."""
BAILIAN_BLOCK_TOKENS: Final = 2
"""Replayed tokens per 16-token Bailian block: lengths × 1/8, prompts of about the size
the benchmark makes Mooncake's (Bailian's to-C trace averages 2,331 tokens a prompt)."""
BAILIAN_REPLAY: Final = Replay(
    length_scale=BAILIAN_BLOCK_TOKENS / BAILIAN.block_tokens,
    output_scale=FULL.mooncake_replay.output_scale,
    time_scale=1.0,
    max_output=FULL.mooncake_replay.max_output,
)
"""Bailian's files differ fourfold in rate and sixfold in length from one another, so no
one factor fits their arrival gaps: ``--time-scale auto`` is their default."""


def arrivals(
    path: Path,
    start: int,
    count: int,
    seed: int,
    time_scale: float | str | None = None,
    engines: int = ENGINES,
) -> tuple[list[Arrival], float]:
    """The slice ``[start, start + count)`` of the trace and the factor its gaps were scaled by.

    The factor is ``time_scale`` when given, the benchmark's own for the format
    otherwise (Bailian's: ``"auto"``); ``"auto"`` picks the one that offers
    the engines ``AUTO_TOKENS_PER_SECOND`` prompt tokens a second. Both are for
    the benchmark's 8 engines and follow ``engines``, so that each engine gets
    the same share of the load; a ``time_scale`` number is taken as given.
    """
    build: Callable[[Replay], list[Arrival]]
    if workloads.trace_suffix(path) == ".csv":
        rows = workloads.read_azure(path, start, count)
        replay = FULL.azure_replay
        build = partial(workloads.azure, rows, seed=seed)
    else:
        form = workloads.hashed_format(path)
        records = workloads.read_mooncake(path, start, count, form)
        if form is BAILIAN:
            replay, block = BAILIAN_REPLAY, BAILIAN_BLOCK_TOKENS
            time_scale = time_scale or "auto"
        else:
            replay, block = FULL.mooncake_replay, FULL.mooncake_block_tokens
        build = partial(workloads.mooncake, records, block)
    if time_scale == "auto":
        unscaled = build(replace(replay, time_scale=1.0))
        span = unscaled[-1].at - unscaled[0].at if unscaled else 0.0
        tokens = sum(len(arrival.prompt_tokens) for arrival in unscaled)
        offered = AUTO_TOKENS_PER_SECOND * engines / ENGINES
        time_scale = tokens / offered / span if span > 0 else 1.0
    elif time_scale is None:
        time_scale = replay.time_scale * ENGINES / engines
    factor = float(time_scale)
    return build(replace(replay, time_scale=factor)), factor


def rate(replayed: Sequence[Arrival], factor: float) -> str:
    """How fast the slice arrives once scaled: requests and prompt tokens a second."""
    span = replayed[-1].at - replayed[0].at
    if span <= 0:
        return "all at once"
    tokens = sum(len(arrival.prompt_tokens) for arrival in replayed)
    return (
        f"{(len(replayed) - 1) / span:.2f} requests/s, {tokens / span:,.0f} prompt tokens/s "
        f"over {span:.1f} s (gaps × {factor:.3g})"
    )


def table(outcomes: Sequence[Outcome], labels: Sequence[str]) -> list[str]:
    """One line per picker: TTFT p50 and p90 as multiples of round-robin's and the envelope's."""
    by_label = dict(zip(labels, outcomes, strict=True))
    base = by_label["round-robin"]
    best = envelope(outcomes, WORKLOAD, None)
    assert best is not None, "the oracles always run"
    lines = [
        f"{'picker':24} {'p50 ms':>8} {'p90 ms':>8} {'p50/RR':>7} {'p90/RR':>7} "
        f"{'p90/env':>7} {'hits':>5}"
    ]
    for label, outcome in by_label.items():
        lines.append(
            f"{label:24} {outcome.ttft_p50 * 1e3:8.1f} {outcome.ttft_p90 * 1e3:8.1f} "
            f"{outcome.ttft_p50 / base.ttft_p50:7.3f} {outcome.ttft_p90 / base.ttft_p90:7.3f} "
            f"{outcome.ttft_p90 / best.ttft_p90:7.3f} {outcome.hit_rate:5.3f}"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replay", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add(
        "trace",
        type=Path,
        help="a Mooncake or Bailian .jsonl, or an Azure or BurstGPT .csv (.gz, .xz, .bz2 too)",
    )
    add("--start", type=int, default=0, help="first record of the slice (0)")
    add("--count", type=int, default=1000, help="records in the slice (1000)")
    add("--seed", type=int, default=0, help="the engines' and the Azure replay's seed (0)")
    add(
        "--step-jitter",
        type=float,
        default=0.0,
        metavar="F",
        help="time each engine step ±F at random (0: exact), so the seed varies any trace",
    )
    add(
        "--engines",
        type=int,
        default=ENGINES,
        metavar="N",
        help=f"replay on N engines ({ENGINES}); the default gaps and auto keep each one's load",
    )
    add(
        "--time-scale",
        metavar="F",
        help="multiply the arrival gaps by F, or 'auto': by what offers "
        f"{AUTO_TOKENS_PER_SECOND:,.0f} prompt tokens/s (default: 0.1 for a CSV, 0.5 for "
        "Mooncake, auto for Bailian)",
    )
    add(
        "--picker",
        action="append",
        choices=(*PICKERS, BOUND),
        help=f"a shipped picker to run, repeatable (default: {', '.join(PICKERS)})",
    )
    add(
        "--config",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="an EndpointPickerConfig to run beside them, repeatable",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not args.trace.is_file():
        sys.exit(f"python -m bench.replay: {args.trace}: no such file")
    if args.start < 0 or args.count < 1:
        sys.exit("python -m bench.replay: --start must be >= 0 and --count >= 1")
    if args.engines < 1:
        sys.exit("python -m bench.replay: --engines must be at least 1")
    if not 0 <= args.step_jitter < 1:
        sys.exit("python -m bench.replay: --step-jitter must be at least 0 and below 1")
    try:
        time_scale = (
            args.time_scale if args.time_scale in (None, "auto") else float(args.time_scale)
        )
    except ValueError:
        time_scale = 0.0
    if isinstance(time_scale, float) and not 0 < time_scale < float("inf"):
        sys.exit("python -m bench.replay: --time-scale must be a number above 0, or auto")
    try:
        replayed, factor = arrivals(
            args.trace, args.start, args.count, args.seed, time_scale, args.engines
        )
    except workloads.UNREADABLE as error:
        sys.exit(f"python -m bench.replay: {args.trace}: {error}")
    if not replayed:
        sys.exit(f"python -m bench.replay: {args.trace}: no records from {args.start}")
    profile = profile_for(FULL)
    pickers = ["round-robin", *(p for p in args.picker or PICKERS if p != "round-robin")]
    runs: list[tuple[str, str, Path | None]] = [(p, p, None) for p in pickers]
    runs += [(path.name, "recommended", path) for path in args.config]
    runs += [(oracle, oracle, None) for oracle in ORACLES]
    runs += [(BOUND, BOUND, None)]  # what a request-path picker can reach
    run = partial(
        simulate,
        WORKLOAD,
        replayed,
        engines=args.engines,
        seed=args.seed,
        scheduling=Scheduling(step_jitter=args.step_jitter),
    )
    outcomes = [run(strategy, profile, config=config) for _, strategy, config in runs]
    last = args.start + len(replayed) - 1
    on = "" if args.engines == ENGINES else f" on {args.engines} engines"
    print(f"{args.trace.name}: records {args.start}-{last}{on}, {rate(replayed, factor)}")
    print("\n".join(table(outcomes, [label for label, _, _ in runs])))


if __name__ == "__main__":
    configure_logging("warning", "console")  # the pickers' own problems, on stderr; no chatter
    main()
