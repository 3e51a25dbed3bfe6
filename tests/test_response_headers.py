"""A picker that needs no response headers is not sent them; one that does, is.

Through the real Envoy, without the demo's extras (what a deployment runs):
pool a's picker runs the recommended configuration, whose in-flight counts
end when the response headers arrive; pool b's is plain round-robin, which
needs nothing of the response, so Envoy skips that exchange for it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.topology import Topology
from tests.conftest import POOLS, write_pod_file
from tests.test_e2e import envoy_stats
from tests.test_envoy_config import http_filter

pytestmark = pytest.mark.e2e

RECOMMENDED = Path(__file__).resolve().parent.parent / "demo/configs/recommended.yaml"
REQUESTS = 5


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """Pool a's picker hears responses (recommended config), pool b's does not (round-robin)."""
    work_dir = tmp_path_factory.mktemp("response-headers")
    topology = Topology(
        work_dir,
        write_pod_file(work_dir / "pods.yaml"),
        simulator_args=["--time-scale", "0.1"],
        picker_args={"a": ["--config", str(RECOMMENDED)]},
        demo_flags=False,
    )
    with topology:
        yield topology


def picker_mode(gateway: Topology, pool: str) -> dict[str, Any]:
    """The processing mode of pool ``pool``'s picker filter in the bootstrap Envoy runs."""
    config = json.loads((gateway.work_dir / "envoy-bootstrap.json").read_text())
    mode: dict[str, Any] = http_filter(config, f"lwepp-{pool}")["processing_mode"]
    return mode


def received_per_stream(gateway: Topology, pool: str) -> float:
    """Messages Envoy received from pool ``pool``'s picker per ext_proc stream."""
    stats = envoy_stats(gateway)
    prefix = f"http.gateway.ext_proc.lwepp-{pool}"
    streams = stats[f"{prefix}.streams_started"]
    assert streams >= REQUESTS
    return float(stats[f"{prefix}.stream_msgs_received"]) / streams


def test_each_picker_says_whether_it_hears_the_response(gateway: Topology) -> None:
    """The recommended picker asks for the response headers and is sent them; round-robin is not."""
    assert gateway.services["lwepp-a"].listening["response_headers"] is True
    assert gateway.services["lwepp-b"].listening["response_headers"] is False
    assert picker_mode(gateway, "a")["response_header_mode"] == "SEND"
    assert picker_mode(gateway, "b")["response_header_mode"] == "SKIP"


def test_round_robin_answers_one_message_less_per_request(gateway: Topology) -> None:
    """Every request succeeds in both pools; only the hearing picker answers the response's
    headers (a third message per stream: headers, body, response headers)."""
    for model in POOLS.values():
        for _ in range(REQUESTS):
            body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
            request = urllib.request.Request(
                f"{gateway.url}/v1/completions", body, {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200
                assert json.load(answer)["choices"]
    assert received_per_stream(gateway, "a") == 3
    assert received_per_stream(gateway, "b") == 2
