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
import functools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry

from lwepp import config as picker_config
from lwepp.assembly import HEALTH_SERVICES, PickerOptions, add_picker_flags, assemble
from lwepp.flowcontrol import config as flow_config
from lwepp.leader import LeaderElector, LeaseTimings
from lwepp.objectives import ObjectiveSource, ObjectiveWatch
from lwepp.picking import Pool
from lwepp.pipeline import ROLES
from lwepp.plugins.discovery import POOL_NAME
from lwepp.rewrite_control import RewriteSource
from lwepp.rewrite_sources import RewriteWatch
from plugin_api import Role, needs_body, roles_of
from plugin_api.document import ConfigErrors
from pods.file import FileSource, PodFileError, load_pods
from pods.kubeapi import KubeconfigError, load_kubeconfig
from pods.kubernetes import DEFAULT_GROUP, InferencePoolSource
from pods.model import PodSource
from pods.selector import LabelSelector, SelectorError
from serving.cli import (
    COMMON_IGNORED,
    Ignored,
    Parser,
    add_ignored_flags,
    add_serving_flags,
    duration,
    go_bool,
    ignored_warnings,
    options_or_exit,
    run,
)
from serving.options import Ports, ServingOptions
from serving.server import Health, Service

log = structlog.get_logger()

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
            print("\n".join(describe(picker_config.load_config(args[1]))))
        except picker_config.ConfigErrors as error:
            parser.exit(1, f"{error}\n")
        parser.exit(0)


def describe(config: picker_config.PickerConfig) -> Iterator[str]:
    """The resolved pipeline as ``--check-config`` prints it."""
    yield f"{config.path}: OK ({config.api_version}, profile {config.profile!r})"
    yield ""
    yield "plugins"
    labels = [p.name if p.name == p.type else f"{p.name} ({p.type})" for p in config.plugins]
    width = max(map(len, labels), default=0)
    for label, p in zip(labels, config.plugins, strict=True):
        roles = roles_of(p.plugin, ROLES)  # as linked: a scorer handed its producer plays less
        details = [", ".join(role.label for role in roles)] if roles else []
        provides: frozenset[str] = getattr(p.plugin, "provides", frozenset())
        if provides:
            details.append(f"provides {', '.join(sorted(provides))} to the plugins naming it")
        reads: frozenset[str] = getattr(p.plugin, "reads", frozenset())
        if reads:
            details.append(f"reads {', '.join(sorted(reads))}")
        if Role.SOURCE in roles and p.plugin.produces:
            details.append(f"produces {', '.join(sorted(p.plugin.produces))}")
        if needs_body(p.plugin):
            details.append("needs the body")
        yield f"  {label:<{width}}  {'; '.join(details)}"
    if not config.plugins:
        yield "  (none)"
    yield ""
    yield f"pipeline (profile {config.profile!r}), stage by stage"
    pipeline = config.pipeline()
    for role in ROLES:
        names = [p.name for p in pipeline.stages[role]]
        if role is Role.SCORE:
            names = [f"{s.name} ×{w:g}" for s, w in pipeline.scorers]
        elif role is Role.PICK and not any(Role.PICK in p.roles for p in config.plugins):
            names[0] += "  (default: the profile names no picker)"
        stage = "background" if role is Role.SOURCE else role.value
        yield f"  {stage:<17}  {', '.join(names) or '-'}"
    needing = [p.name for p in pipeline.plugins if needs_body(p)]
    body = f"held and parsed (needed by {', '.join(needing)})" if needing else "not parsed"
    yield f"  {'body':<17}  {body}"
    yield ""
    yield "flow control"
    yield from flow_config.describe(config.flow)
    if config.warnings:
        yield ""
        yield "warnings"
        for warning in config.warnings:
            yield f"  {warning}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m lwepp",
        description="Lightweight endpoint picker: an Envoy ext_proc service that names, for "
        "each request, the model-server endpoint to send it to (round-robin, or the filters "
        "and scorers of --config).",
    )
    pods = parser.add_argument_group("the pool")
    where = pods.add_mutually_exclusive_group()  # or --config's file-discovery: one of them
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
        nargs="?",
        const=True,
        default=False,
        type=go_bool,
        metavar="BOOL",
        help="with the Kubernetes API: only the replica holding a Lease serves; standbys report "
        "NOT_SERVING on every health service but 'liveness' (the llm-d router's rule). A Go "
        "boolean, as the router's: --ha-enable-leader-election=false (its chart's) is off",
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

    parser.add_argument(
        "--shared-store-address",
        default="",
        metavar="ADDRESS",
        help="a Redis (redis://, rediss://, unix:// or host:port, as the llm-d router's "
        "redisConfig.address) through which replicas and --workers share the prefix index, "
        "the no-hit LRU and in-flight counts (docs/scale-out.md); unreachable: own view only",
    )
    add_picker_flags(parser)
    parser.add_argument(
        "--check-config",
        action=CheckConfig,
        metavar="FILE",
        help="check a configuration file, print the pipeline it makes (or its errors), and exit",
    )
    add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    add_ignored_flags(parser, IGNORED)
    return parser


