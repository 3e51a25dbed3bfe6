"""predicted-latency-producer, latency-scorer and slo-headroom-tier-filter (lwepp.plugins.predicted_latency)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from lwepp.contracts import Candidate, LLMRequest, Usage
from lwepp.plugins.approx_prefix import DEFAULT_PRODUCER, PrefixMatch, match_key
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.predicted_latency import (
    Fit,
    LatencyScorer,
    PredictedLatencyProducer,
    SloHeadroomTierFilter,
)
from plugin_api import Params
from pods.model import Endpoint

POOL = [Candidate(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, {}), {}) for i in range(3)]
BODY = {"model": "m", "prompt": "x" * 4000}  # 1,000 tokens at 4 characters a token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plugins(
    **params: object,
) -> tuple[Clock, InFlightLoadProducer, PredictedLatencyProducer, LatencyScorer]:
    clock = Clock()
    inflight = InFlightLoadProducer("inflight-load-producer")
    producer = PredictedLatencyProducer(
        "predicted-latency-producer", Params({"streamingMode": True, **params}, "p")
    )
    producer.clock = inflight.clock = clock
    scorer = LatencyScorer("latency-scorer")
    scorer.producer = producer
    return clock, inflight, producer, scorer


def serve(
    clock: Clock,
    inflight: InFlightLoadProducer,
    producer: PredictedLatencyProducer,
    index: int,
    ttft: float,
    pool: Sequence[Candidate] = POOL,
) -> None:
    """One request picked for ``pool[index]``, its first token ``ttft`` s later, then its end."""
    request = LLMRequest("r", {}, parsed=BODY)
    inflight.prepare(request)
    producer.predict(request, pool)
    endpoint = [pool[index].endpoint]
    inflight.picked(request, endpoint)
    producer.picked(request, endpoint)
    clock.now += ttft
    inflight.response_chunk(request, b"data: {}")
    producer.response_chunk(request, b"data: {}")
    clock.now += 0.5
    producer.response_complete(request, endpoint[0].hostport, Usage(1000, 11, 0))
    inflight.response_complete(request, endpoint[0].hostport, None)


def scores(
    inflight: InFlightLoadProducer, scorer: LatencyScorer, **headers: str
) -> Sequence[float]:
    request = LLMRequest("q", headers, parsed=BODY)
    inflight.prepare(request)
    return scorer.score(request, POOL, 0.0)


def test_fit_recovers_a_linear_law_and_keeps_slopes_non_negative() -> None:
    """The decayed ridge regression finds y = 0.1 + 0.3·x from clean observations, and a law
    that falls with more work is clipped to a flat slope (more work is never faster)."""
    fit = Fit((0.0, 0.0), decay=1.0)
    for x in range(1, 40):
        fit.observe((1.0, x / 10), 0.1 + 0.3 * x / 10)
    fit.solve((0.0, 0.0), strength=0.01)
    assert abs(fit.theta[0] - 0.1) < 0.01
    assert abs(fit.theta[1] - 0.3) < 0.01
    falling = Fit((0.0, 0.0), decay=1.0)
    for x in range(1, 40):
        falling.observe((1.0, float(x)), 10.0 - x / 10)
    falling.solve((0.0, 0.0))
    assert falling.theta[1] == 0.0


def test_an_endpoint_observed_slow_is_predicted_slow_and_scored_lower() -> None:
    """Each endpoint learns its own speed from its first tokens: one three times slower than
    the others (a slower GPU) is predicted slower and gets the lowest score, with nothing
    in flight anywhere; an endpoint never observed is predicted as fast as the fastest."""
    clock, inflight, producer, scorer = plugins()
    for _ in range(20):
        serve(clock, inflight, producer, 0, 0.1)
        serve(clock, inflight, producer, 1, 0.3)
    request = LLMRequest("q", {}, parsed=BODY)
    inflight.prepare(request)
    fast, slow, new = producer.predict(request, POOL)
    assert abs(fast.ttft - 0.1) < 0.02
    assert abs(slow.ttft - 0.3) < 0.03
    assert new.ttft <= fast.ttft + 1e-9
    got = scores(inflight, scorer)
    assert min(range(3), key=got.__getitem__) == 1


def test_requests_in_flight_raise_the_prediction_before_any_response() -> None:
    """Picks count the moment they are made: prompt tokens sent to an endpoint and not yet
    prefilled make its next prediction longer, so a burst spreads instead of piling."""
    clock, inflight, producer, scorer = plugins()
    for i in range(3):
        serve(clock, inflight, producer, i, 0.2)
    held = LLMRequest("held", {}, parsed=BODY)
    inflight.prepare(held)
    inflight.picked(held, [POOL[0].endpoint])
    got = scores(inflight, scorer)
    assert got[0] < min(got[1], got[2])


def test_slo_headers_score_only_the_endpoints_that_meet_them_and_filter_to_them() -> None:
    """With x-llm-d-slo-ttft-ms, candidates predicted to miss it score 0 and the tier filter
    keeps only those predicted to meet it; ``least`` prefers the one closest to the SLO."""
    clock, inflight, producer, scorer = plugins()
    for _ in range(20):
        serve(clock, inflight, producer, 0, 0.1)
        serve(clock, inflight, producer, 1, 0.25)
        serve(clock, inflight, producer, 2, 0.6)
    got = scores(inflight, scorer, **{"x-llm-d-slo-ttft-ms": "400"})
    assert got[2] == 0.0
    assert got[1] > got[0]
    tier = SloHeadroomTierFilter("slo-tier", Params({"epsilonExploreNeg": 0.0}, "f"))
    tier.producer = producer
    request = LLMRequest("q", {"x-llm-d-slo-ttft-ms": "400"}, parsed=BODY)
    inflight.prepare(request)
    assert [c.endpoint for c in tier.filter(request, POOL, 0.0)] == [
        POOL[0].endpoint,
        POOL[1].endpoint,
    ]
    plain = LLMRequest("q", {}, parsed=BODY)
    assert tier.filter(plain, POOL, 0.0) == POOL


def test_uncached_prefill_weight_keeps_a_prefix_where_it_is_held() -> None:
    """Charged for the prefill its own uncached tokens take, a request goes to the endpoint
    holding its prefix with a short queue, where the earliest-first-token rule alone sends it
    to an idle endpoint that must prefill the whole prompt again."""
    _, inflight, producer, plain = plugins()
    producer.ttft_law.theta = [0.05, 0.3, 0.01]  # 0.3 s per 1,000 tokens to prefill
    for _ in range(2):  # 2,000 tokens waiting on the endpoint that holds the prefix
        held = LLMRequest("held", {}, parsed=BODY)
        inflight.prepare(held)
        inflight.picked(held, [POOL[0].endpoint])
    charged = LatencyScorer("charged", Params({"uncachedPrefillWeight": 2.0}, "s"))
    charged.producer = producer
    request = LLMRequest("q", {}, parsed=BODY)
    inflight.prepare(request)
    hosts = [c.endpoint.hostport for c in POOL]
    request.state[match_key(DEFAULT_PRODUCER)] = PrefixMatch({hosts[0]: 250}, 250, 4)
    assert max(range(3), key=list(plain.score(request, POOL, 0.0)).__getitem__) != 0
    assert max(range(3), key=list(charged.score(request, POOL, 0.0)).__getitem__) == 0


def test_equal_endpoints_noise_does_not_become_a_speed_difference() -> None:
    """Eight equal endpoints whose first tokens scatter ±40% around one law fit raw speeds
    10% apart by chance; shrunk to the pool's mean by as much as that noise explains, they are
    predicted within a third of that of one another, so the pick follows their queues more
    than their luck. A slow endpoint among
    them keeps its own speed (the test above)."""
    clock, inflight, producer, _ = plugins()
    pool = [Candidate(Endpoint(f"e{i}", f"10.0.1.{i}", 8000, {}), {}) for i in range(8)]
    draws = random.Random(3)
    for _ in range(10):
        for i in range(8):
            serve(clock, inflight, producer, i, 0.2 * draws.uniform(0.6, 1.4), pool)
    raw = [m.ttft.raw for m in producer.models.values()]
    assert max(raw) / min(raw) > 1.1
    request = LLMRequest("q", {}, parsed=BODY)
    inflight.prepare(request)
    ttfts = [p.ttft for p in producer.predict(request, pool)]
    assert max(ttfts) / min(ttfts) - 1 < (max(raw) / min(raw) - 1) / 3
