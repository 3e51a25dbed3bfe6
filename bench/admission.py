"""What governing a request costs: the admission control's own time per request, 8 candidates.

``python -m bench.admission`` (also in ``make bench``'s micro part). Each
variant is the request control a configuration builds
(``lwepp.flowcontrol.governance.govern``), its ``admit`` called on a whole
request with the 15 headers of ``bench.streams`` and an objective header, as
the picker calls it before its pick; a ratio to round-robin's pick
(``bench.hooks``) measured the same way in the same run. The pool has room
(the concurrency detector counts nothing in flight), so nothing waits:

``gate off``
    the router's legacy rule for a sheddable request: the objective's
    priority, then the detector's reading over the 8 candidates;
``gate on``
    flow control's path for a request the pool has room for: the priority,
    an ``Item`` (fairness id, size, SLO header), ``submit`` (its band, the
    limits), one dispatch cycle (the saturation over the 8 candidates per
    stage, the bands' ceilings, the band's fairness policy) and the
    admitted request with its followup.

A picker without a ``flowControl`` section or detector runs no control at
all, and pays nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import MappingProxyType

from prometheus_client import CollectorRegistry

from bench.hooks import PODS, _us_per_call, interleaved
from bench.hooks import variants as pick_variants
from bench.report import Timed
from bench.streams import HEADERS
from lwepp.config import load_text
from lwepp.flowcontrol.governance import govern
from lwepp.objectives import Objective, Objectives
from lwepp.picking import Admitted, Pool, RequestControl, RequestInfo
from pods.model import StaticSource

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
{gate}plugins:
- {{type: concurrency-detector, parameters: {{maxConcurrency: 1000}}}}
- type: active-request-scorer
schedulingProfiles: [{{name: default, plugins: [{{pluginRef: active-request-scorer}}]}}]
flowControl:
  saturationDetector: {{pluginRef: concurrency-detector}}
  priorityBands: [{{priority: 10}}, {{priority: -1, maxRequests: 64}}]
"""
BODY = b'{"model": "m", "prompt": "' + b"x" * 4000 + b'"}'


class Fixed:
    """The demo's two objectives (``lwepp.objectives.ObjectiveSource``)."""

    objectives: Objectives = MappingProxyType(
        {"interactive": Objective("interactive", 10, "a"), "batch": Objective("batch", -1, "a")}
    )

    async def run(self) -> None:
        return None


def control(gate: bool) -> RequestControl:
    """The request control the benchmark's configuration builds, gate on or off."""
    config = load_text(CONFIG.format(gate="featureGates: [flowControl]\n" if gate else ""))
    pipeline = config.pipeline()
    pool = Pool(StaticSource(*PODS), {"pool": "a"})
    governed = govern(
        config.flow,
        lambda: pipeline.candidates(pool.endpoints).candidates,
        time.monotonic,
        Fixed(),
        CollectorRegistry(),
        "a",
    )
    (made,) = governed.controls
    return made


def per_admit(made: RequestControl, objective: str, budget: float) -> float:
    """µs per ``admit``, the event loop's own cost left out (admits that never wait run in one
    coroutine, back to back)."""
    request = Admitted(RequestInfo([*HEADERS, ("x-llm-d-inference-objective", objective)], BODY))

    async def many(count: int) -> float:
        started = time.perf_counter()
        for _ in range(count):
            await made.admit(request)
        return time.perf_counter() - started

    async def measure() -> float:
        probe = await many(200) / 200
        count = max(1, int(budget / probe))
        return min([await many(count) for _ in range(5)]) / count * 1e6

    return asyncio.run(measure())


def run(budget: float = 0.3, rounds: int = 3) -> list[Timed]:
    """µs per request: round-robin's pick (the baseline), then each variant; best of
    ``rounds`` interleaved rounds."""
    pick = pick_variants()[0].route()
    variants: list[tuple[str, Callable[[], float]]] = [
        ("round-robin pick (the baseline)", lambda: _us_per_call(pick, budget)),
        ("gate off: a sheddable request (priority, detector)", lambda: per_admit(
            control(False), "batch", budget)),
        ("gate on: a request the pool has room for", lambda: per_admit(
            control(True), "interactive", budget)),
    ]  # fmt: skip
    return interleaved(variants, rounds)


def table(rows: list[Timed]) -> str:
    lines = ["| with 8 candidates | µs per request | vs round-robin's pick |", "|---|---:|---:|"]
    lines += [f"| {r.what} | {r.us:.2f} | {r.ratio:.2f}× |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()), flush=True)
