"""Command line: ``python -m lwepp --pods pods.yaml --selector pool=a`` or ``--pool-name NAME``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import structlog
from prometheus_client import CollectorRegistry

from lwepp import config as picker_config
from lwepp.leader import LeaderElector, LeaseTimings
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import DecisionLog
from lwepp.server import EndpointPickerService, PickerMetrics
from pods.file import FileSource, PodFileError, load_pods
from pods.kubeapi import KubeconfigError, load_kubeconfig
from pods.kubernetes import DEFAULT_GROUP, InferencePoolSource
from pods.model import PodSource, parse_selector
from protos.cli import Parser, add_serving_flags, ports_of, serving_problem
from protos.logs import configure_logging
from protos.server import EXT_PROC_SERVICE, Health, Ports, run_workers, serve

log = structlog.get_logger()

HEALTH_SERVICES = ("", "inference-extension", "liveness", "readiness", EXT_PROC_SERVICE)
"""GIE's lwepp reports ``inference-extension``; the protocol document lists the others."""


def selector(text: str) -> dict[str, str]:
    try:
        return parse_selector(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def pipeline_config(path: str) -> picker_config.PickerConfig:
    try:
        return picker_config.load_config(path)
    except picker_config.ConfigErrors as error:
        raise argparse.ArgumentTypeError(f"\n{error}") from None


class CheckConfig(argparse.Action):
    """``--check-config FILE``: print the pipeline it makes (exit 0) or its errors (exit 1)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        try:
            print(picker_config.load_config(args[1]).describe())
        except picker_config.ConfigErrors as error:
            parser.exit(1, f"{error}\n")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m lwepp",
        description="Lightweight endpoint picker: an Envoy ext_proc service that names, for "
        "each request, the model-server endpoint to send it to (round-robin, or the filters "
        "and scorers of --config).",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--pods",
        help="YAML pod file listing the model-server pods (name, address, ports, labels, "
        "ready); re-read when it changes, keeping the last good list on a broken edit",
    )
    parser.add_argument(
        "--selector",
        type=selector,
        default={},
        help="labels a pod must carry to be in this picker's pool, as key=value[,key=value] "
        "(like an InferencePool's spec.selector.matchLabels); default: every pod",
    )
    where.add_argument(
        "--pool-name",
        help="the InferencePool to serve, read from the Kubernetes API with its pods "
        "(instead of --pods): its selector and targetPorts decide the endpoints",
    )
    parser.add_argument(
        "--pool-namespace",
        help="the InferencePool's namespace (default: this pod's namespace from its service "
        "account, or the kubeconfig context's, else 'default')",
    )
    parser.add_argument(
        "--pool-group",
        default=DEFAULT_GROUP,
        help="API group of the InferencePool (default %(default)s)",
    )
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig file for --pool-name (default: the in-cluster service account, "
        "from KUBERNETES_SERVICE_HOST/PORT and the mounted token)",
    )
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="with --pool-name: only the replica holding a Lease serves; standbys report "
        "NOT_SERVING on the readiness health services (liveness and '' stay SERVING)",
    )
    parser.add_argument(
        "--leader-elect-lease-name",
        help="the Lease, in the pool's namespace (default: lwepp-<pool-name>)",
    )
    parser.add_argument(
        "--leader-elect-lease-duration",
        type=float,
        default=15.0,
        help="seconds a standby waits for a silent leader's lease to expire (default 15)",
    )
    parser.add_argument(
        "--leader-elect-renew-deadline",
        type=float,
        default=10.0,
        help="seconds a leader keeps failing to renew before it stands down (default 10)",
    )
    parser.add_argument(
        "--leader-elect-retry-period",
        type=float,
        default=2.0,
        help="seconds between tries to acquire or renew the lease (default 2)",
    )
    parser.add_argument(
        "--config",
        type=pipeline_config,
        metavar="FILE",
        help="an EndpointPickerConfig (the llm-d router's YAML format): filters, scorers, a "
        "picker and data sources instead of plain round-robin (format: lwepp/config.py)",
    )
    parser.add_argument(
        "--check-config",
        action=CheckConfig,
        metavar="FILE",
        help="check a configuration file, print the pipeline it makes (or its errors), and exit",
    )
    parser.add_argument(
        "--explain",
        choices=["header", "all", "off"],
        default="header",
        help="with --config: explain decisions in the response header x-switchyard-decision "
        "when a request asks (x-switchyard-explain: 1), for every request, or never",
    )
    parser.add_argument(
        "--debug-decisions",
        type=int,
        default=100,
        metavar="N",
        help="with --config: how many explained decisions and fallbacks "
        "GET /debug/decisions on the metrics port keeps",
    )
    parser.add_argument(
        "--disable-test-selection-header",
        action="store_true",
        help="ignore GIE's conformance header test-epp-endpoint-selection, with which any "
        "client can choose the replicas of the pool that may serve it (honoured by default, "
        "as GIE's lwepp does; turn it off in production)",
    )
    parser.add_argument(
        "--pods-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the pod file for changes",
    )
    add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    return parser


def workers_problem(args: argparse.Namespace) -> str | None:
    """Why ``--workers`` above 1 cannot run with these flags, or None.

    Workers share nothing but the ports. Stateless picking (round-robin,
    scorers over polled metrics) works the same in each, one turn counter
    per worker; what a plugin learns from the requests a worker served stays
    in that worker, so with N workers each would see about 1/N of the traffic
    (a prefix index that finds a prefix only one time in N).
    """
    if args.workers == 1:
        return None
    if args.leader_elect:
        return "--workers with --leader-elect: each worker would campaign for the Lease alone"
    if args.config is not None and (learning := args.config.learning):
        return (
            f"--workers {args.workers} with {args.config.path}: plugin(s) "
            f"{', '.join(learning)} learn from the requests served, and each worker "
            "would learn only its own share; run one worker per replica instead"
        )
    return None


def pod_source(args: argparse.Namespace) -> tuple[PodSource, LeaderElector | None]:
    """The pod list the flags name (a file, or an InferencePool) and the optional elector.

    Raises ``PodFileError``, ``KubeconfigError`` or ``ValueError`` with a message
    naming the file, variable or flag at fault.
    """
    if args.pods is not None:
        if args.leader_elect:
            raise ValueError("--leader-elect needs --pool-name (the Lease lives in the cluster)")
        load_pods(args.pods)  # fail fast on a broken file at start-up
        source = FileSource(args.pods, interval=args.pods_interval)
        source.reload()
        return source, None
    if args.selector:
        raise ValueError("--selector is for --pods; an InferencePool brings its own selector")
    config = load_kubeconfig(args.kubeconfig)
    namespace = args.pool_namespace or config.namespace
    pool = InferencePoolSource(config, args.pool_name, namespace, group=args.pool_group)
    if not args.leader_elect:
        return pool, None
    timings = LeaseTimings(
        args.leader_elect_lease_duration,
        args.leader_elect_renew_deadline,
        args.leader_elect_retry_period,
    )
    lease = args.leader_elect_lease_name or f"lwepp-{args.pool_name}"
    return pool, LeaderElector(config, namespace, lease, timings=timings)


async def run(
    args: argparse.Namespace,
    trace: TextIO | None,
    source: PodSource,
    elector: LeaderElector | None = None,
) -> None:
    pool = Pool(source, args.selector)
    registry = CollectorRegistry()
    strategy: Strategy = RoundRobin()
    jobs, pages = [], {}
    if args.config is not None:
        for warning in args.config.warnings:
            log.warning("configuration", detail=warning)
        pipeline = args.config.pipeline(
            registry=registry,
            explain=args.explain,
            decisions=DecisionLog(args.debug_decisions),
        )
        strategy, jobs, pages = (
            pipeline,
            pipeline.background(lambda: pool.endpoints),
            pipeline.debug_pages(),
        )
    service = EndpointPickerService(
        pool,
        strategy,
        PickerMetrics(registry),
        args.max_body_bytes,
        test_selection=not args.disable_test_selection_header,
    )
    health = Health(HEALTH_SERVICES, ready=lambda: source.synced)
    if elector is not None:
        # A standby is alive but not ready: only readiness names follow the lease.
        live = ("", "liveness")
        health = Health(
            [name for name in HEALTH_SERVICES if name not in live],
            ready=lambda: source.synced and elector.is_leader,
            live=live,
        )
    await serve(
        "lwepp",
        service,
        ports_of(args),
        health,
        registry,
        background=[source.run, *jobs] if elector is None else [source.run, elector.run, *jobs],
        json_routes=pages,
        grace=args.grace,
        trace=trace,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := serving_problem(args) or workers_problem(args):
        parser.error(problem)
    configure_logging(args.log_level)
    try:
        source, elector = pod_source(args)
    except (PodFileError, KubeconfigError, ValueError) as error:
        sys.exit(f"lwepp: {error}")
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        sys.exit(run_workers("lwepp", flags, args.workers, ports_of(args)))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(run(args, trace, source, elector))


if __name__ == "__main__":
    main()
