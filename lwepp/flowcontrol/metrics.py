"""Flow control's Prometheus metrics, under the llm-d router's names, labels and buckets.

Only a picker with the ``flowControl`` gate on exports them, as in the
router (``docs/metrics.md`` of llm-d-router, ``llm_d_router_metrics.go``):

================================================  =========================================
``llm_d_epp_flow_control_requests_total``          requests that left flow control, by
                                                   ``outcome`` (Dispatched, RejectedCapacity,
                                                   EvictedTTL...), ``priority``, ``inference_pool``
``..._request_queue_duration_seconds``             from joining to leaving, by ``fairness_id``,
                                                   ``priority``, ``outcome``, ``inference_pool``,
                                                   ``model_name``, ``target_model_name``
``..._request_enqueue_duration_seconds``           the time to enqueue (or refuse) one request,
                                                   by ``fairness_id``, ``priority``, ``outcome``
``..._dispatch_cycle_duration_seconds``            one dispatch cycle
``..._queue_size``, ``..._queue_bytes``            what waits now, by ``fairness_id``,
                                                   ``priority``, ``inference_pool``, and the models
``..._pool_saturation``                            the detector's reading, by ``inference_pool``
                                                   and ``stage`` (prefill, decode, effective)
``..._stale_endpoints``                            endpoints the detector found without fresh
                                                   metrics, by ``detector``
``..._capacity_utilization_requests`` / ``_bytes`` a band's queue over its limit, by ``priority``
``..._global_capacity_utilization_requests`` /     all bands over the global limit (only when
``_bytes``                                         one is set)
================================================  =========================================

The in-flight eviction series (``revocations``...) are not exported: eviction
is not implemented. Fairness ids are the clients' to choose, so past the
1,000th distinct one they count as ``other`` (the router caps model names
so): a picker exports at most that many series per priority and model.
"""

from __future__ import annotations

import functools
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lwepp.flowcontrol.queues import Item, Outcome

PREFIX: Final = "llm_d_epp_flow_control_"
QUEUE_BUCKETS: Final = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
CYCLE_BUCKETS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
CAP: Final = 1000


