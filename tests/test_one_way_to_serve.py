"""One way to run a service: every serving flag is read once, into one ``ServingOptions``, and
all three command lines (``lwepp``, ``bbr``, ``onehop``) hand ``serve`` exactly what it made.

A serving flag added to ``add_serving_flags`` and read in ``serving_options`` therefore reaches
every service; one defined but never read fails the first test, and a command line that builds
its options another way fails the second.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import bbr.__main__
import lwepp.__main__
import onehop.__main__
from serving import cli
from serving.cli import Parser, add_serving_flags, serving_options
from serving.options import Ports, ServingOptions
from serving.server import Service
from tests.test_kubeconfig import kubeconfig

GROUPS = ("serving", "TLS", "logging")
"""The titles (their first word) of the argument groups ``add_serving_flags`` adds."""


def serving_dests() -> set[str]:
    parser = Parser()
    add_serving_flags(parser, Ports())
    return {
        action.dest
        for group in parser._action_groups
        if group.title and group.title.split()[0] in GROUPS
        for action in group._group_actions
    }


class Reads(argparse.Namespace):
    """A namespace that remembers which attributes were read."""

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        object.__setattr__(self, "read", set())

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name != "read":
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)


def test_every_serving_flag_is_read_into_the_options() -> None:
    """``serving_options`` reads every flag ``add_serving_flags`` defines (and there are some)."""
    dests = serving_dests()
    assert {"grpc_port", "metrics_endpoint_auth", "secure_serving", "zap_encoder"} <= dests
    parser = Parser()
    add_serving_flags(parser, Ports())
    parsed = parser.parse_args([])
    args = Reads(**vars(parsed))
    serving_options(args)
    assert dests - args.read == set()


def flags(tmp_path: Path) -> list[str]:
    """Every serving flag, each set away from its default."""
    config = kubeconfig(tmp_path, "https://127.0.0.1:1", "{token: t}")
    return [
        *("--host", "127.0.0.2", "--grpc-port", "1101", "--grpc-health-port", "1102"),
        *("--metrics-port", "1103", "--metrics-endpoint-auth", "--kubeconfig", str(config)),
        *("--enable-debug-pages", "--health-checking", "--drain-timeout", "2s", "--grace", "3"),
        *("--max-body-bytes", "4096", "--grpc-max-recv-msg-size", "5MiB"),
        *("--grpc-max-send-msg-size", "6MiB", "--trace-messages", str(tmp_path / "trace")),
        *("--secure-serving=false", "--zap-encoder", "console", "-v", "4"),
    ]


def served(
    monkeypatch: pytest.MonkeyPatch, main: Callable[[Sequence[str]], int | None], argv: list[str]
) -> tuple[Service, ServingOptions]:
    """What ``main(argv)`` hands ``serve``, without serving."""
    seen: list[tuple[Service, ServingOptions]] = []

    async def serve(service: Service, options: ServingOptions) -> None:
        seen.append((service, options))

    monkeypatch.setattr(cli, "serve", serve)
    assert main(argv) in (0, None)
    [(service, options)] = seen
    return service, options


def test_the_three_command_lines_serve_with_the_same_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lwepp``, ``bbr`` and ``onehop`` with the same serving flags give ``serve`` equal
    options, every field set as the flags say (metrics auth included: once, the one hop left
    its metrics port open)."""
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n- {name: a, address: 10.0.0.1, ports: [8000], labels: {pool: a}}\n")
    common = flags(tmp_path)
    results = {
        "lwepp": served(monkeypatch, lwepp.__main__.main, ["--pods", str(pods), *common]),
        "bbr": served(monkeypatch, bbr.__main__.main, common),
        "onehop": served(
            monkeypatch, onehop.__main__.main, ["--pods", str(pods), "--pool", "a=m", *common]
        ),
    }
    options = {name: opts for name, (_, opts) in results.items()}
    expected = ServingOptions(
        ports=Ports("127.0.0.2", 1101, 1102, 1103),
        grace=3.0,
        drain=2.0,
        max_body_bytes=4096,
        grpc_options=(
            ("grpc.max_receive_message_length", 5 * 2**20),
            ("grpc.max_send_message_length", 6 * 2**20),
        ),
        health_on_ext_proc=True,
        debug_pages=True,
        kubeconfig=str(tmp_path / "config"),
        trace_messages=str(tmp_path / "trace"),
        log_level="debug",
        log_encoder="console",
    )
    for name, got in options.items():
        assert got.metrics_auth is not None, name
        assert dataclasses.replace(got, metrics_auth=None) == expected, name
    for name, (service, _) in results.items():
        assert service.name == name
        assert service.debug_pages is not None
