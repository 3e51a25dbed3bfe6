"""The flow controller: requests wait in bands and flows; one dispatch cycle lets the next one go.

This is the llm-d router's flow controller (``pkg/epp/flowcontrol``: the
registry's bands and flows, its shard processor's enqueue, dispatch cycle
and expiry sweep), as plain synchronous code over an injected clock. It
never waits itself: whoever drives it calls

``submit(item)``
    A request joins its band (made from a template on first use) and flow,
    or is refused at once when a limit would be passed: the global and the
    band's ``maxRequests`` and ``maxBytes``, counted over what is queued
    (not what is in flight, as the router counts). Refused while the pool
    has no endpoint, it is ``RejectedNoEndpoints``; else ``RejectedCapacity``.
``dispatch()``
    One cycle: read the pool's saturation (the detector over the pool's
    candidates, per stage: prefill and decode endpoints by their
    ``llm-d.ai/role`` label, the effective value the larger), ask the usage
    limit policy for each band's ceiling, then, highest priority first, stop
    at the first band whose ceiling the saturation has reached (lower bands
    must not overtake it), or let the band's fairness policy choose a flow
    and take that flow's head. At most one request per cycle, as the router:
    the next cycle sees the load that one added.
``expire()``
    Evict what waited past its budget: ``defaultRequestTTL`` while the pool
    has endpoints (``EvictedTTL``), ``noEndpointRequestTTL`` while it has
    none (``EvictedNoEndpoints``); a change between the two starts a fresh
    budget. 0 disables eviction in that regime.
``cancel(item)``, ``close()``
    The client went away (``EvictedContextCancelled``); the picker is
    stopping: everything queued, and whatever comes after, is refused
    (``EvictedOther``/``RejectedOther``, "shutting down").

Each finished item's ``on_done`` is called once, synchronously. The service
drives this from its event loop (``lwepp.flowcontrol.admission``); the
overload benchmark drives it in virtual time (``bench.overload``).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Final, Protocol

from lwepp.contracts import Candidate
from lwepp.flowcontrol.metrics import FlowMetrics
from lwepp.flowcontrol.policies import FairnessPolicy, OrderingPolicy, UsageLimitPolicy
from lwepp.flowcontrol.queues import Band, Flow, Item, Outcome
from lwepp.plugins.role_filters import ROLE_LABEL

DEFAULT_TTL: Final = 60.0
"""``defaultRequestTTL`` (and ``noEndpointRequestTTL``) when unset: the router's 60 s."""
BAND_MAX_REQUESTS: Final = 5000
BAND_MAX_BYTES: Final = 1_000_000_000
"""A band's limits when unset (a band's limits are always bounded, the global ones optional)."""

PREFILL_ROLES: Final = frozenset({"prefill", "encode-prefill"})
DECODE_ROLES: Final = frozenset({"decode", ""})
BOTH_ROLES: Final = frozenset({"prefill-decode", "both", "encode-prefill-decode"})

SHUTTING_DOWN: Final = "flow controller shutting down"


class Detector(Protocol):
    """What flow control asks a saturation detector (``lwepp.plugins.saturation``)."""

    name: str
    stale: int

    def saturation(self, candidates: Sequence[Candidate], now: float) -> float: ...


@dataclass(frozen=True, slots=True)
class BandSpec:
    """One band's configuration, or a template's (its ``priority`` then unused)."""

    priority: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    max_requests: int = BAND_MAX_REQUESTS
    max_bytes: int = BAND_MAX_BYTES


@dataclass(frozen=True, slots=True)
class Settings:
    """A ``flowControl`` section, decoded (``lwepp.flowcontrol.config``)."""

    detector: Any
    """The saturation detector (a ``Detector``)."""
    template: BandSpec
    usage_limit: UsageLimitPolicy
    bands: tuple[BandSpec, ...] = ()
    negative: BandSpec | None = None
    """The template for priorities below 0 (None: ``template``)."""
    max_requests: int = 0
    max_bytes: int = 0
    """Global limits over every band; 0: none."""
    ttl: float = DEFAULT_TTL
    no_endpoint_ttl: float = DEFAULT_TTL
    policies: tuple[Any, ...] = field(default=())
    """Every policy plugin the section uses (for ``--check-config``)."""


