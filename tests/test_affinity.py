"""prefix-cache-affinity-filter and the approximate producer it reads: the router's rules."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from lwepp.config import ConfigErrors, load_text
from lwepp.contracts import Candidate, LLMRequest
from lwepp.picking import RequestInfo
from lwepp.plugins.affinity import PrefixCacheAffinityFilter
from lwepp.plugins.approx_prefix import ApproxPrefixCacheProducer, match_key
from lwepp.plugins.inflight import InFlight, load_key
from lwepp.plugins.load_scorers import TokenLoadScorer
from lwepp.plugins.predicted_latency import PredictedLatencyProducer, Prediction
from lwepp.plugins.prefix import PrefixCacheScorer
from plugin_api import Params
from plugin_api.frozen import frozen
from pods.model import Endpoint

A, B, C = (Endpoint(n, f"10.0.0.{i + 1}", 8000) for i, n in enumerate("abc"))
PROMPT = "You are a careful assistant. " * 40  # 1,160 characters: 18 blocks of 64


def request(prompt: str = PROMPT, state: dict[str, Any] | None = None) -> LLMRequest:
    body = {"model": "m", "prompt": prompt}
    made = LLMRequest("r", {}, model="m", parsed=frozen(body))
    made.state.update(state or {})
    return made


def made(**parameters: Any) -> tuple[PrefixCacheAffinityFilter, ApproxPrefixCacheProducer]:
    """A filter and the producer the configuration would hand it, A holding the prompt."""
    producer = ApproxPrefixCacheProducer("approx-prefix-cache-producer")
    filter_ = PrefixCacheAffinityFilter("affinity", Params(parameters or None, "affinity"))
    filter_.use_prefix(producer)
    warm = request()
    producer.prepare(warm)
    producer.prefix_match(warm, [Candidate(A)], 0.0)
    producer.picked(warm, [A])
    return filter_, producer


def kept(filter_: PrefixCacheAffinityFilter, req: LLMRequest, *endpoints: Endpoint) -> list[str]:
    candidates = [Candidate(e) for e in endpoints]
    return [c.endpoint.pod for c in filter_.filter(req, candidates, 0.0)]


def in_flight(**tokens: int) -> dict[str, InFlight]:
    by_pod = {A.pod: A, B.pod: B, C.pod: C}
    counts = {by_pod[pod].hostport: n for pod, n in tokens.items()}
    return {load_key("inflight-load-producer"): InFlight({}, counts)}


def test_only_the_endpoints_holding_most_of_the_prompt_are_kept() -> None:
    """A holds the whole prompt (ratio 1 >= 0.8): only A stays; a prompt A holds too little of
    (below the threshold) keeps every candidate, as does a prompt nobody holds."""
    filter_, producer = made()
    producer.prepare(first := request())
    assert kept(filter_, first, A, B, C) == ["a"]
    longer = request(PROMPT + "and then a long new question that nobody has seen " * 12)
    producer.prepare(longer)
    assert kept(filter_, longer, A, B, C) == ["a", "b", "c"]
    fresh = request("Something else entirely. " * 40)
    producer.prepare(fresh)
    assert kept(filter_, fresh, A, B, C) == ["a", "b", "c"]


def test_the_ttft_gate_breaks_stickiness_when_the_cached_endpoint_is_too_busy() -> None:
    """With 15928 tokens/s, 200,000 tokens in flight on A more than B's is 12.6 s of prefill:
    over a 10 s penalty all are kept, under a 15 s one only A."""
    for penalty, expected in ((10_000, ["a", "b"]), (15_000, ["a"])):
        filter_, producer = made(maxTTFTPenaltyMs=penalty)
        req = request(state=in_flight(a=200_000))
        producer.prepare(req)
        assert kept(filter_, req, A, B) == expected


class Predicts:
    """A predicted-latency producer's face to the filter: fixed TTFTs (seconds) by pod."""

    def __init__(self, enabled: bool = True, **ttft: float) -> None:
        self.enabled, self.ttft = enabled, ttft

    def predict(self, _request: LLMRequest, candidates: list[Candidate]) -> list[Prediction]:
        return [Prediction(self.ttft[c.endpoint.pod], 0.01, 0, (1.0, 0.0, 0.0)) for c in candidates]


def test_the_ttft_gate_reads_the_latency_predictor_when_told() -> None:
    """``ttftSource: latencyPredictor``: the gate compares predicted TTFTs (A, which holds the
    prompt, 19 s slower than B breaks stickiness; 2 s slower sticks); a producer that does not
    predict skips the gate, as the router skips it without predictions. Tokens in flight are
    not read."""
    filter_, producer = made(ttftSource="latencyPredictor")
    for ttft, state, expected in (
        (Predicts(a=20.0, b=1.0, c=1.5), None, ["a", "b", "c"]),
        (Predicts(a=3.0, b=1.0, c=1.5), in_flight(a=10**9), ["a"]),
        (Predicts(enabled=False, a=20.0, b=1.0, c=1.5), None, ["a"]),
    ):
        filter_.use_predictor(ttft)
        req = request(state=state)
        producer.prepare(req)
        assert kept(filter_, req, A, B, C) == expected


