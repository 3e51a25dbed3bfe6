"""Assembling a body-based router: the flags that shape its chains, and the router they make.

``python -m bbr`` serves one router; ``python -m onehop`` runs the same
request chain before its picks. Both take BBR's flags (``add_router_flags``)
and build the router with ``router_of``, which also attaches what feeds its
plugins (``base-model-to-header``'s ConfigMaps: ``bbr.base_models``) as
background tasks and collects what they had to say at start.
"""

from __future__ import annotations

import argparse
from typing import Any

from prometheus_client import CollectorRegistry

from bbr.base_models import KubeAccess, feed
from bbr.plugins import DEFAULT_PLUGINS, BaseModelToHeader, PluginSpec
from bbr.server import BodyBasedRouter
from plugin_api import ConfigError
from serving.cli import add_bool


def plugin_flag(flag: str) -> PluginSpec:
    """``--plugin TYPE:NAME[:JSON]``, or the parser's error naming what is wrong."""
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_router_flags(parser: Any, *, streaming: bool = False) -> None:
    """``--plugin`` (repeatable) and ``--streaming`` (default ``streaming``), added to
    ``parser`` (an argument parser, or one of its groups)."""
    parser.add_argument(
        "--plugin",
        dest="plugins",
        type=plugin_flag,
        action="append",
        metavar="TYPE:NAME[:JSON]",
        help="add a plugin to the chains, in order (repeatable): a built-in type "
        "(body-field-to-header, base-model-to-header) or package.module.Class, an instance name, "
        "and its parameters as a JSON object. Default: the model extractor, "
        'body-field-to-header:model-extractor:{"fieldName":"model",'
        '"headerName":"X-Gateway-Model-Name"}',
    )
    add_bool(
        parser,
        "--streaming",
        streaming,
        "expect FULL_DUPLEX_STREAMED bodies when Envoy does not say (no protocol_config, "
        f"Envoy before 1.34); otherwise BUFFERED is assumed (default {str(streaming).lower()})",
    )


def router_of(
    args: argparse.Namespace, registry: CollectorRegistry, max_body_bytes: int
) -> tuple[BodyBasedRouter, list[str]]:
    """The router the flags describe, its metrics in ``registry``, its plugins fed (their
    sources in its ``background``), and the warnings to give at start. Raises ``ConfigError``."""
    router = BodyBasedRouter(
        registry,
        args.plugins or DEFAULT_PLUGINS,
        streaming=args.streaming,
        max_body_bytes=max_body_bytes,
    )
    warnings = []
    for plugin in router.plugins:
        if isinstance(plugin, BaseModelToHeader):
            job, warning = feed(plugin, KubeAccess(args.kubeconfig))
            router.background.extend([job] if job is not None else [])
            warnings.extend([warning] if warning is not None else [])
    return router, warnings