class FlowController:
    """Bands, flows and the dispatch cycle for one pool (the module docstring explains each
    call). ``candidates`` returns the pool's endpoints with their attributes now; ``clock``
    is the one requests are stamped with; ``metrics`` None exports nothing."""

    def __init__(
        self,
        settings: Settings,
        candidates: Callable[[], Sequence[Candidate]],
        clock: Callable[[], float],
        metrics: FlowMetrics | None = None,
    ) -> None:
        self.settings, self.candidates, self.clock, self.metrics = (
            settings,
            candidates,
            clock,
            metrics,
        )
        self.detector = settings.detector
        self.bands: dict[int, Band] = {}
        self.order: list[int] = []
        """The bands' priorities, highest first."""
        for spec in settings.bands:
            self._add_band(spec, spec.priority, configured=True)
        self.length = 0
        self.size = 0
        self.peak_length = 0
        self.peak_size = 0
        self.saturation = 1.0
        """The effective saturation the last cycle read."""
        self.empty = False
        self.since = 0.0
        """Whether the pool had no endpoint at the last look, and since when."""
        self.closed = False
        self._waiting: collections.deque[Item] = collections.deque()
        self._changed: set[Band] = set()
        """The bands whose queues changed since their gauges were last set."""
        self._stages: set[str] = set()
        """The stages whose saturation series exist (a pool's endpoints may lose a role)."""
        """Every queued item in the order it joined: the order their budgets run out."""

    # --- joining -------------------------------------------------------------------

    def band_for(self, priority: int) -> Band:
        """The band of ``priority``, made from its template on first use."""
        band = self.bands.get(priority)
        if band is None:
            negative = self.settings.negative
            spec = negative if priority < 0 and negative is not None else self.settings.template
            band = self._add_band(spec, priority)
        return band

    def _add_band(self, spec: BandSpec, priority: int, *, configured: bool = False) -> Band:
        band = Band(
            priority,
            spec.max_requests,
            spec.max_bytes,
            spec.fairness,
            spec.ordering,
            configured=configured,
        )
        self.bands[priority] = band
        self.order.insert(bisect.bisect_left([-p for p in self.order], -priority), priority)
        return band

    def submit(self, item: Item) -> None:
        """Queue ``item``, or finish it at once (refused); ``on_done`` says which."""
        started = perf_counter()
        now = self.clock()
        if self.closed:
            self._finish(item, Outcome.REJECTED_OTHER, now, SHUTTING_DOWN)
        else:
            band = self.band_for(item.priority)
            if self._fits(band, item.size):
                self._enqueue(band, item, now)
            else:
                self._look(now)
                outcome = Outcome.REJECTED_NO_ENDPOINTS if self.empty else Outcome.REJECTED_CAPACITY
                self._finish(item, outcome, now, "queue at capacity")
        if self.metrics is not None:
            self.metrics.enqueued(item, perf_counter() - started)  # its gauges: the next cycle

    def _fits(self, band: Band, size: int) -> bool:
        """The router's ``hasCapacity``: limits against what is queued, with this one."""
        s = self.settings
        if s.max_bytes and self.size + size > s.max_bytes:
            return False
        if s.max_requests and self.length + 1 > s.max_requests:
            return False
        if band.max_bytes and band.size + size > band.max_bytes:
            return False
        return not (band.max_requests and band.length + 1 > band.max_requests)

    def _enqueue(self, band: Band, item: Item, now: float) -> None:
        item.enqueued = now
        item.ttl = self.settings.ttl
        band.flow(item.fairness_id).push(band.ordering.key(item), item)
        band.length += 1
        band.size += item.size
        band.peak_length = max(band.peak_length, band.length)
        band.peak_size = max(band.peak_size, band.size)
        self.length += 1
        self.size += item.size
        self.peak_length = max(self.peak_length, self.length)
        self.peak_size = max(self.peak_size, self.size)
        self._waiting.append(item)
        if self.metrics is not None:
            self.metrics.queued(item, 1)
            self._capacity_gauges(band)

    # --- leaving -------------------------------------------------------------------

    def dispatch(self) -> Item | None:
        """One dispatch cycle: the request let go (its ``on_done`` told), or None."""
        started = perf_counter()
        now = self.clock()
        candidates = self.candidates()
        self._look(now, candidates)
        saturation = self.saturation = self._measure(candidates, now)
        chosen = self._choose(saturation, now) if self.length else None
        if self.metrics is not None:
            self._show()
            self.metrics.cycle_duration.observe(perf_counter() - started)
        return chosen

    def _choose(self, saturation: float, now: float) -> Item | None:
        ceilings = self.settings.usage_limit.ceilings(saturation, self.order)
        for priority, ceiling in zip(self.order, ceilings, strict=True):
            if saturation >= ceiling:
                return None  # this band waits, and no lower one may overtake it
            band = self.bands[priority]
            if not band.length:
                continue
            flow = band.fairness.select(band)
            if flow is None:
                continue
            item = flow.pop()
            self._left(band, flow, item)
            self._finish(item, Outcome.DISPATCHED, now)
            return item
        return None

    def expire(self) -> int:
        """Evict every request whose queue-wait budget ran out; how many were."""
        now = self.clock()
        evicted = 0
        waiting = self._waiting
        while waiting:
            item = waiting[0]
            if item.outcome is not None:
                waiting.popleft()
                continue
            deadline = self._deadline(item)
            if deadline is None or deadline > now:
                break
            waiting.popleft()
            outcome = Outcome.EVICTED_NO_ENDPOINTS if self.empty else Outcome.EVICTED_TTL
            self._remove(item, outcome, now, "request TTL expired")
            evicted += 1
        self._show()
        return evicted

    def next_expiry(self) -> float | None:
        """When the oldest queued request's budget runs out (None: nothing will expire)."""
        while self._waiting and self._waiting[0].outcome is not None:
            self._waiting.popleft()
        return self._deadline(self._waiting[0]) if self._waiting else None

    def _deadline(self, item: Item) -> float | None:
        ttl = self.settings.no_endpoint_ttl if self.empty else self.settings.ttl
        return None if ttl <= 0 else max(item.enqueued, self.since) + ttl

    def cancel(self, item: Item) -> None:
        """The client went away while ``item`` waited: it leaves at once."""
        if item.outcome is None:
            self._remove(item, Outcome.EVICTED_CONTEXT_CANCELLED, self.clock(), "client gone")
            self._show()

    def close(self) -> None:
        """Refuse everything queued and everything to come: the picker is stopping."""
        self.closed = True
        now = self.clock()
        for item in list(self._waiting):
            if item.outcome is None:
                self._remove(item, Outcome.EVICTED_OTHER, now, SHUTTING_DOWN)
        self._waiting.clear()
        self._show()

    def _remove(self, item: Item, outcome: Outcome, now: float, reason: str) -> None:
        """Take ``item`` out of the middle of its flow, and finish it."""
        band = self.bands[item.priority]
        flow = band.flows[item.fairness_id]
        item.outcome = outcome  # first: the flow then skips its entry
        flow.drop(item)
        self._left(band, flow, item, popped=False)
        self._finish(item, outcome, now, reason)

    def _left(self, band: Band, flow: Flow, item: Item, *, popped: bool = True) -> None:
        band.length -= 1
        band.size -= item.size
        self.length -= 1
        self.size -= item.size
        band.forget_if_empty(flow)
        if self.metrics is not None:
            self.metrics.queued(item, -1)
            self._capacity_gauges(band)

    def _finish(self, item: Item, outcome: Outcome, now: float, reason: str = "") -> None:
        item.outcome, item.reason, item.finished = outcome, reason, now
        if self.metrics is not None:
            waited = now - item.enqueued if item.enqueued else 0.0
            self.metrics.left(item, outcome, waited)
        if item.on_done is not None:
            item.on_done(item)

    # --- the pool ------------------------------------------------------------------

    def _look(self, now: float, candidates: Sequence[Candidate] | None = None) -> None:
        """Note whether the pool has endpoints (a change starts fresh queue-wait budgets)."""
        empty = not (self.candidates() if candidates is None else candidates)
        if empty != self.empty:
            self.empty, self.since = empty, now

    def _measure(self, candidates: Sequence[Candidate], now: float) -> float:
        """The effective saturation: the larger of the prefill and decode stages'."""
        prefill, decode = partition(candidates)
        detector, metrics = self.detector, self.metrics
        saturation = -1.0
        for stage, part in (("prefill", prefill), ("decode", decode)):
            if not part:
                if metrics is not None and stage in self._stages:  # no such endpoints now
                    self._stages.discard(stage)
                    metrics.saturated(stage, None)
                continue
            value = detector.saturation(part, now)
            if metrics is not None:
                self._stages.add(stage)
                metrics.saturated(stage, value)
            saturation = max(saturation, value)
        if saturation < 0:  # no endpoint at all
            saturation = detector.saturation(candidates, now)
        if metrics is not None:
            metrics.saturated("effective", saturation)
            metrics.stale_endpoints(detector.name, detector.stale)
        return saturation

    def _capacity_gauges(self, band: Band) -> None:
        self._changed.add(band)

    def _show(self) -> None:
        """Set the gauges of what the last operation changed, once (``FlowMetrics.flush``)."""
        metrics, s = self.metrics, self.settings
        if metrics is None:
            return
        metrics.flush()
        if not self._changed:
            return
        for band in self._changed:
            metrics.band(band.priority, band.length / band.max_requests, band.size / band.max_bytes)
        self._changed.clear()
        if s.max_requests:
            metrics.global_requests.labels(metrics.pool).set(self.length / s.max_requests)
        if s.max_bytes:
            metrics.global_bytes.labels(metrics.pool).set(self.size / s.max_bytes)


def partition(candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """Prefill and decode endpoints by ``llm-d.ai/role`` (an unlabelled one decodes; one that
    does both is in both), as the router's dispatch cycle splits the pool."""
    prefill: list[Candidate] = []
    decode: list[Candidate] = []
    for candidate in candidates:
        role = candidate.endpoint.labels.get(ROLE_LABEL, "")
        if role in DECODE_ROLES:
            decode.append(candidate)
        elif role in PREFILL_ROLES:
            prefill.append(candidate)
        elif role in BOTH_ROLES:
            prefill.append(candidate)
            decode.append(candidate)
    return prefill, decode
