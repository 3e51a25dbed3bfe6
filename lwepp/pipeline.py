"""The filter/scorer pipeline: a ``Strategy`` that picks for one request, then hears its response.

Each plugin plays every role whose method it has (``plugin_api.Role``), at each
stage in the order the plugins were given. Request side (``decide``), each
stage one loop::

    prepare     each computes per-request data once, into request.state
    admit       each may refuse the request (HTTP 429, its reason in the message;
                ``admit_request``, given the request's priority)
    filter      each narrows the candidates; none left → HTTP 503
    score       each rates every candidate in [0, 1]; the pipeline clamps the
                score (NaN counts as 0), multiplies it by the scorer's weight
                and adds it to the candidate's total
    pick        the scored candidates → endpoints, best first (then fallbacks)
    picked      each learns the pick

Response side: when a plugin hooks the response (or the decision is to be
explained), the ``Choice`` carries a ``Followup``, which the core calls as the
response passes: its headers (hooks add headers), each body chunk, and its
end (hooks hear the served endpoint and the token usage read from the body).

The pipeline plugs into the core (``lwepp.server``) through ``Strategy``
alone, exactly as ``RoundRobin`` does. With no scorers the default picker
(``max-score-picker``, ties in turn) answers exactly as round-robin does.

A plugin that raises, or breaks its contract (a filter returning a stranger,
a scorer returning the wrong number of scores, a picker choosing a
non-candidate), never loses the request: the error is logged naming the
plugin and stage, counted in ``llm_d_epp_plugin_errors_total{plugin,stage}``,
and the request goes round-robin over the candidates it started with. Two
exceptions: a failing picked hook leaves the pick standing (it was sound, and
other hooks have already learned it), and a failing response hook is skipped
(the response is on its way).

Metrics, with the llm-d router's names (``registry``): each plugin call's time
in ``llm_d_epp_plugin_duration_seconds{extension_point,plugin_type,plugin_name}``
(the router's extension points: DataProducer for prepare, Filter, Scorer,
Picker, PreRequest for picked, ResponseReceived, ResponseStreaming,
ResponseComplete), and, set by ``refresh_metrics``, the pool's mean and
standard deviation of the attributes the data sources measured:
``llm_d_epp_average_kv_cache_utilization``, ``_average_queue_size``,
``_average_running_requests`` and the ``std_dev_`` three, labelled with the
pool's ``name``. ``llm_d_epp_plugin_errors_total{plugin,stage}`` is
Switchyard's own (the router has no such count).

Every plugin call goes through one helper, ``Pipeline.call`` (timed, and a
failure named), or ``Pipeline.hook`` for the calls a failure must not stop.
Explaining a decision, off unless asked for, is ``lwepp.explain``'s.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from types import MappingProxyType
from typing import Any, Final, TypeVar

import orjson
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lwepp.attributes import (
    NO_ATTRIBUTES,
    AttributeStore,
    Snapshot,
    forget_departed,
    keep_running,
)
from lwepp.body import UsageReader, parse_request
from lwepp.contracts import (
    Admitter,
    Candidate,
    DataSource,
    Filter,
    LLMRequest,
    PickedHook,
    Picker,
    Plugin,
    PrepareHook,
    ResponseChunkHook,
    ResponseCompleteHook,
    ResponseHeadersHook,
    Scored,
    Scorer,
)
from lwepp.explain import (
    DECISION_HEADER,
    DecisionLog,
    ExplainMode,
    Explanation,
    asked,
    header_json,
)
from lwepp.picking import Choice, RequestInfo, RoundRobin
from lwepp.plugins.pickers import MaxScorePicker
from plugin_api import ConfigError, Role, needs_body, roles_of
from pods.model import Endpoint
from wire.exchange import Refusal, header_value_problem

log = structlog.get_logger()

T = TypeVar("T")

ROLES: Final = tuple(role for role in Role if role not in (Role.REQUEST, Role.RESPONSE))
"""The roles a picker's plugins play: every ``plugin_api.Role`` but BBR's two, in stage order."""

MODEL_HEADER: Final = "x-gateway-model-name"
"""Set by BBR from the body's ``model``; the request's model when the body is not parsed."""

NO_SCORES: Final[Mapping[str, float]] = MappingProxyType({})

EXTENSION_POINTS: Final = {
    Role.PREPARE: "DataProducer",
    Role.ADMIT: "Admission",
    Role.FILTER: "Filter",
    Role.SCORE: "Scorer",
    Role.PICK: "Picker",
    Role.PICKED: "PreRequest",
    Role.RESPONSE_HEADERS: "ResponseReceived",
    Role.RESPONSE_CHUNK: "ResponseStreaming",
    Role.RESPONSE_COMPLETE: "ResponseComplete",
}
"""Each request-path stage as the llm-d router names it in ``plugin_duration_seconds``."""

DURATION_BUCKETS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
"""The router's buckets for ``llm_d_epp_plugin_duration_seconds``."""

