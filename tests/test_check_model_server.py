"""``python -m lwepp.check_model_server``: engine samples, the simulator in each dialect, the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from demo.topology import free_ports
from lwepp.check_model_server import Report, check, check_metrics, render
from pods.model import Pod
from simulator import Settings, serve_pods
from simulator.metrics import ENGINES

SAMPLES = Path(__file__).parent / "data" / "metrics"


def finding(report: Report, signal: str) -> tuple[str, str]:
    (found,) = [f for f in report.findings if f.signal == signal]
    return found.status, found.value


@pytest.mark.parametrize(
    ("engine", "queue", "running", "kv", "block_size", "blocks"),
    [
        ("vllm", "1", "2", "0.3412", "16", "27264"),
        ("sglang", "0", "3", "0.18", "1", "418832"),
        ("trtllm", "2", "4", "0.61", "32", "8192"),
        ("triton", "1", "3", "0.0312", "64", "4584"),
        ("llamacpp", "1", "2", None, None, None),
    ],
)
def test_each_engines_metrics_sample_is_read_under_its_own_names(
    engine: str,
    queue: str,
    running: str,
    kv: str | None,
    block_size: str | None,
    blocks: str | None,
) -> None:
    """The engine is recognised from the names; each signal is read, or unknown (never 0)."""
    report = check_metrics((SAMPLES / f"{engine}.txt").read_text())
    assert report.engine == engine
    assert finding(report, "queue") == ("ok", queue)
    assert finding(report, "running") == ("ok", running)
    for signal, value in (("kv_usage", kv), ("block_size", block_size), ("block_count", blocks)):
        assert finding(report, signal) == (("ok", value) if value else ("unknown", ""))


def test_vllm_lora_state_comes_from_the_newest_series() -> None:
    """vllm:lora_requests_info's value is a timestamp: the newest series is the current state."""
    report = check_metrics((SAMPLES / "vllm.txt").read_text())
    assert finding(report, "lora") == (
        "ok",
        "max 4, running sql-lora,tweet-lora, waiting sql-lora",
    )


@pytest.mark.parametrize(
    ("text", "signal", "status"),
    [
        ("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n", "kv_usage", "missing"),
        (
            "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 34\n",
            "kv_usage",
            "invalid",
        ),
        (
            "vllm:num_requests_waiting -1\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n",
            "queue",
            "invalid",
        ),
    ],
    ids=["kv-missing", "kv-percent-not-fraction", "negative-queue"],
)
def test_missing_and_malformed_signals_are_called_out(text: str, signal: str, status: str) -> None:
    """A signal that is absent or out of range (a percentage for a fraction, a negative queue) is reported as missing or invalid."""
    assert finding(check_metrics(text), signal)[0] == status


def test_an_older_vllm_kv_name_is_hinted_at() -> None:
    """vLLM's older KV-cache metric name counts as missing, with a hint naming it."""
    report = check_metrics(
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:gpu_cache_usage_perc 0.1\n"
    )
    assert finding(report, "kv_usage")[0] == "missing"
    assert any("vllm:gpu_cache_usage_perc" in hint for hint in report.hints)


def test_unknown_names_say_what_was_seen() -> None:
    """A page of no known engine recognises none and names the metrics it did see."""
    report = check_metrics("my_engine_queue 3\n")
    assert report.engine is None
    assert "my_engine_queue" in (report.metrics_error or "")


# --- against the simulator, in each dialect -------------------------------------------------


@asynccontextmanager
async def simulator(engine: str, **labels: str) -> AsyncIterator[str]:
    pod = Pod("sim-0", "127.0.0.1", (0,), {"model": "m", **labels})
    async with serve_pods([pod], Settings(time_scale=0), dialect=engine) as (replica,):
        yield replica.url


def against_simulator(engine: str, probe: Callable[[str], Any], **labels: str) -> Any:
    """Run a blocking ``probe(url)`` in a thread while the simulator serves on this loop."""

    async def run() -> Any:
        async with simulator(engine, **labels) as url:
            return await asyncio.to_thread(probe, url)

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize("engine", ENGINES)
def test_simulator_in_each_dialect_gets_the_engines_verdict(engine: str) -> None:
    """Every dialect is recognised; llama.cpp's has no KV gauge, so it is only degraded."""
    report = against_simulator(engine, check, adapters="lora-a")
    assert report.engine == engine
    assert [api.ok for api in report.api] == [True, True]
    verdict, status, _ = report.verdict
    assert (verdict, status) == (("degraded", 1) if engine == "llamacpp" else ("ready", 0))
    expected_lora = "ok" if engine == "vllm" else "unknown"
    assert finding(report, "lora")[0] == expected_lora
    assert "Verdict: " in render(report)


def test_forcing_the_wrong_engine_finds_nothing_to_score_on() -> None:
    """--engine sglang against a vLLM server finds no queue signal: a degraded verdict, exit 1."""
    report = against_simulator("vllm", lambda url: check(url, engine="sglang"))
    assert report.engine == "sglang"
    assert finding(report, "queue")[0] == "missing"
    assert report.verdict[:2] == ("degraded", 1)


# --- the command line -------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lwepp.check_model_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("engine", "code", "verdict"),
    [("vllm", 0, "READY"), ("llamacpp", 1, "DEGRADED")],
)
def test_cli_prints_the_verdict_and_exits_with_its_status(
    engine: str, code: int, verdict: str
) -> None:
    """The CLI prints the engine it recognised and the verdict, and exits 0 ready, 1 degraded."""
    result = against_simulator(engine, cli)
    assert result.returncode == code, result.stdout + result.stderr
    assert f"Verdict: {verdict}" in result.stdout
    assert f"Engine: {engine} (recognised from /metrics)" in result.stdout


def test_cli_on_a_server_that_is_not_there_says_unusable() -> None:
    """Nothing listening at the URL: verdict unusable, exit 2."""
    (port,) = free_ports(1)
    result = cli(f"http://127.0.0.1:{port}", "--timeout", "2", "--json")
    assert result.returncode == 2
    assert '"verdict": "unusable"' in result.stdout


def test_cli_help_names_the_engines_and_the_exit_statuses() -> None:
    """--help names every engine, --engine and the exit statuses."""
    result = cli("--help")
    assert result.returncode == 0
    for word in ("vllm", "sglang", "trtllm", "triton", "llamacpp", "Exit 0", "--engine"):
        assert word in result.stdout


def test_the_checker_stays_off_the_request_path() -> None:
    """A leaf: starting LWEPP does not import it."""
    code = "import sys, lwepp.__main__; assert 'lwepp.check_model_server' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
