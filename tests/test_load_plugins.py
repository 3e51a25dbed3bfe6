"""Load from the request path: the in-flight producer, the load scorers, no-hit-lru, their config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from lwepp.config import ConfigErrors, load_text
from lwepp.contracts import Candidate, LLMRequest, Measurement
from lwepp.picking import RequestInfo
from lwepp.plugins.inflight import STALE_SECONDS, InFlightLoadProducer, load_key
from lwepp.plugins.load_scorers import ActiveRequestScorer, LoadAwareScorer, TokenLoadScorer
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.prefix import PrefixCacheScorer, PrefixMatch, match_key
from plugin_api import Params
from plugin_api.frozen import frozen
from pods.model import Endpoint

NOW = 1000.0
ENDPOINTS = tuple(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, {}) for i in range(4))
ROOT = Path(__file__).resolve().parent.parent


def cands(*endpoints: Endpoint, **attributes: float) -> list[Candidate]:
    return [
        Candidate(e, {k: Measurement(v, NOW) for k, v in attributes.items()}) for e in endpoints
    ]


def body_request(body: dict[str, Any], request_id: str = "r") -> LLMRequest:
    return LLMRequest(request_id, {}, model=body.get("model"), parsed=frozen(body))


def params(**values: Any) -> Params:
    return Params(values, "plugin 'x'")


# --- inflight-load-producer ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def producer(**values: Any) -> tuple[InFlightLoadProducer, Clock]:
    made, clock = InFlightLoadProducer("inflight-load-producer", params(**values)), Clock()
    made.clock = clock
    return made, clock


def test_a_pick_counts_its_request_and_prompt_tokens_until_the_response_ends() -> None:
    """picked adds one request and the prompt's tokens (4 characters each) to the primary pick;
    the first chunk releases the tokens, the end releases the request."""
    made, _ = producer()
    request = body_request({"model": "m", "prompt": "x" * 400})
    made.prepare(request)
    made.picked(request, ENDPOINTS[:2])
    assert request.state[load_key(made.name)] is made.load
    assert dict(made.load.requests) == {ENDPOINTS[0].hostport: 1}
    assert dict(made.load.tokens) == {ENDPOINTS[0].hostport: 100}
    made.response_chunk(request, b"data: {}\n\n")
    assert dict(made.load.tokens) == {}
    assert dict(made.load.requests) == {ENDPOINTS[0].hostport: 1}
    made.response_chunk(request, b"data: {}\n\n")
    made.response_complete(request, ENDPOINTS[0].hostport, None)
    assert dict(made.load.requests) == {}
    made.response_complete(request, ENDPOINTS[0].hostport, None)  # a second end changes nothing
    assert dict(made.load.requests) == {}


def test_cached_blocks_are_not_counted_as_tokens_to_compute() -> None:
    """With a PrefixMatch, only the blocks the endpoint lacks, and text past the indexed part,
    count: 100 tokens, 4 blocks of 16 indexed, 3 held → 16 + 36."""
    made, _ = producer()
    request = body_request({"model": "m", "prompt": "x" * 400})
    match = PrefixMatch({ENDPOINTS[0].hostport: 3}, total=4, block_tokens=16)
    request.state[match_key("approx-prefix-cache-producer")] = match
    made.picked(request, ENDPOINTS[:1])
    assert made.load.tokens[ENDPOINTS[0].hostport] == 16 + 36


def test_estimated_output_tokens_stay_until_the_end() -> None:
    """addEstimatedOutputTokens: round(prompt × outputRatio), capped by max_tokens, released
    at the end only."""
    made, _ = producer(addEstimatedOutputTokens=True, outputRatio=2.0)
    request = body_request({"model": "m", "prompt": "x" * 400, "max_tokens": 150})
    made.picked(request, ENDPOINTS[:1])
    assert made.load.tokens[ENDPOINTS[0].hostport] == 100 + 150
    made.response_chunk(request, b"x")
    assert made.load.tokens[ENDPOINTS[0].hostport] == 150
    made.response_complete(request, None, None)
    assert dict(made.load.tokens) == {}


def test_a_response_that_never_ends_is_released_after_five_idle_minutes() -> None:
    """A lost stream's entry is released by the next pick once untouched for STALE_SECONDS;
    a chunk keeps it alive."""
    made, clock = producer()
    lost, alive = body_request({"prompt": "a"}, "lost"), body_request({"prompt": "b"}, "alive")
    made.picked(lost, ENDPOINTS[:1])
    made.picked(alive, ENDPOINTS[1:2])
    clock.now = STALE_SECONDS - 1
    made.response_chunk(alive, b"x")
    clock.now = STALE_SECONDS + 1
    made.picked(body_request({"prompt": "c"}, "new"), ENDPOINTS[2:3])
    assert dict(made.load.requests) == {ENDPOINTS[1].hostport: 1, ENDPOINTS[2].hostport: 1}


def test_producer_parameters_are_checked() -> None:
    """Negative outputRatio or maxEstimatedOutputTokens are refused, naming the field."""
    with pytest.raises(ValueError, match="outputRatio"):
        producer(outputRatio=-1.0)
    with pytest.raises(ValueError, match="maxEstimatedOutputTokens"):
        producer(maxEstimatedOutputTokens=-1)


# --- the scorers ---------------------------------------------------------------------


def with_load(requests: dict[int, int], tokens: dict[int, int] | None = None) -> LLMRequest:
    made, _ = producer()
    request = LLMRequest("r", {})
    for index, count in requests.items():
        for _ in range(count):
            made.picked(LLMRequest("x", {}), ENDPOINTS[index : index + 1])
    for index, count in (tokens or {}).items():
        made.picked(body_request({"prompt": "x" * 4 * count}), ENDPOINTS[index : index + 1])
    made.prepare(request)
    return request


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, [1.0, 0.75, 0.5, 0.0]),
        ({"idleThreshold": 1}, [1.0, 1.0, 0.5, 0.0]),
        ({"maxBusyScore": 0.5}, [1.0, 0.375, 0.25, 0.0]),
        ({"maxBusyScore": 1.5, "idleThreshold": -3}, [1.0, 0.75, 0.5, 0.0]),  # the router's
        ({"requestTimeout": "2m"}, [1.0, 0.75, 0.5, 0.0]),
    ],
    ids=["defaults", "idle-threshold", "max-busy-score", "out-of-range-ignored", "timeout"],
)
def test_active_request_scorer(parameters: dict[str, Any], expected: list[float]) -> None:
    """Idle endpoints score 1; busy ones (max - n) / max × maxBusyScore."""
    scorer = ActiveRequestScorer("a", params(**parameters))
    request = with_load({1: 1, 2: 2, 3: 4})
    assert list(scorer.score(request, cands(*ENDPOINTS), NOW)) == expected


def test_token_load_scorer() -> None:
    """1 - min(1, tokens / queueThresholdTokens), on the tokens the producer counts."""
    scorer = TokenLoadScorer("t", params(queueThresholdTokens=200))
    request = with_load({}, {1: 50, 2: 200, 3: 400})
    assert list(scorer.score(request, cands(*ENDPOINTS), NOW)) == [1.0, 0.75, 0.0, 0.0]


@pytest.mark.parametrize(
    ("queue", "expected"),
    [(0, 0.5), (32, 0.375), (128, 0.0), (500, 0.0), (None, 0.0)],
    ids=["empty", "some", "threshold", "beyond", "unknown"],
)
def test_load_aware_scorer(queue: float | None, expected: float) -> None:
    """0.5 for an empty queue, 0.5 × (1 - min(q, 128) / 128) otherwise; unknown scores 0."""
    given = cands(ENDPOINTS[0]) if queue is None else cands(ENDPOINTS[0], queue_depth=queue)
    assert list(LoadAwareScorer("l").score(LLMRequest("r", {}), given, NOW)) == [expected]


def test_load_aware_threshold_not_positive_means_the_default() -> None:
    """As the router: a threshold <= 0 is replaced by 128."""
    assert LoadAwareScorer("l", params(threshold=0)).threshold == 128.0
    assert LoadAwareScorer("l", params(threshold=16)).threshold == 16.0


# --- no-hit-lru-scorer -------------------------------------------------------------------


def cold(scorer: NoHitLRUScorer, candidates: Sequence[Candidate], pick: int) -> list[float]:
    request = LLMRequest("r", {})
    scores = list(scorer.score(request, candidates, NOW))
    scorer.picked(request, [candidates[pick].endpoint])
    return scores


def test_no_hit_lru_sends_cold_requests_least_recently_used_first() -> None:
    """Never-used endpoints first in candidate order, then used ones oldest first; the pick of a
    cold request becomes the most recent."""
    scorer, given = NoHitLRUScorer("n"), cands(*ENDPOINTS)
    third = 1 / 3
    assert cold(scorer, given, 0) == [1.0, 1 - third, 1 - 2 * third, 0.0]
    # p0 used: the three never used come first, then p0 at rank 3.
    assert cold(scorer, given, 2) == [0.0, 1.0, 1 - third, 1 - 2 * third]
    # used: p0 (oldest), p2; never: p1, p3.
    assert cold(scorer, given, 1) == pytest.approx([1 - 2 * third, 1.0, 0.0, 1 - third])
    cold(scorer, given, 0)  # p0 again: now the most recent
    assert list(scorer.lru) == [e.hostport for e in (ENDPOINTS[2], ENDPOINTS[1], ENDPOINTS[0])]


def test_no_hit_lru_is_neutral_for_warm_requests_and_leaves_its_lru_alone() -> None:
    """A request some candidate holds a prefix of: 0.5 everywhere, and no LRU update."""
    scorer, given = NoHitLRUScorer("n"), cands(*ENDPOINTS[:2])
    request = LLMRequest("r", {})
    request.state[match_key("approx-prefix-cache-producer")] = PrefixMatch(
        {ENDPOINTS[0].hostport: 2, ENDPOINTS[1].hostport: 0}, 4, 16
    )
    assert list(scorer.score(request, given, NOW)) == [0.5, 0.5]
    scorer.picked(request, [ENDPOINTS[0]])
    assert not scorer.lru


def test_no_hit_lru_bounds_its_lru() -> None:
    """lruSize endpoints at most: the least recently used is forgotten."""
    scorer = NoHitLRUScorer("n", params(lruSize=2))
    for index in (0, 1, 2):
        cold(scorer, cands(*ENDPOINTS), index)
    assert list(scorer.lru) == [ENDPOINTS[1].hostport, ENDPOINTS[2].hostport]


def test_prefix_scorer_leaves_its_match_for_the_plugins_after_it() -> None:
    """prefix-cache-scorer writes a PrefixMatch under its producer's key: no match, then a
    full match on the endpoint it learned."""
    scorer = PrefixCacheScorer("prefix", params(autoTune=False, blockSizeTokens=1))
    given = cands(*ENDPOINTS[:2])
    for expected in (0, 3):
        request = body_request({"model": "m", "prompt": "abcd" * 3})
        scorer.prepare(request)
        scorer.score(request, given, NOW)
        match = request.state[match_key("approx-prefix-cache-producer")]
        assert (match.matched[ENDPOINTS[0].hostport], match.total) == (expected, 3)
        scorer.picked(request, [ENDPOINTS[0]])


# --- through the pipeline and the configuration ------------------------------------------


def test_in_flight_requests_spread_a_burst_and_are_released_at_the_end() -> None:
    """Four picks before any response ends go to four endpoints; once three end, the next
    pick avoids the one still busy."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: active-request-scorer\n"
    )
    pipeline = config.pipeline()
    body = orjson.dumps({"model": "m", "prompt": "hi"})
    picks = [pipeline.choose(RequestInfo((), body), ENDPOINTS) for _ in range(4)]
    assert {p.endpoints[0] for p in picks} == set(ENDPOINTS)
    for pick in picks[1:]:
        assert pick.followup is not None
        pick.followup.headers(pick.endpoints[0].hostport, {})
        pick.followup.end()
    for _ in range(3):
        assert (
            pipeline.choose(RequestInfo((), body), ENDPOINTS).endpoints[0] != picks[0].endpoints[0]
        )


def test_a_consumer_gets_the_producer_it_reads() -> None:
    """active-request-scorer without a producer: the router's default one is added, with a
    warning; a named producer that is not there is an error naming the field."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: active-request-scorer\n"
    )
    assert any(isinstance(p, InFlightLoadProducer) for p in config.running)
    assert any("added inflight-load-producer" in w for w in config.warnings)
    with pytest.raises(ConfigErrors, match="inFlightLoadProducerName: 'mine' names no"):
        load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
            "- type: active-request-scorer\n  parameters: {inFlightLoadProducerName: mine}\n"
        )


def test_the_recommended_config_loads_without_warnings() -> None:
    """demo/configs/recommended.yaml: prefix, in-flight requests and tokens, no-hit-lru."""
    config = load_text((ROOT / "demo/configs/recommended.yaml").read_text())
    assert config.warnings == ()
    kinds = {type(p) for p in config.running}
    assert {InFlightLoadProducer, ActiveRequestScorer, TokenLoadScorer, NoHitLRUScorer} <= kinds
