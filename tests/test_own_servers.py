"""The gateway in front of servers it did not start (``python -m demo --no-simulator``).

The "own servers" here are simulator processes the test starts itself, on a
pod file of their own, exactly as a user's vLLM would be running before the
demo starts; the gateway's pod file also names a server that is not there.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from demo.servers import findings, probe
from demo.topology import HOST, Process, Topology, free_ports, listening_line, wait_for
from lwepp.check_model_server import ApiCheck, Report
from pods.file import dump_pods
from pods.model import Pod
from tests.test_e2e import Answer, post

pytestmark = pytest.mark.e2e

T = TypeVar("T")
LABELS = {"pool": "mine", "model": "my-model"}


def pod(name: str, port: int) -> Pod:
    return Pod(name, HOST, (port,), LABELS)


@contextlib.contextmanager
def servers(work_dir: Path, *pods: Pod) -> Iterator[Process]:
    """Simulated model servers on ``pods``' ports, running until the block ends."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / f"{pods[0].name}.yaml"
    path.write_text(dump_pods(pods))
    argv = [sys.executable, "-m", "simulator", "--pods", str(path), "--time-scale", "0.1"]
    service = Process(f"servers-{pods[0].name}", argv, work_dir / f"{pods[0].name}.log")
    try:
        wait_for(service, "listening", lambda: listening_line(service), 30)
        yield service
    finally:
        service.stop()


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``probe`` until it returns a value, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (result := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:.0f} s")
        time.sleep(0.1)
    return result


def ask(url: str) -> Answer:
    body = {"model": "my-model", "prompt": "hello there", "max_tokens": 2}
    return post(url, "/v1/completions", body)


def test_a_server_that_never_answered_is_reported_and_skipped_until_it_answers(
    tmp_path: Path,
) -> None:
    """No simulator starts; the start check names the missing server (unreachable) without
    refusing to start; requests go to the servers that answer; the missing one is picked as
    soon as it answers; with every server gone, the pool's picker answers 503 in JSON."""
    a, b, late = (pod(name, port) for name, port in zip("abc", free_ports(3), strict=True))
    (tmp_path / "mine.yaml").write_text(dump_pods([a, b, late]))
    changes: list[tuple[str, str | None]] = []
    with (
        servers(tmp_path / "servers", a, b) as running,
        Topology(
            tmp_path / "gateway",
            tmp_path / "mine.yaml",
            simulator=False,
            on_server_change=lambda pod, why: changes.append((pod.name, why)),
        ) as gateway,
    ):
        assert "simulator" not in gateway.services
        checks = {check.pod: check for check in gateway.checks}
        assert (checks["a"].reachable, checks["a"].problems) == (True, ())
        assert "engine vllm" in checks["a"].notes
        assert checks["c"].reachable is False
        (problem,) = checks["c"].problems
        assert problem.startswith("unreachable (")

        served = [ask(gateway.url).headers["x-sim-pod"] for _ in range(4)]
        assert sorted(served) == ["a", "a", "b", "b"]

        with servers(tmp_path / "late", late):

            def lands_on_late() -> bool | None:
                return True if ask(gateway.url).headers["x-sim-pod"] == "c" else None

            eventually("picked once it answers", lands_on_late)
            assert ("c", None) in changes

        running.stop()

        def refused() -> dict[str, Any] | None:
            answer = ask(gateway.url)
            if answer.status != 503 or answer.headers.get("content-type") != "application/json":
                return None
            error: dict[str, Any] = answer.json()["error"]
            return error if error["code"] == "no_endpoints" else None

        error = eventually("refused by the picker", refused)
        assert error["type"] == "server_error"