def workers_problem(
    args: argparse.Namespace, config: picker_config.PickerConfig | None
) -> str | None:
    """Why ``--workers`` above 1 cannot run with these flags, or None.

    Workers share nothing but the ports. Stateless picking (round-robin,
    scorers over polled metrics) works the same in each, one turn counter
    per worker; what a plugin learns from the requests a worker served stays
    in that worker, so with N workers each would see about 1/N of the traffic
    (a prefix index that finds a prefix only one time in N), unless they share
    it through ``--shared-store-address`` (``lwepp.sharing``). Flow control
    then queues per worker, on the shared in-flight counts, as it does per
    replica.
    """
    if args.workers == 1:
        return None
    if args.leader_elect:
        return "--workers with --leader-elect: each worker would campaign for the Lease alone"
    if args.shared_store_address:
        return None
    if config is not None and config.flow.gate:
        return (
            f"--workers {args.workers} with flow control ({config.path}): each worker would "
            "queue, and count the pool's load, on its own; add --shared-store-address or run "
            "one worker per replica"
        )
    if config is not None and (learning := config.learning):
        return (
            f"--workers {args.workers} with {config.path}: plugin(s) "
            f"{', '.join(learning)} learn from the requests served, and each worker "
            "would learn only its own share; add --shared-store-address (a Redis) or run one "
            "worker per replica"
        )
    return None


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


def pod_source(
    args: argparse.Namespace, discovery: Any = None
) -> tuple[PodSource, LeaderElector | None]:
    """The pod list the flags name (a file, an InferencePool or a selector), or the
    configuration's ``discovery`` plugin (``file-discovery``), and the elector.

    Raises ``PodFileError``, ``KubeconfigError`` or ``ValueError`` with a message
    naming the file, variable or flag at fault.
    """
    flags = [f for f in ("pods", "pool_name", "endpoint_selector") if getattr(args, f) is not None]
    if discovery is not None:
        if flags := [f for f in flags if f != "pool_name"]:  # --pool-name only names it there
            flag = "--" + flags[0].replace("_", "-")
            raise ValueError(f"{flag} and the configuration's {discovery.name} both name the pods")
        if args.leader_elect:
            raise ValueError("--leader-elect needs the Kubernetes API (the Lease lives there)")
        load_pods(discovery.path)  # fail fast on a broken file at start-up, as the router
        endpoints_file = discovery.pod_source(args.pods_interval)
        endpoints_file.reload()
        return endpoints_file, None
    if not flags:
        raise ValueError(
            "one of the arguments --pods --pool-name --endpoint-selector is required (or a "
            "file-discovery plugin named by dataLayer.discovery in --config)"
        )
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


