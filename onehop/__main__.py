"""Command line: ``python -m onehop --pods pods.yaml --pool a=llama-3-8b --pool b=qwen``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TextIO

import structlog
from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS, PluginSpec
from bbr.server import BodyBasedRouter
from lwepp import config as picker_config
from lwepp.__main__ import HEALTH_SERVICES, refresh_metrics
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import DecisionLog, Pipeline
from lwepp.server import (
    EndpointPickerService,
)
from onehop.server import OneHop, Registries
from plugin_api import ConfigError
from pods.file import FileSource, PodFileError, load_pods
from pods.kubeapi import KubeconfigError
from pods.model import Endpoint
from serving.cli import (
    COMMON_IGNORED,
    Parser,
    add_bool,
    add_ignored_flags,
    add_serving_flags,
    grpc_options,
    log_level,
    metrics_auth,
    ports_of,
    server_tls,
    serving_problem,
)
from serving.logs import configure_logging
from serving.metrics_auth import MetricsAuth
from serving.server import Health, Ports, run_workers, serve
from serving.tls import TLSError, shared_tls

log = structlog.get_logger()


def pool_flag(text: str) -> tuple[str, tuple[str, ...]]:
    """``--pool NAME=MODEL[,MODEL...]``: a pool (its pods carry ``pool=NAME``) and its models."""
    name, sign, models = text.partition("=")
    served = tuple(m.strip() for m in models.split(",") if m.strip())
    if not sign or not name.strip() or not served:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=MODEL[,MODEL...]")
    return name.strip(), served


def plugin_flag(flag: str) -> PluginSpec:
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m onehop",
        description="BBR and the endpoint pickers of several pools in one ext_proc service, "
        "for a gateway that calls Python once per request: the model from the body "
        "(X-Gateway-Model-Name), then the model's pool's pick, in the same stream.",
    )
    add = parser.add_argument
    add("--pods", required=True, help="YAML pod file listing the model-server pods")
    add(
        "--pool",
        dest="pools",
        type=pool_flag,
        action="append",
        required=True,
        metavar="NAME=MODEL[,MODEL...]",
        help="a pool and the models routed to it (repeatable); its pods are those whose "
        "--pool-label is NAME; MODEL * takes any model no other pool names, and requests "
        "naming none. Must agree with the gateway's routes",
    )
    add("--pool-label", default="pool", help="the pod label naming a pod's pool (%(default)s)")
    add(
        "--kubeconfig",
        help="kubeconfig file for the Kubernetes API that --metrics-endpoint-auth asks "
        "(default: $KUBECONFIG, else the in-cluster service account)",
    )
    add("--pods-interval", type=float, default=1.0, help="seconds between pod file checks")
    add(
        "--config",
        metavar="FILE",
        help="an EndpointPickerConfig every pool's picker runs (each its own instance); "
        "default: round-robin",
    )
    add(
        "--explain",
        choices=["header", "all", "off"],
        default="off",
        help="with --config: explain decisions in x-switchyard-decision, when a request asks "
        "(header), for every request (all), or never (the default, as python -m lwepp: the "
        "header names every candidate's address and scores)",
    )
    add(
        "--plugin",
        dest="plugins",
        type=plugin_flag,
        action="append",
        metavar="TYPE:NAME[:JSON]",
        help="BBR's request plugins, in order (as python -m bbr); default: the model extractor",
    )
    add(
        "--enable-test-selection-header",
        dest="test_selection",
        action="store_true",
        help="honour test-epp-endpoint-selection, as python -m lwepp does (default: ignored)",
    )
    add(
        "--report-served-endpoint",
        action="store_true",
        help="name the replica that served each request in x-conformance-test-served-endpoint, "
        "as python -m lwepp does (default: never)",
    )
    add_bool(
        parser,
        "--streaming",
        True,
        "expect FULL_DUPLEX_STREAMED request bodies when Envoy does not say (no protocol_config)",
    )
    add(
        "--refresh-prometheus-metrics-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often the pool gauges are recomputed (default 5)",
    )
    add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    add_ignored_flags(parser, COMMON_IGNORED)
    return parser


def endpoints_now(pool: Pool) -> Sequence[Endpoint]:
    """The pool's endpoints at this moment (what a pipeline's data sources poll)."""
    return pool.endpoints


def build(
    args: argparse.Namespace, source: FileSource
) -> tuple[OneHop, Registries, list[Callable[[], Coroutine[Any, Any, None]]], dict[str, Any]]:
    """The handler, its metrics, background jobs and debug pages, from the flags.

    Each pool gets its own registry and its own copy of the configuration's
    plugins: what a plugin learns (a prefix index) belongs to one pool.
    Raises ``ConfigError`` or ``picker_config.ConfigErrors``.
    """
    bbr_registry = CollectorRegistry()
    router = BodyBasedRouter(
        bbr_registry,
        args.plugins or DEFAULT_PLUGINS,
        streaming=args.streaming,
        max_body_bytes=args.max_body_bytes,
    )
    registries = [bbr_registry]
    jobs: list[Callable[[], Coroutine[Any, Any, None]]] = [source.run]
    pages: dict[str, Any] = {}
    pickers: dict[str, EndpointPickerService] = {}
    names = [name for name, _ in args.pools]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"--pool: pool {repeated[0]!r} is given twice (list its models once)")
    for name, models in args.pools:
        registry = CollectorRegistry()
        registries.append(registry)
        pool = Pool(source, {args.pool_label: name})
        strategy: Strategy = RoundRobin()
        pipeline: Pipeline | None = None
        if args.config is not None:
            pipeline = picker_config.load_config(args.config).pipeline(
                registry=registry, explain=args.explain, decisions=DecisionLog(100), pool=name
            )
            strategy = pipeline
            jobs += pipeline.background(functools.partial(endpoints_now, pool))
            pages |= {f"{path}/{name}": page for path, page in pipeline.debug_pages().items()}
        metrics = PickerMetrics(registry, name)
        picker = EndpointPickerService(
            pool,
            strategy,
            metrics,
            args.max_body_bytes,
            test_selection=args.test_selection,
            report_served=args.report_served_endpoint,
        )
        every = args.refresh_prometheus_metrics_interval
        jobs.append(functools.partial(refresh_metrics, every, metrics, pool, pipeline))
        for model in models:
            if model in pickers:
                raise ConfigError(f"--pool: model {model!r} is in two pools")
            pickers[model] = picker
    return OneHop(router, pickers, args.max_body_bytes), Registries(registries), jobs, pages


async def run(
    args: argparse.Namespace,
    built: tuple[OneHop, Registries, list[Callable[[], Coroutine[Any, Any, None]]], dict[str, Any]],
    source: FileSource,
    trace: TextIO | None,
    tls: Any,
    auth: MetricsAuth | None = None,
) -> None:
    handler, registries, jobs, pages = built
    registry = CollectorRegistry()
    registry.register(registries)
    await serve(
        "onehop",
        handler,
        ports_of(args),
        Health(HEALTH_SERVICES, ready=lambda: source.synced),
        registry,
        background=jobs,
        json_routes=pages if args.enable_debug_pages else None,
        metrics_auth=auth,
        grace=args.grace,
        trace=trace,
        tls=tls,
        drain=args.drain_timeout,
        grpc_options=grpc_options(args),
        health_on_ext_proc=bool(args.health_checking),
        announce={"response_headers": handler.hears_response},
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := serving_problem(args):
        parser.error(problem)
    if args.workers > 1 and args.config is not None:
        parser.error("--workers with --config: each worker would learn from its share only")
    source = FileSource(args.pods, interval=args.pods_interval)
    try:
        built = build(args, source)  # a bad --config, --plugin or --pool stops here
    except picker_config.ConfigErrors as error:
        parser.error(f"argument --config:\n{error}")
    except ConfigError as error:
        parser.error(str(error))
    configure_logging(log_level(args), args.zap_encoder)
    try:
        load_pods(args.pods)  # fail fast on a broken file
        source.reload()
        for name, models in args.pools:  # a typo in a name: every request of its models gets 503
            if not built[0].pickers[models[0]].pool.endpoints:  # the pool build() made
                selector = f"{args.pool_label}={name}"
                log.warning("no pod matches the pool", pool=name, pods=args.pods, selector=selector)
        tls = server_tls(args)
        auth = metrics_auth(args, args.kubeconfig)
    except (PodFileError, TLSError, KubeconfigError) as error:
        sys.exit(f"onehop: {error}")
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        sys.exit(run_workers("onehop", flags, args.workers, ports_of(args), shared_tls(tls)))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(run(args, built, source, trace, tls, auth))


if __name__ == "__main__":
    main()
