"""The flow controller, synchronously, on an injected clock: bands, flows, limits, budgets, policies.

A ``Gauge`` stands in for the saturation detector: the tests set the pool's
saturation by hand, so every dispatch decision is the controller's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lwepp.contracts import Candidate
from lwepp.flowcontrol.controller import BandSpec, FlowController, Settings
from lwepp.flowcontrol.metrics import FlowMetrics
from lwepp.flowcontrol.policies import (
    EdfOrdering,
    FcfsOrdering,
    GlobalStrictFairness,
    PriorityHoldback,
    RoundRobinFairness,
    SloDeadlineOrdering,
    SoftReflectiveCeiling,
    StaticUsageLimit,
    slo_of,
)
from lwepp.flowcontrol.queues import Item, Outcome
from plugin_api import ConfigError, Params
from pods.model import Endpoint

POOL = (Candidate(Endpoint("p0", "10.0.0.1", 8000)), Candidate(Endpoint("p1", "10.0.0.2", 8000)))


@dataclass
class Gauge:
    """A saturation detector whose reading the test sets."""

    value: float = 0.0
    name: str = "gauge"
    stale: int = 0
    seen: list[int] = field(default_factory=list)

    def saturation(self, candidates: Sequence[Candidate], now: float) -> float:
        self.seen.append(len(candidates))
        return self.value if candidates else 1.0


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def band(
    priority: int = 0, fairness: object = None, ordering: object = None, **limits: int
) -> BandSpec:
    return BandSpec(
        priority,
        fairness or GlobalStrictFairness("global-strict-fairness-policy"),  # type: ignore[arg-type]
        ordering or FcfsOrdering("fcfs-ordering-policy"),  # type: ignore[arg-type]
        **limits,
    )


def controller(
    gauge: Gauge,
    clock: Clock,
    *bands: BandSpec,
    pool: list[Candidate] | None = None,
    metrics: FlowMetrics | None = None,
    **settings: object,
) -> FlowController:
    candidates = list(POOL) if pool is None else pool
    spec = Settings(
        detector=gauge,
        template=settings.pop("template", band()),  # type: ignore[arg-type]
        usage_limit=settings.pop("usage_limit", StaticUsageLimit("static")),  # type: ignore[arg-type]
        bands=bands,
        **settings,  # type: ignore[arg-type]
    )
    return FlowController(spec, lambda: candidates, clock, metrics)


def item(name: str, priority: int = 0, fairness: str = "default-flow", **fields: object) -> Item:
    return Item(name, fairness, priority, **fields)  # type: ignore[arg-type]


def dispatch_all(flow: FlowController) -> list[str]:
    out = []
    while (chosen := flow.dispatch()) is not None:
        out.append(chosen.request_id)
    return out


def test_higher_bands_go_first_and_a_saturated_band_blocks_every_lower_one() -> None:
    """Requests wait while the pool is saturated; then the highest band goes first, each band
    first come first served, and nothing of a lower band passes a waiting higher one."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, band(10), band(-1))
    for name, priority in [("b1", -1), ("i1", 10), ("b2", -1), ("i2", 10), ("n1", 0)]:
        flow.submit(item(name, priority))
        clock.now += 1
    assert flow.dispatch() is None
    assert flow.length == 5
    gauge.value = 0.5
    assert dispatch_all(flow) == ["i1", "i2", "n1", "b1", "b2"]
    assert flow.length == 0


def test_the_usage_limit_stops_dispatch_at_the_first_band_over_its_ceiling() -> None:
    """With priority-holdback the lowest band waits at a saturation the top band still passes,
    and the band below a waiting one never overtakes it."""
    gauge, clock = Gauge(0.6), Clock()
    holdback = PriorityHoldback("holdback", Params({"minCeiling": 0.5}))
    flow = controller(gauge, clock, band(10), band(0), band(-1), usage_limit=holdback)
    assert holdback.ceilings(0.6, [10, 0, -1]) == [1.0, 0.75, 0.5]
    for name, priority in [("b", -1), ("n", 0), ("i", 10)]:
        flow.submit(item(name, priority))
    assert dispatch_all(flow) == ["i", "n"]
    gauge.value = 0.8  # now the middle band waits, and the lowest may not pass it
    flow.submit(item("n2", 0))
    assert flow.dispatch() is None
    gauge.value = 0.1
    assert dispatch_all(flow) == ["n2", "b"]


