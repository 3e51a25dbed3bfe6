"""latency-slo-admitter (lwepp.plugins.latency_slo) and the pipeline's admit stage."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from lwepp.config import load_text
from lwepp.contracts import Candidate, LLMRequest, Measurement
from lwepp.flowcontrol.policies import SloDeadlineOrdering
from lwepp.flowcontrol.queues import Item
from lwepp.pipeline import ADMISSION_DENIED, Pipeline
from lwepp.plugins.latency_slo import DENIED, LatencySloAdmitter
from lwepp.plugins.predicted_latency import LatencyScorer, PredictedLatencyProducer
from plugin_api import Params
from serving.testing import request_headers
from tests.test_pipeline_service import POST, run, service, serving
from tests.test_predicted_latency import BODY, POOL, Clock, plugins, serve
from wire.exchange import Refusal

SLO = {"x-llm-d-slo-ttft-ms": "50"}
"""Tighter than any endpoint is predicted (0.1, 0.25 and 0.6 s, and each holds a request)."""


def warm(kv: float | None = 0.5, held: Sequence[int] = (0, 1, 2), **params: object) -> tuple[
    Clock, object, PredictedLatencyProducer, LatencyScorer, LatencySloAdmitter, list[Candidate]
]:  # fmt: skip
    """Three endpoints learnt at 0.1, 0.25 and 0.6 s TTFT, a request in flight on each of
    ``held``, KV-cache use ``kv`` everywhere (None: never measured)."""
    clock, inflight, producer, scorer = plugins(**params)
    for _ in range(20):
        for index, ttft in enumerate((0.1, 0.25, 0.6)):
            serve(clock, inflight, producer, index, ttft)
    for index in held:
        holder = LLMRequest(f"held{index}", {}, parsed=BODY)
        inflight.prepare(holder)
        inflight.picked(holder, [POOL[index].endpoint])
    attributes = {} if kv is None else {"kv_cache_usage": Measurement(kv, 0.0)}
    pool = [Candidate(c.endpoint, attributes) for c in POOL]
    admitter = LatencySloAdmitter("latency-slo-admitter")
    admitter.producer = producer
    return clock, inflight, producer, scorer, admitter, pool


def admits(
    priority: int = -1,
    headers: dict[str, str] = SLO,
    kv: float | None = 0.5,
    held: Sequence[int] = (0, 1, 2),
    **params: object,
) -> bool:
    _, inflight, _, _, admitter, pool = warm(kv, held, **params)
    request = LLMRequest("q", headers, parsed=BODY)
    inflight.prepare(request)  # type: ignore[attr-defined]
    reason = admitter.admit_request(request, pool, 0.0, priority)
    assert reason in (None, DENIED)
    return reason is None


def test_a_sheddable_request_no_busy_warm_endpoint_can_serve_in_time_is_refused() -> None:
    """Priority below 0, a TTFT SLO every candidate is predicted to miss, each busy and warm:
    refused, with the router's reason."""
    assert not admits()


@pytest.mark.parametrize(
    "case",
    [
        {"priority": 0},
        {"headers": {}},
        {"headers": {"x-llm-d-slo-ttft-ms": "400"}},
        {"held": (0, 2)},
        {"kv": 0.01},
        {"kv": None},
        {"predictInProduce": False},
    ],
    ids=["not-sheddable", "no-slo", "one-meets-it", "one-idle", "one-cold", "unmeasured", "off"],
)
def test_any_of_the_router_s_conditions_admits(case: dict[str, object]) -> None:
    """Each condition alone lets the request on: priority 0 or more, no SLO asked, a candidate
    predicted to meet it, one with nothing in flight, one cold (KV use under 2%, or never
    measured), no prediction made."""
    assert admits(**case)  # type: ignore[arg-type]


