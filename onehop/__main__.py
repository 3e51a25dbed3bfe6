"""Command line: ``python -m onehop --pods pods.yaml --pool a=llama-3-8b --pool b=qwen-2.5-7b``.

BBR's flags (``bbr.add_router_flags``), the picking flags of ``python -m
lwepp`` (``lwepp.add_picker_flags``) and the serving flags every service
takes; each pool's picker is built as ``python -m lwepp`` builds its one
(``lwepp.assemble``), with a configuration and a registry of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import structlog
from prometheus_client import CollectorRegistry

from bbr import BodyBasedRouter, add_router_flags, router_of
from lwepp import (
    HEALTH_SERVICES,
    Assembly,
    EndpointPickerService,
    PickerOptions,
    Pool,
    add_picker_flags,
    assemble,
)
from onehop.server import OneHop, Registries
from plugin_api import ConfigError
from plugin_api.document import ConfigErrors
from pods.file import FileSource, PodFileError, load_pods
from serving import cli
from serving.options import Ports, ServingOptions
from serving.server import Health, Service

log = structlog.get_logger()


def pool_flag(text: str) -> tuple[str, tuple[str, ...]]:
    """``--pool NAME=MODEL[,MODEL...]``: a pool (its pods carry ``pool=NAME``) and its models."""
    name, sign, models = text.partition("=")
    served = tuple(m.strip() for m in models.split(",") if m.strip())
    if not sign or not name.strip() or not served:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=MODEL[,MODEL...]")
    return name.strip(), served


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(
        prog="python -m onehop",
        description="BBR and the endpoint pickers of several pools in one ext_proc service, "
        "for a gateway that calls Python once per request: the model from the body "
        "(X-Gateway-Model-Name), then the model's pool's pick, in the same stream.",
    )
    pools = parser.add_argument_group("the pools")
    pools.add_argument("--pods", required=True, help="YAML pod file listing the model-server pods")
    pools.add_argument(
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
    pools.add_argument(
        "--pool-label", default="pool", help="the pod label naming a pod's pool (%(default)s)"
    )
    pools.add_argument(
        "--pods-interval", type=float, default=1.0, help="seconds between pod file checks"
    )
    add_router_flags(parser.add_argument_group("BBR's request chain"), streaming=True)
    add_picker_flags(parser)
    cli.add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    cli.add_ignored_flags(parser, cli.COMMON_IGNORED)
    return parser


def pickers(
    args: argparse.Namespace, picking: PickerOptions, source: FileSource, max_body_bytes: int
) -> tuple[dict[str, Assembly], dict[str, EndpointPickerService], list[CollectorRegistry]]:
    """Every pool's picker (by pool name), each model's picker, and their registries.

    Each pool gets its own registry and its own copy of the configuration's
    plugins: what a plugin learns (a prefix index) belongs to one pool.
    Raises ``ConfigError`` or ``lwepp.config.ConfigErrors``.
    """
    names = [name for name, _ in args.pools]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"--pool: pool {repeated[0]!r} is given twice (list its models once)")
    built: dict[str, Assembly] = {}
    by_model: dict[str, EndpointPickerService] = {}
    registries = []
    for name, models in args.pools:
        registry = CollectorRegistry()
        registries.append(registry)
        pool = Pool(source, {args.pool_label: name})
        built[name] = assemble(
            pool,
            picking.load_config(),
            picking,
            registry,
            name=name,
            max_body_bytes=max_body_bytes,
            rewrites=picking.rewrite_file(name),  # the file's rewrites whose poolRef names it
        )
        for model in models:
            if model in by_model:
                raise ConfigError(f"--pool: model {model!r} is in two pools")
            by_model[model] = built[name].service
    return built, by_model, registries


def one_hop(
    args: argparse.Namespace,
    options: ServingOptions,
    router: BodyBasedRouter,
    bbr_registry: CollectorRegistry,
    source: FileSource,
    picked: tuple[dict[str, Assembly], dict[str, EndpointPickerService], list[CollectorRegistry]],
) -> Service:
    """The one hop as ``serve`` runs it: BBR's router and every pool's picker (``pickers``)."""
    built, by_model, registries = picked
    for name, pool_picker in built.items():  # a typo in a name: every request of it gets 503
        if not pool_picker.service.pool.endpoints:
            selector = f"{args.pool_label}={name}"
            log.warning("no pod matches the pool", pool=name, pods=args.pods, selector=selector)
    handler = OneHop(router, by_model, options.max_body_bytes)
    registry = CollectorRegistry()
    registry.register(Registries([bbr_registry, *registries]))
    pages = {
        f"{path}/{name}": page
        for name, pool_picker in built.items()
        for path, page in pool_picker.debug_pages.items()
    }
    return Service(
        "onehop",
        handler,
        Health(HEALTH_SERVICES, ready=lambda: source.synced),
        registry,
        background=[
            source.run,
            *router.background,
            *(job for b in built.values() for job in b.background),
        ],
        debug_pages=pages,
        announce={
            "response_headers": handler.hears_response,
            "response_body": handler.reads_response_body,
        },
        stopping=[hook for pool_picker in built.values() for hook in pool_picker.stopping],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = cli.options_or_exit(parser, args)
    picking = PickerOptions.from_args(args)
    if options.workers > 1 and (picking.config_path or picking.config_text):
        parser.error("--workers with --config: each worker would learn from its share only")
    if picking.model_rewrites == "api":
        parser.error("--model-rewrites=api: the one hop reads its pools' rewrites from a file")
    try:
        picking.rewrite_file(None)
    except ConfigErrors as error:
        parser.error(f"argument --model-rewrites:\n{error}")
    source = FileSource(args.pods, interval=args.pods_interval)
    bbr_registry = CollectorRegistry()
    try:
        picking.objective_file()
    except ConfigErrors as error:
        parser.error(f"argument --inference-objectives:\n{error}")
    try:  # a bad --plugin, --config or --pool stops here
        router, router_warnings = router_of(args, bbr_registry, options.max_body_bytes)
        picked = pickers(args, picking, source, options.max_body_bytes)
    except ConfigErrors as error:
        parser.error(f"argument --config:\n{error}")
    except ConfigError as error:
        parser.error(str(error))
    try:
        load_pods(args.pods)  # fail fast on a broken file
        source.reload()
    except PodFileError as error:
        sys.exit(f"onehop: {error}")
    service = one_hop(args, options, router, bbr_registry, source, picked)
    warnings = [*cli.ignored_warnings(args, cli.COMMON_IGNORED), *router_warnings]
    return cli.run("onehop", options, lambda: service, argv, warnings)


if __name__ == "__main__":
    sys.exit(main())
