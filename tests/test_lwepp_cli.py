"""``python -m lwepp`` as an operator runs it: flags, a bad pod file, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from serving.testing import ExtProcClient, request_body, request_headers
from tests.processes import service, start_events

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
        # The serving flags are BBR's, with the same checks (serving.cli).
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
    trace = tmp_path / "trace.txt"

    async def logged(process: subprocess.Popen[str], event: str) -> None:
        """Wait until the service logs ``event`` (its stderr is one JSON object a line)."""
        assert process.stderr is not None
        while True:
            line = await asyncio.to_thread(process.stderr.readline)
            assert line, f"the service exited before logging {event!r}"
            if json.loads(line)["event"] == event:
                return

    async def received(phase: str) -> None:
        """Wait until the service has read ``phase`` on stream 1 (--trace-messages writes it):
        a poll with a deadline, the file being the only sign another process gives of it."""
        deadline = time.monotonic() + 10
        while not (trace.exists() and f"## stream 1 <- {phase}\n" in trace.read_text()):
            assert time.monotonic() < deadline, f"the service never read {phase}"
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with ExtProcClient(f"127.0.0.1:{ports['grpc_port']}") as client:
            stream = client.open()
            await stream.send(request_headers({":method": "POST", ":path": "/v1/completions"}))
            await received("request_headers")  # the stream is in flight on the server
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(logged(process, "stopping"), 10)  # shutdown has begun
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
    args = ("--pods", pods, "--selector", "pool=b", "--trace-messages", str(trace))
    with service("lwepp", *args) as (process, ports):
        asyncio.run(scenario())
        assert process.wait(timeout=10) == 0


def test_a_selector_no_pod_matches_is_warned_about_at_start(tmp_path: Path) -> None:
    """A --selector that matches none of the file's pods (a typo) is a warning naming the file and
    the selector before the service listens; it still starts (the file may gain such pods)."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(PODS)
    events = start_events("lwepp", "--pods", str(pods), "--selector", "pool=zzz")
    warned = [e for e in events if e["event"] == "no pod matches the selector"]
    assert len(warned) == 1
    assert warned[0]["level"] == "warning"
    assert (warned[0]["pods"], warned[0]["selector"]) == (str(pods), "pool=zzz")
    assert events[-1]["event"] == "listening"
