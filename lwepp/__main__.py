"""Command line: ``python -m lwepp --pods pods.yaml --selector pool=a``, ``--pool-name NAME`` or
``--endpoint-selector SELECTOR --endpoint-target-ports PORTS``.

It takes the flags GIE's lwepp, GIE's conformance manifests and the llm-d
router's chart pass to a picker, as they write them: the renamed ones as
aliases (``--config-file``, ``--ha-enable-leader-election``), the ones
Switchyard has no use for in ``IGNORED`` (accepted, and named in a warning at
start when their value asks for something it does not do).
``tests/data/upstream/serving-args.yaml`` holds those manifests' argument
lists; a test runs this CLI with each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, TextIO, cast

import structlog
from prometheus_client import CollectorRegistry

from lwepp import config as picker_config
from lwepp.leader import LeaderElector, LeaseTimings
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import DecisionLog, ExplainMode, Pipeline
from lwepp.server import EndpointPickerService
from pods.file import FileSource, PodFileError, load_pods
from pods.kubeapi import KubeconfigError, load_kubeconfig
from pods.kubernetes import DEFAULT_GROUP, InferencePoolSource
from pods.model import PodSource
from pods.selector import LabelSelector, SelectorError
from serving.cli import (
    COMMON_IGNORED,
    Ignored,
    Parser,
    add_bool,
    add_ignored_flags,
    add_serving_flags,
    duration,
    grpc_options,
    ignored_warnings,
    log_level,
    metrics_auth,
    ports_of,
    server_tls,
    serving_problem,
)
from serving.logs import configure_logging
from serving.metrics_auth import MetricsAuth
from serving.server import EXT_PROC_SERVICE, Health, Ports, run_workers, serve
from serving.tls import ServerTLS, TLSError, shared_tls

log = structlog.get_logger()

HEALTH_SERVICES = ("", "inference-extension", "liveness", "readiness", EXT_PROC_SERVICE)
"""GIE's lwepp reports ``inference-extension``; the protocol document lists the others."""

LIVENESS: Final = "liveness"
"""Under leader election, the one name a standby reports SERVING (the llm-d router's rule:
``""``, ``readiness`` and the ext_proc service follow the lease)."""

IGNORED: Final = (
    *COMMON_IGNORED,
    Ignored(
        "--refresh-metrics-interval",
        "duration",
        "metrics-data-source's refreshIntervalSeconds parameter sets the scrape interval",
    ),
    Ignored(
        "--metrics-staleness-threshold",
        "duration",
        "scorers take their own maxAgeSeconds; pool gauges use measurements under 2 s old",
    ),
    Ignored("--metrics-client-ca-file", "value", "/metrics is plain HTTP"),
    Ignored("--metrics-cert-dir", "value", "/metrics is plain HTTP"),
    Ignored(
        "--enable-grpc-stream-metrics",
        "bool",
        "no per-stream gRPC metrics; see llm_d_epp_request_total",
        quiet=False,
    ),
    Ignored(
        "--disable-endpoint-subset-filter",
        "bool",
        "the gateway's endpoint subset is always honoured, as the protocol requires",
        quiet=False,
    ),
    Ignored(
        "--allow-experimental-plugins",
        "bool",
        "every built-in plugin is available; none is gated as experimental",
        quiet=False,
    ),
)
"""The llm-d router's flags that change nothing here, and why."""


