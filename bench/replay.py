"""Replay a trace of your own through the routing part's engines: does a picker beat round-robin?

``make bench-routing`` judges the pickers on the traces it ships. Traffic
differs, and a configuration that wins there can lose on yours, so this
runs any trace in Mooncake's format (one JSON object a line: ``timestamp``
in ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks), Azure's CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``, 2023 or
2024) or BurstGPT's (``Timestamp,Model,Request tokens,Response tokens,...``)
through the same virtual-time path (``bench.routing.simulate``: LWEPP's real
pick path, 8 simulated Llama-3.1-8B engines on L4s), scaled as the
benchmark scales its own (``bench.routing.FULL``), and prints each picker's
TTFT against round-robin's and the oracle envelope's::

    python -m bench.replay conversation_trace.jsonl --start 3000 --count 1000
    python -m bench.replay my-trace.jsonl --config my-picker.yaml
    python -m bench.replay BurstGPT_1.csv --time-scale 0.02

Traces differ in rate as much as in content: the arrival gaps are scaled by
the benchmark's factor (0.1 for a CSV, 0.5 for Mooncake) unless
``--time-scale`` gives another, and the first line printed gives the rate
that results. Round-robin's p50 far above the others', or all pickers at the
same TTFT, says the engines are saturated or idle there, where no picker
can be judged.

Each configuration file runs as an EndpointPickerConfig (the pipeline that
``python -m lwepp --config`` runs). Numbers depend only on the trace, the
slice and the seed: the same arguments give the same table on any machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench import workloads
from bench.routing import FULL, ORACLES, Outcome, envelope, profile_for, simulate
from protos.logs import configure_logging

WORKLOAD = "replay"
"""The workload name every run of a replay carries."""
PICKERS = ("round-robin", "recommended", "precise", "prefix-aware")
"""What runs unless ``--picker`` names others; the oracles always run, for the envelope."""


def arrivals(
    path: Path, start: int, count: int, seed: int, time_scale: float | None = None
) -> list[workloads.Arrival]:
    """The slice ``[start, start + count)`` of the trace, scaled as the benchmark's own
    (its arrival gaps by ``time_scale`` instead, when given)."""
    if path.suffix == ".csv":
        rows = workloads.read_azure(path, start, count)
        azure = FULL.azure_replay
        if time_scale is not None:
            azure = replace(azure, time_scale=time_scale)
        return workloads.azure(rows, azure, seed)
    records = workloads.read_mooncake(path, start, count)
    mooncake = FULL.mooncake_replay
    if time_scale is not None:
        mooncake = replace(mooncake, time_scale=time_scale)
    return workloads.mooncake(records, FULL.mooncake_block_tokens, mooncake)


def rate(replayed: Sequence[workloads.Arrival]) -> str:
    """How fast the slice arrives once scaled: its requests over the time they span."""
    span = replayed[-1].at - replayed[0].at
    per_second = f"{(len(replayed) - 1) / span:.2f} requests/s" if span > 0 else "all at once"
    return f"{per_second} over {span:.1f} s"


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
    add("trace", type=Path, help="a Mooncake-format .jsonl or an Azure-format .csv trace")
    add("--start", type=int, default=0, help="first record of the slice (0)")
    add("--count", type=int, default=1000, help="records in the slice (1000)")
    add("--seed", type=int, default=0, help="the engines' and the Azure replay's seed (0)")
    add(
        "--time-scale",
        type=float,
        metavar="F",
        help="multiply the arrival gaps by F (the benchmark's: 0.1 for a CSV, 0.5 for Mooncake)",
    )
    add(
        "--picker",
        action="append",
        choices=PICKERS,
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
    if args.time_scale is not None and not 0 < args.time_scale < float("inf"):
        sys.exit("python -m bench.replay: --time-scale must be a number above 0")
    try:
        replayed = arrivals(args.trace, args.start, args.count, args.seed, args.time_scale)
    except ValueError as error:
        sys.exit(f"python -m bench.replay: {args.trace}: {error}")
    if not replayed:
        sys.exit(f"python -m bench.replay: {args.trace}: no records from {args.start}")
    profile = profile_for(FULL)
    pickers = ["round-robin", *(p for p in args.picker or PICKERS if p != "round-robin")]
    runs: list[tuple[str, str, Path | None]] = [(p, p, None) for p in pickers]
    runs += [(path.name, "recommended", path) for path in args.config]
    runs += [(oracle, oracle, None) for oracle in ORACLES]
    outcomes = [
        simulate(WORKLOAD, replayed, strategy, profile, seed=args.seed, config=config)
        for _, strategy, config in runs
    ]
    last = args.start + len(replayed) - 1
    print(f"{args.trace.name}: records {args.start}-{last}, {rate(replayed)}")
    print("\n".join(table(outcomes, [label for label, _, _ in runs])))


if __name__ == "__main__":
    configure_logging("warning", "console")  # the pickers' own problems, on stderr; no chatter
    main()
