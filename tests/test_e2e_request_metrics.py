"""Each request's series, through the real Envoy, against what the client measured.

Pool ``a``'s picker runs ``--request-metrics=response``, so the demo's Envoy
streams the response body through it; a streamed and a buffered completion go
through BBR, the picker and a simulated vLLM replica one after the other, and
the picker's ``/metrics`` is read before and after each. Every time series
observed once must fall in the bucket of what the client measured, give or take
the gateway's own share (``SLACK``: BBR and Envoy before the picker sees the
request whole, Envoy after it has passed the last chunk); counts and sizes must
be exact.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from demo.topology import Topology
from tests.conftest import write_pod_file

pytestmark = pytest.mark.e2e

SLACK = 0.1
"""Seconds the client's measurement may exceed the picker's: the gateway's part, on a busy
machine (measured: a few ms)."""
LABELS = {
    "model_name": "model-a",
    "target_model_name": "model-a",
    "fairness_id": "default-flow",
    "priority": "0",
}
Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work_dir = tmp_path_factory.mktemp("request-metrics")
    pods = write_pod_file(work_dir / "pods.yaml")
    picker_args = {"a": ["--request-metrics=response"]}
    with Topology(work_dir, pods, picker_args=picker_args, demo_flags=False) as topology:
        yield topology


def scrape(gateway: Topology) -> Scrape:
    port = gateway.services["lwepp-a"].listening["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@dataclass
class Measured:
    """What the client saw of one completion."""

    sent: int
    duration: float = 0.0
    first: float = 0.0
    chunks: list[float] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)

    def usage(self, stream: bool) -> dict[str, int]:
        if not stream:
            usage: dict[str, int] = json.loads(self.received)["usage"]
            return usage
        events = [line[6:] for line in self.received.decode().splitlines() if line[:6] == "data: "]
        return next(json.loads(e)["usage"] for e in events if e != "[DONE]" and '"usage"' in e)


async def complete(gateway: Topology, stream: bool, headers: dict[str, str]) -> Measured:
    body = {"model": "model-a", "prompt": "Count slowly to twenty.", "max_tokens": 24}
    body["stream"] = stream
    data = json.dumps(body).encode()
    measured = Measured(len(data))
    async with aiohttp.ClientSession() as http:
        started = time.perf_counter()
        async with http.post(
            f"{gateway.url}/v1/completions",
            data=data,
            headers={"content-type": "application/json", **headers},
        ) as answer:
            assert answer.status == 200
            async for chunk in answer.content.iter_any():
                measured.chunks.append(time.perf_counter() - started)
                measured.received += chunk
        measured.duration = time.perf_counter() - started
    measured.first = measured.chunks[0]
    return measured


def observed(before: Scrape, after: Scrape, name: str, **extra: str) -> tuple[float, float]:
    """The count and sum ``name`` gained between two scrapes (its pool-a labels and ``extra``)."""
    labels = frozenset({**LABELS, **extra}.items())

    def gained(suffix: str) -> float:
        key = (f"{name}_{suffix}", labels)
        return after.get(key, 0.0) - before.get(key, 0.0)

    return gained("count"), gained("sum")


def bucket(before: Scrape, after: Scrape, name: str, **extra: str) -> tuple[float, float]:
    """The bounds ``(lo, hi]`` of the one bucket ``name`` observed into between two scrapes."""
    edges = sorted(
        (float(dict(labels)["le"]), value - before.get((sample, labels), 0.0))
        for (sample, labels), value in after.items()
        if sample == f"{name}_bucket"
        and {**LABELS, **extra}.items() <= dict(labels).items()
        and value - before.get((sample, labels), 0.0) > 0
    )
    hi = edges[0][0]
    lower = [
        float(dict(labels)["le"])
        for (sample, labels) in after
        if sample == f"{name}_bucket"
        and {**LABELS, **extra}.items() <= dict(labels).items()
        and float(dict(labels)["le"]) < hi
    ]
    return max(lower, default=0.0), hi


def check_time(
    before: Scrape, after: Scrape, name: str, client: float, **extra: str
) -> tuple[float, float, float]:
    """One observation of ``name``: the picker's value, in its bucket, and the client's value
    in that bucket too, or above the picker's by no more than the gateway's share."""
    count, value = observed(before, after, name, **extra)
    assert count == 1, name
    lo, hi = bucket(before, after, name, **extra)
    assert lo < value <= hi, name
    assert lo - SLACK < client <= hi + SLACK, f"{name}: client {client} outside ({lo}, {hi}]"
    assert -0.005 <= client - value <= SLACK, f"{name}: client {client}, picker {value}"
    print(f"{name}{extra}: picker {value:.4f} s, client {client:.4f} s, bucket ({lo}, {hi}]")
    return value, lo, hi


def test_a_stream_s_series_match_what_the_client_measured(gateway: Topology) -> None:
    """Duration, TTFT, TPOT, ITL, tokens, sizes and a met TTFT objective, for a stream."""
    before = scrape(gateway)
    measured = asyncio.run(complete(gateway, True, {"x-llm-d-slo-ttft-ms": "60000"}))
    after = scrape(gateway)
    usage = measured.usage(stream=True)
    check_time(before, after, "llm_d_epp_request_duration_seconds", measured.duration)
    check_time(before, after, "llm_d_epp_request_ttft_seconds", measured.first, streaming="true")
    tokens = usage["completion_tokens"]
    tpot = (measured.duration - measured.first) / (tokens - 1)
    _, value = observed(before, after, "llm_d_epp_request_streaming_tpot_seconds")
    assert abs(tpot - value) <= SLACK / (tokens - 1)
    itl_count, itl_sum = observed(before, after, "llm_d_epp_request_streaming_itl_seconds")
    assert itl_count >= len(measured.chunks) - 1  # Envoy may join chunks on their way out
    assert abs(itl_sum - (measured.chunks[-1] - measured.first)) <= SLACK
    assert observed(before, after, "llm_d_epp_request_output_tokens") == (1, tokens)
    assert observed(before, after, "llm_d_epp_request_input_tokens") == (1, usage["prompt_tokens"])
    assert observed(before, after, "llm_d_epp_response_size_bytes") == (1, len(measured.received))
    assert observed(before, after, "llm_d_epp_request_size_bytes") == (1, measured.sent)
    assert after[("llm_d_epp_request_running", frozenset(LABELS.items()))] == 0
    met = {"model_name": "model-a", "target_model_name": "model-a", "objective": ""}
    key = (
        "llm_d_epp_request_slo_total",
        frozenset({**met, "slo": "ttft", "outcome": "met"}.items()),
    )
    assert after[key] - before.get(key, 0.0) == 1


def test_a_buffered_answer_s_series_match_what_the_client_measured(gateway: Topology) -> None:
    """A JSON answer: its TTFT is its duration (the router's rule); a 1 ms TTFT objective is
    missed; the choice was timed once."""
    before = scrape(gateway)
    measured = asyncio.run(complete(gateway, False, {"x-llm-d-slo-ttft-ms": "1"}))
    after = scrape(gateway)
    usage = measured.usage(stream=False)
    check_time(before, after, "llm_d_epp_request_duration_seconds", measured.duration)
    check_time(
        before, after, "llm_d_epp_request_ttft_seconds", measured.duration, streaming="false"
    )
    tokens = usage["completion_tokens"]
    assert observed(before, after, "llm_d_epp_request_output_tokens") == (1, tokens)
    assert observed(before, after, "llm_d_epp_response_size_bytes") == (1, len(measured.received))
    assert observed(before, after, "llm_d_epp_request_streaming_itl_seconds")[0] == 0
    scheduled: tuple[str, frozenset[tuple[str, str]]] = (
        "llm_d_epp_scheduler_e2e_duration_seconds_count",
        frozenset(),
    )
    assert after[scheduled] - before[scheduled] == 1
    missed = {"model_name": "model-a", "target_model_name": "model-a", "objective": ""}
    key = (
        "llm_d_epp_request_slo_total",
        frozenset({**missed, "slo": "ttft", "outcome": "missed"}.items()),
    )
    assert after[key] - before.get(key, 0.0) == 1