def test_the_pipeline_answers_429_before_any_filter_and_counts_it() -> None:
    """An admitter's reason stops the pick before the filters: a 429 refusal naming it, one
    count in ``llm_d_epp_admission_refusals_total{plugin}``; a request it admits is picked,
    and the scorer reads the predictions the admitter had the producer make (the same
    objects: nothing is predicted twice)."""
    clock, inflight, producer, scorer, admitter, pool = warm()
    seen: list[str] = []

    class Spy:
        name = "spy"

        def filter(
            self, request: LLMRequest, candidates: Sequence[Candidate], now: float
        ) -> Sequence[Candidate]:
            seen.append(request.request_id)
            return candidates

    registry = CollectorRegistry()
    pipeline = Pipeline(
        [inflight, admitter, Spy(), scorer, producer], clock=clock, registry=registry
    )
    pipeline.priority = lambda headers: (
        -1 if ("x-llm-d-inference-objective", "batch") in headers else 0
    )
    for candidate in pool:  # warm: the KV-cache use the data source measured
        pipeline.store.write(candidate.endpoint.hostport, candidate.attributes)
    refused = LLMRequest("r1", {**SLO, "x-llm-d-inference-objective": "batch"}, parsed=BODY)
    with pytest.raises(Refusal) as caught:
        pipeline.decide(refused, [c.endpoint for c in pool])
    assert caught.value.status == 429
    assert caught.value.message == f"request cannot be admitted: {DENIED}"
    assert seen == []
    counted = registry.get_sample_value(
        "llm_d_epp_admission_refusals_total", {"plugin": "latency-slo-admitter"}
    )
    assert counted == 1.0
    admitted = LLMRequest("r2", dict(SLO), parsed=BODY)
    decision = pipeline.decide(admitted, [c.endpoint for c in pool])
    assert decision.endpoints
    assert seen == ["r2"]
    first = producer.predict(admitted, pool)
    assert all(a is b for a, b in zip(first, producer.predict(admitted, pool), strict=True))


def test_the_producer_name_parameter_is_the_router_s() -> None:
    """``latencyPredictionInfoProducerName`` names the producer it reads."""
    admitter = LatencySloAdmitter(
        "a", Params({"latencyPredictionInfoProducerName": "mine"}, "plugins[0].parameters")
    )
    [want] = admitter.wants
    assert (want.field, want.name) == ("latencyPredictionInfoProducerName", "mine")


FLOW = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: slo-deadline-ordering-policy
  parameters: {predictedLatencyProducerName: predicted-latency-producer}
flowControl:
  defaultPriorityBand: {orderingPolicyRef: slo-deadline-ordering-policy}
"""


def test_slack_ordering_puts_a_long_prompt_before_a_short_one_that_came_first() -> None:
    """With ``predictedLatencyProducerName`` the key is received + SLO - the request's own
    predicted TTFT: a 10,000-token prompt (about 1 s to prefill at the producer's prior)
    received 0.1 s after a 10-token one, both with a 2 s SLO, goes first; the router's key
    (the default) keeps the earlier one first. The producer is added, as the router would."""
    config = load_text(FLOW, "picker.yaml")
    settings = config.flow.settings
    assert settings is not None
    slack = settings.template.ordering
    assert isinstance(slack, SloDeadlineOrdering)
    assert isinstance(slack.predictor, PredictedLatencyProducer)
    assert any(isinstance(p, PredictedLatencyProducer) for p in config.running)
    short = Item("short", "f", 0, size=40, received=0.0, slo_ms=2000.0)
    long = Item("long", "f", 0, size=40_000, received=0.1, slo_ms=2000.0)
    assert sorted([short, long], key=slack.key) == [long, short]
    assert sorted([short, long], key=SloDeadlineOrdering("plain").key) == [short, long]


def test_an_admitter_s_refusal_reaches_the_client_as_a_429_with_its_reason() -> None:
    """Through the picker's ext_proc server: an ImmediateResponse 429 whose OpenAI-style body
    names the reason, in the stream's first reply."""

    class Refuses:
        name = "refuses"

        def admit_request(
            self, request: LLMRequest, candidates: Sequence[Candidate], now: float, priority: int
        ) -> str | None:
            return DENIED

    picker = service(Pipeline([Refuses()]))

    async def scenario() -> None:
        async with serving(picker) as (client, _):
            (reply,) = await client.exchange([request_headers(POST, end_of_stream=True)])
        answer = reply.immediate_response
        assert answer.status.code == 429
        error = json.loads(answer.body)["error"]
        assert error["message"] == f"request cannot be admitted: {DENIED}"
        assert error["code"] == ADMISSION_DENIED

    run(scenario)
