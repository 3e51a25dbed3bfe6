"""``govern``: the request control, background task and stop hook one picker's governance needs."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry

from lwepp.contracts import Candidate
from lwepp.flowcontrol.admission import Admission, Dispatcher
from lwepp.flowcontrol.config import FlowConfig
from lwepp.flowcontrol.controller import FlowController
from lwepp.flowcontrol.metrics import FlowMetrics
from lwepp.objectives import NONE, Objectives, ObjectiveSource
from lwepp.picking import RequestControl

Job = Callable[[], Coroutine[Any, Any, None]]


class NoObjectives:
    """No InferenceObjective anywhere: every request has priority 0."""

    objectives: Final[Objectives] = NONE

    async def run(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Governance:
    """What a picker runs to govern its requests: ``controls`` for the service, ``jobs`` beside
    it (the objectives' source, the dispatcher), ``stopping`` when it stops."""

    controls: tuple[RequestControl, ...] = ()
    jobs: tuple[Job, ...] = ()
    stopping: tuple[Callable[[], None], ...] = ()
    controller: FlowController | None = None
    dispatcher: Dispatcher | None = None


def govern(
    flow: FlowConfig,
    candidates: Callable[[], Sequence[Candidate]] | None,
    clock: Callable[[], float],
    objectives: ObjectiveSource | None,
    registry: CollectorRegistry,
    pool: str = "",
) -> Governance:
    """The governance ``flow`` asks for, over the pool's ``candidates`` now (None: a picker
    without a pipeline, which governs nothing); ``clock`` stamps the requests.

    No detector and the gate off: no control at all, so a picker costs what it
    did. Objectives without a control still load (a metric may read them).
    """
    source = objectives or NoObjectives()
    jobs: tuple[Job, ...] = (source.run,) if objectives is not None else ()
    detector = flow.detector
    if candidates is None or detector is None:
        return Governance(jobs=jobs)
    counts = bool(getattr(detector, "counts_in_flight", False))
    if flow.settings is None:  # the gate off: the router's legacy rule, sheddable requests only
        pool_now = candidates

        def saturation() -> float:
            return float(detector.saturation(pool_now(), clock()))

        return Governance(
            (Admission(source, saturation=saturation, counts_in_flight=counts),), jobs
        )
    controller = FlowController(flow.settings, candidates, clock, FlowMetrics(registry, pool))
    dispatcher = Dispatcher(controller)
    admission = Admission(
        source, controller=controller, dispatcher=dispatcher, counts_in_flight=counts
    )
    return Governance(
        (admission,), (*jobs, dispatcher.run), (controller.close,), controller, dispatcher
    )
