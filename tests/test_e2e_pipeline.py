"""The demo gateway with the prefix-aware picker configuration, through the real Envoy.

What ``python -m demo --picker-config demo/configs/prefix-aware.yaml`` runs:
every pool's LWEPP scores on its replicas' scraped metrics and on the prompt's
prefix, and a request that asks is told why it went where it went.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from demo.topology import Topology
from tests.conftest import write_pod_file

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).parent.parent / "demo/configs/prefix-aware.yaml"
PROMPT = "You are a careful assistant. Answer briefly. Question: what is a prefix cache?"


@pytest.fixture(scope="module")
def prefix_aware(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work_dir = tmp_path_factory.mktemp("prefix-aware")
    pods = write_pod_file(work_dir / "pods.yaml")
    with Topology(
        work_dir, pods, simulator_args=["--time-scale", "0.1"], picker_config=CONFIG
    ) as topology:
        yield topology


async def ask(topology: Topology, prompt: str) -> tuple[str, dict[str, Any]]:
    """One explained completion: the replica that answered and the picker's decision."""
    body = {"model": "model-a", "prompt": prompt, "max_tokens": 2}
    headers = {"x-switchyard-explain": "1"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{topology.url}/v1/completions", json=body, headers=headers) as answer,
    ):
        assert answer.status == 200, await answer.text()
        return answer.headers["x-sim-endpoint"], json.loads(answer.headers["x-switchyard-decision"])


def test_the_explain_header_shows_why_each_request_went_where_it_went(
    prefix_aware: Topology,
) -> None:
    """Each answer carries its decision; a repeated prompt follows its cached prefix."""

    async def scenario() -> None:
        first_served, first = await ask(prefix_aware, PROMPT)
        assert first["picked"] == [first_served]
        assert first["weights"] == {
            "prefix-cache-scorer": 3.0,
            "queue-scorer": 2.0,
            "kv-cache-utilization-scorer": 2.0,
        }
        for _ in range(3):
            served, decision = await ask(prefix_aware, PROMPT)
            best = decision["scores"][0]
            assert served == first_served == best["endpoint"]
            assert best["scores"]["prefix-cache-scorer"] == 1.0

    asyncio.run(scenario())
