"""What the hook machinery costs per request: LWEPP's pick with 0, 1 and 5 plugins vs round-robin.

The plugins measured here do (almost) nothing — a scorer returning 1.0 for
each candidate, a filter keeping every candidate, a prepare/picked hook that
returns — so what is timed is the machinery itself: the request view
(headers into a dict), the candidates with their attribute snapshots, one
loop per stage, the weighted totals, the picker, the checks, the reply.
What real plugins cost on top is ``bench/plugins.py``'s table.

Two measurements, each a ratio to plain round-robin in the same run:

1. **The pick**, in process: the core's ``EndpointPickerService.route`` with
   ``RoundRobin`` as its strategy against the same with each ``Pipeline``, 8
   candidates, the 15 request headers of ``bench.streams``.
2. **Whole ext_proc streams** (``bench.streams``: headers + a 4 KB body in
   full-duplex mode, server on one core): server CPU per stream, where the
   pick is one step among the gRPC and protobuf work.

Zero plugins is the pipeline with its default picker (``max-score-picker``,
ties in turn); one is a scorer; five are a filter, three scorers and a
prepare/picked hook.
"""

from __future__ import annotations

import functools
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from bench.report import Timed
from bench.streams import HEADERS, measure
from lwepp.contracts import Candidate, LLMRequest
from lwepp.explain import EXPLAIN_HEADER
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import Pipeline
from lwepp.server import EndpointPickerService, PickerState
from pods.model import Endpoint, Pod, StaticSource
from wire.extproc import ProcessingResponse

PLUGINS = (0, 1, 5)

PODS = tuple(Pod(f"pod-{i}", f"10.0.0.{i + 1}", (8000,), {"pool": "a"}) for i in range(8))
"""Eight model-server pods in one pool: the candidates of every pick measured."""


class Constant:
    """A scorer that rates every candidate 1.0."""

    def __init__(self, name: str) -> None:
        self.name = name

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        return [1.0] * len(candidates)


class KeepAll:
    """A filter that keeps every candidate."""

    name = "keep-all"

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        return candidates


class Nothing:
    """A prepare and picked hook that does nothing."""

    name = "nothing"

    def prepare(self, request: LLMRequest) -> None:
        return None

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        return None


def _label(plugins: int) -> str:
    return f"pipeline, {plugins} plugin{'' if plugins == 1 else 's'}"


def pipeline(plugins: int) -> Pipeline:
    """A pipeline of 0, 1 or 5 do-nothing plugins, explaining when a request asks (the
    ``--explain=header`` a demo runs; only the last variant asks)."""
    if plugins == 0:
        return Pipeline(explain="header")
    if plugins == 1:
        return Pipeline([Constant("one")], explain="header")
    return Pipeline(
        [Nothing(), KeepAll(), *(Constant(f"s{i}") for i in range(3))], explain="header"
    )


def pool() -> Pool:
    return Pool(StaticSource(*PODS), {"pool": "a"})


def service(plugins: int | None) -> EndpointPickerService:
    """The core with round-robin (None), or with a pipeline of ``plugins`` as its strategy."""
    strategy: Strategy = RoundRobin() if plugins is None else pipeline(plugins)
    return EndpointPickerService(pool(), strategy, PickerMetrics(CollectorRegistry()))


@dataclass(frozen=True, slots=True)
class Variant:
    """One picker measured: the service (its strategy plugged in) and the request's headers."""

    what: str
    service: EndpointPickerService
    headers: Sequence[tuple[str, str]] = tuple(HEADERS)

    def route(self) -> Callable[[], ProcessingResponse]:
        """One pick as the service makes it once the request headers are in, ready to time."""
        state = PickerState(self.service.max_body_bytes)
        state.request.headers = list(self.headers)
        state.candidates = self.service.pool.endpoints
        return lambda: self.service.route(state)


def variants() -> list[Variant]:
    """Round-robin first (the baseline), then each pipeline, then five plugins explained."""
    return [
        Variant("round-robin (the core)", service(None)),
        *(Variant(_label(n), service(n)) for n in PLUGINS),
        Variant("pipeline, 5 plugins, explained", service(5), [*HEADERS, (EXPLAIN_HEADER, "1")]),
    ]


def _us_per_call(fn: Callable[[], object], budget: float) -> float:
    """Best-of-5 µs per call, each run about ``budget`` seconds (sized from a 100-call probe)."""
    timer = timeit.Timer(fn)
    number = max(1, int(budget / (timer.timeit(100) / 100)))
    return min(timer.repeat(5, number)) / number * 1e6


def run(budget: float = 0.3, rounds: int = 3) -> list[Timed]:
    """Per-pick µs of each variant, interleaved ``rounds`` times, best round kept."""
    routes = [(v.what, v.route()) for v in variants()]
    return interleaved(
        [(name, functools.partial(_us_per_call, fn, budget)) for name, fn in routes], rounds
    )


def interleaved(measures: Sequence[tuple[str, Callable[[], float]]], rounds: int) -> list[Timed]:
    """Each measure (µs) ``rounds`` times, interleaved so that noise hits them alike, the best
    kept; as rows against the first."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, timed in measures:
            us = timed()
            best[name] = min(us, best.get(name, us))
    base = best[measures[0][0]]
    return [Timed(name, best[name], base) for name, _ in measures]


def table(rows: list[Timed]) -> str:
    lines = ["| picker | µs per pick | vs round-robin |", "|---|---:|---:|"]
    lines += [f"| {r.what} | {r.us:.2f} | {r.ratio:.2f}× |" for r in rows]
    return "\n".join(lines)


STREAM_KINDS = ("lwepp", *(f"lwepp-hooks-{n}" for n in PLUGINS))
"""``bench.server`` kinds: the core with round-robin, then with each pipeline."""


def stream_rows(streams: int = 2000, concurrency: int = 16, rounds: int = 3) -> list[Timed]:
    """Server CPU µs per whole stream, as ratios to the core's round-robin."""
    results = measure(list(STREAM_KINDS), streams, concurrency, rounds)
    base = results[0].cpu_us_per_stream
    names = ["round-robin (the core)", *(_label(n) for n in PLUGINS)]
    return [Timed(n, r.cpu_us_per_stream, base) for n, r in zip(names, results, strict=True)]


def stream_table(rows: list[Timed]) -> str:
    lines = ["| picker | server CPU µs/stream | vs round-robin |", "|---|---:|---:|"]
    lines += [f"| {r.what} | {r.us:,.0f} | {r.ratio:.2f}× |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()), flush=True)
    if "--streams" in sys.argv:
        print(stream_table(stream_rows()))
