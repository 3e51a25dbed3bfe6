"""``python -m lwepp`` as an operator runs it: flags, a bad pod file, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from protos.testing import ExtProcClient, request_body, request_headers
from tests.processes import service

PODS = """
pods:
- {name: a-0, address: 127.0.0.1, ports: [18001], labels: {pool: a}}
- {name: b-0, address: 127.0.0.1, ports: [18002], labels: {pool: b}}
"""


def test_help_explains_the_flags() -> None:
    """``--help`` documents every flag an operator needs."""
    out = subprocess.run(
        [sys.executable, "-m", "lwepp", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--pods", "--selector", "--grpc-port", "--grpc-health-port", "--metrics-port"):
        assert flag in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pods", "{dir}/missing.yaml"], "missing.yaml: cannot read"),
        (["--pods", "{dir}/bad.yaml"], "pods[0].ports: required"),
        (["--pods", "{dir}/pods.yaml", "--selector", "pool in ()"], "in needs at least one"),
        # The serving flags are BBR's, with the same checks (protos.cli).
        (["--pods", "{dir}/pods.yaml", "--grpc-port", "70000"], "70000 is not a port"),
        (["--pods", "{dir}/pods.yaml", "--metrics-port", "9002"], "must differ"),
        (["--pods", "{dir}/pods.yaml", "--max-body-bytes", "0"], "must be at least 1"),
        (["--pods", "{dir}/pods.yaml", "--grace", "-1"], "must be 0 or more"),
    ],
    ids=["missing-file", "bad-file", "bad-selector", "bad-port", "same-ports", "zero-cap", "grace"],
)
def test_bad_configuration_is_refused_with_a_precise_message(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """A bad pod file or flag exits non-zero with a message naming the file, field or flag."""
    (tmp_path / "bad.yaml").write_text("pods: [{name: x, address: 127.0.0.1}]")
    (tmp_path / "pods.yaml").write_text(PODS)
    result = subprocess.run(
        [sys.executable, "-m", "lwepp", *(a.format(dir=tmp_path) for a in args)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_sigterm_lets_the_in_flight_request_finish(tmp_path: Path) -> None:
    """After SIGTERM a stream already open still gets its pick; then the process exits 0."""
    (tmp_path / "pods.yaml").write_text(PODS)

    async def scenario() -> None:
        async with ExtProcClient(f"127.0.0.1:{ports['grpc_port']}") as client:
            stream = client.open()
            await stream.send(request_headers({":method": "POST", ":path": "/v1/completions"}))
            await asyncio.sleep(0.2)  # the stream is open on the server before SIGTERM
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            await stream.send(request_body(b'{"model": "m"}'))
            reply = await stream.recv()
            assert reply is not None
            headers = reply.request_headers.response.header_mutation.set_headers
            assert headers[0].header.raw_value == b"127.0.0.1:18002"
            await stream.close()
            while await stream.recv() is not None:
                pass
            assert await stream.code() == grpc.StatusCode.OK

    pods = str(tmp_path / "pods.yaml")
    with service("lwepp", "--pods", pods, "--selector", "pool=b") as (process, ports):
        asyncio.run(scenario())
        assert process.wait(timeout=10) == 0
