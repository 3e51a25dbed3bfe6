"""``make bench``: every benchmark part, written as Markdown, JSON and plots.

``python -m bench [PART ...] [--seed N] [--quick] [--out DIR] [--workloads W,...]``; the parts
are ``micro`` (codec, plugins, hook pipeline), ``overhead`` (what the
gateway path adds, through a real Envoy), ``routing`` (what picking buys,
in virtual time), ``overload`` (flow control governing an overloaded pool,
in virtual time) and ``live`` (the demo gateway beside peer routers over
HTTP; ``--engine llamacpp`` runs it on real llama.cpp engines, and the
overhead part in front of one, as time to first token). With no
part named, all run in that order. Results go to
``DIR/results.md``, ``DIR/results.json`` and one PNG and SVG per plot; the
Markdown is printed as well.
"""

from __future__ import annotations

import argparse
import importlib
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from bench.report import Options, Section, progress, write

PARTS: Final = ("micro", "overhead", "routing", "overload", "live")
ENGINES: Final = ("simulator", "llamacpp")
WORKLOADS: Final = (
    "shared-prefix",
    "multi-turn",
    "system-prompt",
    "mooncake",
    "azure-code",
    "mixed-pool",
)
"""The routing part's workloads, as ``--workloads`` names them (``bench.routing.run``)."""


def parse(argv: Sequence[str] | None = None) -> tuple[list[str], Options]:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "parts", nargs="*", choices=[*PARTS, []], metavar="PART", help=", ".join(PARTS)
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of every workload (0)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke size: seconds, numbers meaningless"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="simulator",
        help="the model servers of the live and overhead parts: the simulator (default; the "
        "overhead part's is then Envoy answering itself) or real llama.cpp engines",
    )
    parser.add_argument(
        "--workloads",
        default="",
        help="the routing part's workloads, comma-separated (default: every one): "
        + ", ".join(WORKLOADS),
    )
    args = parser.parse_args(argv)
    for part in args.parts:
        if part not in PARTS:
            parser.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    for workload in workloads:
        if workload not in WORKLOADS:
            parser.error(f"unknown workload {workload!r}: choose from {', '.join(WORKLOADS)}")
    options = Options(
        seed=args.seed, quick=args.quick, out=args.out, engine=args.engine, workloads=workloads
    )
    return list(args.parts) or list(PARTS), options


def main(argv: Sequence[str] | None = None) -> None:
    parts, options = parse(argv)
    sections: list[Section] = []
    for part in parts:
        progress(f"{part}: starting")
        module = importlib.import_module(f"bench.{part}")
        sections.append(module.run(options))
        progress(f"{part}: done")
    # The live part always runs model servers; the overhead part only with real engines.
    on_engines = [
        p for p in parts if p == "live" or (p == "overhead" and options.engine != "simulator")
    ]
    header = (
        f"# Switchyard benchmarks\n\n{platform.python_implementation()} "
        f"{platform.python_version()}, {platform.machine()}, seed {options.seed}"
        + (f", {' and '.join(on_engines)} on {options.engine} engines" if on_engines else "")
        + (", **quick (smoke) run: the numbers mean nothing**" if options.quick else "")
    )
    paths = write(sections, options.out, header=header)
    print(paths[0].read_text(), flush=True)
    progress(f"wrote {', '.join(str(p) for p in paths[:2])} and {len(paths) - 2} plot files")


if __name__ == "__main__":
    main()