POOL_ATTRIBUTES: Final = {
    "kv_cache_usage": "kv_cache_utilization",
    "queue_depth": "queue_size",
    "running_requests": "running_requests",
}
"""Endpoint attributes summarised per pool → the router's gauge names for them."""

ADMISSION_DENIED: Final = "admission-denied"
"""The ``code`` of an admitter's refusal (its OpenAI-style error body)."""

FRESH_SECONDS: Final = 2.0
"""Measurements older than this are left out of the pool's averages (the router's
``--metrics-staleness-threshold`` default)."""


class PluginFailure(Exception):
    """A plugin raised or broke its contract: says which plugin, at which stage, and what."""

    def __init__(self, plugin: str, stage: str, problem: str) -> None:
        super().__init__(f"{stage} {plugin}: {problem}")
        self.plugin, self.stage = plugin, stage

    @classmethod
    def of(cls, plugin: Plugin, stage: Role, error: Exception) -> PluginFailure:
        return cls(plugin.name, stage.value, f"{type(error).__name__}: {error}")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the pipeline decided for one request.

    ``endpoints`` is empty when filtering left no candidate (answered 503).
    ``explanation`` is set only when explaining was asked for; ``failure``
    when a plugin failed and the request went round-robin instead.
    """

    endpoints: tuple[Endpoint, ...]
    request: LLMRequest
    explanation: dict[str, Any] | None = None
    failure: PluginFailure | None = None


class Pipeline:
    """Plugins at each stage of a pick, and the hooks on its response: a ``Strategy``.

    ``plugins`` are placed at every stage whose method they have, in the
    order given (at most one picker; with none, ``max-score-picker``).
    ``weights`` multiply scorers' scores by scorer name (default 1.0).
    ``store`` holds the endpoint attributes data sources write; ``clock`` is
    the one they stamp measurements with (the ``now`` plugins get). Plugin
    failures are counted in ``registry``. ``Pipeline()`` has no plugins and
    picks round-robin.
    """

    def __init__(
        self,
        plugins: Sequence[object] = (),
        *,
        weights: Mapping[str, float] | None = None,
        store: AttributeStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        explain: ExplainMode = "off",
        decisions: DecisionLog | None = None,
        types: Mapping[str, str] | None = None,
        pool: str = "",
    ) -> None:
        self.plugins: tuple[Any, ...] = tuple(plugins)
        self.stages: dict[Role, tuple[Any, ...]] = {
            role: tuple(p for p in self.plugins if role in roles_of(p, ROLES)) for role in ROLES
        }
        """The plugins of each role, in stage order (``--check-config`` prints them)."""
        if len(self.stages[Role.PICK]) > 1:
            raise ConfigError(
                f"more than one picker: {', '.join(p.name for p in self.stages[Role.PICK])}"
            )
        self.stages[Role.PICK] = self.stages[Role.PICK] or (MaxScorePicker("max-score-picker"),)
        self.sources: tuple[DataSource, ...] = self.stages[Role.SOURCE]
        self.prepare: tuple[PrepareHook, ...] = self.stages[Role.PREPARE]
        self.admitters: tuple[Admitter, ...] = self.stages[Role.ADMIT]
        self.filters: tuple[Filter, ...] = self.stages[Role.FILTER]
        weights = weights or {}
        self.scorers: tuple[tuple[Scorer, float], ...] = tuple(
            (scorer, weights.get(scorer.name, 1.0)) for scorer in self.stages[Role.SCORE]
        )
        self.picker: Picker = self.stages[Role.PICK][0]
        self.picked: tuple[PickedHook, ...] = self.stages[Role.PICKED]
        self.on_headers: tuple[ResponseHeadersHook, ...] = self.stages[Role.RESPONSE_HEADERS]
        self.on_chunk: tuple[ResponseChunkHook, ...] = self.stages[Role.RESPONSE_CHUNK]
        self.on_complete: tuple[ResponseCompleteHook, ...] = self.stages[Role.RESPONSE_COMPLETE]
        self.controls = tuple(p for p in self.plugins if callable(getattr(p, "admit", None)))
        """Plugins that are request controls as well (``lwepp.picking.RequestControl``: the
        token producer asks an engine's tokenizer before the pick); the assembly runs them
        last before the choice."""
        self.response_hooks = bool(self.on_headers or self.on_chunk or self.on_complete)
        """True when some plugin hears the response."""
        self.needs_body = any(needs_body(p) for p in self.plugins)
        """True when some plugin reads the body: only then is it parsed."""
        self.reads: frozenset[str] = frozenset().union(
            *(getattr(p, "reads", frozenset()) for p in self.plugins)
        )
        for source in self.sources:  # what its readers need: a source names what it cannot give
            if hasattr(source, "wanted"):
                produced = frozenset(source.produces)
                readers = [p.name for p in self.plugins if getattr(p, "reads", set()) & produced]
                source.wanted = self.reads & produced
                setattr(source, "readers", tuple(readers))  # noqa: B010 (a protocol's extra)
        self.store = store or AttributeStore()
        self.clock = clock
        registry = registry or CollectorRegistry()
        self.priority: Callable[[Sequence[tuple[str, str]]], int] = no_priority
        """A request's priority from its headers (its InferenceObjective's), for the admitters;
        the assembly gives the pool's objectives (``lwepp.objectives.priority_of``)."""
        self.refusals = Counter(
            "llm_d_epp_admission_refusals",
            "requests an admitter refused, by admitter (answered 429)",
            ["plugin"],
            registry=registry,
        )
        self.plugin_errors = Counter(
            "llm_d_epp_plugin_errors",
            "plugin failures by plugin and stage (request side: answered round-robin instead)",
            ["plugin", "stage"],
            registry=registry,
        )
        durations = Histogram(
            "llm_d_epp_plugin_duration_seconds",
            "Plugin processing latency distribution in seconds for each extension point, "
            "plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        types = types or {}
        self.timers: dict[tuple[Role, str], Any] = {
            (role, p.name): durations.labels(
                EXTENSION_POINTS[role], types.get(p.name, type(p).__name__), p.name
            )
            for role, plugins in self.stages.items()
            if role in EXTENSION_POINTS
            for p in plugins
        }
        """Each plugin's ``plugin_duration_seconds`` child, per stage: bound once."""
        self.unusable = Gauge(
            "llm_d_epp_data_source_unusable_endpoints",
            "Endpoints whose last answer to the data source gave nothing the picker can use "
            "(unreachable, or none of the metrics its plugins read).",
            ["plugin"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.pool_gauges = {
            (kind, attribute): Gauge(
                f"llm_d_epp_{kind}_{name}",
                f"The {kind.replace('_', ' ')} of {attribute} across the pool's endpoints.",
                ["name"],
                registry=registry,
                multiprocess_mode="livemax",
            ).labels(pool)
            for attribute, name in POOL_ATTRIBUTES.items()
            for kind in ("average", "std_dev")
        }
        self.explain = explain
        self.hears_response = self.response_hooks or explain != "off"
        """What the ``Strategy`` seam asks: a hook, or an explanation (a response header)."""
        self.decisions = decisions or DecisionLog()
        self._fallback = RoundRobin()
        self._last: _Candidates | None = None

    # --- the Strategy seam -----------------------------------------------------------

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        """Decide, and carry the response side along when a hook or an explanation needs it."""
        llm = self.request_of(request)
        decision = self.decide(llm, candidates, explain=asked(self.explain, llm.headers))
        if decision.explanation is not None:
            self.decisions.add(decision.explanation)
        elif decision.failure is not None:  # kept unexplained too: what one looks for there
            self.decisions.add(
                {
                    "request": llm.request_id,
                    "picked": [e.hostport for e in decision.endpoints],
                    "fallback": str(decision.failure),
                }
            )
        if not decision.endpoints:
            explained = decision.explanation
            headers = [(DECISION_HEADER, header_json(explained))] if explained else []
            raise Refusal(
                503, "no endpoint accepted the request", reason="no_pick", headers=headers
            )
        if self.response_hooks or decision.explanation is not None:
            return Choice(decision.endpoints, ResponseHooks(self, decision))
        return Choice(decision.endpoints)

    def request_of(self, request: RequestInfo) -> LLMRequest:
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

    # --- one plugin call ---------------------------------------------------------------

    def call(self, role: Role, plugin: Plugin, method: Callable[..., T], *args: Any) -> T:
        """One plugin call: timed into its ``plugin_duration_seconds`` for the stage, and any
        exception it raises turned into a ``PluginFailure`` naming the plugin and the stage."""
        started = perf_counter()
        try:
            result = method(*args)
        except Exception as error:
            raise PluginFailure.of(plugin, role, error) from error
        self.timers[role, plugin.name].observe(perf_counter() - started)
        return result

    def hook(
        self, role: Role, plugin: Plugin, request: LLMRequest, method: Callable[..., T], *args: Any
    ) -> T | None:
        """A hook's call (picked, response): as ``call``, but a failure is counted and logged
        and the request goes on (None), since what it serves is already decided."""
        try:
            return self.call(role, plugin, method, *args)
        except PluginFailure as failure:
            self.failed(failure, request)
            return None

    # --- the request side ------------------------------------------------------------

    def decide(
        self, request: LLMRequest, candidates: Sequence[Endpoint], *, explain: bool = False
    ) -> Decision:
        """Run the request side for ``candidates`` (never empty); explain it if asked."""
        record = Explanation(request.request_id, candidates) if explain else None
        try:
            chosen = self._choose(request, candidates, record)
        except PluginFailure as failure:
            self.failed(failure, request)
            chosen = tuple(self._fallback.choose(RequestInfo(()), candidates).endpoints)
            if record is not None:
                record.fell_back(failure, chosen)
            return Decision(chosen, request, record.data if record else None, failure)
        for hook in self.picked:
            self.hook(Role.PICKED, hook, request, hook.picked, request, chosen)
        return Decision(chosen, request, record.data if record else None)

    def _choose(
        self, request: LLMRequest, endpoints: Sequence[Endpoint], record: Explanation | None
    ) -> tuple[Endpoint, ...]:
        now = self.clock()
        given = self.candidates(endpoints)
        candidates: Sequence[Candidate] = given.candidates

        for hook in self.prepare:
            self.call(Role.PREPARE, hook, hook.prepare, request)

        if self.admitters:
            self.admit(request, candidates, now)

        for step in self.filters:
            kept = list(self.call(Role.FILTER, step, step.filter, request, candidates, now))
            ids = {id(c) for c in candidates}
            if any(id(c) not in ids for c in kept):
                raise PluginFailure(step.name, "filter", "returned a candidate it was not given")
            if record is not None:
                record.filtered(step.name, candidates, kept)
            candidates = kept
            if not candidates:
                return ()

        unfiltered = candidates is given.candidates
        totals = [0.0] * len(candidates)
        raw: list[dict[str, float]] = [{} for _ in candidates] if self.scorers else []
        for scorer, weight in self.scorers:
            scores = self.call(Role.SCORE, scorer, scorer.score, request, candidates, now)
            if len(scores) != len(candidates):
                problem = f"{len(scores)} scores for {len(candidates)} candidates"
                raise PluginFailure(scorer.name, "score", problem)
            for i, score in enumerate(scores):
                score = min(1.0, max(0.0, score))  # NaN fails both tests: it counts as 0
                raw[i][scorer.name] = score
                totals[i] += weight * score
        if unfiltered and not self.scorers:
            scored: Sequence[Scored] = given.unscored
        else:
            scored = [
                Scored(c, total, raw[i] if raw else NO_SCORES)
                for i, (c, total) in enumerate(zip(candidates, totals, strict=True))
            ]
        if record is not None:
            record.scored(self.scorers, scored, self.reads, now)

        picker = self.picker
        chosen = tuple(self.call(Role.PICK, picker, picker.pick, request, scored))
        allowed = given.hostports if unfiltered else {c.endpoint.hostport for c in candidates}
        for endpoint in chosen:
            if endpoint.hostport not in allowed:  # the subset hint is the protocol's hard rule
                problem = f"chose {endpoint.hostport}, which is not a candidate"
                raise PluginFailure(picker.name, "pick", problem)
        if record is not None:
            record.picked(picker.name, chosen)
        return chosen

    def admit(self, request: LLMRequest, candidates: Sequence[Candidate], now: float) -> None:
        """Each admitter in turn; the first that gives a reason refuses the request.

        A refusal is an answer, not a failure: it leaves ``decide`` as a ``Refusal``, the
        request goes nowhere. The router answers its admitters' denials 500 (``Internal``);
        here 429, the status it gives its other refusal of a sheddable request (saturation):
        shedding load on purpose is not a server fault, and clients back off on 429.
        """
        priority = self.priority(tuple(request.headers.items()))
        for gate in self.admitters:
            reason = self.call(
                Role.ADMIT, gate, gate.admit_request, request, candidates, now, priority
            )
            if reason is not None:
                self.refusals.labels(gate.name).inc()
                raise Refusal(429, f"request cannot be admitted: {reason}", reason=ADMISSION_DENIED)

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

    def refresh_metrics(self, endpoints: Sequence[Endpoint]) -> None:
        """Set the pool gauges from the attributes measured within ``FRESH_SECONDS``, and each
        data source's count of endpoints it reads nothing usable from (``problems``).

        A pool with no fresh measurement of an attribute reports 0 for it, as
        the router does for a pool whose pods have no fresh metrics.
        """
        snapshot, now = self.store.snapshot, self.clock()
        for source in self.sources:
            if isinstance(problems := getattr(source, "problems", None), Mapping):
                self.unusable.labels(source.name).set(len(problems))
        for attribute in POOL_ATTRIBUTES:
            values = []
            for endpoint in endpoints:
                measured = snapshot.get(endpoint.hostport, NO_ATTRIBUTES).get(attribute)
                if measured is not None and now - measured.at <= FRESH_SECONDS:
                    value = measured.value
                    if isinstance(value, int | float) and math.isfinite(value):
                        values.append(float(value))
            mean = statistics.fmean(values) if values else 0.0
            spread = statistics.pstdev(values) if values else 0.0
            self.pool_gauges["average", attribute].set(mean)
            self.pool_gauges["std_dev", attribute].set(spread)

    def failed(self, failure: PluginFailure, request: LLMRequest) -> None:
        """Count and log a plugin's failure, naming the plugin, the stage and the request."""
        self.plugin_errors.labels(failure.plugin, failure.stage).inc()
        log.warning(
            "plugin failed",
            plugin=failure.plugin,
            stage=failure.stage,
            error=str(failure),
            request_id=request.request_id,
            exc_info=failure.__cause__,
        )

    # --- hosting: what runs beside the picks -----------------------------------------

    def background(
        self, endpoints: Callable[[], Sequence[Endpoint]]
    ) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        """The data sources' tasks, for ``serving.server.serve`` to run (each restarted on failure).

        A source that fails is counted as ``llm_d_epp_plugin_errors_total{stage="source"}``.
        """

        def failed(source: str, error: BaseException) -> None:
            self.plugin_errors.labels(source, "source").inc()
            log.warning("data source failed; restarting it", source=source, exc_info=error)

        jobs: list[Callable[[], Coroutine[Any, Any, None]]] = [
            functools.partial(keep_running, source, endpoints, self.store, self.clock, failed)
            for source in self.sources
        ]
        if jobs:  # and, beside them, forget the attributes of endpoints that left
            jobs.append(functools.partial(forget_departed, self.store, endpoints))
        return jobs

    def debug_pages(self) -> dict[str, Callable[[], bytes]]:
        """``/debug/decisions``, ``/debug/attributes`` (the store, with ages), and
        ``/debug/<name>`` for each data source with a ``debug_page`` (the precise prefix
        index: its engines and their problems), as JSON."""
        pages: dict[str, Callable[[], bytes]] = {
            "/debug/decisions": self.decisions.render,
            "/debug/attributes": lambda: orjson.dumps(self.store.describe(self.clock())),
        }
        for source in self.sources:
            if callable(page := getattr(source, "debug_page", None)):
                pages[f"/debug/{source.name}"] = page
        return pages


class ResponseHooks:
    """One request's response side, the pipeline's ``Followup``: what its hooks hear as it passes.

    The body is kept (its tail, for an event stream) only when a
    ``response_complete`` hook will want the token usage read from it.
    """

    __slots__ = ("decision", "pipeline", "reader", "served")

    def __init__(self, pipeline: Pipeline, decision: Decision) -> None:
        self.pipeline, self.decision = pipeline, decision
        self.served: str | None = None
        self.reader: UsageReader | None = None

    def headers(self, served: str | None, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """The response headers arrived: what every hook adds, then the explanation."""
        self.served = served
        request, added = self.decision.request, list[tuple[str, str]]()
        for hook in self.pipeline.on_headers:
            pairs = self.pipeline.hook(
                Role.RESPONSE_HEADERS, hook, request, _header_values, hook, request, served, headers
            )
            added += pairs or ()
        if self.pipeline.on_complete:
            self.reader = UsageReader("text/event-stream" in headers.get("content-type", ""))
        if self.decision.explanation is not None:
            added.append((DECISION_HEADER, header_json(self.decision.explanation)))
        return added

    def chunk(self, chunk: bytes) -> None:
        """A piece of the response body: to every chunk hook, and kept for its usage."""
        request = self.decision.request
        for hook in self.pipeline.on_chunk:
            self.pipeline.hook(
                Role.RESPONSE_CHUNK, hook, request, hook.response_chunk, request, chunk
            )
        if self.reader is not None:
            self.reader.add(chunk)

    def end(self) -> None:
        """The response is over: the served endpoint and the usage, to every completion hook."""
        usage = self.reader.usage() if self.reader is not None else None
        request = self.decision.request
        for hook in self.pipeline.on_complete:
            self.pipeline.hook(
                Role.RESPONSE_COMPLETE,
                hook,
                request,
                hook.response_complete,
                request,
                self.served,
                usage,
            )


def no_priority(headers: Sequence[tuple[str, str]]) -> int:
    """Every request's priority without InferenceObjectives: 0, as the router's default."""
    return 0


def _header_values(
    hook: ResponseHeadersHook,
    request: LLMRequest,
    served: str | None,
    headers: Mapping[str, str],
) -> list[tuple[str, str]]:
    """A headers hook's additions, each checked: Envoy would fail the whole response on one
    value no header can carry (the hook fails instead)."""
    pairs = list(hook.response_headers(request, served, headers).items())
    for name, value in pairs:
        if problem := header_value_problem(value):
            raise ValueError(f"the value for header {name} {problem}")
    return pairs


@dataclass(frozen=True, slots=True)
class _Candidates:
    """One endpoint list as candidates, with what a pick without filters or scorers needs."""

    endpoints: Sequence[Endpoint]
    snapshot: Snapshot
    candidates: tuple[Candidate, ...]
    hostports: frozenset[str]
    unscored: tuple[Scored, ...]
    """Every candidate with a total of 0: the scored list when no scorer is configured."""