def label_selector(text: str) -> LabelSelector:
    try:
        return LabelSelector.parse(text)
    except SelectorError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def target_ports(text: str) -> tuple[int, ...]:
    """``8000,8001``: 1 to 8 ports (the llm-d router's limit), duplicates dropped."""
    ports: list[int] = []
    for item in text.split(","):
        try:
            number = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a port number") from None
        if not 1 <= number <= 65535:
            raise argparse.ArgumentTypeError(f"{number} is not a port (1-65535)")
        if number not in ports:
            ports.append(number)
    if not 1 <= len(ports) <= 8:
        raise argparse.ArgumentTypeError("expected 1 to 8 ports")
    return tuple(ports)


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
    pods = parser.add_argument_group("the pool")
    where = pods.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--pods",
        help="YAML pod file listing the model-server pods (name, address, ports, labels, "
        "ready); re-read when it changes, keeping the last good list on a broken edit",
    )
    pods.add_argument(
        "--selector",
        type=label_selector,
        default=LabelSelector(),
        help="labels a pod must carry to be in this picker's pool, as a Kubernetes label "
        "selector (pool=a,tier in (gold,silver),!canary); default: every pod",
    )
    where.add_argument(
        "--pool-name",
        help="the InferencePool to serve, read from the Kubernetes API with its pods "
        "(instead of --pods): its selector and targetPorts decide the endpoints",
    )
    where.add_argument(
        "--endpoint-selector",
        type=label_selector,
        help="serve the pods this label selector matches, read from the Kubernetes API, with no "
        "InferencePool (the llm-d router's standalone mode); needs --endpoint-target-ports",
    )
    pods.add_argument(
        "--endpoint-target-ports",
        type=target_ports,
        metavar="PORTS",
        help="with --endpoint-selector: the pods' ports to serve, comma separated (1 to 8); "
        "with --pool-name ignored (the pool's targetPorts decide, as in GIE's lwepp)",
    )
    pods.add_argument(
        "--pool-namespace",
        help="the namespace of the InferencePool or of the selected pods (default: $NAMESPACE, "
        "else this pod's namespace from its service account, or the kubeconfig context's, else "
        "'default')",
    )
    pods.add_argument(
        "--pool-group",
        default=DEFAULT_GROUP,
        help="API group of the InferencePool (default %(default)s)",
    )
    pods.add_argument(
        "--kubeconfig",
        help="kubeconfig file for the Kubernetes API (default: $KUBECONFIG, else the "
        "in-cluster service account, from KUBERNETES_SERVICE_HOST/PORT and the mounted token)",
    )
    pods.add_argument(
        "--pods-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the pod file for changes",
    )

    ha = parser.add_argument_group("leader election")
    ha.add_argument(
        "--leader-elect",
        "--ha-enable-leader-election",
        dest="leader_elect",
        action="store_true",
        help="with the Kubernetes API: only the replica holding a Lease serves; standbys report "
        "NOT_SERVING on every health service but 'liveness' (the llm-d router's rule)",
    )
    ha.add_argument(
        "--leader-elect-lease-name",
        help="the Lease, in the pool's namespace (default: lwepp-<pool-name>)",
    )
    ha.add_argument(
        "--leader-elect-lease-duration",
        type=duration,
        default=15.0,
        help="seconds a standby waits for a silent leader's lease to expire (default 15)",
    )
    ha.add_argument(
        "--leader-elect-renew-deadline",
        type=duration,
        default=10.0,
        help="seconds a leader keeps failing to renew before it stands down (default 10)",
    )
    ha.add_argument(
        "--leader-elect-retry-period",
        type=duration,
        default=2.0,
        help="seconds between tries to acquire or renew the lease (default 2)",
    )

    picking = parser.add_argument_group("picking")
    configs = picking.add_mutually_exclusive_group()
    configs.add_argument(
        "--config",
        "--config-file",
        dest="config",
        metavar="FILE",
        help="an EndpointPickerConfig (the llm-d router's YAML format): filters, scorers, a "
        "picker and data sources instead of plain round-robin (format: lwepp/config.py)",
    )
    configs.add_argument(
        "--config-text",
        metavar="YAML",
        help="the EndpointPickerConfig itself, in lieu of a file",
    )
    picking.add_argument(
        "--check-config",
        action=CheckConfig,
        metavar="FILE",
        help="check a configuration file, print the pipeline it makes (or its errors), and exit",
    )
    picking.add_argument(
        "--explain",
        choices=["header", "all", "off"],
        default=None,
        help="with --config: explain decisions (every candidate's address, scores and "
        "measurements) to the client, in the response header x-switchyard-decision, when a "
        "request asks (x-switchyard-explain: 1), for every request, or never (default off)",
    )
    add_bool(
        picking,
        "--emit-endpoint-scores",
        False,
        "the llm-d router's switch for the same: --explain=all (default false)",
    )
    picking.add_argument(
        "--debug-decisions",
        type=int,
        default=100,
        metavar="N",
        help="with --config and --enable-debug-pages: how many explained decisions and "
        "fallbacks GET /debug/decisions on the metrics port keeps",
    )
    conformance = parser.add_argument_group(
        "GIE's conformance tests (both off: they let a client choose, or learn, its replica)"
    )
    conformance.add_argument(
        "--enable-test-selection-header",
        dest="test_selection",
        action="store_true",
        help="honour test-epp-endpoint-selection, the header with which a client names the "
        "replicas that may serve it (GIE's lwepp always does; default: ignored)",
    )
    conformance.add_argument(
        "--disable-test-selection-header",
        dest="test_selection",
        action="store_false",
        help="ignore that header: the default; accepted for deployments that still say so "
        "(of the two flags, the last one given wins)",
    )
    conformance.add_argument(
        "--report-served-endpoint",
        action="store_true",
        help="name the replica that served each request in the response header "
        "x-conformance-test-served-endpoint (with x-went-into-resp-headers), and ask GIE's "
        "echo server to echo it, as GIE's lwepp always does (default: never)",
    )
    picking.add_argument(
        "--refresh-prometheus-metrics-interval",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="how often the pool gauges (ready endpoints, with --config the pool's averages) "
        "are recomputed (default 5s, as the llm-d router)",
    )
    add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    add_ignored_flags(parser, IGNORED)
    return parser


