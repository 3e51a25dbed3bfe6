"""Each request's own series (``lwepp.request_metrics``), observed over real gRPC with a hand-driven
clock: what the router records, at each of the three levels."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry

from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RequestInfo, RoundRobin
from lwepp.request_metrics import RequestMetrics, RequestSeries, Timed, install, no_objective
from lwepp.server import EndpointPickerService
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    response_body,
    response_headers,
    running,
)
from tests.fakes import StaticPods, pod
from wire.extproc import BodyMode, ProcessingRequest

STREAMED = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
BODY = b'{"model":"m","prompt":"hi","stream":true}'
HEADERS = {":method": "POST", ":path": "/v1/completions", "x-gateway-model-name": "m"}
LABELS = {
    "model_name": "m",
    "target_model_name": "m",
    "fairness_id": "default-flow",
    "priority": "0",
}
SSE = {":status": "200", "content-type": "text/event-stream"}
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def token(text: str) -> bytes:
    return b'data: {"choices":[{"text":"' + text.encode() + b'"}]}\n\n'


STREAM_TIMES = (10.0, 10.25, 10.30, 10.40, 10.40)
"""When a three-token stream is admitted, its three chunks arrive, and it ends."""


def stream() -> list[ProcessingRequest]:
    """A three-token stream with its usage, in three chunks."""
    return [
        response_headers(SSE),
        response_body(token("a"), end_of_stream=False),
        response_body(token("b") + token("c"), end_of_stream=False),
        response_body(USAGE + DONE),
    ]


class Ticks:
    """A clock that reads the given times, one per call."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def drive(
    clock: Ticks,
    messages: Sequence[ProcessingRequest],
    headers: dict[str, str] | None = None,
    objective_of: Callable[[RequestInfo], str] = no_objective,
) -> CollectorRegistry:
    """One request through a picker whose only control is ``RequestMetrics``, over real gRPC."""
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry)
    series = RequestSeries(registry)
    control = RequestMetrics(series, metrics.labels, objective_of=objective_of, clock=clock)
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    picker = EndpointPickerService(pool, RoundRobin(), metrics, controls=[control])

    async def go() -> None:
        async with (
            running("lwepp", picker) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            opening = [request_headers(headers or HEADERS, body_modes=STREAMED), request_body(BODY)]
            await client.exchange([*opening, *messages])

    asyncio.run(go())
    gc.collect()
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, {**LABELS, **labels})
    assert found is not None, f"{name} {labels}"
    return found


def test_a_stream_is_timed_from_admission_to_its_first_chunk_and_end() -> None:
    """Duration, TTFT (streaming), inter-chunk latency, TPOT and NTPOT as the router defines
    them; tokens from the stream's usage; the bytes the client gets; nothing left running."""
    registry = drive(
        Ticks(*STREAM_TIMES),
        stream(),
    )
    assert value(registry, "llm_d_epp_request_duration_seconds_sum") == pytest.approx(0.40)
    ttft = value(registry, "llm_d_epp_request_ttft_seconds_sum", streaming="true")
    assert ttft == pytest.approx(0.25)
    assert value(registry, "llm_d_epp_request_streaming_itl_seconds_count") == 2
    assert value(registry, "llm_d_epp_request_streaming_itl_seconds_sum") == pytest.approx(0.15)
    tpot = value(registry, "llm_d_epp_request_streaming_tpot_seconds_sum")
    assert tpot == pytest.approx((0.40 - 0.25) / 2)
    assert value(registry, "llm_d_epp_request_ntpot_seconds_sum") == pytest.approx(0.40 / 3)
    assert value(registry, "llm_d_epp_request_output_tokens_sum") == 3
    assert value(registry, "llm_d_epp_request_input_tokens_sum") == 7
    size = len(token("a") + token("b") + token("c") + USAGE + DONE)
    assert value(registry, "llm_d_epp_response_size_bytes_sum") == size
    assert value(registry, "llm_d_epp_request_running") == 0
    assert value(registry, "llm_d_epp_request_ttft_seconds_bucket", streaming="true", le="0.4") == 1
    assert value(registry, "llm_d_epp_request_ttft_seconds_bucket", streaming="true", le="0.2") == 0


def test_a_json_answer_s_first_token_is_its_end_and_it_has_no_inter_token_latency() -> None:
    """A whole JSON answer: TTFT equals the duration (streaming="false"), no ITL or TPOT."""
    answer = b'{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":5,"completion_tokens":2}}'
    registry = drive(
        Ticks(1.0, 1.5, 1.7, 1.8),
        [
            response_headers({":status": "200", "content-type": "application/json"}),
            response_body(answer[:10], end_of_stream=False),
            response_body(answer[10:]),
        ],
    )
    ttft = value(registry, "llm_d_epp_request_ttft_seconds_sum", streaming="false")
    assert ttft == pytest.approx(0.8)
    assert value(registry, "llm_d_epp_request_duration_seconds_sum") == pytest.approx(0.8)
    assert value(registry, "llm_d_epp_request_output_tokens_sum") == 2
    assert not registry.get_sample_value("llm_d_epp_request_streaming_itl_seconds_count", LABELS)
    assert not registry.get_sample_value("llm_d_epp_request_streaming_tpot_seconds_count", LABELS)


