"""``python -m conformance`` (``make conformance``): run the suite, print a table, report."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

from conformance import report
from conformance.cases import CASES, NOT_APPLICABLE
from conformance.client import HELPERS, Timing
from conformance.command import FIELDS, SWITCHYARD, PickerCommand, TemplateError
from conformance.crds import CrdError
from conformance.run import details, run_suite, table
from conformance.upstream import RELEASED, UPSTREAMS, Upstream
from demo.topology import TopologyError

FOREIGN_REPORTS = Path("conformance-reports")
"""Where the reports of any picker but Switchyard's plain LWEPP go by default."""


def build_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in FIELDS) + 6
    fields = "\n".join(
        textwrap.fill(
            meaning,
            78,
            initial_indent=f"  {{{name}}}".ljust(width),
            subsequent_indent=" " * width,
        )
        for name, meaning in FIELDS.items()
    )
    description = (
        "Run GIE's conformance tests locally: echo pods on 127.X.Y.0/24, one endpoint picker "
        "per InferencePool, a real Envoy with a listener per Gateway. Every test runs twice, "
        "against the pickers alone and through the gateway, with the original's requests and "
        "pass criteria. Prints a table, writes one report per profile in GIE's format and a "
        "README beside them, and exits 0 only if no test failed. A picker whose template "
        "names {kubeconfig} reads its InferencePool and the pods from the harness's "
        "Kubernetes API server, as in a cluster; one that names {endpoints} or {pods} is "
        "handed them."
    )
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(description, 78),
        epilog=f"Fields of a --picker template:\n{fields}",
    )
    add = parser.add_argument
    add(
        "--picker",
        default="",
        metavar="TEMPLATE",
        help="the command of each pool's endpoint picker, with {fields} filled in per pool "
        f"(below); default: Switchyard's LWEPP, {SWITCHYARD!r}",
    )
    add(
        "--picker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more word for the picker command, e.g. "
        "--picker-arg=--config=demo/configs/prefix-aware.yaml; repeatable",
    )
    add(
        "--picker-plaintext",
        action="store_true",
        help="dial the pickers' ext_proc port without TLS ({secure_serving} is then false); "
        "by default the gateway dials TLS, as GIE's gateways dial lwepp",
    )
    add(
        "--upstream",
        choices=list(UPSTREAMS),
        default=RELEASED.name,
        help="released: GIE v1.6.0's tests on Gateway API's helpers v1.6.1 (default); next: "
        "with the changes pending upstream (GIE PR #3053: no per-pod warm-up in the weighted "
        "test; Gateway API main: 100 ms after a failed attempt); see docs/conformance.md",
    )
    add(
        "--out",
        type=Path,
        help=f"the reports' directory (default: {report.default_dir()} for a whole run of "
        f"Switchyard's plain LWEPP, ./{FOREIGN_REPORTS} for any other run)",
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
        "--max-time-to-consistency",
        type=float,
        default=Timing().max_time_to_consistency,
        metavar="SECONDS",
        help="how long a check may take to pass three times in a row (GIE: %(default)s)",
    )
    add(
        "--delay-after-failure",
        type=float,
        metavar="SECONDS",
        help=f"the wait after a failed attempt of such a check (default: {HELPERS}'s 1 s; "
        "--upstream next: Gateway API main's 0.1 s)",
    )
    meta = parser.add_argument_group(
        "the report's implementation block (Gateway API's flags of the same names; default: "
        "Switchyard's for its own picker, empty for another)"
    )
    meta.add_argument("--organization")
    meta.add_argument("--project")
    meta.add_argument("--url")
    meta.add_argument("--version")
    meta.add_argument("--contact", help="comma-separated")
    meta.add_argument(
        "--mode",
        default=report.DEFAULT_MODE,
        help="the report's mode, part of its file name (default: %(default)s)",
    )
    return parser


def _implementation(args: argparse.Namespace, own_picker: bool) -> report.Implementation:
    base = (
        report.Implementation.switchyard()
        if own_picker
        else report.Implementation("", "", "", "", ())
    )
    contact = (
        tuple(c.strip() for c in args.contact.split(",") if c.strip())
        if args.contact is not None
        else base.contact
    )
    return report.Implementation(
        args.organization if args.organization is not None else base.organization,
        args.project if args.project is not None else base.project,
        args.url if args.url is not None else base.url,
        args.version if args.version is not None else base.version,
        contact,
    )


def upstream_and_timing(args: argparse.Namespace) -> tuple[Upstream, Timing]:
    """The upstream behaviour asked for, and the waits: its wait after a failed attempt unless
    ``--delay-after-failure`` names one."""
    upstream = UPSTREAMS[args.upstream]
    delay = args.delay_after_failure
    return upstream, Timing(
        max_time_to_consistency=args.max_time_to_consistency,
        delay_after_failure=upstream.delay_after_failure if delay is None else delay,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        picker = PickerCommand.parse(args.picker or SWITCHYARD, args.picker_arg)
    except TemplateError as error:
        parser.error(str(error))
    own_picker = not args.picker  # Switchyard's LWEPP, configured or not
    upstream, timing = upstream_and_timing(args)
    with tempfile.TemporaryDirectory(prefix="conformance-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        print(f"Running GIE's conformance tests (logs in {work_dir}) ...", flush=True)
        print(f"Picker: {picker.template}", flush=True)
        try:
            run = run_suite(
                work_dir,
                timing,
                args.test,
                picker,
                plaintext=args.picker_plaintext,
                upstream=upstream,
            )
            suite = asyncio.run(run)
        except (CrdError, TopologyError) as error:
            sys.exit(f"conformance: {error}")
    print(table(suite))
    print()
    print(details(suite))
    print()
    print("\n".join(suite.conditions()))
    print(f"Topology up in {suite.startup_seconds:.1f} s; whole run {suite.seconds:.1f} s.")
    implementation = _implementation(args, own_picker)
    # The run docs/conformance records: every test, Switchyard's plain LWEPP, as GIE runs lwepp.
    checked_in = (
        own_picker
        and not args.picker_arg
        and not args.test
        and not args.picker_plaintext
        and upstream is RELEASED
    )
    out = args.out or (report.default_dir() if checked_in else FOREIGN_REPORTS)
    for path in report.write(suite, out, implementation, args.mode):
        print(f"Wrote {path}")
    if empty := implementation.empty_fields():
        print(
            f"The reports' implementation {', '.join(empty)} "
            f"{'is' if len(empty) == 1 else 'are'} empty: GIE's submission rules need "
            "them (--organization, --project, --url, --version, --contact)."
        )
    if not suite.passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
