"""The pipeline without the wire: stage order, weighted scores, fallbacks, the body, explaining."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lwepp.attributes import AttributeStore
from lwepp.contracts import Candidate, LLMRequest, Measurement, Scored
from lwepp.picking import RequestInfo, RoundRobin
from lwepp.pipeline import Pipeline
from pods.model import Endpoint
from tests.plugin_fakes import FakeFilter, FakeScorer, FixedPicker, RecordingHook

ENDPOINTS = [Endpoint(f"p{i}", f"10.0.0.{i + 1}", 8000) for i in range(4)]
BY_NAME = {e.hostport: e for e in ENDPOINTS}
A, B, C, D = (e.hostport for e in ENDPOINTS)
HEADERS = [("x-request-id", "r-1"), ("x-gateway-model-name", "m")]


class Capture:
    """A picker that keeps what it was given and picks the first candidate."""

    def __init__(self) -> None:
        self.name = "capture"
        self.scored: list[Scored] = []

    def pick(self, request: LLMRequest, scored: Sequence[Scored]) -> list[Endpoint]:
        self.scored = list(scored)
        return [scored[0].candidate.endpoint]


def errors(registry: CollectorRegistry, plugin: str, stage: str) -> float:
    value = registry.get_sample_value(
        "llm_d_epp_plugin_errors_total", {"plugin": plugin, "stage": stage}
    )
    return value or 0.0


def decide(pipeline: Pipeline, body: bytes | None = None, explain: bool = False) -> Any:
    request = pipeline.request_of(RequestInfo(HEADERS, body))
    return pipeline.decide(request, ENDPOINTS, explain=explain)


def test_stages_run_in_order_each_seeing_the_last_ones_result() -> None:
    """prepare → filter → score → pick → picked; scorers see only what the filters kept."""
    log: list[tuple[str, str, Any]] = []
    hook = RecordingHook("hook", log)
    scorer = FakeScorer("s", {C: 1.0})
    pipeline = Pipeline([hook, FakeFilter("no-a", [A]), FakeFilter("no-b", [B]), scorer])
    decision = decide(pipeline)
    assert [e.hostport for e in decision.endpoints] == [C]
    assert scorer.seen == [[C, D]]
    assert [stage for _, stage, _ in log] == ["prepare", "picked"]
    assert log[-1][2] == [C]
    assert decision.request.state == {"hook.prepared": True}


@pytest.mark.parametrize(
    ("first", "second", "weights", "expected"),
    [
        (0.5, 0.25, (1.0, 1.0), 0.75),
        (0.5, 0.25, (2.0, 4.0), 2.0),
        (1.5, -0.5, (1.0, 1.0), 1.0),
        (math.nan, 1.0, (3.0, 1.0), 1.0),
        (0.5, 0.5, (0.0, 2.0), 1.0),
    ],
    ids=["sum", "weighted", "clamped", "nan-is-zero", "zero-weight"],
)
def test_scores_are_clamped_weighted_and_summed(
    first: float, second: float, weights: tuple[float, float], expected: float
) -> None:
    """Each score is clamped to [0, 1] (NaN → 0), times its weight, summed per candidate."""
    picker = Capture()
    pipeline = Pipeline(
        [FakeScorer("one", default=first), FakeScorer("two", default=second), picker],
        weights={"one": weights[0], "two": weights[1]},
    )
    decide(pipeline)
    assert [s.total for s in picker.scored] == [expected] * 4
    raw = picker.scored[0].scores
    assert raw == {"one": min(1.0, max(0.0, first)) if first == first else 0.0, "two": raw["two"]}


@given(
    st.lists(st.floats(0, 1), min_size=4, max_size=4),
    st.lists(st.floats(0, 1), min_size=4, max_size=4),
    st.floats(0, 5),
    st.floats(0, 5),
)
def test_totals_are_monotone_in_the_weights(
    first: list[float], second: list[float], weight: float, more: float
) -> None:
    """Raising a scorer's weight never lowers any candidate's total."""

    def totals(w: float) -> list[float]:
        picker = Capture()
        table1, table2 = (
            dict(zip(BY_NAME, first, strict=True)),
            dict(zip(BY_NAME, second, strict=True)),
        )
        scorers = [FakeScorer("a", table1), FakeScorer("b", table2)]
        decide(Pipeline([*scorers, picker], weights={"a": w}))
        return [s.total for s in picker.scored]

    low, high = totals(weight), totals(weight + more)
    assert all(h >= lo for h, lo in zip(high, low, strict=True))


def test_without_scorers_the_pipeline_is_round_robin() -> None:
    """No plugins: the default picker's picks are RoundRobin's, pick for pick."""
    pipeline, round_robin = Pipeline(), RoundRobin()
    for _ in range(10):
        assert pipeline.choose(RequestInfo(HEADERS), ENDPOINTS) == round_robin.choose(
            RequestInfo(HEADERS), ENDPOINTS
        )


def test_a_filter_that_removes_everyone_leaves_no_endpoint() -> None:
    """No candidate left: the decision is empty (the service answers 503); scorers do not run."""
    scorer = FakeScorer("s")
    decision = decide(Pipeline([FakeFilter("none", [A, B, C, D]), scorer]))
    assert decision.endpoints == ()
    assert scorer.seen == []
    assert decision.failure is None


class Stranger:
    """A filter that returns a candidate it was not given."""

    name = "stranger"

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        return [Candidate(Endpoint("x", "10.9.9.9", 1))]


class Short:
    """A scorer that returns one score too few."""

    name = "short"

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        return [1.0] * (len(candidates) - 1)


OUTSIDER = Endpoint("x", "10.9.9.9", 1)


@pytest.mark.parametrize(
    ("pipeline", "plugin", "stage", "problem"),
    [
        (
            lambda log: Pipeline([RecordingHook("h", log, fail_at="prepare")]),
            "h",
            "prepare",
            "Boom: h fails at prepare",
        ),
        (lambda log: Pipeline([FakeFilter("f", fail=True)]), "f", "filter", "Boom"),
        (lambda log: Pipeline([Stranger()]), "stranger", "filter", "not given"),
        (lambda log: Pipeline([FakeScorer("s", fail=True)]), "s", "score", "Boom"),
        (lambda log: Pipeline([Short()]), "short", "score", "3 scores for 4"),
        (
            lambda log: Pipeline([FixedPicker("fixed", ["x"], {"x": OUTSIDER})]),
            "fixed",
            "pick",
            "chose 10.9.9.9:1, which is not a candidate",
        ),
    ],
    ids=[
        "prepare-raises",
        "filter-raises",
        "filter-stranger",
        "scorer-raises",
        "scorer-short",
        "picker-outsider",
    ],
)
def test_a_failing_plugin_falls_back_to_round_robin(
    pipeline: Any, plugin: str, stage: str, problem: str
) -> None:
    """The failure names plugin and stage, is counted, and the request goes round-robin."""
    registry, log = CollectorRegistry(), list[tuple[str, str, Any]]()
    built: Pipeline = pipeline(log)
    built.plugin_errors = Pipeline(registry=registry).plugin_errors
    round_robin = RoundRobin()
    for count in (1, 2):
        decision = decide(built)
        assert decision.failure is not None
        assert (decision.failure.plugin, decision.failure.stage) == (plugin, stage)
        assert problem in str(decision.failure)
        assert decision.endpoints == round_robin.choose(RequestInfo(()), ENDPOINTS).endpoints
        assert errors(registry, plugin, stage) == count


def test_a_failing_picked_hook_leaves_the_pick_standing() -> None:
    """The pick was sound: it stays; the hook's error is counted and the next hook still runs."""
    registry, log = CollectorRegistry(), list[tuple[str, str, Any]]()
    pipeline = Pipeline(
        [
            FakeScorer("s", {D: 1.0}),
            RecordingHook("bad", log, fail_at="picked"),
            RecordingHook("good", log),
        ],
        registry=registry,
    )
    decision = decide(pipeline)
    assert [e.hostport for e in decision.endpoints] == [D]
    assert decision.failure is None
    assert [name for name, stage, _ in log if stage == "picked"] == ["bad", "good"]
    assert errors(registry, "bad", "picked") == 1


