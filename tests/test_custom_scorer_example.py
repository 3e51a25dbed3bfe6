"""``examples/custom_scorer/``: a user's scorer, loaded by dotted path from its config, at work."""

from __future__ import annotations

from pathlib import Path

import pytest

from lwepp.config import load_config
from lwepp.picking import Pool, RequestInfo
from pods.file import load_pods
from pods.model import StaticSource

EXAMPLE = Path(__file__).parent.parent / "examples/custom_scorer"


@pytest.mark.parametrize(
    ("zone", "expected"),
    [("eu", ["llama-eu"] * 4), ("us", ["llama-us"] * 4), (None, ["llama-us", "llama-eu"] * 2)],
    ids=["eu-client", "us-client", "no-zone-round-robin"],
)
def test_the_example_scorer_keeps_clients_in_their_zone(
    zone: str | None, expected: list[str]
) -> None:
    """The example's config loads its scorer by dotted path; the zone header steers the pick."""
    pipeline = load_config(EXAMPLE / "picker.yaml").pipeline()
    assert [(s.name, w) for s, w in pipeline.scorers] == [("zone", 3.0), ("queue-scorer", 1.0)]
    endpoints = Pool(StaticSource(*load_pods(EXAMPLE / "pods.yaml")), {"pool": "a"}).endpoints
    headers = [("x-client-zone", zone)] if zone else []
    picks = [pipeline.choose(RequestInfo(headers), endpoints).endpoints[0].pod for _ in range(4)]
    assert picks == expected