def test_band_and_global_limits_refuse_at_the_door_and_count_only_what_is_queued() -> None:
    """A band's ``maxRequests`` and the global ``maxBytes`` refuse what would pass them
    (``RejectedCapacity``); a dispatched request no longer counts."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, band(0, max_requests=2), max_bytes=250)
    done: list[tuple[str, Outcome | None]] = []

    def submit(name: str, size: int) -> None:
        flow.submit(item(name, size=size, on_done=lambda i: done.append((i.request_id, i.outcome))))

    submit("a", 100)
    submit("b", 100)
    submit("c", 10)  # the band holds 2
    assert done == [("c", Outcome.REJECTED_CAPACITY)]
    gauge.value = 0.0
    assert flow.dispatch() is not None  # a leaves
    gauge.value = 1.0
    submit("d", 200)  # 100 + 200 > 250 bytes
    submit("e", 150)
    assert done[1:] == [("a", Outcome.DISPATCHED), ("d", Outcome.REJECTED_CAPACITY)]
    assert (flow.length, flow.size) == (2, 250)
    assert (flow.peak_length, flow.peak_size) == (2, 250)


def test_a_full_queue_with_no_endpoint_is_rejected_no_endpoints() -> None:
    """Refused for capacity while the pool has no endpoint: ``RejectedNoEndpoints`` (503)."""
    flow = controller(Gauge(), Clock(), band(0, max_requests=1), pool=[])
    flow.submit(item("a"))
    refused = item("b")
    flow.submit(refused)
    assert refused.outcome is Outcome.REJECTED_NO_ENDPOINTS


def test_queue_wait_budgets_run_out_by_regime_each_change_starting_a_fresh_one() -> None:
    """``defaultRequestTTL`` while the pool has endpoints (``EvictedTTL``); once it is empty,
    ``noEndpointRequestTTL`` counted from the change (``EvictedNoEndpoints``)."""
    gauge, clock = Gauge(1.0), Clock()
    pool = list(POOL)
    flow = controller(gauge, clock, pool=pool, ttl=10.0, no_endpoint_ttl=30.0)
    first, second = item("first"), item("second")
    flow.submit(first)
    clock.now += 5
    flow.submit(second)
    assert flow.next_expiry() == 110.0
    clock.now = 110.0
    assert flow.expire() == 1
    assert first.outcome is Outcome.EVICTED_TTL
    pool.clear()
    clock.now = 112.0
    assert flow.dispatch() is None  # the cycle sees the pool empty: a fresh 30 s budget
    assert flow.next_expiry() == 142.0
    clock.now = 141.0
    assert flow.expire() == 0
    clock.now = 142.0
    assert flow.expire() == 1
    assert second.outcome is Outcome.EVICTED_NO_ENDPOINTS


def test_a_zero_budget_never_evicts() -> None:
    """``defaultRequestTTL: 0s`` disables eviction: a request waits as long as it must."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, ttl=0.0, no_endpoint_ttl=0.0)
    flow.submit(item("a"))
    clock.now += 10**6
    assert flow.next_expiry() is None
    assert flow.expire() == 0


def test_a_cancelled_request_frees_its_place_at_once_and_the_heap_stays_bounded() -> None:
    """The client gone: its place is free for the next request, and however many leave from
    the middle of a queue, it never holds more than twice its limit in entries."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, band(0, max_requests=4))
    keep = item("keep")
    flow.submit(keep)
    for n in range(1000):
        leaving = item(f"x{n}")
        flow.submit(leaving)
        queued = leaving.outcome
        flow.cancel(leaving)
        assert (queued, leaving.outcome) == (None, Outcome.EVICTED_CONTEXT_CANCELLED)
        entries = sum(len(f.heap) for f in flow.bands[0].flows.values())
        assert entries <= 2 * 4
    assert flow.length == 1
    gauge.value = 0.0
    assert dispatch_all(flow) == ["keep"]


def test_closing_answers_everything_queued_and_refuses_what_comes_after() -> None:
    """Shutdown: every queued request ``EvictedOther`` (503 shutting down), every new one
    ``RejectedOther``."""
    flow = controller(Gauge(1.0), Clock())
    waiting = [item(f"w{n}") for n in range(3)]
    for one in waiting:
        flow.submit(one)
    flow.close()
    assert {one.outcome for one in waiting} == {Outcome.EVICTED_OTHER}
    late = item("late")
    flow.submit(late)
    assert late.outcome is Outcome.REJECTED_OTHER
    assert flow.length == 0


@given(
    flows=st.integers(min_value=1, max_value=6),
    per_flow=st.integers(min_value=1, max_value=6),
    order=st.randoms(use_true_random=False),
)
def test_round_robin_serves_every_busy_flow_in_turn(
    flows: int, per_flow: int, order: object
) -> None:
    """n busy flows of k requests each, queued in any order: the first n·k dispatches give each
    flow exactly one in every n, in sorted fairness-id order."""
    gauge, clock = Gauge(0.0), Clock()
    flow = controller(gauge, clock, band(0, RoundRobinFairness("rr")))
    gauge.value = 1.0
    names = [f"t{f}" for f in range(flows) for _ in range(per_flow)]
    order.shuffle(names)  # type: ignore[attr-defined]
    for n, tenant in enumerate(names):
        flow.submit(item(f"{tenant}-{n}", fairness=tenant))
    gauge.value = 0.0
    served = [flow.dispatch() for _ in range(flows * per_flow)]
    tenants = [one.fairness_id for one in served if one is not None]
    expected = sorted({f"t{f}" for f in range(flows)})
    assert tenants == expected * per_flow


def test_global_strict_serves_the_band_as_one_queue() -> None:
    """Without fairness the band's oldest request goes first, whatever its flow."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock)
    for name, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a")]:
        flow.submit(item(name, fairness=tenant))
        clock.now += 1
    gauge.value = 0.0
    assert dispatch_all(flow) == ["a1", "a2", "b1", "a3"]


