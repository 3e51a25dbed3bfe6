"""``python -m bbr``: parse the flags, build the plugin chains, serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS, ConfigError, PluginSpec
from bbr.server import HEALTH_SERVICES, MAX_BODY_BYTES, BodyBasedRouter
from protos.logs import configure_logging
from protos.server import Health, Ports, serve, supervise

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the flag and what is wrong), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _plugin(flag: str) -> PluginSpec:
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def port(text: str) -> int:
    number = int(text)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port (0-65535, 0 picks a free one)")
    return number


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m bbr",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Body-based router: an Envoy ext_proc service that reads the request body\n"
        "and sets X-Gateway-Model-Name (and whatever else its plugins decide),\n"
        "so that the gateway can route on the model.",
        epilog="example:\n  python -m bbr --streaming --plugin \\\n    "
        '\'body-field-to-header:model-extractor:{"fieldName":"model",'
        '"headerName":"X-Gateway-Model-Name"}\'',
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--grpc-port", type=port, default=9004, help="ext_proc port (default 9004)")
    p.add_argument(
        "--grpc-health-port", type=port, default=9005, help="gRPC health port (default 9005)"
    )
    p.add_argument(
        "--metrics-port", type=port, default=9091, help="Prometheus /metrics port (default 9091)"
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
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body accepted, larger is answered 413; larger responses skip the "
        "response plugins (default %(default)s, 10 MiB)",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="lowest level logged; each request logs at debug only (default info)",
    )
    p.add_argument(
        "--trace-messages",
        metavar="FILE",
        help="append every ext_proc message, both ways, to FILE in protobuf text format "
        "(for learning and debugging; slow)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="serve from N processes on the same ext_proc and health ports (SO_REUSEPORT "
        "spreads Envoy's connections over them, one core each); worker i serves its own "
        "/metrics on --metrics-port + i. BBR keeps no state between requests, so workers "
        "differ only in whose counters a request lands in (default 1)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get to finish on SIGTERM (default %(default)s)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    ports = Ports(args.host, args.grpc_port, args.grpc_health_port, args.metrics_port)
    fixed = [number for number in (ports.grpc, ports.health, ports.metrics) if number]
    if len(set(fixed)) < len(fixed):
        p.error("--grpc-port, --grpc-health-port and --metrics-port must differ")
    if args.max_body_bytes < 1:
        p.error("argument --max-body-bytes: must be at least 1")
    if not args.grace >= 0:
        p.error("argument --grace: must be a number of seconds, 0 or more")
    if args.workers < 1:
        p.error("argument --workers: must be at least 1")
    if args.workers > 1 and args.trace_messages:
        p.error("argument --workers: trace one process (--workers 1) with --trace-messages")
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
        return supervise("bbr", flags, args.workers, ports)
    health = Health(list(HEALTH_SERVICES))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(serve("bbr", router, ports, health, registry, grace=args.grace, trace=trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
