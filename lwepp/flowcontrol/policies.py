"""Flow control's policies, as the llm-d router names them: plugins a ``flowControl`` section names.

Each is a plugin of the configuration's ``plugins`` list (so a router file
carries over), named by a band's ``fairnessPolicyRef`` or
``orderingPolicyRef`` or by ``usageLimitPolicyPluginRef``; one the file does
not list is made with its defaults when named, or used as the default.

**Fairness** (which flow of a band goes next):

``global-strict-fairness-policy`` (the default)
    No fairness: the best head item of all the band's flows under the
    band's ordering policy, so the band behaves as one queue.
``round-robin-fairness-policy``
    The band's flows in turn, by fairness id in sorted order, from the one
    after the last served (a per-band cursor); empty flows are skipped. Two
    busy tenants then get one dispatch each in turn, whatever they offer.

**Ordering** (which item of a flow goes next; ties go to the earlier one):

``fcfs-ordering-policy`` (the default)
    First come, first served: by the time the item joined the queue.
``edf-ordering-policy``
    Earliest deadline first: queued time + the item's queue-wait budget
    (``defaultRequestTTL``); items with no budget sort last.
``slo-deadline-ordering-policy``
    By received time + the ``x-llm-d-slo-ttft-ms`` the request asked for
    (its ``x-slo-ttft-ms`` alias too); a missing or invalid header sorts last.
    The router's policy reads no prediction, and neither does this one by
    default. Switchyard's own parameter ``predictedLatencyProducerName``
    (unset: off) names a ``predicted-latency-producer`` (added with its
    defaults if the file lists none) and orders by *slack* instead: the
    latest moment the request can be dispatched and still meet its SLO,
    received + SLO - its own predicted TTFT (its prompt on the fastest
    endpoint, nothing queued: ``PredictedLatencyProducer.own_ttft``), so a
    long prompt that needs its whole budget to prefill goes before a short one
    that arrived a moment earlier. The key is computed once, when the request
    joins its queue, from its body's size; no queue comparison predicts.
    Measured (``python -m bench.slo``, ``docs/hooks.md``) it meets fewer
    SLOs than the router's key when prompts differ in length (long prompts,
    served first, hold the engines longer): an experiment, off by default.

**Usage limits** (how full the pool may be before a band waits): each band
gets a ceiling, and dispatch stops at the first band, highest priority
first, whose ceiling the pool's saturation has reached (``ceilings``'
``priorities`` are that order):

``static-usage-limit-policy`` (the default)
    ``threshold`` (1.0, in (0, 1]) for every band.
``priority-holdback-policy``
    Lower bands stop earlier, so the higher ones keep headroom:
    ``minCeiling`` (required, in [0, 1)) to ``maxCeiling`` (1.0, in (0, 1]),
    ``shape: linear`` (the only one), ``domain: rank`` (the bands evenly
    spaced, highest at ``maxCeiling``) or ``value`` (by priority value). One
    band gets ``maxCeiling``.
``soft-reflective-ceiling-policy``
    No parameters. The top band's ceiling is 1; band ``i`` of ``n`` opens
    while saturation is below ``1 - i·sat/(n-1)``; past that, and while
    saturation is below 1 but at least ``1 - sat``, it opens on one call in
    every ``round(sat / (1 - sat))``, so lower bands still trickle through.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Final, Protocol

from lwepp.contracts import PREDICTED_LATENCY, Want
from lwepp.flowcontrol.queues import NO_DEADLINE, Band, Flow, Item
from plugin_api import NO_PARAMS, Params

FAIRNESS: Final = "fairness-policy"
ORDERING: Final = "ordering-policy"
USAGE_LIMIT: Final = "usage-limit-policy"
"""What each kind of policy provides (``lwepp.contracts.Want``'s word): the section names it."""

SLO_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
PREDICTOR: Final = "predicted-latency-producer"
"""The producer ``slo-deadline-ordering-policy`` reads when told to (``lwepp.plugins``' type)."""


class FairnessPolicy(Protocol):
    """Chooses the flow of ``band`` to serve next (None: none has an item)."""

    name: str

    def new_state(self) -> Any:
        """The policy's own state for one band (kept in ``Band.state``)."""
        ...

    def select(self, band: Band) -> Flow | None: ...


class OrderingPolicy(Protocol):
    """Orders a flow's items: the smallest ``key`` goes first (ties: the earlier arrival)."""

    name: str

    def key(self, item: Item) -> Any: ...


class UsageLimitPolicy(Protocol):
    """A ceiling for each band, given the pool's saturation and the bands' priorities,
    highest first."""

    name: str

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]: ...


# --- fairness ------------------------------------------------------------------------


class GlobalStrictFairness:
    """``global-strict-fairness-policy``: the band's best head item, whichever flow."""

    provides: ClassVar[frozenset[str]] = frozenset({FAIRNESS})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name

    def new_state(self) -> None:
        return None

    def select(self, band: Band) -> Flow | None:
        best: tuple[Any, int, Flow] | None = None
        for flow in band.flows.values():
            head = flow.head()
            if head is not None and (best is None or (head[0], head[1].seq) < best[:2]):
                best = (head[0], head[1].seq, flow)
        return None if best is None else best[2]


