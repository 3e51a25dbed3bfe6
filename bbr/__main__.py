"""``python -m bbr``: parse the flags, build the plugin chains, serve until SIGTERM.

It takes the flags the payload processor's chart (llm-d-inference-payload-processor)
and GIE's BBR chart pass, as they write them; those it has no use for are in
``IGNORED`` (accepted, and named in a warning at start when their value asks
for something BBR does not do).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Final

import structlog
from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS, PluginSpec
from bbr.server import HEALTH_SERVICES, BodyBasedRouter
from plugin_api import ConfigError
from pods.kubeapi import KubeconfigError
from serving.cli import (
    COMMON_IGNORED,
    Parser,
    add_bool,
    add_ignored_flags,
    add_serving_flags,
    grpc_options,
    ignored_warnings,
    log_level,
    metrics_auth,
    ports_of,
    server_tls,
    serving_problem,
)
from serving.logs import configure_logging
from serving.server import Health, Ports, run_workers, serve
from serving.tls import TLSError, shared_tls

IGNORED: Final = COMMON_IGNORED
"""The payload processor's flags that change nothing here (it has none beyond the common ones)."""

log = structlog.get_logger()


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
    add_bool(
        p,
        "--streaming",
        False,
        "expect FULL_DUPLEX_STREAMED bodies when Envoy does not say (no protocol_config, "
        "Envoy before 1.34); otherwise BUFFERED is assumed",
    )
    add_serving_flags(p, Ports("127.0.0.1", 9004, 9005, 9091))
    add_ignored_flags(p, IGNORED)
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
    configure_logging(log_level(args), args.zap_encoder)
    for warning in ignored_warnings(args, IGNORED):
        log.warning("flag", detail=warning)
    try:
        tls = server_tls(args)
        auth = metrics_auth(args)
    except (TLSError, KubeconfigError) as error:
        sys.exit(f"bbr: {error}")
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        return run_workers("bbr", flags, args.workers, ports_of(args), shared_tls(tls))
    health = Health(list(HEALTH_SERVICES))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(
            serve(
                "bbr",
                router,
                ports_of(args),
                health,
                registry,
                grace=args.grace,
                trace=trace,
                tls=tls,
                drain=args.drain_timeout,
                grpc_options=grpc_options(args),
                health_on_ext_proc=bool(args.health_checking),
                json_routes={} if args.enable_debug_pages else None,
                metrics_auth=auth,
                announce={"response": bool(router.response_chain)},
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
