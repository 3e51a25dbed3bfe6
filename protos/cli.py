"""The serving flags both services take, defined and checked once.

``python -m lwepp`` and ``python -m bbr`` listen the same way (an ext_proc
port, a gRPC health port, a metrics port), run as N workers the same way,
drain the same way on SIGTERM and cap held bodies the same way; only their
default ports differ. ``add_serving_flags`` adds those flags to a service's
parser, ``serving_problem`` says what is wrong with their values, and
``Parser`` prints one line per error (the flag and what is wrong), exit 2.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from protos.exchange import MAX_BODY_BYTES
from protos.server import Ports

LOG_LEVELS = ("debug", "info", "warning", "error")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the flag and what is wrong), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0: any free port)."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port (0-65535, 0 picks a free one)")
    return number


def add_serving_flags(parser: argparse.ArgumentParser, defaults: Ports) -> None:
    """``--host``, the three ports, ``--workers``, ``--grace``, ``--max-body-bytes``,
    ``--trace-messages`` and ``--log-level``; ``defaults`` gives the host and ports."""
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--host", default=defaults.host, help="address to listen on (default %(default)s)"
    )
    serving.add_argument(
        "--grpc-port",
        type=port,
        default=defaults.grpc,
        help="ext_proc gRPC port Envoy calls (default %(default)s; 0: any free port)",
    )
    serving.add_argument(
        "--grpc-health-port",
        type=port,
        default=defaults.health,
        help="gRPC health service port; SERVING once the service is ready (default %(default)s)",
    )
    serving.add_argument(
        "--metrics-port",
        type=port,
        default=defaults.metrics,
        help="HTTP port serving Prometheus /metrics (default %(default)s)",
    )
    serving.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="serve from N processes on the same ext_proc and health ports (SO_REUSEPORT "
        "spreads Envoy's connections over them, one core each); worker i serves its own "
        "/metrics on --metrics-port + i, and keeps its own state (default 1)",
    )
    serving.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get to finish after SIGTERM (default %(default)s)",
    )
    serving.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body held while waiting for its end, larger is answered 413 "
        "(default %(default)s, 10 MiB)",
    )
    serving.add_argument(
        "--trace-messages",
        metavar="FILE",
        help="append every ext_proc message, both ways, to FILE in protobuf text format "
        "(for learning and debugging; slow)",
    )
    serving.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="lowest level logged; each request logs at debug only (default %(default)s)",
    )


def ports_of(args: argparse.Namespace) -> Ports:
    return Ports(args.host, args.grpc_port, args.grpc_health_port, args.metrics_port)


def serving_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the serving flags' values, naming the flag; None if nothing."""
    fixed = [
        number for number in (args.grpc_port, args.grpc_health_port, args.metrics_port) if number
    ]
    if len(set(fixed)) < len(fixed):
        return "--grpc-port, --grpc-health-port and --metrics-port must differ"
    if args.max_body_bytes < 1:
        return "argument --max-body-bytes: must be at least 1"
    if not args.grace >= 0:
        return "argument --grace: must be a number of seconds, 0 or more"
    if args.workers < 1:
        return "argument --workers: must be at least 1"
    if args.workers > 1 and args.trace_messages:
        return "argument --workers: trace one process (--workers 1) with --trace-messages"
    return None
