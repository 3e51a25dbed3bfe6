"""``python -m conformance`` (``make conformance``): run the suite, print a table, report."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from conformance import report
from conformance.cases import CASES, NOT_APPLICABLE
from conformance.client import Timing
from conformance.run import details, run_suite, table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Run GIE's conformance tests locally: echo pods on 127.X.Y.0/24, one "
        "LWEPP per InferencePool, a real Envoy with a listener per Gateway. Every test runs "
        "twice, against the pickers alone and through the gateway, with the original's "
        "requests and pass criteria. Prints a table, writes a report in GIE's format, and "
        "exits 0 only if no test failed.",
    )
    add = parser.add_argument
    add(
        "--report",
        type=Path,
        help=f"where to write the report (default: {report.default_path()}, this version's "
        "checked-in report; with --picker-arg, conformance-report.yaml here)",
    )
    add("--work-dir", type=Path, help="logs, pod files and Envoy's config (default: a temp dir)")
    add(
        "--test",
        action="append",
        default=[],
        metavar="NAME",
        choices=[case.name for case in CASES] + list(NOT_APPLICABLE),
        help="run only this test; repeatable",
    )
    add(
        "--picker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra flag for every LWEPP, e.g. --picker-arg=--config=my-picker.yaml to "
        "hold a configured picker to the same tests; repeatable",
    )
    add(
        "--max-time-to-consistency",
        type=float,
        default=Timing().max_time_to_consistency,
        metavar="SECONDS",
        help="how long a check may take to pass three times in a row (GIE: %(default)s)",
    )
    add(
        "--delay-after-failure",
        type=float,
        default=Timing().delay_after_failure,
        metavar="SECONDS",
        help="the wait after a failed attempt of such a check (Gateway API's helpers: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    timing = Timing(
        max_time_to_consistency=args.max_time_to_consistency,
        delay_after_failure=args.delay_after_failure,
    )
    with tempfile.TemporaryDirectory(prefix="conformance-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        print(f"Running GIE's conformance tests (logs in {work_dir}) ...", flush=True)
        suite = asyncio.run(run_suite(work_dir, timing, args.test, args.picker_arg))
    print(table(suite))
    print()
    print(details(suite))
    print()
    print(f"Topology up in {suite.startup_seconds:.1f} s; whole run {suite.seconds:.1f} s.")
    default = Path("conformance-report.yaml") if args.picker_arg else report.default_path()
    print(f"Report: {report.write(suite, args.report or default)}")
    if not suite.passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
