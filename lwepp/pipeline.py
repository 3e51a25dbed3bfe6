"""The filter/scorer pipeline: how one request becomes a pick, and what the plugins hear afterwards.

Request side (``decide``), each stage one loop over its plugins in
configuration order::

    prepare hooks    each computes per-request data once, into request.state
    filters          each narrows the candidates; none left → HTTP 503
    scorers          each rates every candidate in [0, 1]; the pipeline clamps the
                     score (NaN counts as 0), multiplies it by the scorer's weight
                     and adds it to the candidate's total
    picker           the scored candidates → endpoints, best first (then fallbacks)
    picked hooks     each learns the pick

Response side (called by ``lwepp.hooked``): response headers, body chunks,
completion, each a loop over the response hooks.

``Pipeline`` is a ``Strategy`` (``lwepp.picking``): the core's stream
handling asks it for endpoints exactly as it asks ``RoundRobin``, and with
no scorers the default picker (``max-score-picker``, ties in turn) answers
exactly as round-robin does.

A plugin that raises, or breaks its contract (a filter returning a stranger,
a scorer returning the wrong number of scores, a picker choosing a
non-candidate), never loses the request: the error is logged naming the
plugin and stage, counted in ``lwepp_plugin_errors_total{plugin,stage}``,
and the request goes round-robin over the candidates it started with. Two
exceptions: a failing picked hook leaves the pick standing (it was sound, and
other hooks have already learned it), and a failing response hook is skipped
(the response is on its way).

The record of why a request went where it went (``Explanation``) is built
only when asked for: explaining costs nothing otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, Counter

from lwepp.attributes import NO_ATTRIBUTES, AttributeStore, Snapshot, plain
from lwepp.body import parse_request
from lwepp.hooks import (
    Candidate,
    Filter,
    LLMRequest,
    PickedHook,
    Picker,
    Plugin,
    PrepareHook,
    ResponseHook,
    Scored,
    Scorer,
    Usage,
)
from lwepp.picking import PickRequest, RoundRobin
from lwepp.plugins.pickers import MaxScorePicker
from pods.model import Endpoint

log = structlog.get_logger()

MODEL_HEADER: Final = "x-gateway-model-name"
"""Set by BBR from the body's ``model``; the request's model when the body is not parsed."""

NO_SCORES: Final[Mapping[str, float]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Weighted:
    """A scorer and the weight its scheduling profile gives it (default 1.0, never negative)."""

    scorer: Scorer
    weight: float = 1.0


class PluginFailure(Exception):
    """A plugin raised or broke its contract: says which plugin, at which stage, and what."""

    def __init__(self, plugin: str, stage: str, problem: str) -> None:
        super().__init__(f"{stage} {plugin}: {problem}")
        self.plugin, self.stage = plugin, stage

    @classmethod
    def of(cls, plugin: Plugin, stage: str, error: Exception) -> PluginFailure:
        return cls(plugin.name, stage, f"{type(error).__name__}: {error}")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the pipeline decided for one request, and what its response side needs.

    ``endpoints`` is empty when filtering left no candidate (answered 503).
    ``explanation`` is set only when explaining was asked for; ``failure``
    when a plugin failed and the request went round-robin instead.
    """

    endpoints: tuple[Endpoint, ...]
    request: LLMRequest
    explanation: dict[str, Any] | None = None
    failure: PluginFailure | None = None


