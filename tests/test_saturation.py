"""The saturation detectors: the router's formulas, stale metrics as saturated, their filters."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from lwepp.contracts import Candidate, LLMRequest, Measurement
from lwepp.plugins.inflight import InFlight
from lwepp.plugins.saturation import ConcurrencyDetector, UtilizationDetector
from plugin_api import ConfigError, Params
from pods.model import Endpoint

NOW = 50.0
REQUEST = LLMRequest("r", {})


def endpoint(n: int) -> Endpoint:
    return Endpoint(f"p{n}", f"10.0.0.{n}", 8000)


def measured(n: int, queue: float | None, kv: float | None, age: float = 0.0) -> Candidate:
    values = {}
    if queue is not None:
        values["queue_depth"] = Measurement(queue, NOW - age)
    if kv is not None:
        values["kv_cache_usage"] = Measurement(kv, NOW - age)
    return Candidate(endpoint(n), values)


def test_utilization_is_the_mean_of_each_endpoints_tighter_resource() -> None:
    """score = max(queue / 5, kv / 0.8) per endpoint, averaged without weights; a KV usage the
    engine does not publish counts as 0."""
    detector = UtilizationDetector("u")
    pool = [measured(1, 10, 0.2), measured(2, 0, 0.6), measured(3, 1, None)]
    assert detector.saturation(pool, NOW) == pytest.approx((2.0 + 0.75 + 0.2) / 3)
    assert detector.stale == 0


def test_stale_or_missing_metrics_count_as_saturated_and_an_empty_pool_reads_full() -> None:
    """Fail closed: an endpoint without a queue depth measured within 200 ms scores 1.0 and is
    counted stale; no endpoint at all reads 1.0."""
    detector = UtilizationDetector("u")
    pool = [measured(1, 0, 0.0), measured(2, 0, 0.0, age=0.21), measured(3, None, 0.1)]
    assert detector.saturation(pool, NOW) == pytest.approx(2 / 3)
    assert detector.stale == 2
    assert detector.saturation([], NOW) == 1.0


def test_the_utilization_filter_allows_headroom_and_keeps_everyone_rather_than_no_one() -> None:
    """Kept: queue < threshold × (1 + headroom) and KV < threshold × (1 + headroom), fresh;
    when that leaves none, every candidate (the scorers pick the least bad)."""
    detector = UtilizationDetector(
        "u", Params({"headroom": 0.2, "queueDepthThreshold": 5, "metricsStalenessThreshold": "1s"})
    )
    pool = [measured(1, 5, 0.1), measured(2, 6, 0.1), measured(3, 1, 0.97), measured(4, 0, 0.0, 2)]
    assert [c.endpoint.pod for c in detector.filter(REQUEST, pool, NOW)] == ["p1"]
    full = pool[1:3]
    assert detector.filter(REQUEST, full, NOW) == full


def test_concurrency_modes_read_what_the_picker_has_in_flight() -> None:
    """requests: Σ requests / (endpoints × maxConcurrency); tokens alike; hybrid: the mean of
    each endpoint's larger ratio. The counts are the in-flight producer's, read live."""
    requests = {"10.0.0.1:8000": 3, "10.0.0.2:8000": 1}
    tokens = {"10.0.0.1:8000": 100}
    pool = [Candidate(endpoint(1)), Candidate(endpoint(2))]

    def detector(mode: str) -> ConcurrencyDetector:
        params = {"concurrencyMode": mode, "maxConcurrency": 4, "maxTokenConcurrency": 1000}
        made = ConcurrencyDetector("c", Params(params))
        made.load = InFlight(MappingProxyType(requests), MappingProxyType(tokens))
        return made

    assert detector("requests").saturation(pool, NOW) == 0.5
    assert detector("tokens").saturation(pool, NOW) == 0.05
    assert detector("hybrid").saturation(pool, NOW) == pytest.approx((0.75 + 0.25) / 2)
    assert detector("requests").saturation([], NOW) == 1.0
    assert detector("tokens").needs_body
    assert not detector("requests").needs_body
    requests["10.0.0.2:8000"] = 4  # live: the next reading sees it
    assert detector("requests").saturation(pool, NOW) == 0.875


def test_the_concurrency_filter_drops_full_endpoints_and_may_leave_none() -> None:
    """An endpoint at capacity × (1 + headroom) is dropped; as in the router, none may be left."""
    made = ConcurrencyDetector("c", Params({"maxConcurrency": 2, "headroom": 0.5}))
    made.load = InFlight({"10.0.0.1:8000": 3, "10.0.0.2:8000": 2}, {})
    pool = [Candidate(endpoint(1)), Candidate(endpoint(2))]
    assert [c.endpoint.pod for c in made.filter(REQUEST, pool, NOW)] == ["p2"]
    made.load = InFlight({"10.0.0.1:8000": 3, "10.0.0.2:8000": 3}, {})
    assert made.filter(REQUEST, pool, NOW) == []


@pytest.mark.parametrize(
    ("kind", "params", "problem"),
    [
        (UtilizationDetector, {"queueDepthThreshold": 0}, "queueDepthThreshold: must be > 0"),
        (UtilizationDetector, {"kvCacheUtilThreshold": 1.2}, "kvCacheUtilThreshold: must be in"),
        (UtilizationDetector, {"metricsStalenessThreshold": "soon"}, "expected a duration"),
        (UtilizationDetector, {"headroom": -1}, "headroom: must be >= 0"),
        (ConcurrencyDetector, {"concurrencyMode": "bytes"}, "expected one of requests"),
        (ConcurrencyDetector, {"maxConcurrency": 0}, "maxConcurrency: must be > 0"),
    ],
    ids=["queue", "kv", "staleness", "headroom", "mode", "concurrency"],
)
def test_detector_parameters_are_checked(
    kind: type, params: dict[str, object], problem: str
) -> None:
    """The router's constraints, each error naming the field."""
    with pytest.raises(ConfigError) as raised:
        kind("d", Params(params))
    assert problem in str(raised.value)