@pytest.mark.parametrize("needs_body", [False, True], ids=["headers-only", "needs-body"])
def test_the_body_is_parsed_only_when_a_plugin_needs_it(needs_body: bool) -> None:
    """Without a body-reading plugin the request carries no body; with one, a read-only parse."""
    log: list[tuple[str, str, Any]] = []
    pipeline = Pipeline([RecordingHook("h", log, needs_body=needs_body)])
    decision = decide(pipeline, b'{"model": "from-body", "messages": [{"role": "user"}]}')
    request = decision.request
    assert pipeline.needs_body is needs_body
    if not needs_body:
        assert (request.body, request.parsed, request.model) == (None, None, "m")
        return
    assert request.model == "from-body"
    assert request.parsed is not None
    assert request.parsed["messages"][0]["role"] == "user"
    with pytest.raises(TypeError, match="read-only"):
        request.parsed["messages"][0]["role"] = "system"
    with pytest.raises(TypeError, match="read-only"):
        request.parsed["messages"].append({})


def test_a_body_that_is_not_a_json_object_parses_to_none() -> None:
    """``parsed`` is None for a body that is not a JSON object; the model comes from the header."""
    pipeline = Pipeline([RecordingHook("h", [], needs_body=True)])
    request = decide(pipeline, b"[1, 2]").request
    assert (request.body, request.parsed, request.model) == (b"[1, 2]", None, "m")