def test_deadline_orderings() -> None:
    """EDF: queued time + budget (none: last); SLO deadline: received time + the TTFT SLO the
    request asked for (none or invalid: last)."""
    edf, slo = EdfOrdering("edf"), SloDeadlineOrdering("slo")
    a = item("a", enqueued=10.0, ttl=5.0)
    b = item("b", enqueued=12.0, ttl=1.0)
    c = item("c", enqueued=1.0, ttl=0.0)
    assert sorted([a, b, c], key=edf.key) == [b, a, c]
    x = item("x", received=10.0, slo_ms=500.0)
    y = item("y", received=10.2, slo_ms=100.0)
    z = item("z", received=0.0)
    assert sorted([x, y, z], key=slo.key) == [y, x, z]
    assert slo_of([("X-Slo-Ttft-Ms", "250")]) == 250.0
    assert slo_of([("x-llm-d-slo-ttft-ms", "50"), ("x-slo-ttft-ms", "9")]) == 50.0
    assert slo_of([("x-llm-d-slo-ttft-ms", "soon")]) is None
    assert slo_of([("x-llm-d-slo-ttft-ms", "-1")]) is None


def test_an_edf_band_dispatches_by_deadline() -> None:
    """A band ordered by EDF, through the controller: the budget comes from the settings."""
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, band(0, ordering=EdfOrdering("edf")), ttl=30.0)
    flow.submit(item("early"))
    clock.now += 1
    flow.submit(item("later"))
    gauge.value = 0.0
    assert dispatch_all(flow) == ["early", "later"]


def test_usage_limit_policies_compute_the_routers_ceilings() -> None:
    """Static: one threshold; holdback by rank and by value; soft-reflective: lower bands open
    below their reflective ceiling, and past it on one call in round(sat / (1 - sat))."""
    assert StaticUsageLimit("s", Params({"threshold": 0.9})).ceilings(0.3, [1, 0]) == [0.9, 0.9]
    by_value = PriorityHoldback("h", Params({"minCeiling": 0.2, "domain": "value"}))
    assert by_value.ceilings(0.0, [10, 5, 0]) == pytest.approx([1.0, 0.6, 0.2])
    assert by_value.ceilings(0.0, [3]) == [1.0]
    soft = SoftReflectiveCeiling("soft")
    assert soft.ceilings(0.2, [10, 0]) == [1.0, 1.0]  # below its reflective ceiling 0.8
    opened = [soft.ceilings(0.75, [10, 0])[1] for _ in range(6)]  # period round(0.75/0.25) = 3
    assert opened == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert soft.ceilings(1.2, [10, 0]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("policy", "params", "problem"),
    [
        (StaticUsageLimit, {"threshold": 1.5}, "threshold: must be in (0, 1]"),
        (PriorityHoldback, {}, "minCeiling: required"),
        (PriorityHoldback, {"minCeiling": 1.0}, "minCeiling: must be in [0, 1)"),
        (PriorityHoldback, {"minCeiling": 0.1, "shape": "cubic"}, "shape: expected linear"),
        (PriorityHoldback, {"minCeiling": 0.1, "domain": "x"}, "domain: expected rank or value"),
    ],
    ids=["threshold", "no-min", "min-1", "shape", "domain"],
)
def test_policy_parameters_are_checked(
    policy: type, params: dict[str, object], problem: str
) -> None:
    """Bad policy parameters name the field."""
    with pytest.raises(ConfigError) as raised:
        policy("p", Params(params))
    assert problem in str(raised.value)


def test_metrics_follow_the_queues_and_the_outcomes() -> None:
    """``flow_control_queue_size`` counts what waits per flow, ``requests_total`` each outcome,
    ``pool_saturation`` the last reading (per stage: no prefill endpoint, no prefill series)."""
    registry = CollectorRegistry()
    gauge, clock = Gauge(1.0), Clock()
    flow = controller(gauge, clock, band(0, max_requests=1), metrics=FlowMetrics(registry, "a"))
    flow.submit(item("a", model="m", size=7))
    flow.submit(item("b", model="m"))
    assert flow.dispatch() is None  # gauges are set at the end of each cycle

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"llm_d_epp_flow_control_{name}", labels)

    queue = {"fairness_id": "default-flow", "priority": "0", "inference_pool": "a"}
    models = {"model_name": "m", "target_model_name": "m"}
    assert value("queue_size", **queue, **models) == 1
    assert value("queue_bytes", **queue, **models) == 7
    rejected = {"outcome": "RejectedCapacity", "priority": "0", "inference_pool": "a"}
    assert value("requests_total", **rejected) == 1
    gauge.value = 0.25
    flow.dispatch()
    assert value("queue_size", **queue, **models) == 0
    assert value("pool_saturation", inference_pool="a", stage="effective") == 0.25
    assert value("pool_saturation", inference_pool="a", stage="decode") == 0.25
    assert value("pool_saturation", inference_pool="a", stage="prefill") is None
    assert value("capacity_utilization_requests", priority="0", inference_pool="a") == 0.0
