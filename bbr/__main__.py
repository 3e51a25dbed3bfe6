"""``python -m bbr``: parse the flags, build the plugin chains, serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS, PluginSpec
from bbr.server import HEALTH_SERVICES, BodyBasedRouter
from plugin import ConfigError
from protos.cli import Parser, add_serving_flags, ports_of, serving_problem
from protos.logs import configure_logging
from protos.server import Health, Ports, run_workers, serve


def _plugin(flag: str) -> PluginSpec:
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bbr",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Body-based router: an Envoy ext_proc service that reads the request body\n"
        "and sets X-Gateway-Model-Name (and whatever else its plugins decide),\n"
        "so that the gateway can route on the model.",
        epilog="example:\n  python -m bbr --streaming --plugin \\\n    "
        '\'body-field-to-header:model-extractor:{"fieldName":"model",'
        '"headerName":"X-Gateway-Model-Name"}\'',
    )
    p.add_argument(
        "--plugin",
        dest="plugins",
        type=_plugin,
        action="append",
        metavar="TYPE:NAME[:JSON]",
        help="add a plugin to the chains, in order (repeatable): a built-in type "
        "(body-field-to-header, base-model-to-header) or package.module.Class, an instance name, "
        "and its parameters as a JSON object. Default: the model extractor, as in the example",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="expect FULL_DUPLEX_STREAMED bodies when Envoy does not say (no protocol_config, "
        "Envoy before 1.34); otherwise BUFFERED is assumed",
    )
    add_serving_flags(p, Ports("127.0.0.1", 9004, 9005, 9091))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if problem := serving_problem(args):
        p.error(problem)
    registry = CollectorRegistry()
    try:
        router = BodyBasedRouter(
            registry,
            args.plugins or DEFAULT_PLUGINS,
            streaming=args.streaming,
            max_body_bytes=args.max_body_bytes,
        )
    except ConfigError as error:
        p.error(f"argument --plugin: {error}")
    configure_logging(args.log_level)
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        return run_workers("bbr", flags, args.workers, ports_of(args))
    health = Health(list(HEALTH_SERVICES))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(
            serve("bbr", router, ports_of(args), health, registry, grace=args.grace, trace=trace)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