def test_the_command_reports_each_server_and_keeps_running(tmp_path: Path) -> None:
    """`python -m demo --no-simulator` prints, per server, ok or what fails, serves, and stops
    on SIGTERM with status 0."""
    live, dead = pod("live-0", free_ports(1)[0]), pod("gone-0", free_ports(1)[0])
    (tmp_path / "mine.yaml").write_text(dump_pods([live, dead]))
    with servers(tmp_path / "servers", live):
        argv = [
            *(
                sys.executable,
                "-m",
                "demo",
                "--no-simulator",
                "--pods",
                str(tmp_path / "mine.yaml"),
            ),
            *("--port", "0", "--admin-port", "0", "--work-dir", str(tmp_path / "run")),
        ]
        demo = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert demo.stdout is not None
        try:
            lines = []
            for line in demo.stdout:
                lines.append(line.rstrip())
                if line.startswith("Ctrl-C stops everything."):
                    break
            text = "\n".join(lines)
            assert "Your servers (checked at start" in text, text
            (ok,) = [line for line in lines if line.startswith("  live-0 ")]
            assert f"{HOST}:{live.ports[0]}" in ok
            assert " ok " in ok
            (bad,) = [line for line in lines if line.startswith("  gone-0 ")]
            assert "PROBLEM  unreachable (" in bad
            url = next(line.split()[1] for line in lines if line.startswith("Gateway: "))
            assert json.loads(ask(url).body)["object"] == "text_completion"
            demo.send_signal(signal.SIGTERM)
            assert demo.wait(30) == 0
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
            demo.stdout.close()


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        (None, "demo: --no-simulator needs --pods"),
        (
            "pods:\n- name: x\n  address: gpu-1.local\n  ports: [8000]\n",
            "mine.yaml:3: pods[0].address: expected an IP address, got 'gpu-1.local'",
        ),
    ],
    ids=["no-pod-file", "not-an-ip"],
)
def test_bad_input_is_refused_with_a_message(
    tmp_path: Path, pods: str | None, message: str
) -> None:
    """No pod file, or a pod file the decoder refuses: exit status 1, the reason on stderr."""
    argv = [sys.executable, "-m", "demo", "--no-simulator", "--work-dir", str(tmp_path)]
    if pods is not None:
        (tmp_path / "mine.yaml").write_text(pods)
        argv += ["--pods", str(tmp_path / "mine.yaml")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert message in result.stderr


@pytest.mark.parametrize(
    ("metrics_error", "problem"),
    [
        ("/metrics answered 404", "no /metrics (/metrics answered 404): a picker cannot weigh"),
        ("/metrics: URLError: timed out", "no /metrics (/metrics: URLError: timed out)"),
        ("no known engine's names (saw: tgi_queue_size)", "unknown engine: no known engine's"),
    ],
    ids=["no-metrics-page", "metrics-unreachable", "unknown-engine"],
)
def test_the_start_check_names_what_fails_of_a_server_that_answers(
    metrics_error: str, problem: str
) -> None:
    """A server whose API answers but whose /metrics is missing, or speaks no known engine's
    names, is reported with that problem (and the models it lists), not refused."""
    report = Report(
        "http://10.0.0.7:8000",
        metrics_error=metrics_error,
        api=[
            ApiCheck("GET /v1/models", True, "my-model"),
            ApiCheck("POST /v1/completions", True, "model my-model, 1 token, usage reported"),
        ],
    )
    problems, notes = findings(report)
    assert len(problems) == 1
    assert problems[0].startswith(problem)
    assert notes == ["lists my-model"]


@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        (200, b'{"object": "list", "data": [{"id": "my-model"}]}', None),
        (200, b'{"object": "list", "data": []}', None),
        (200, b"# HELP up 1\nup 1\n", "GET /v1/models answered 200 with no JSON model list"),
        (200, b"\xff\xfe", "GET /v1/models answered 200 with no JSON model list"),
        (200, b'{"models": []}', "not a model list (no 'data' list)"),
        (200, b"[]", "not a model list (no 'data' list)"),
        (503, b"loading", "GET /v1/models answered 503"),
    ],
    ids=["list", "empty-list", "metrics-page", "not-utf8", "no-data", "json-array", "loading"],
)
def test_the_readiness_probe_wants_a_model_list_not_just_a_200(
    status: int, body: bytes, verdict: str | None
) -> None:
    """A port is ready only when GET /v1/models answers 200 with OpenAI's list: a port
    that answers anything 200 (a metrics exporter a pod file points at by mistake) would
    otherwise draw every request and answer each with nothing."""

    class Fixed(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((HOST, 0), Fixed)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        found = probe(f"{HOST}:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    if verdict is None:
        assert found is None
    else:
        assert found is not None
        assert verdict in found
