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

import structlog
from prometheus_client import CollectorRegistry

from bbr import config as router_config
from bbr.base_models import KubeAccess, feed
from bbr.plugins import DEFAULT_PLUGINS, BaseModelToHeader, PluginSpec
from bbr.server import BodyBasedRouter
from plugin_api import ConfigError
from serving.cli import add_bool

log = structlog.get_logger()


def plugin_flag(flag: str) -> PluginSpec:
    """``--plugin TYPE:NAME[:JSON]``, or the parser's error naming what is wrong."""
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_router_flags(parser: Any, *, streaming: bool = False, config: bool = False) -> None:
    """``--plugin`` (repeatable) and ``--streaming`` (default ``streaming``), added to
    ``parser`` (an argument parser, or one of its groups); with ``config``, the payload
    processor's ``--config-file`` and ``--config-text`` (``python -m bbr``: the one hop's
    ``--config`` is its pickers')."""
    if config:
        configs = parser.add_mutually_exclusive_group()
        configs.add_argument(
            "--config-file",
            metavar="FILE",
            help="a PayloadProcessorConfig (the payload processor's YAML format): the plugins "
            "and the one profile that places them in the request and response chains, in lieu "
            "of --plugin (format: bbr/config.py)",
        )
        configs.add_argument(
            "--config-text", metavar="YAML", help="the PayloadProcessorConfig itself"
        )
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
    sources in its ``background``), and the warnings to give at start. Raises ``ConfigError``
    (``ConfigErrors`` listing every problem of a configuration, at its lines)."""
    path, text = getattr(args, "config_file", None), getattr(args, "config_text", None)
    if (path is not None or text is not None) and args.plugins:
        raise ConfigError("--plugin and a configuration (--config-file, --config-text): give one")
    config = None
    if path is not None:
        config = router_config.load_config(path)
    elif text is not None:
        config = router_config.load_text(text)
    router = BodyBasedRouter(
        registry,
        config.chains if config is not None else args.plugins or DEFAULT_PLUGINS,
        streaming=args.streaming,
        max_body_bytes=max_body_bytes,
    )
    warnings = list(config.warnings) if config is not None else []
    for plugin in router.plugins:
        if isinstance(plugin, BaseModelToHeader):
            job, warning = feed(plugin, KubeAccess(args.kubeconfig))
            router.background.extend([job] if job is not None else [])
            warnings.extend([warning] if warning is not None else [])
    return router, warnings