class FlowMetrics:
    """The series above, for one pool (``pool``, the ``inference_pool`` label)."""

    def __init__(self, registry: CollectorRegistry, pool: str = "") -> None:
        self.pool = pool
        models = ("model_name", "target_model_name")

        def gauge(
            name: str, about: str, *labels: str, mode: Literal["livesum", "livemax"] = "livesum"
        ) -> Gauge:
            return Gauge(PREFIX + name, about, labels, registry=registry, multiprocess_mode=mode)

        self.requests = Counter(
            PREFIX + "requests",
            "Total number of requests processed by the Flow Control layer.",
            ["outcome", "priority", "inference_pool"],
            registry=registry,
        )
        self.queue_duration = Histogram(
            PREFIX + "request_queue_duration_seconds",
            "Distribution of total time requests spend in the Flow Control layer (from enqueue "
            "to final outcome).",
            ["fairness_id", "priority", "outcome", "inference_pool", *models],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.enqueue_duration = Histogram(
            PREFIX + "request_enqueue_duration_seconds",
            "Distribution of time taken to enqueue requests into the Flow Control layer.",
            ["fairness_id", "priority", "outcome"],
            buckets=CYCLE_BUCKETS,
            registry=registry,
        )
        self.cycle_duration = Histogram(
            PREFIX + "dispatch_cycle_duration_seconds",
            "Distribution of time taken for each internal dispatch cycle in the Flow Control "
            "layer.",
            buckets=CYCLE_BUCKETS,
            registry=registry,
        )
        self.queue_size = gauge(
            "queue_size",
            "Current number of requests actively held in the Flow Control queue.",
            *("fairness_id", "priority", "inference_pool", *models),
        )
        self.queue_bytes = gauge(
            "queue_bytes",
            "Current total size in bytes of requests actively held in the Flow Control queue.",
            *("fairness_id", "priority", "inference_pool", *models),
        )
        self.saturation = gauge(
            "pool_saturation",
            "Pool saturation signal gating Flow Control dispatch: 'effective' is max(prefill, "
            "decode) and is the value used for gating; 1.0 is the set point. An empty pool, and "
            "with the utilization detector an endpoint without fresh metrics, reads as 1.0.",
            "inference_pool",
            "stage",
            mode="livemax",
        )
        self.stale = gauge(
            "stale_endpoints",
            "Candidate endpoints whose metrics are missing or older than the staleness "
            "threshold at the last saturation evaluation (scored as fully saturated).",
            "detector",
            mode="livemax",
        )
        self.band_requests = gauge(
            "capacity_utilization_requests",
            "Fraction of a priority band's request-count capacity currently occupied.",
            "priority",
            "inference_pool",
            mode="livemax",
        )
        self.band_bytes = gauge(
            "capacity_utilization_bytes",
            "Fraction of a priority band's byte-size capacity currently occupied.",
            "priority",
            "inference_pool",
            mode="livemax",
        )
        self.global_requests = gauge(
            "global_capacity_utilization_requests",
            "Fraction of the global request-count capacity currently occupied (when set).",
            "inference_pool",
            mode="livemax",
        )
        self.global_bytes = gauge(
            "global_capacity_utilization_bytes",
            "Fraction of the global byte-size capacity currently occupied (when set).",
            "inference_pool",
            mode="livemax",
        )
        self._fairness: set[str] = set()
        self._pending: dict[tuple[str, ...], tuple[int, int]] = {}
        self._shown: dict[tuple[str, ...], float] = {}
        # Speed, behind names (as the picker's own counters): a series' child is looked up by
        # its labels on every change, and the lookup costs more than the change; each is
        # kept once seen. Bounded: fairness ids past CAP are one "other".
        cached = functools.lru_cache(maxsize=4 * CAP)
        self._requests = cached(self.requests.labels)
        self._waited = cached(self.queue_duration.labels)
        self._enqueued = cached(self.enqueue_duration.labels)
        self._size = cached(self.queue_size.labels)
        self._bytes = cached(self.queue_bytes.labels)
        self._band_requests = cached(self.band_requests.labels)
        self._band_bytes = cached(self.band_bytes.labels)
        self._stage = cached(self.saturation.labels)
        self._stale = cached(self.stale.labels)

    def fairness(self, fairness_id: str) -> str:
        """The label for a fairness id: itself, or ``other`` past ``CAP`` distinct ones."""
        if fairness_id not in self._fairness and len(self._fairness) >= CAP:
            return "other"
        self._fairness.add(fairness_id)
        return fairness_id

    def queued(self, item: Item, delta: int) -> None:
        """``item`` joined (``delta`` 1) or left (-1) its queue: counted now, shown at the
        next ``flush`` (a request that joins and leaves in one cycle changes no gauge)."""
        labels = (self.fairness(item.fairness_id), str(item.priority), self.pool, item.model)
        requests, size = self._pending.get(labels, (0, 0))
        self._pending[labels] = (requests + delta, size + delta * item.size)

    def flush(self) -> None:
        """Show the queue gauges' changes since the last flush (the end of every operation)."""
        for labels, (requests, size) in self._pending.items():
            if requests or size:
                self._size(*labels, labels[-1]).inc(requests)
                self._bytes(*labels, labels[-1]).inc(size)
        self._pending.clear()

    def left(self, item: Item, outcome: Outcome, waited: float) -> None:
        """``item`` left flow control with ``outcome`` after ``waited`` seconds."""
        priority = str(item.priority)
        self._requests(outcome.value, priority, self.pool).inc()
        fairness = self.fairness(item.fairness_id)
        self._waited(fairness, priority, outcome.value, self.pool, item.model, item.model).observe(
            waited
        )

    def enqueued(self, item: Item, seconds: float) -> None:
        """Enqueueing (or refusing) ``item`` took ``seconds``."""
        outcome = item.outcome.value if item.outcome is not None else "NotYetFinalized"
        fairness = self.fairness(item.fairness_id)
        self._enqueued(fairness, str(item.priority), outcome).observe(seconds)

    def saturated(self, stage: str, value: float | None) -> None:
        """A stage's reading (None: the pool has no endpoint of that stage: no series)."""
        if value is None:
            self.saturation.remove(self.pool, stage)
            self._stage.cache_clear()
            self._shown.pop(("stage", stage), None)
        elif self._changed(("stage", stage), value):
            self._stage(self.pool, stage).set(value)

    def stale_endpoints(self, detector: str, count: int) -> None:
        if self._changed(("stale", detector), count):
            self._stale(detector).set(count)

    def band(self, priority: int, requests: float, size: float) -> None:
        """A band's queue over its limits."""
        label = str(priority)
        if self._changed(("band", label), requests):
            self._band_requests(label, self.pool).set(requests)
        if self._changed(("band bytes", label), size):
            self._band_bytes(label, self.pool).set(size)

    def _changed(self, key: tuple[str, ...], value: float) -> bool:
        """Whether a gauge's value differs from the one shown (then it is the one shown)."""
        if self._shown.get(key) == value:
            return False
        self._shown[key] = value
        return True
