"""The pickers: max-score (ties in turn), random and weighted-random, and their parameters."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lwepp.contracts import Candidate, LLMRequest, Scored
from lwepp.picking import RequestInfo, RoundRobin
from lwepp.plugins import REGISTRY
from lwepp.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from plugin_api import ConfigError, Params
from pods.model import Endpoint
from tests.plugin_fakes import configured

REQUEST = LLMRequest("r", {})


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"p{i}", f"10.0.0.{i + 1}", 8000) for i in range(n)]


def scored(totals: list[float]) -> list[Scored]:
    return [
        Scored(Candidate(e), t, {}) for e, t in zip(endpoints(len(totals)), totals, strict=True)
    ]


def names(picked: object) -> list[str]:
    return [e.pod for e in picked]  # type: ignore[attr-defined]


def test_max_score_takes_the_highest_total() -> None:
    """One endpoint by default: the candidate with the best total."""
    assert names(MaxScorePicker("m").pick(REQUEST, scored([0.2, 0.9, 0.5]))) == ["p1"]


def test_max_score_breaks_ties_in_turn() -> None:
    """Endpoints sharing the best total take turns, whatever else is on the list."""
    picker = MaxScorePicker("m")
    picks = [names(picker.pick(REQUEST, scored([1.0, 0.0, 1.0, 1.0])))[0] for _ in range(6)]
    assert picks == ["p2", "p3", "p0", "p2", "p3", "p0"]


@given(st.integers(1, 8), st.integers(1, 30))
def test_max_score_with_all_tied_is_the_cores_round_robin(n: int, picks: int) -> None:
    """When nothing scores (all totals 0) the picker answers exactly as RoundRobin does."""
    picker, round_robin = MaxScorePicker("m"), RoundRobin()
    candidates = endpoints(n)
    for _ in range(picks):
        ours = picker.pick(REQUEST, [Scored(Candidate(e), 0.0, {}) for e in candidates])
        assert list(ours) == list(round_robin.choose(RequestInfo(()), candidates).endpoints)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=8), st.integers(1, 8), st.integers(0, 20))
def test_max_score_never_puts_a_lower_total_first(
    totals: list[float], count: int, earlier: int
) -> None:
    """The list is ordered by total, best first, and holds min(N, candidates) distinct endpoints."""
    picker = MaxScorePicker("m", Params({"maxNumOfEndpoints": count}))
    for _ in range(earlier):  # wherever the turn counter stands
        picker.pick(REQUEST, scored(totals))
    candidates = scored(totals)
    by_endpoint = {s.candidate.endpoint: s.total for s in candidates}
    picked = picker.pick(REQUEST, candidates)
    got = [by_endpoint[e] for e in picked]
    assert got == sorted(got, reverse=True)
    assert len(set(picked)) == len(picked) == min(count, len(totals))
    assert got[0] == max(totals)


def test_max_score_returns_fallbacks_best_first() -> None:
    """``maxNumOfEndpoints: 3``: primary then two fallbacks in order of total."""
    picker = MaxScorePicker("m", Params({"maxNumOfEndpoints": 3}))
    assert names(picker.pick(REQUEST, scored([0.1, 0.9, 0.5, 0.7]))) == ["p1", "p3", "p2"]


def test_random_picker_ignores_scores_and_uses_the_injected_rng() -> None:
    """Uniform over the candidates: a seeded RNG makes the draw reproducible."""
    first = RandomPicker("r", Params({"maxNumOfEndpoints": 2}), random.Random(7)).pick(
        REQUEST, scored([1.0, 0.0, 0.0, 0.0])
    )
    again = RandomPicker("r", Params({"maxNumOfEndpoints": 2}), random.Random(7)).pick(
        REQUEST, scored([1.0, 0.0, 0.0, 0.0])
    )
    assert first == again
    assert len(set(first)) == 2
    picker = RandomPicker("r", Params({"maxNumOfEndpoints": 1}), random.Random(1))
    counts = Counter(names(picker.pick(REQUEST, scored([1.0, 0.0])))[0] for _ in range(2000))
    assert 850 < counts["p1"] < 1150  # the zero-scored endpoint is picked as often


def test_weighted_random_follows_the_totals() -> None:
    """Probability proportional to the total: 3:1 totals give about 3:1 picks; 0 never first."""
    picker = WeightedRandomPicker("w", Params({"maxNumOfEndpoints": 1}), random.Random(3))
    counts = Counter(names(picker.pick(REQUEST, scored([3.0, 1.0, 0.0])))[0] for _ in range(4000))
    assert counts["p2"] == 0
    assert 2.6 < counts["p0"] / counts["p1"] < 3.4


def test_weighted_random_puts_zero_totals_last_and_is_uniform_when_all_zero() -> None:
    """Zero totals come after every positive one; all zero is a uniform draw."""
    picker = WeightedRandomPicker("w", Params({"maxNumOfEndpoints": 3}), random.Random(5))
    for _ in range(50):
        assert names(picker.pick(REQUEST, scored([0.0, 0.5, 0.0])))[0] == "p1"
    uniform = Counter(names(picker.pick(REQUEST, scored([0.0, 0.0])))[0] for _ in range(2000))
    assert 850 < uniform["p0"] < 1150


@pytest.mark.parametrize("kind", ["max-score-picker", "random-picker", "weighted-random-picker"])
def test_pickers_are_registered_and_decode_max_num_of_endpoints(kind: str) -> None:
    """Each picker is in the registry under the router's name and reads ``maxNumOfEndpoints``."""
    picker = REGISTRY[kind]("p", Params({"maxNumOfEndpoints": 2}, "p"))
    assert picker.max_endpoints == 2
    assert len(picker.pick(REQUEST, scored([0.5, 0.2, 0.1]))) == 2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"maxNumOfEndpoints": 0}, "parameters.maxNumOfEndpoints: must be >= 1, got 0"),
        ({"maxNumOfEndpoints": "2"}, "parameters.maxNumOfEndpoints: expected int"),
        ({"maxEndpoints": 2}, "unknown field 'maxEndpoints'"),
    ],
    ids=["zero", "string", "misspelt"],
)
def test_picker_parameters_are_strict(raw: dict[str, object], message: str) -> None:
    """A bad or unknown parameter is an error naming the plugin and the field."""
    with pytest.raises(ConfigError, match=message):
        configured("max-score-picker", raw, "best")