def load_picker_config(args: argparse.Namespace) -> picker_config.PickerConfig | None:
    """The ``--config`` file or the ``--config-text``; raises ``ConfigErrors``."""
    if args.config is not None:
        return picker_config.load_config(args.config)
    if args.config_text is not None:
        return picker_config.load_text(args.config_text)
    return None


def workers_problem(
    args: argparse.Namespace, config: picker_config.PickerConfig | None
) -> str | None:
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
    if config is not None and (learning := config.learning):
        return (
            f"--workers {args.workers} with {config.path}: plugin(s) "
            f"{', '.join(learning)} learn from the requests served, and each worker "
            "would learn only its own share; run one worker per replica instead"
        )
    return None


def explain_mode(args: argparse.Namespace) -> ExplainMode:
    """``--explain``, else ``all`` with ``--emit-endpoint-scores``, else ``off``: a
    decision shows every candidate's address and load, so no client sees one unasked."""
    if args.explain is not None:
        return cast(ExplainMode, args.explain)
    return "all" if args.emit_endpoint_scores else "off"


def warnings(args: argparse.Namespace) -> list[str]:
    """The start-up warnings the flags call for: ignored flags and values."""
    found = ignored_warnings(args, IGNORED)
    if args.endpoint_target_ports is not None and args.endpoint_selector is None:
        found.append(
            "--endpoint-target-ports: ignored: "
            + ("the pool's targetPorts decide" if args.pool_name else "the pod file lists ports")
        )
    return found


def namespace_of(args: argparse.Namespace, fallback: str) -> str:
    """``--pool-namespace``, else ``$NAMESPACE`` (the llm-d router's chart sets it from the
    pod), else ``fallback`` (the service account's or the kubeconfig context's)."""
    return str(args.pool_namespace or os.environ.get("NAMESPACE") or fallback)


def pod_source(args: argparse.Namespace) -> tuple[PodSource, LeaderElector | None]:
    """The pod list the flags name (a file, an InferencePool or a selector) and the elector.

    Raises ``PodFileError``, ``KubeconfigError`` or ``ValueError`` with a message
    naming the file, variable or flag at fault.
    """
    if args.pods is not None:
        if args.leader_elect:
            raise ValueError("--leader-elect needs the Kubernetes API (the Lease lives there)")
        load_pods(args.pods)  # fail fast on a broken file at start-up
        pod_file = FileSource(args.pods, interval=args.pods_interval)
        pod_file.reload()
        return pod_file, None
    if args.selector:
        raise ValueError("--selector is for --pods; use --endpoint-selector with the API")
    config = load_kubeconfig(args.kubeconfig)
    namespace = namespace_of(args, config.namespace)
    if args.endpoint_selector is not None:
        if args.endpoint_target_ports is None:
            raise ValueError("--endpoint-selector needs --endpoint-target-ports (1 to 8 ports)")
        source: PodSource = InferencePoolSource.without_pool(
            config, namespace, args.endpoint_selector, args.endpoint_target_ports
        )
    else:
        source = InferencePoolSource(config, args.pool_name, namespace, group=args.pool_group)
    if not args.leader_elect:
        return source, None
    timings = LeaseTimings(
        args.leader_elect_lease_duration,
        args.leader_elect_renew_deadline,
        args.leader_elect_retry_period,
    )
    lease = args.leader_elect_lease_name or f"lwepp-{args.pool_name or 'endpoint-selector'}"
    return source, LeaderElector(config, namespace, lease, timings=timings)