def test_candidates_carry_the_attributes_as_last_written() -> None:
    """Each candidate gets its endpoint's snapshot; ``now`` is the pipeline's clock."""
    store = AttributeStore()
    store.write(B, {"queue_depth": Measurement(3.0, at=10.0)})
    seen: list[Any] = []

    class Reader:
        name, reads = "reader", frozenset({"queue_depth"})

        def score(
            self, request: LLMRequest, candidates: Sequence[Candidate], now: float
        ) -> list[float]:
            seen.extend((c.endpoint.hostport, c.value("queue_depth", now, 5.0)) for c in candidates)
            return [0.0] * len(candidates)

    decide(Pipeline([Reader()], store=store, clock=lambda: 12.0))
    assert seen == [(A, None), (B, 3.0), (C, None), (D, None)]
    seen.clear()
    decide(Pipeline([Reader()], store=store, clock=lambda: 16.0))
    assert (B, None) in seen  # six seconds old: stale for a five-second limit


def test_the_explanation_is_built_only_when_asked_for() -> None:
    """Unasked, no record; asked, the candidates, removals, weights, raw scores, totals, the pick."""
    store = AttributeStore()
    store.write(C, {"queue_depth": Measurement(2.0, at=9.5)})
    pipeline = Pipeline(
        [
            FakeFilter("no-a", [A]),
            FakeScorer("queue", {C: 1.0, D: 0.5}, reads=frozenset({"queue_depth"})),
            FakeScorer("kv", {B: 0.5}),
        ],
        weights={"queue": 2.0},
        store=store,
        clock=lambda: 10.0,
    )
    assert decide(pipeline).explanation is None
    explained = decide(pipeline, explain=True).explanation
    assert explained == {
        "request": "r-1",
        "candidates": [A, B, C, D],
        "filters": [{"filter": "no-a", "removed": [A]}],
        "weights": {"queue": 2.0, "kv": 1.0},
        "scores": [
            {
                "endpoint": C,
                "total": 2.0,
                "scores": {"queue": 1.0, "kv": 0.0},
                "attributes": {"queue_depth": {"value": 2.0, "age": 0.5}},
            },
            {"endpoint": D, "total": 1.0, "scores": {"queue": 0.5, "kv": 0.0}},
            {"endpoint": B, "total": 0.5, "scores": {"queue": 0.0, "kv": 0.5}},
        ],
        "picker": "max-score-picker",
        "picked": [C],
        "fallback": None,
    }


def test_an_explained_fallback_says_why() -> None:
    """When a plugin fails, the explanation names it and shows the round-robin pick."""
    pipeline = Pipeline([FakeScorer("s", fail=True)])
    explained = decide(pipeline, explain=True).explanation
    assert explained is not None
    assert explained["fallback"] == "score s: Boom: s is broken"
    assert explained["picker"] == "round-robin (fallback)"
    assert explained["picked"] == [B]


@pytest.mark.parametrize(
    ("hook", "explain", "hears"),
    [(False, "off", False), (True, "off", True), (False, "header", True), (False, "all", True)],
)
def test_the_pipeline_hears_the_response_only_for_a_hook_or_an_explanation(
    hook: bool, explain: str, hears: bool
) -> None:
    """``hears_response`` (whether the gateway must send the response headers) is True exactly
    when a plugin hooks the response or explanations may go out on it; round-robin never."""
    plugins: list[Any] = [FakeScorer("kv", {B: 0.5})]
    if hook:
        plugins.append(RecordingHook("hook", []))
    pipeline = Pipeline(plugins, explain=explain)  # type: ignore[arg-type]
    assert pipeline.hears_response is hears
    assert RoundRobin().hears_response is False