def rewrite_source(
    args: argparse.Namespace, picking: PickerOptions, source: PodSource
) -> RewriteSource | None:
    """The pool's InferenceModelRewrites: a file, the Kubernetes API (the default with
    ``--pool-name``, as the llm-d router reads them), or none. Raises ``ConfigErrors`` for a
    broken file and ``ValueError`` for ``api`` without a pool."""
    if picking.rewrite_path is not None:
        return picking.rewrite_file(args.pool_name or picking.model_rewrites_pool)
    if picking.model_rewrites == "off" or (picking.model_rewrites is None and not args.pool_name):
        return None
    if not isinstance(source, InferencePoolSource) or not args.pool_name:
        raise ValueError("--model-rewrites=api needs --pool-name: rewrites name their pool")
    return RewriteWatch(source.config, source.namespace, args.pool_name, args.pool_group)


def objective_source(args: argparse.Namespace, picking: PickerOptions) -> ObjectiveSource | None:
    """``--inference-objectives``; else, with ``--pool-name``, the pool's InferenceObjectives
    from the Kubernetes API (as the router, which reads none in its standalone and file modes).
    Raises ``ConfigErrors`` for a broken file, ``KubeconfigError`` as ``pod_source``."""
    found = picking.objective_file()
    if found is not None or not args.pool_name:
        return found
    config = load_kubeconfig(args.kubeconfig)
    return ObjectiveWatch(config, args.pool_name, namespace_of(args, config.namespace))


def pool_label(args: argparse.Namespace) -> str:
    """The pool's name in the metrics' ``name`` label (file discovery: the router's ``epp``)."""
    if args.pool_name:
        return str(args.pool_name)
    if args.pods is None and args.endpoint_selector is None:
        return POOL_NAME
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


def picker(
    args: argparse.Namespace,
    options: ServingOptions,
    picking: PickerOptions,
    config: picker_config.PickerConfig | None,
    source: PodSource,
    elector: LeaderElector | None,
    rewrites: RewriteSource | None = None,
    objectives: ObjectiveSource | None = None,
) -> Service:
    """The one pool's picker, as ``serve`` runs it (made inside the event loop)."""
    pool = Pool(source, args.selector)
    pods = args.pods or getattr(config and config.discovery, "path", None)
    if pods is not None and not pool.endpoints:  # a file is read whole at start
        log.warning(
            "no pod matches the selector",
            pods=pods,
            selector=str(pool.selector),
            detail="every request is answered 503 no_endpoints until the file lists one",
        )
    registry = CollectorRegistry()
    namespace = getattr(source, "namespace", "")
    if config is not None and config.discovery is not None:  # the router's order of sources
        namespace = namespace_of(args, "default")
    built = assemble(
        pool,
        config,
        picking,
        registry,
        name=pool_label(args),
        namespace=namespace,
        max_body_bytes=options.max_body_bytes,
        rewrites=rewrites,
        objectives=objectives,
        shared_store=args.shared_store_address,
    )
    side = [source.run] if elector is None else [source.run, elector.run]
    return Service(
        "lwepp",
        built.service,
        health_of(source, elector),
        registry,
        background=[*side, *built.background],
        debug_pages=built.debug_pages,
        announce={
            "response_headers": built.service.hears_response,
            "response_body": built.service.reads_response_body,
        },
        stopping=built.stopping,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_or_exit(parser, args)
    picking = PickerOptions.from_args(args)
    try:
        config = picking.load_config()
    except picker_config.ConfigErrors as error:
        parser.error(f"argument --config:\n{error}")
    if problem := workers_problem(args, config):
        parser.error(problem)
    try:
        objectives = objective_source(args, picking)
    except picker_config.ConfigErrors as error:
        parser.error(f"argument --inference-objectives:\n{error}")
    try:
        source, elector = pod_source(args, config and config.discovery)
        rewrites = rewrite_source(args, picking, source)
    except ConfigErrors as error:
        parser.error(f"argument --model-rewrites:\n{error}")
    except (PodFileError, KubeconfigError, ValueError) as error:
        sys.exit(f"lwepp: {error}")
    return run(
        "lwepp",
        options,
        functools.partial(
            picker, args, options, picking, config, source, elector, rewrites, objectives
        ),
        argv,
        warnings(args),
    )


if __name__ == "__main__":
    sys.exit(main())
