"""Model rewrites through the real Envoy and at the picker alone: ``conformance.rewrites``' cases.

Each case runs as the conformance harness runs GIE's tests: first against the
pool's picker alone, then through the gateway (Envoy, BBR, the picker, the
simulated servers), with the suite's helpers and shorter waits. The one hop
runs the cases that exercise its own admit step (between BBR's chain and the pick).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.client import Timing
from conformance.rewrites import (
    ADAPTERS,
    ALIASES,
    CASES,
    MODEL,
    RewriteCase,
    rewrite_world,
    run_case,
)
from demo.topology import Topology

pytestmark = pytest.mark.e2e

TIMING = Timing(max_time_to_consistency=30, delay_after_failure=0.1)
SKIPPED = {
    "ModelRewriteNoModel": ("skipped", "passed"),  # the gateway 404s a request naming no model
    "ModelRewriteOpenAISDK": ("passed", "skipped"),  # the SDK speaks HTTP to a gateway
}
ONE_HOP = (
    "ModelRewriteExactBeforeGeneric",
    "ModelRewriteHeaderTarget",
    "ModelRewriteResponseMappedBack",
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, Path]]:
    with rewrite_world(tmp_path_factory.mktemp("rewrites")) as running:
        yield running


@pytest.fixture(scope="module")
def one_hop_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, Path]]:
    with rewrite_world(tmp_path_factory.mktemp("rewrites-one-hop"), one_hop=True) as running:
        yield running


def outcomes(case: RewriteCase, world: tuple[Topology, Path]) -> tuple[tuple[str, str], str]:
    """(through the gateway, at the picker) and the details, for the failure message."""
    result = asyncio.run(run_case(case, *world, TIMING))
    detail = f"gateway: {result.gateway.detail}\npicker: {result.picker.detail}"
    return (result.gateway.outcome, result.picker.outcome), detail


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_rewrite_case_passes_both_ways(
    case: RewriteCase, world: tuple[Topology, Path]
) -> None:
    """Every case passes at the picker and through the gateway, but where it cannot apply."""
    seen, detail = outcomes(case, world)
    assert seen == SKIPPED.get(case.name, ("passed", "passed")), detail


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ONE_HOP], ids=list(ONE_HOP))
def test_the_one_hop_applies_rewrites_as_the_picker_does(
    case: RewriteCase, one_hop_world: tuple[Topology, Path]
) -> None:
    """The one hop runs the pool's request controls between BBR's chain and the pick."""
    seen, detail = outcomes(case, one_hop_world)
    assert seen == SKIPPED.get(case.name, ("passed", "passed")), detail


def test_the_model_list_names_every_name_a_client_may_send(
    world: tuple[Topology, Path],
) -> None:
    """``GET /v1/models``: the pool's model and adapters, and each name a rewrite matches (the
    gateway routes those to the pool too), owned by the pool."""
    topology, _ = world
    with urllib.request.urlopen(f"{topology.url}/v1/models") as answer:
        listed = json.load(answer)["data"]
    assert [card["id"] for card in listed] == [MODEL, *ADAPTERS, *ALIASES]
    assert {card["owned_by"] for card in listed} == {"a"}
