"""Admission: the request control that decides whether, and when, a request goes to its pick.

It plugs into the picker's second seam (``lwepp.picking.RequestControl``),
where the llm-d router's director does the same around its scheduler: the
request's InferenceObjective first (``lwepp.objectives``: its priority, 0
without one), then admission, then the pick. Two ways, by the
``flowControl`` feature gate:

**Gate off** (the router's legacy admission): a sheddable request (priority
< 0) is refused with 429 while the saturation detector reads 1.0 or more;
every other request goes on at once. Without a detector nothing is refused.

**Gate on**: every request joins flow control (``lwepp.flowcontrol.controller``)
as an ``Item`` of its flow (fairness id from ``x-llm-d-inference-fairness-id``
or its ``x-gateway-`` alias, else ``default-flow``; its priority; its body's
size) and waits for its turn. A request the pool has room for is dispatched
in the same call, without waiting; the others wait on a future that a
dispatch cycle, an eviction, the client leaving or shutdown completes. The
cycles run in one background task (``Dispatcher``): at once after each
dispatch (once the dispatched request was picked, so the next cycle sees its
load), when a request arrives or a response ends, at the next queue-wait
deadline, and every ``TICK`` while something waits.

The answers, as the router gives them (``refusal``; an OpenAI-style JSON
error whose ``code`` is the reason, and the reason in the header
``x-llm-d-request-dropped-reason``):

==================================  =====  ============================
queue full (``RejectedCapacity``)    429   ``rejected-saturated``
queue-wait budget ran out            429   ``rejected-ttl-expired``
no endpoint (full, or ran out)       503   ``rejected-no-endpoints``
the client went away                 503   ``rejected-context-cancelled``
the picker is stopping               503   ``rejected-shutting-down``
==================================  =====  ============================

A client that goes away while its request waits frees its place at once:
Envoy resets the ext_proc stream, gRPC cancels the stream's task, and the
cancelled wait takes the item out of its queue (``FlowController.cancel``).
On SIGTERM the service calls ``close`` before it waits for open streams:
everything queued is answered 503 before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

from lwepp.flowcontrol.controller import SHUTTING_DOWN, FlowController
from lwepp.flowcontrol.policies import SLO_HEADERS, slo_ms
from lwepp.flowcontrol.queues import Item, Outcome
from lwepp.objectives import OBJECTIVE_HEADERS, ObjectiveSource, priority_named
from lwepp.picking import Admitted
from wire.exchange import Refusal

DROPPED_HEADER: Final = "x-llm-d-request-dropped-reason"
FAIRNESS_HEADERS: Final = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DEFAULT_FAIRNESS: Final = "default-flow"
MODEL_HEADER: Final = "x-gateway-model-name"
TICK: Final = 0.005
"""How often a dispatch cycle runs while requests wait and nothing else wakes it (the router's
processor ticks every 1 ms; a Python event loop pays ~30 µs per wake, and the cycles that
matter run on an arrival or a response's end anyway)."""

ANSWERS: Final[Mapping[Outcome, tuple[int, str, str]]] = {
    Outcome.REJECTED_CAPACITY: (
        429,
        "rejected-saturated",
        "request rejected pre-queue: queue at capacity",
    ),
    Outcome.REJECTED_NO_ENDPOINTS: (
        503,
        "rejected-no-endpoints",
        "no endpoints available: request rejected pre-queue: queue at capacity",
    ),
    Outcome.EVICTED_TTL: (429, "rejected-ttl-expired", "request timed out in queue: TTL expired"),
    Outcome.EVICTED_NO_ENDPOINTS: (
        503,
        "rejected-no-endpoints",
        "request timed out in queue and no endpoints are available",
    ),
    Outcome.EVICTED_CONTEXT_CANCELLED: (503, "rejected-context-cancelled", "client disconnected"),
    Outcome.REJECTED_OTHER: (503, "rejected-shutting-down", SHUTTING_DOWN),
    Outcome.EVICTED_OTHER: (503, "rejected-shutting-down", SHUTTING_DOWN),
}
"""Each outcome but ``Dispatched``: its status, dropped reason and message (the router's)."""


def refusal(item: Item) -> Refusal:
    """The answer to a request that flow control did not dispatch."""
    status, reason, message = ANSWERS[item.outcome or Outcome.REJECTED_OTHER]
    return Refusal(status, message, reason=reason, headers=[(DROPPED_HEADER, reason)])


READ: Final = frozenset(
    {*OBJECTIVE_HEADERS, *FAIRNESS_HEADERS, *SLO_HEADERS, MODEL_HEADER, "x-request-id"}
)
"""The headers admission reads, each once."""


class Read(NamedTuple):
    """What admission reads of a request's headers (``read``)."""

    objective: str | None
    fairness_id: str
    slo: str | None
    model: str
    request_id: str


def read(headers: Sequence[tuple[str, str]]) -> Read:
    """The headers admission needs, in one pass: each the first value of its name, names in
    lower case; of a header and its deprecated alias, the header's."""
    found: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in READ and key not in found:
            found[key] = value

    def first(names: Sequence[str]) -> str | None:
        return next((found[n].strip() for n in names if found.get(n)), None)

    return Read(
        first(OBJECTIVE_HEADERS),
        first(FAIRNESS_HEADERS) or DEFAULT_FAIRNESS,
        first(SLO_HEADERS),
        found.get(MODEL_HEADER, ""),
        found.get("x-request-id", ""),
    )


class Dispatcher:
    """Runs the controller's dispatch cycles and evictions in the event loop (``run``)."""

    def __init__(self, controller: FlowController, tick: float = TICK) -> None:
        self.controller, self.tick = controller, tick
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Something changed (a request came, a response ended): run a cycle soon."""
        self._wake.set()

    async def run(self) -> None:
        controller = self.controller
        while True:
            self._wake.clear()
            if controller.dispatch() is not None:
                await asyncio.sleep(0)  # the dispatched request is picked before the next cycle
                continue
            controller.expire()
            if not controller.length:
                await self._wake.wait()
                continue
            expiry = controller.next_expiry()
            wait = self.tick if expiry is None else min(self.tick, expiry - controller.clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wait))


class _Woken:
    """A flow-controlled request's followup: its end wakes the dispatcher (a slot freed)."""

    __slots__ = ("dispatcher",)

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def headers(self, served: str | None, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        return []

    def chunk(self, chunk: bytes) -> bytes | None:
        return None

    def end(self) -> None:
        self.dispatcher.wake()


class Admission:
    """The request control (``RequestControl``): the objective's priority, then admission.

    ``objectives``: where the pool's InferenceObjectives are read. ``controller``
    and ``dispatcher``: flow control (gate on), else None. ``saturation``: the
    detector's reading of the pool now, for the gate-off rule (None: no
    detector). ``counts_in_flight``: the detector counts requests until their
    response ends, so the gateway must stream the response through the picker
    for the picker to see that end (the concurrency detector).
    """

    def __init__(
        self,
        objectives: ObjectiveSource,
        *,
        controller: FlowController | None = None,
        dispatcher: Dispatcher | None = None,
        saturation: Callable[[], float] | None = None,
        counts_in_flight: bool = False,
    ) -> None:
        self.objectives, self.controller, self.dispatcher = objectives, controller, dispatcher
        self.saturation = saturation
        self.reads_response_body = counts_in_flight
        self.hears_response = counts_in_flight or controller is not None
        self._followup = _Woken(dispatcher) if dispatcher is not None else None

    async def admit(self, admitted: Admitted) -> Admitted:
        found = read(admitted.request.headers)
        priority = priority_named(found.objective, self.objectives.objectives)
        controller = self.controller
        if controller is None:
            if priority < 0 and self.saturation is not None and self.saturation() >= 1.0:
                raise Refusal(
                    429,
                    "system saturated, sheddable request dropped",
                    reason="sheddable-request-dropped",
                )
            return admitted
        body = admitted.request.body
        item = Item(
            found.request_id,
            found.fairness_id,
            priority,
            size=len(body) if body is not None else 0,
            received=controller.clock(),
            slo_ms=slo_ms(found.slo),
            model=found.model,
        )
        await self.wait(controller, item)
        if item.outcome is not Outcome.DISPATCHED:
            raise refusal(item)
        assert self._followup is not None
        return Admitted(admitted.request, admitted.body, (*admitted.followups, self._followup))

    async def wait(self, controller: FlowController, item: Item) -> None:
        """Queue ``item`` and wait until flow control decides; a request the pool has room for
        is dispatched in this call."""
        controller.submit(item)
        if item.outcome is None:
            controller.dispatch()
        if item.outcome is not None:
            return  # refused at once, or dispatched at once: no wait, no future
        done = asyncio.get_running_loop().create_future()

        def decided(_item: Item) -> None:
            if not done.done():
                done.set_result(None)

        item.on_done = decided  # only now: nothing decides a queued item until this awaits
        assert self.dispatcher is not None
        self.dispatcher.wake()
        try:
            await done
        except asyncio.CancelledError:  # the client went away: its place is freed at once
            controller.cancel(item)
            raise