def test_a_predictor_source_adds_the_predicted_latency_producer() -> None:
    """Configured with ``ttftSource: latencyPredictor`` and no producer listed, the filter gets
    ``predicted-latency-producer``, as the router requires its data."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: prefix-cache-affinity-filter\n  parameters: {ttftSource: latencyPredictor}\n"
    )
    [affinity] = [c.plugin for c in config.plugins if c.type == "prefix-cache-affinity-filter"]
    assert isinstance(affinity.predictor, PredictedLatencyProducer)
    assert "predicted-latency-producer" in [c.type for c in config.plugins]


def test_a_zero_penalty_always_sticks() -> None:
    """maxTTFTPenaltyMs 0 (llm-d's optimized baseline): however busy A is, it keeps the prompt."""
    filter_, producer = made(maxTTFTPenaltyMs=0)
    req = request(state=in_flight(a=10**9))
    producer.prepare(req)
    assert kept(filter_, req, A, B) == ["a"]


def test_the_older_in_flight_token_gate() -> None:
    """maxTokensInFlightPenalty (the router before v0.10): more than that many tokens in flight
    on the best sticky endpoint than on the best other one keeps all."""
    for extra, expected in ((286_721, ["a", "b"]), (286_720, ["a"])):
        filter_, producer = made(maxTTFTPenaltyMs=0, maxTokensInFlightPenalty=286_720)
        req = request(state=in_flight(a=extra))
        producer.prepare(req)
        assert kept(filter_, req, A, B) == expected


def test_exploration_keeps_every_candidate_when_drawn() -> None:
    """explorationProbability: a draw under it skips the gate."""
    filter_, producer = made(explorationProbability=0.5)
    draws = iter([0.4, 0.6])
    filter_.rng = random.Random()
    filter_.rng.random = lambda: next(draws)  # type: ignore[method-assign]
    for expected in (["a", "b"], ["a"]):
        req = request()
        producer.prepare(req)
        assert kept(filter_, req, A, B) == expected


def test_the_match_is_computed_once_and_shared() -> None:
    """The filter and the scorer read one PrefixMatch, the producer's, left in the request."""
    filter_, producer = made()
    scorer = PrefixCacheScorer("prefix")
    scorer.use_producer(producer)
    req = request()
    producer.prepare(req)
    kept(filter_, req, A, B)
    found = req.state[match_key("approx-prefix-cache-producer")]
    assert list(scorer.score(req, [Candidate(A)], 0.0)) == [1.0]
    assert req.state[match_key("approx-prefix-cache-producer")] is found


def test_token_load_adds_the_request_s_uncached_tokens() -> None:
    """token-load-scorer: of two idle endpoints, the one holding the prompt scores higher (it
    would compute only the uncached tail)."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: token-load-scorer\n  parameters: {queueThresholdTokens: 1000}\n"
        "- type: prefix-cache-scorer\n"
    )
    pipeline = config.pipeline()
    [scorer] = [s for s, _ in pipeline.scorers if isinstance(s, TokenLoadScorer)]
    body = orjson.dumps({"model": "m", "prompt": PROMPT})
    first = pipeline.choose(RequestInfo((), body), (A, B))
    assert first.followup is not None
    first.followup.headers(first.endpoints[0].hostport, {})
    first.followup.end()
    llm = pipeline.request_of(RequestInfo((), body))
    for hook in pipeline.prepare:
        hook.prepare(llm)
    held, other = (A, B) if first.endpoints[0] == A else (B, A)
    scores = scorer.score(llm, [Candidate(held), Candidate(other)], 0.0)
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(1 - (len(PROMPT) // 4) / 1000)


OPTIMIZED_BASELINE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-load-scorer
- type: inflight-load-producer
- type: approx-prefix-cache-producer
  parameters:
      maxPrefixTokensToMatch: 40960
- type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.80
    maxTokensInFlightPenalty: 286720
    maxTTFTPenaltyMs: 0
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: token-load-scorer
"""


def test_llm_d_s_optimized_baseline_runs_as_written() -> None:
    """The guide's file: the filter then token-load, the listed producers handed over (none
    added), one warning for the field v0.10 removed; a repeated prompt returns to its
    endpoint while the endpoint has requests in flight."""
    config = load_text(OPTIMIZED_BASELINE)
    pipeline = config.pipeline()
    [filter_] = pipeline.filters
    [producer] = [p for p in config.running if isinstance(p, ApproxPrefixCacheProducer)]
    assert isinstance(filter_, PrefixCacheAffinityFilter)
    assert filter_.prefix is producer
    assert producer.settings.max_tokens == 40960
    [warning] = config.warnings
    assert "maxTokensInFlightPenalty: removed from the router in v0.10" in warning
    body = orjson.dumps({"model": "m", "prompt": PROMPT})
    picks = [pipeline.choose(RequestInfo((), body), (A, B, C)).endpoints[0] for _ in range(5)]
    assert len(set(picks)) == 1


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("{affinityThreshold: 1.5}", "affinityThreshold: must be <= 1"),
        ("{explorationProbability: 2}", "explorationProbability: must be in"),
        ("{maxTTFTPenaltyMs: -1}", "maxTTFTPenaltyMs: must be >= 0"),
        ("{ttftSource: guess}", "ttftSource: must be one of prefillThroughput"),
        ("{peakPrefillThroughput: 0}", "peakPrefillThroughput: must be > 0 when"),
        ("{maxTokensInFlightPenalty: -3}", "maxTokensInFlightPenalty: must be >= 0"),
    ],
    ids=["threshold", "exploration", "penalty", "source", "peak", "tokens"],
)
def test_bad_parameters_are_refused_naming_the_field(parameters: str, message: str) -> None:
    """Each bad parameter is refused at load, naming the field."""
    with pytest.raises(ConfigErrors, match=message):
        load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
            f"- type: prefix-cache-affinity-filter\n  parameters: {parameters}\n"
        )
