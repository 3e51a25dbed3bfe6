"""Command line: ``python -m lwepp --pods pods.yaml --selector pool=a``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import TextIO

from prometheus_client import CollectorRegistry

from lwepp.picking import Pool, RoundRobin
from lwepp.server import MAX_BODY_BYTES, EndpointPickerService, Metrics
from pods.file import FileSource, PodFileError, load_pods
from pods.model import parse_selector
from protos.logs import configure_logging
from protos.server import EXT_PROC_SERVICE, Health, Ports, serve

HEALTH_SERVICES = ("", "inference-extension", "liveness", "readiness", EXT_PROC_SERVICE)
"""GIE's lwepp reports ``inference-extension``; the protocol document lists the others."""


def selector(text: str) -> dict[str, str]:
    try:
        return parse_selector(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lwepp",
        description="Lightweight endpoint picker: an Envoy ext_proc service that names, for "
        "each request, the model-server endpoint to send it to (round-robin).",
    )
    parser.add_argument(
        "--pods",
        required=True,
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
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--grpc-port", type=int, default=9002, help="ext_proc gRPC port Envoy calls (0: any free)"
    )
    parser.add_argument(
        "--grpc-health-port",
        type=int,
        default=9003,
        help="gRPC health service port; SERVING once the pod file has been read",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9090, help="HTTP port serving Prometheus /metrics"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body held while waiting for its end (413 above it)",
    )
    parser.add_argument(
        "--pods-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the pod file for changes",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get to finish after SIGTERM",
    )
    parser.add_argument(
        "--trace-messages",
        metavar="FILE",
        help="append every ext_proc message, both ways, to FILE in protobuf text format "
        "(for learning and debugging; slow)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


async def run(args: argparse.Namespace, trace: TextIO | None) -> None:
    source = FileSource(args.pods, interval=args.pods_interval)
    source.reload()
    pool = Pool(source, args.selector)
    registry = CollectorRegistry()
    service = EndpointPickerService(pool, RoundRobin(), Metrics(registry), args.max_body_bytes)
    ports = Ports(args.host, args.grpc_port, args.grpc_health_port, args.metrics_port)
    health = Health(HEALTH_SERVICES, ready=lambda: source.synced)
    await serve(
        "lwepp",
        service,
        ports,
        health,
        registry,
        background=[source.run],
        grace=args.grace,
        trace=trace,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        load_pods(args.pods)  # fail fast on a broken file at start-up
    except PodFileError as error:
        sys.exit(f"lwepp: {error}")
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(run(args, trace))


if __name__ == "__main__":
    main()
