"""What flow control holds: requests waiting (``Item``), one queue per flow, flows per band.

The llm-d router's three tiers, bottom up:

- an **item** is one request waiting for its turn, with what the policies
  read (its fairness id and priority, its size, when it arrived and was
  queued, an SLO deadline) and, once decided, its ``Outcome``;
- a **flow** is the queue of one fairness id within one priority (the
  router's ``FlowKey``): items ordered by the band's ordering policy;
- a **band** is one priority's flows, with its limits, its fairness policy
  and its ordering policy.

Items leave a queue four ways: dispatched (the head), evicted when their
queue-wait budget runs out, cancelled when the client goes away, or swept
when the controller shuts down. The last three may take an item from the
middle of a heap; it is marked finished and skipped when it surfaces, and
the heap is compacted once such dead entries outnumber the live ones, so a
queue never holds more than twice its limit in entries, however many
clients give up.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # the policies read these queues; only their types are needed here
    from lwepp.flowcontrol.policies import FairnessPolicy, OrderingPolicy


class Outcome(enum.Enum):
    """How a request left flow control: the router's ``QueueOutcome`` names (its metric's
    ``outcome`` label)."""

    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
    REJECTED_OTHER = "RejectedOther"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
    EVICTED_CONTEXT_CANCELLED = "EvictedContextCancelled"
    EVICTED_OTHER = "EvictedOther"


NO_DEADLINE: Final = float("inf")
"""Sorts after every deadline: an item without one (no TTL, no SLO header) goes last."""

_sequence = itertools.count()


@dataclass(slots=True, eq=False)
class Item:
    """One request in flow control. The caller fills the request's side; the controller the
    rest, and calls ``on_done(item)`` once, when ``outcome`` is set.

    ``received`` is when the request arrived (the SLO deadline counts from it),
    ``enqueued`` when it joined its queue, both on the controller's clock;
    ``size`` its body's bytes; ``slo_ms`` the ``x-llm-d-slo-ttft-ms`` it asked
    for; ``model`` its model name (a metric label).
    """

    request_id: str
    fairness_id: str
    priority: int
    size: int = 0
    received: float = 0.0
    slo_ms: float | None = None
    model: str = ""
    on_done: Callable[[Item], None] | None = None
    enqueued: float = 0.0
    ttl: float = 0.0
    """The queue-wait budget it was given (0: none), for the EDF ordering."""
    outcome: Outcome | None = None
    reason: str = ""
    """What the outcome means, for the refusal's message (``shutting down``...)."""
    finished: float = 0.0
    seq: int = field(default_factory=lambda: next(_sequence))


class Flow:
    """The queue of one fairness id in one band: items by the band's ordering key, then by
    arrival (``seq``); ``length`` and ``size`` count the live ones only."""

    __slots__ = ("dead", "fairness_id", "heap", "length", "size")

    def __init__(self, fairness_id: str) -> None:
        self.fairness_id = fairness_id
        self.heap: list[tuple[Any, int, Item]] = []
        self.length = 0
        self.size = 0
        self.dead = 0

    def push(self, key: Any, item: Item) -> None:
        heapq.heappush(self.heap, (key, item.seq, item))
        self.length += 1
        self.size += item.size

    def head(self) -> tuple[Any, Item] | None:
        """The next live item and its ordering key, or None (dead entries are dropped)."""
        heap = self.heap
        while heap and heap[0][2].outcome is not None:
            heapq.heappop(heap)
            self.dead -= 1
        return (heap[0][0], heap[0][2]) if heap else None

    def pop(self) -> Item:
        """Take the head (there must be one: ``head`` first)."""
        _, _, item = heapq.heappop(self.heap)
        self.length -= 1
        self.size -= item.size
        return item

    def drop(self, item: Item) -> None:
        """``item``, finished elsewhere, no longer counts; its entry is skipped later."""
        self.length -= 1
        self.size -= item.size
        self.dead += 1
        if self.dead > self.length:  # compact: the heap stays within twice what it holds
            self.heap = [entry for entry in self.heap if entry[2].outcome is None]
            heapq.heapify(self.heap)
            self.dead = 0

    def items(self) -> Iterator[Item]:
        return (item for _, _, item in self.heap if item.outcome is None)


class Band:
    """One priority's flows, limits and policies (``policies``' fairness and ordering).

    ``state`` is the fairness policy's own, per band (round-robin's cursor).
    ``configured``: named in ``priorityBands`` (else made from a template on
    first use).
    """

    __slots__ = (
        "configured",
        "fairness",
        "flows",
        "length",
        "max_bytes",
        "max_requests",
        "ordering",
        "peak_length",
        "peak_size",
        "priority",
        "size",
        "state",
    )

    def __init__(
        self,
        priority: int,
        max_requests: int,
        max_bytes: int,
        fairness: FairnessPolicy,
        ordering: OrderingPolicy,
        *,
        configured: bool = False,
    ) -> None:
        self.priority, self.max_requests, self.max_bytes = priority, max_requests, max_bytes
        self.fairness, self.ordering, self.configured = fairness, ordering, configured
        self.flows: dict[str, Flow] = {}
        self.length = 0
        self.size = 0
        self.peak_length = 0
        self.peak_size = 0
        """The most it ever held (the overload benchmark checks them against the limits)."""
        self.state: Any = fairness.new_state()

    def flow(self, fairness_id: str) -> Flow:
        found = self.flows.get(fairness_id)
        if found is None:
            found = self.flows[fairness_id] = Flow(fairness_id)
        return found

    def forget_if_empty(self, flow: Flow) -> None:
        """A flow with nothing queued goes (fairness ids are the clients' to choose)."""
        if flow.length == 0 and self.flows.get(flow.fairness_id) is flow:
            del self.flows[flow.fairness_id]