class RoundRobinFairness:
    """``round-robin-fairness-policy``: flows in turn, in sorted fairness-id order."""

    provides: ClassVar[frozenset[str]] = frozenset({FAIRNESS})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name

    def new_state(self) -> list[str | None]:
        return [None]  # the fairness id served last

    def select(self, band: Band) -> Flow | None:
        cursor: list[str | None] = band.state
        ids = sorted(band.flows)
        if not ids:
            cursor[0] = None
            return None
        # The one after the last served, as if its flow were still listed (an empty flow is
        # dropped from the band, and the router would skip it anyway).
        start = 0 if cursor[0] is None else bisect.bisect_right(ids, cursor[0])
        for i in range(len(ids)):
            flow = band.flows[ids[(start + i) % len(ids)]]
            if flow.head() is not None:
                cursor[0] = flow.fairness_id
                return flow
        cursor[0] = None
        return None


# --- ordering ------------------------------------------------------------------------


class FcfsOrdering:
    """``fcfs-ordering-policy``: by queued time."""

    provides: ClassVar[frozenset[str]] = frozenset({ORDERING})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name

    def key(self, item: Item) -> Any:
        return item.enqueued


class EdfOrdering:
    """``edf-ordering-policy``: by queued time + queue-wait budget, then queued time."""

    provides: ClassVar[frozenset[str]] = frozenset({ORDERING})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name

    def key(self, item: Item) -> Any:
        deadline = item.enqueued + item.ttl if item.ttl > 0 else NO_DEADLINE
        return (deadline, item.enqueued)


class Predictor(Protocol):
    """What the slack ordering asks ``predicted-latency-producer``."""

    enabled: bool

    def own_ttft(self, body_bytes: int) -> float: ...


class SloDeadlineOrdering:
    """``slo-deadline-ordering-policy``: by received time + the request's TTFT SLO (less its own
    predicted TTFT, with ``predictedLatencyProducerName``)."""

    provides: ClassVar[frozenset[str]] = frozenset({ORDERING})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.predictor: Predictor | None = None
        producer = params.get("predictedLatencyProducerName", str, "")
        self.wants = (
            (Want("predictedLatencyProducerName", producer, PREDICTED_LATENCY, self._use,
                  default=PREDICTOR, add=True),)
            if producer
            else ()
        )  # fmt: skip

    def _use(self, producer: Predictor) -> None:
        self.predictor = producer

    def key(self, item: Item) -> Any:
        slo = item.slo_ms
        if slo is None:
            return (NO_DEADLINE, item.received)
        deadline = item.received + slo / 1000
        if (predictor := self.predictor) is not None and predictor.enabled:
            deadline -= predictor.own_ttft(item.size)
        return (deadline, item.received)


def slo_of(headers: Sequence[tuple[str, str]]) -> float | None:
    """The TTFT SLO a request asks for, in ms (None: no header, or not a number >= 0)."""
    found: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in SLO_HEADERS and key not in found:
            found[key] = value
    return slo_ms(next((found[h] for h in SLO_HEADERS if h in found), None))


def slo_ms(text: str | None) -> float | None:
    """A TTFT SLO header's value in ms (None: absent, or not a number >= 0)."""
    if text is None:
        return None
    try:
        ms = float(text.strip())
    except ValueError:
        return None
    return ms if math.isfinite(ms) and ms >= 0 else None


# --- usage limits --------------------------------------------------------------------


class StaticUsageLimit:
    """``static-usage-limit-policy``: one ceiling, ``threshold``, for every band."""

    provides: ClassVar[frozenset[str]] = frozenset({USAGE_LIMIT})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.threshold = params.get("threshold", float, 1.0, above=0)
        if self.threshold > 1:
            raise params.error("threshold", f"must be in (0, 1], got {self.threshold}")

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        return [self.threshold] * len(priorities)


class PriorityHoldback:
    """``priority-holdback-policy``: ceilings from ``maxCeiling`` down to ``minCeiling``."""

    provides: ClassVar[frozenset[str]] = frozenset({USAGE_LIMIT})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        shape = params.get("shape", str, "linear")
        if shape != "linear":
            raise params.error("shape", f"expected linear, got {shape!r}")
        self.domain = params.get("domain", str, "rank")
        if self.domain not in ("rank", "value"):
            raise params.error("domain", f"expected rank or value, got {self.domain!r}")
        self.low = params.require("minCeiling", float)
        if not 0 <= self.low < 1:
            raise params.error("minCeiling", f"must be in [0, 1), got {self.low}")
        self.high = params.get("maxCeiling", float, 1.0, above=0)
        if self.high > 1:
            raise params.error("maxCeiling", f"must be in (0, 1], got {self.high}")

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        n = len(priorities)
        if n <= 1:
            return [self.high] * n
        spread = self.high - self.low
        if self.domain == "rank":
            return [self.high - i * spread / (n - 1) for i in range(n)]
        top, bottom = priorities[0], priorities[-1]
        if top == bottom:
            return [self.high] * n
        return [self.low + (p - bottom) / (top - bottom) * spread for p in priorities]


class SoftReflectiveCeiling:
    """``soft-reflective-ceiling-policy`` (the module docstring has the rule)."""

    provides: ClassVar[frozenset[str]] = frozenset({USAGE_LIMIT})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.tick = 0

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        n = len(priorities)
        if n <= 1:
            return [1.0] * n
        opening = False
        if 1.0 - saturation <= saturation < 1.0:
            period = max(1, math.floor(saturation / (1.0 - saturation + 1e-9) + 0.5))  # Go's Round
            self.tick += 1
            opening = self.tick % period == 0
        result = [1.0]
        for i in range(1, n):
            reflective = 1.0 - i * saturation / (n - 1)
            if saturation < reflective:
                result.append(1.0)
            elif saturation >= 1.0:
                result.append(0.0)
            else:
                result.append(1.0 if opening else 0.0)
        return result