class PipelineMetrics:
    """The pipeline's Prometheus metrics, registered beside the core's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.plugin_errors = Counter(
            "lwepp_plugin_errors",
            "plugin failures by plugin and stage (request side: answered round-robin instead)",
            ["plugin", "stage"],
            registry=registry,
        )


class Pipeline:
    """Prepare hooks, filters, weighted scorers, a picker, and the hooks after it.

    Every argument is optional: ``Pipeline()`` has no plugins and picks
    round-robin. ``store`` holds the endpoint attributes data sources write;
    ``clock`` is the one they stamp measurements with (the ``now`` plugins get).
    """

    def __init__(
        self,
        *,
        prepare: Sequence[PrepareHook] = (),
        filters: Sequence[Filter] = (),
        scorers: Sequence[Weighted] = (),
        picker: Picker | None = None,
        picked: Sequence[PickedHook] = (),
        responses: Sequence[ResponseHook] = (),
        store: AttributeStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        self.prepare = tuple(prepare)
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker: Picker = picker or MaxScorePicker("max-score-picker")
        self.picked = tuple(picked)
        self.responses = tuple(responses)
        self.store = store or AttributeStore()
        self.clock = clock
        self.metrics = metrics or PipelineMetrics(CollectorRegistry())
        plugins: list[Plugin] = [
            *self.prepare,
            *self.filters,
            *(w.scorer for w in self.scorers),
            self.picker,
            *self.picked,
            *self.responses,
        ]
        self.needs_body = any(p.needs_body for p in plugins)
        """True when some plugin reads the body: only then is it parsed."""
        self.reads: frozenset[str] = frozenset().union(*(p.reads for p in plugins))
        self._fallback = RoundRobin()
        self._last: _Candidates | None = None

    # --- request side ------------------------------------------------------------

    def pick(self, request: PickRequest, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """The ``Strategy`` seam: the chosen endpoints, all the core needs."""
        return self.decide(self.request_of(request), candidates).endpoints

    def request_of(self, request: PickRequest) -> LLMRequest:
        """The request as plugins see it: headers (lower-case, first value), model, body."""
        # Envoy sends header names lower-case; read backwards, the first value is the one kept.
        headers = dict(reversed(request.headers))
        body = parsed = None
        if self.needs_body and request.body is not None:
            body, parsed = request.body, parse_request(request.body)
        model = parsed.get("model") if parsed is not None else None
        return LLMRequest(
            request_id=headers.get("x-request-id", ""),
            headers=MappingProxyType(headers),
            model=model if isinstance(model, str) else headers.get(MODEL_HEADER),
            body=body,
            parsed=parsed,
        )

    def decide(
        self, request: LLMRequest, candidates: Sequence[Endpoint], *, explain: bool = False
    ) -> Decision:
        """Run the request side for ``candidates`` (never empty); explain it if asked."""
        record = Explanation(request.request_id, candidates) if explain else None
        try:
            chosen = self._choose(request, candidates, record)
        except PluginFailure as failure:
            self.failed(failure, request)
            chosen = tuple(self._fallback.pick(PickRequest(()), candidates))
            if record is not None:
                record.fell_back(failure, chosen)
            return Decision(chosen, request, record.data if record else None, failure)
        for hook in self.picked:
            try:
                hook.picked(request, chosen)
            except Exception as error:
                self.failed(PluginFailure.of(hook, "picked", error), request)
        return Decision(chosen, request, record.data if record else None)

    def _choose(
        self, request: LLMRequest, endpoints: Sequence[Endpoint], record: Explanation | None
    ) -> tuple[Endpoint, ...]:
        now = self.clock()
        given = self.candidates(endpoints)
        candidates: Sequence[Candidate] = given.candidates

        for hook in self.prepare:
            try:
                hook.prepare(request)
            except Exception as error:
                raise PluginFailure.of(hook, "prepare", error) from error

        for step in self.filters:
            try:
                kept = list(step.filter(request, candidates, now))
                ids = {id(c) for c in candidates}
                if any(id(c) not in ids for c in kept):
                    raise ValueError("returned a candidate it was not given")
            except Exception as error:
                raise PluginFailure.of(step, "filter", error) from error
            if record is not None:
                record.filtered(step.name, candidates, kept)
            candidates = kept
            if not candidates:
                return ()

        unfiltered = candidates is given.candidates
        totals = [0.0] * len(candidates)
        raw: list[dict[str, float]] = [{} for _ in candidates] if self.scorers else []
        for weighted in self.scorers:
            scorer = weighted.scorer
            try:
                scores = scorer.score(request, candidates, now)
                if len(scores) != len(candidates):
                    raise ValueError(f"{len(scores)} scores for {len(candidates)} candidates")
                for i, score in enumerate(scores):
                    score = min(1.0, max(0.0, score))  # NaN fails both tests: it counts as 0
                    raw[i][scorer.name] = score
                    totals[i] += weighted.weight * score
            except Exception as error:
                raise PluginFailure.of(scorer, "score", error) from error
        if unfiltered and not self.scorers:
            scored: Sequence[Scored] = given.unscored
        else:
            scored = [
                Scored(c, total, raw[i] if raw else NO_SCORES)
                for i, (c, total) in enumerate(zip(candidates, totals, strict=True))
            ]
        if record is not None:
            record.scored(self.scorers, scored, self.reads, now)

        try:
            chosen = tuple(self.picker.pick(request, scored))
            allowed = given.hostports if unfiltered else {c.endpoint.hostport for c in candidates}
            for endpoint in chosen:
                if endpoint.hostport not in allowed:  # the subset hint is the protocol's hard rule
                    raise ValueError(f"chose {endpoint.hostport}, which is not a candidate")
        except Exception as error:
            raise PluginFailure.of(self.picker, "pick", error) from error
        if record is not None:
            record.picked(self.picker.name, chosen)
        return chosen

    def candidates(self, endpoints: Sequence[Endpoint]) -> _Candidates:
        """The endpoints as candidates, each with its attributes as last measured.

        They depend only on the endpoint tuple and the store's snapshot, both
        replaced whole on a change, and they are immutable: the last ones are
        reused until either is a different object (most picks, in steady traffic).
        """
        snapshot, last = self.store.snapshot, self._last
        if last is None or last.endpoints is not endpoints or last.snapshot is not snapshot:
            candidates = tuple(
                Candidate(e, snapshot.get(e.hostport, NO_ATTRIBUTES)) for e in endpoints
            )
            last = self._last = _Candidates(
                endpoints,
                snapshot,
                candidates,
                frozenset(e.hostport for e in endpoints),
                tuple(Scored(c, 0.0, NO_SCORES) for c in candidates),
            )
        return last

    # --- response side -----------------------------------------------------------

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> list[tuple[str, str]]:
        """The headers every response hook adds, in hook order."""
        added: list[tuple[str, str]] = []
        for hook in self.responses:
            try:
                added += hook.response_headers(request, served, headers).items()
            except Exception as error:
                self.failed(PluginFailure.of(hook, "response_headers", error), request)
        return added

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        for hook in self.responses:
            try:
                hook.response_chunk(request, chunk)
            except Exception as error:
                self.failed(PluginFailure.of(hook, "response_chunk", error), request)

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        for hook in self.responses:
            try:
                hook.response_complete(request, served, usage)
            except Exception as error:
                self.failed(PluginFailure.of(hook, "response_complete", error), request)

    def failed(self, failure: PluginFailure, request: LLMRequest) -> None:
        """Count and log a plugin's failure, naming the plugin, the stage and the request."""
        self.metrics.plugin_errors.labels(failure.plugin, failure.stage).inc()
        log.warning(
            "plugin failed",
            plugin=failure.plugin,
            stage=failure.stage,
            error=str(failure),
            request_id=request.request_id,
            exc_info=failure.__cause__,
        )


