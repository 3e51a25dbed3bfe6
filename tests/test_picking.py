"""Candidates and round-robin: who may serve a request, and fair turns."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lwepp.picking import (
    SUBSET_KEY,
    Pool,
    RequestInfo,
    RoundRobin,
    allowed_entries,
    candidates,
)
from pods.model import endpoints_of
from tests.fakes import StaticPods, pod

PODS = (
    pod("p0", "10.0.0.1", 3000),
    pod("p1", "10.0.0.2", 3000, 3002, 3004),
    pod("p2", "10.0.0.3", 3000),
)
ENDPOINTS = endpoints_of(PODS, {})


@pytest.mark.parametrize(
    ("hint", "header", "expected"),
    [
        (None, None, None),
        ({}, None, None),
        ({SUBSET_KEY: []}, None, []),
        ({SUBSET_KEY: "10.0.0.1:3000, 10.0.0.2"}, None, ["10.0.0.1:3000", "10.0.0.2"]),
        (
            {SUBSET_KEY: ["10.0.0.1", "10.0.0.2,10.0.0.3", 7, " "]},
            None,
            [
                "10.0.0.1",
                "10.0.0.2",
                "10.0.0.3",
            ],
        ),
        ({SUBSET_KEY: ["10.0.0.1"]}, "10.0.0.3", ["10.0.0.3"]),
        (None, "10.0.0.3, ", ["10.0.0.3"]),
        ({SUBSET_KEY: ["10.0.0.1"]}, " , ", ["10.0.0.1"]),
    ],
    ids=[
        "nothing",
        "namespace-without-key",
        "empty-list-allows-nothing",
        "comma-string",
        "list-with-commas-and-junk",
        "header-replaces-metadata",
        "header-only",
        "blank-header-ignored",
    ],
)
def test_allowed_entries(hint: dict[str, Any] | None, header: str | None, expected: Any) -> None:
    """The subset hint and the conformance header decode as GIE's lwepp decodes them."""
    assert allowed_entries(hint, header) == expected


@pytest.mark.parametrize(
    ("allowed", "expected"),
    [
        (None, [e.hostport for e in ENDPOINTS]),
        (["10.0.0.2"], ["10.0.0.2:3000", "10.0.0.2:3002", "10.0.0.2:3004"]),
        (["10.0.0.1", "10.0.0.2:3002"], ["10.0.0.1:3000", "10.0.0.2:3002"]),
        (["10.0.0.2:9999"], []),
        (["10.9.9.9"], []),
        ([], []),
    ],
    ids=["unrestricted", "bare-ip-all-ports", "mixed", "wrong-port", "unknown-ip", "empty"],
)
def test_candidates(allowed: list[str] | None, expected: list[str]) -> None:
    """An ``ip:port`` entry allows that endpoint; a bare IP allows every port of the pod."""
    assert [e.hostport for e in candidates(ENDPOINTS, allowed)] == expected


def test_ipv6_entries_match() -> None:
    """Bracketed IPv6 entries match with and without a port."""
    v6 = endpoints_of((pod("v6", "fd00::1", 80, 81),), {})
    assert [e.port for e in candidates(v6, ["[fd00::1]:81"])] == [81]
    assert [e.port for e in candidates(v6, ["fd00::1"])] == [80, 81]


def test_round_robin_starts_at_the_second_candidate() -> None:
    """As in GIE, the counter advances before use: the first pick is index 1."""
    picker = RoundRobin()
    picks = [picker.choose(RequestInfo([]), ENDPOINTS).endpoints[0].hostport for _ in range(3)]
    assert picks == [ENDPOINTS[1].hostport, ENDPOINTS[2].hostport, ENDPOINTS[3].hostport]


@given(n=st.integers(min_value=1, max_value=12), k=st.integers(min_value=1, max_value=20))
def test_round_robin_is_fair(n: int, k: int) -> None:
    """n·k picks over n candidates give each candidate exactly k."""
    pool = endpoints_of(tuple(pod(f"p{i}", f"10.1.0.{i + 1}", 80) for i in range(n)), {})
    picker = RoundRobin()
    counts = Counter(picker.choose(RequestInfo([]), pool).endpoints[0] for _ in range(n * k))
    assert set(counts.values()) == {k}
    assert len(counts) == n


def test_pool_follows_the_source_and_reuses_its_tuple() -> None:
    """The pool's endpoints change when the source replaces its pods, and only then."""
    source = StaticPods(pod("a", "10.0.0.1", 80, pool="a"), pod("b", "10.0.0.2", 80, pool="b"))
    pool = Pool(source, {"pool": "a"})
    first = pool.endpoints
    assert [e.pod for e in first] == ["a"]
    assert pool.endpoints is first
    source.replace(pod("a2", "10.0.0.5", 80, pool="a"))
    assert [e.pod for e in pool.endpoints] == ["a2"]
