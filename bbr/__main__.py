"""``python -m bbr``: parse the flags, build the plugin chains, serve until SIGTERM.

It takes the flags the payload processor's chart (llm-d-inference-payload-processor)
and GIE's BBR chart pass, as they write them; those it has no use for are in
``IGNORED`` (accepted, and named in a warning at start when their value asks
for something BBR does not do).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Final

from prometheus_client import CollectorRegistry

from bbr.assembly import add_router_flags, router_of
from bbr.server import HEALTH_SERVICES
from plugin_api import ConfigError
from serving import cli
from serving.options import Ports
from serving.server import Health, Service

IGNORED: Final = cli.COMMON_IGNORED
"""The payload processor's flags that change nothing here (it has none beyond the common ones)."""


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog="python -m bbr",
        description="Body-based router: an Envoy ext_proc service that reads the request body\n"
        "and sets X-Gateway-Model-Name (and whatever else its plugins decide),\n"
        "so that the gateway can route on the model.",
        epilog="example:\n  python -m bbr --streaming --plugin \\\n    "
        '\'body-field-to-header:model-extractor:{"fieldName":"model",'
        '"headerName":"X-Gateway-Model-Name"}\'',
    )
    add_router_flags(p, config=True)
    cli.add_serving_flags(p, Ports("127.0.0.1", 9004, 9005, 9091))
    cli.add_ignored_flags(p, IGNORED)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    options = cli.options_or_exit(p, args)
    registry = CollectorRegistry()
    try:
        router, warnings = router_of(args, registry, options.max_body_bytes)
    except ConfigError as error:
        if args.config_file is None and args.config_text is None:
            p.error(f"argument --plugin: {error}")
        p.error(f"argument --config-file:\n{error}")  # every problem, one per line
    service = Service(
        "bbr",
        router,
        Health(list(HEALTH_SERVICES)),
        registry,
        background=router.background,
        announce={"response": bool(router.response_chain)},
    )
    warnings = [*cli.ignored_warnings(args, IGNORED), *warnings]
    return cli.run("bbr", options, lambda: service, argv, warnings)


if __name__ == "__main__":
    sys.exit(main())
