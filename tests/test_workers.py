"""``--workers N``: N processes serve one ext_proc port, and they stop together."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.streams import drive

PODS = """
pods:
- {name: a-0, address: 10.0.0.1, ports: [8000], labels: {pool: a}}
- {name: a-1, address: 10.0.0.2, ports: [8000], labels: {pool: a}}
"""

PREFIX_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
"""


def _start(module: str, *args: str, workers: int = 2) -> tuple[subprocess.Popen[str], list[Any]]:
    """The supervisor, and each worker's ``listening`` line once all are up."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", module, *args, "--workers", str(workers)),
            *("--grpc-port=0", "--grpc-health-port=0", "--metrics-port=0", "--grace=2"),
            "--secure-serving=false",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    listening: list[Any] = []
    for line in process.stderr:
        event = orjson.loads(line)
        if event["event"] == "serving metrics":
            listening.append(event)  # the supervisor's, first
        if event["event"] == "listening":
            listening.append(event)
            if len(listening) == workers + 1:
                return process, listening
    raise AssertionError(f"{module} exited with {process.wait()} before {workers} workers listened")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Supervisors a test started; any still running at the end is killed."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def _counter(port: int, name: str) -> float:
    """The sum of every series of ``name`` on a metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    series = [line for line in lines if line.split("{")[0].split(" ")[0] == name]
    return sum(float(line.rsplit(" ", 1)[1]) for line in series)


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def _wait_gone(pids: list[int], limit: float = 15.0) -> bool:
    """Whether every pid has exited, polling for at most ``limit`` seconds (a bound, not a timing)."""
    deadline = time.monotonic() + limit
    while not all(_gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(
    ("module", "args", "counter", "info"),
    [
        ("lwepp", ["--pods", "{pods}"], "llm_d_epp_request_total", "llm_d_epp_info"),
        ("bbr", [], "bbr_requests_total", "bbr_info"),
    ],
    ids=["lwepp", "bbr"],
)
def test_every_worker_serves_the_shared_port_and_all_stop_on_sigterm(
    tmp_path: Path,
    started: list[subprocess.Popen[str]],
    module: str,
    args: list[str],
    counter: str,
    info: str,
) -> None:
    """Two workers share one ext_proc port; streams over many connections reach both (each
    counts its own); the supervisor's one metrics port serves their sum; SIGTERM stops all."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(PODS)
    process, [supervisor, *listening] = _start(module, *(a.format(pods=pods) for a in args))
    started.append(process)
    assert len({w["grpc_port"] for w in listening}) == 1
    assert len({w["health_port"] for w in listening}) == 1
    assert sorted(w["worker"] for w in listening) == ["0/2", "1/2"]
    pids = [int(w["pid"]) for w in listening]
    assert process.pid not in pids
    assert int(supervisor["pid"]) == process.pid
    # 32 connections: Linux spreads connections over the workers by hash; all 32 on one
    # worker has a chance of 2 in 2**32.
    asyncio.run(drive(listening[0]["grpc_port"], 64, concurrency=32, connections=32))
    served = [_counter(w["metrics_port"], counter) for w in listening]
    assert all(n > 0 for n in served), served
    assert sum(served) == 64
    assert _counter(supervisor["metrics_port"], counter) == 64  # one page, every worker's
    assert _counter(supervisor["metrics_port"], info) == 1  # a gauge: the live workers' max
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert all(_gone(pid) for pid in pids)


def test_killed_supervisor_takes_its_workers_down(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """A supervisor killed outright (SIGKILL) cannot pass the signal on: the kernel
    sends its workers SIGTERM instead (PR_SET_PDEATHSIG), so none keeps the port."""
    process, [_, *listening] = _start("bbr")
    started.append(process)
    process.kill()
    process.wait()
    assert _wait_gone([int(w["pid"]) for w in listening])


def test_a_worker_that_dies_stops_the_others(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """Should one worker exit, the supervisor stops the rest and exits 1: a replica on
    fewer cores than asked is restarted whole rather than left limping."""
    process, [_, *listening] = _start("bbr")
    started.append(process)
    os.kill(int(listening[0]["pid"]), signal.SIGKILL)
    assert process.wait(timeout=20) == 1
    assert all(_gone(int(w["pid"])) for w in listening)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--config", "{dir}/prefix.yaml"], "approx-prefix-cache-producer learn from the requests"),
        (["--trace-messages", "{dir}/trace"], "trace one process"),
        (["--workers", "0"], "at least 1"),
    ],
    ids=["learning-plugin", "trace", "zero"],
)
def test_lwepp_refuses_workers_where_each_would_see_only_its_share(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    """A picker config whose plugins learn from served requests (the prefix index) would
    learn 1/N of the traffic per worker: ``--workers`` above 1 is refused, naming them."""
    (tmp_path / "pods.yaml").write_text(PODS)
    (tmp_path / "prefix.yaml").write_text(PREFIX_CONFIG)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "lwepp", "--pods", str(tmp_path / "pods.yaml")),
            *("--workers", "2", *(a.format(dir=tmp_path) for a in extra)),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert message in result.stderr