@dataclass(frozen=True, slots=True)
class _Candidates:
    """One endpoint list as candidates, with what a pick without filters or scorers needs."""

    endpoints: Sequence[Endpoint]
    snapshot: Snapshot
    candidates: tuple[Candidate, ...]
    hostports: frozenset[str]
    unscored: tuple[Scored, ...]
    """Every candidate with a total of 0: the scored list when no scorer is configured."""


class Explanation:
    """Why a request went where it went, as JSON-ready data (built only when asked for).

    ``candidates``: the endpoints the request could go to; ``filters``: what
    each filter removed; ``weights``: each scorer's weight; ``scores``: each
    candidate (best first) with its total, each scorer's raw score and the
    attributes the plugins read (value and age in seconds); ``picked``: the
    answer; ``fallback``: the plugin failure that made it round-robin.
    """

    __slots__ = ("data",)

    def __init__(self, request_id: str, candidates: Sequence[Endpoint]) -> None:
        self.data: dict[str, Any] = {
            "request": request_id,
            "candidates": [e.hostport for e in candidates],
            "filters": [],
            "weights": {},
            "scores": [],
            "picker": None,
            "picked": [],
            "fallback": None,
        }

    def filtered(self, name: str, before: Sequence[Candidate], after: Sequence[Candidate]) -> None:
        kept = {id(c) for c in after}
        removed = [c.endpoint.hostport for c in before if id(c) not in kept]
        self.data["filters"].append({"filter": name, "removed": removed})

    def scored(
        self,
        scorers: Sequence[Weighted],
        scored: Sequence[Scored],
        reads: frozenset[str],
        now: float,
    ) -> None:
        self.data["weights"] = {w.scorer.name: w.weight for w in scorers}
        rows = []
        for s in sorted(scored, key=lambda s: s.total, reverse=True):
            row: dict[str, Any] = {
                "endpoint": s.candidate.endpoint.hostport,
                "total": round(s.total, 4),
                "scores": {name: round(score, 4) for name, score in s.scores.items()},
            }
            measured = {
                n: s.candidate.attributes[n] for n in sorted(reads) if n in s.candidate.attributes
            }
            if measured:
                row["attributes"] = {
                    n: {"value": plain(m.value), "age": round(now - m.at, 3)}
                    for n, m in measured.items()
                }
            rows.append(row)
        self.data["scores"] = rows

    def picked(self, picker: str, endpoints: Sequence[Endpoint]) -> None:
        self.data["picker"] = picker
        self.data["picked"] = [e.hostport for e in endpoints]

    def fell_back(self, failure: PluginFailure, endpoints: Sequence[Endpoint]) -> None:
        self.data["fallback"] = str(failure)
        self.picked("round-robin (fallback)", endpoints)
