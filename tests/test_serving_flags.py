"""The serving flags the originals take and Switchyard implements: health on the ext_proc port,
gRPC message limits, a configuration given as text, logging levels, Go's value spellings."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lwepp.__main__ import build_parser
from lwepp.assembly import PickerOptions
from serving.cli import byte_size, duration, go_bool, log_level
from serving.testing import ExtProcClient, request_body, request_headers
from tests.processes import service

PODS = "pods:\n- {name: a, address: 10.0.0.1, ports: [8000]}\n"


def test_health_checking_answers_health_on_the_ext_proc_port_too(tmp_path: Path) -> None:
    """GIE's ``--health-checking``: the health service is also on the ext_proc port."""
    (tmp_path / "pods.yaml").write_text(PODS)

    async def check(port: int) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return int(answer.status)

    args = ("--pods", str(tmp_path / "pods.yaml"))
    with service("lwepp", *args, "--health-checking") as (_, ports):
        assert asyncio.run(check(ports["grpc_port"])) in (1, 2)  # SERVING or NOT_SERVING
    with service("lwepp", *args) as (_, ports), pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(check(ports["grpc_port"]))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_grpc_max_recv_msg_size_refuses_a_larger_message() -> None:
    """``--grpc-max-recv-msg-size=1KiB``: a 2 KB body chunk is refused by gRPC itself."""

    async def send(port: int) -> None:
        async with ExtProcClient(f"127.0.0.1:{port}") as client:
            await client.exchange([request_headers({}), request_body(b"x" * 2048)])

    with service("bbr", "--grpc-max-recv-msg-size=1KiB") as (_, ports):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(send(ports["grpc_port"]))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_config_text_is_the_configuration_itself() -> None:
    """--config-text is read as the picker configuration itself; its source is named --config-text."""
    text = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n- type: random-picker\n"
    args = build_parser().parse_args(["--pods", "p.yaml", "--config-text", text])
    config = PickerOptions.from_args(args).load_config()
    assert config is not None
    assert config.path == "--config-text"
    assert type(config.pipeline().picker).__name__ == "RandomPicker"


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        ([], "info"),
        (["--v=3"], "info"),
        (["-v", "4"], "debug"),
        (["--zap-log-level=debug"], "debug"),
        (["--zap-log-level=5"], "debug"),
        (["--zap-log-level=error"], "error"),
        (["--v=5", "--log-level=warning"], "warning"),
    ],
)
def test_the_originals_verbosity_sets_the_log_level(flags: list[str], level: str) -> None:
    """The originals' -v and --zap-log-level set the log level; --log-level wins over them."""
    assert log_level(build_parser().parse_args(["--pods", "p.yaml", *flags])) == level


def test_go_spellings_of_booleans_durations_and_sizes() -> None:
    """Go's spellings of booleans, durations and byte sizes parse as Go does; anything else is refused."""
    assert [go_bool(t) for t in ("true", "T", "1", "false", "F", "0")] == [True] * 3 + [False] * 3
    assert [duration(t) for t in ("30s", "1m30s", "250ms", "1.5h", "7")] == [30, 90, 0.25, 5400, 7]
    assert [byte_size(t) for t in ("10MiB", "25MB", "4194304", "1Ki")] == [
        10 * 2**20, 25 * 10**6, 4194304, 1024,
    ]  # fmt: skip
    with pytest.raises(argparse.ArgumentTypeError):
        go_bool("yes")
    with pytest.raises(argparse.ArgumentTypeError):
        duration("30x")
    with pytest.raises(argparse.ArgumentTypeError):
        duration("-1s")
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size("10 apples")