def test_a_stream_without_usage_has_its_output_tokens_counted_as_its_events() -> None:
    """No usage event (the client did not ask for one): each ``data:`` event but ``[DONE]``
    is one output token; no input token count is made up."""
    registry = drive(
        Ticks(0.0, 0.1, 0.2, 0.3),
        [
            response_headers(SSE),
            response_body(token("a") + token("b"), end_of_stream=False),
            response_body(token("c") + token("d") + DONE),
        ],
    )
    assert value(registry, "llm_d_epp_request_output_tokens_sum") == 4
    assert not registry.get_sample_value("llm_d_epp_request_input_tokens_count", LABELS)


def test_latency_objectives_are_counted_met_or_missed_per_objective_and_model() -> None:
    """A TTFT objective of 200 ms missed by a 250 ms first token, a TPOT objective of 100 ms
    met by 75 ms per token (old header names work too); ``objective`` is present, empty."""
    registry = drive(
        Ticks(*STREAM_TIMES),
        stream(),
        headers={**HEADERS, "x-llm-d-slo-ttft-ms": "200", "x-slo-tpot-ms": "100"},
    )
    slo = {"model_name": "m", "target_model_name": "m", "objective": ""}
    assert registry.get_sample_value(
        "llm_d_epp_request_slo_total", {**slo, "slo": "ttft", "outcome": "missed"}
    )
    assert registry.get_sample_value(
        "llm_d_epp_request_slo_total", {**slo, "slo": "tpot", "outcome": "met"}
    )
    counted = [
        s
        for family in registry.collect()
        for s in family.samples
        if s.name == "llm_d_epp_request_slo_total"
    ]
    assert len(counted) == 2


def test_the_objective_label_names_what_the_picker_resolves() -> None:
    """Where the picker resolves the request's InferenceObjective, its name is the label."""
    registry = drive(
        Ticks(*STREAM_TIMES),
        stream(),
        headers={**HEADERS, "x-llm-d-slo-ttft-ms": "300"},
        objective_of=lambda request: "gold",
    )
    labels = {"model_name": "m", "target_model_name": "m", "objective": "gold", "slo": "ttft"}
    assert registry.get_sample_value("llm_d_epp_request_slo_total", {**labels, "outcome": "met"})


def test_an_objective_that_is_no_positive_number_is_ignored() -> None:
    """As the router, a header that does not read as milliseconds counts nothing."""
    registry = drive(
        Ticks(0.0, 0.1, 0.2, 0.2),
        [
            response_headers(SSE),
            response_body(token("a"), end_of_stream=False),
            response_body(DONE),
        ],
        headers={**HEADERS, "x-llm-d-slo-ttft-ms": "soon", "x-llm-d-slo-tpot-ms": "-5"},
    )
    names = {s.name for family in registry.collect() for s in family.samples}
    assert "llm_d_epp_request_slo_total" not in names


def test_a_response_that_breaks_off_is_running_no_more_and_is_not_observed() -> None:
    """The stream ends before the response does: the running count is taken back when the
    stream lets go of the request, and no duration is made up."""
    registry = drive(
        Ticks(0.0, 0.1),
        [response_headers(SSE), response_body(token("a"), end_of_stream=False)],
    )
    assert value(registry, "llm_d_epp_request_running") == 0
    assert not registry.get_sample_value("llm_d_epp_request_duration_seconds_count", LABELS)


def test_the_wrapped_strategy_is_timed_and_the_body_it_chose_for_measured() -> None:
    """``Timed`` observes each choice's time, and the held body's size (else the request's
    content-length); the choice is the wrapped strategy's."""
    registry = CollectorRegistry()
    series = RequestSeries(registry)
    timed = Timed(RoundRobin(), series, PickerMetrics(registry).labels, Ticks(1.0, 1.003, 2, 2))
    candidates = [pod("p0", "10.0.0.1", 3000), pod("p1", "10.0.0.2", 3000)]
    endpoints = [e for p in candidates for e in Pool(StaticPods(p), {}).endpoints]
    headers = tuple(HEADERS.items())
    assert timed.choose(RequestInfo(headers, BODY), endpoints).endpoints == (endpoints[1],)
    timed.choose(RequestInfo((*headers, ("content-length", "300"))), endpoints)
    assert registry.get_sample_value("llm_d_epp_scheduler_e2e_duration_seconds_count") == 2
    scheduled = registry.get_sample_value("llm_d_epp_scheduler_e2e_duration_seconds_sum")
    assert scheduled == pytest.approx(0.003)
    assert value(registry, "llm_d_epp_request_size_bytes_sum") == len(BODY) + 300


@pytest.mark.parametrize(
    ("level", "hears", "reads", "series"),
    [("off", False, False, False), ("request", False, False, True), ("response", True, True, True)],
    ids=["off", "request", "response"],
)
def test_each_level_says_what_the_gateway_must_send(
    level: str, hears: bool, reads: bool, series: bool
) -> None:
    """``off`` leaves round-robin as it is; ``request`` adds no exchange; ``response`` asks
    for the response headers and body."""
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry)
    round_robin = RoundRobin()
    strategy, controls = install(level, round_robin, metrics.labels, registry)  # type: ignore[arg-type]
    assert (strategy is round_robin) == (level == "off")
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    picker = EndpointPickerService(pool, strategy, metrics, controls=controls)
    assert (picker.hears_response, picker.reads_response_body) == (hears, reads)
    names = {family.name for family in registry.collect()}
    assert ("llm_d_epp_scheduler_e2e_duration_seconds" in names) == series