def pool_label(args: argparse.Namespace) -> str:
    """The pool's name in the metrics' ``name`` label."""
    if args.pool_name:
        return str(args.pool_name)
    return str(args.endpoint_selector or args.selector or os.path.basename(args.pods))


def health_of(source: PodSource, elector: LeaderElector | None) -> Health:
    """Every name follows readiness (the pool read); with an elector, the lease too, except
    ``liveness``, which a standby keeps SERVING so that it is not restarted."""
    if elector is None:
        return Health(HEALTH_SERVICES, ready=lambda: source.synced)
    return Health(
        [name for name in HEALTH_SERVICES if name != LIVENESS],
        ready=lambda: source.synced and elector.is_leader,
        live=(LIVENESS,),
    )


async def refresh_metrics(
    every: float, metrics: PickerMetrics, pool: Pool, pipeline: Pipeline | None
) -> None:
    """Recompute the pool gauges now and every ``every`` seconds (the router's
    ``--refresh-prometheus-metrics-interval``): one value per scrape, in every worker."""
    while True:
        metrics.refresh(pool.endpoints)
        if pipeline is not None:
            pipeline.refresh_metrics(pool.endpoints)
        await asyncio.sleep(every)


async def run(
    args: argparse.Namespace,
    trace: TextIO | None,
    source: PodSource,
    elector: LeaderElector | None = None,
    config: picker_config.PickerConfig | None = None,
    tls: ServerTLS | None = None,
    auth: MetricsAuth | None = None,
) -> None:
    pool = Pool(source, args.selector)
    if args.pods is not None and not pool.endpoints:  # a file is read whole at start
        log.warning(
            "no pod matches the selector",
            pods=args.pods,
            selector=str(pool.selector),
            detail="every request is answered 503 no_endpoints until the file lists one",
        )
    registry = CollectorRegistry()
    strategy: Strategy = RoundRobin()
    pipeline: Pipeline | None = None
    jobs: list[Callable[[], Coroutine[Any, Any, None]]] = []
    pages: dict[str, Callable[[], bytes]] = {}
    if config is not None:
        for warning in config.warnings:
            log.warning("configuration", detail=warning)
        pipeline = config.pipeline(
            registry=registry,
            explain=explain_mode(args),
            decisions=DecisionLog(args.debug_decisions),
            pool=pool_label(args),
        )
        strategy, jobs, pages = (
            pipeline,
            pipeline.background(lambda: pool.endpoints),
            pipeline.debug_pages(),
        )
    namespace = getattr(source, "namespace", "")
    metrics = PickerMetrics(registry, pool_label(args), namespace)
    service = EndpointPickerService(
        pool,
        strategy,
        metrics,
        args.max_body_bytes,
        test_selection=args.test_selection,
        report_served=args.report_served_endpoint,
    )
    every = args.refresh_prometheus_metrics_interval
    jobs.append(lambda: refresh_metrics(every, metrics, pool, pipeline))
    await serve(
        "lwepp",
        service,
        ports_of(args),
        health_of(source, elector),
        registry,
        background=[source.run, *jobs] if elector is None else [source.run, elector.run, *jobs],
        json_routes=pages if args.enable_debug_pages else None,
        metrics_auth=auth,
        grace=args.grace,
        trace=trace,
        tls=tls,
        drain=args.drain_timeout,
        grpc_options=grpc_options(args),
        health_on_ext_proc=bool(args.health_checking),
        announce={"response_headers": service.hears_response},
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_picker_config(args)
    except picker_config.ConfigErrors as error:
        parser.error(f"argument --config:\n{error}")
    if problem := serving_problem(args) or workers_problem(args, config):
        parser.error(problem)
    configure_logging(log_level(args), args.zap_encoder)
    for warning in warnings(args):
        log.warning("flag", detail=warning)
    try:
        source, elector = pod_source(args)
        tls = server_tls(args)
        auth = metrics_auth(args, args.kubeconfig)
    except (PodFileError, KubeconfigError, ValueError, TLSError) as error:
        sys.exit(f"lwepp: {error}")
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        sys.exit(run_workers("lwepp", flags, args.workers, ports_of(args), shared_tls(tls)))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(run(args, trace, source, elector, config, tls, auth))


if __name__ == "__main__":
    main()
