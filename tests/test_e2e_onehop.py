"""The one-hop gateway through the real Envoy: one ext_proc service for BBR's job and the picks.

The same checks as ``test_e2e.py``'s where they apply (``demo --one-hop``):
the simulated replicas, Envoy, and ``python -m onehop`` in place of BBR
and the pickers.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.topology import Topology
from tests.conftest import write_pod_file
from tests.test_e2e import envoy_stats, get, mixed_calls, openai_error, pool_of, post, send_all

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """One running one-hop gateway shared by the module's tests."""
    work_dir: Path = tmp_path_factory.mktemp("one-hop")
    pods = write_pod_file(work_dir / "pods.yaml")
    topology = Topology(work_dir, pods, simulator_args=["--time-scale", "0.1"], one_hop=True)
    with topology:
        yield topology


def test_only_the_one_hop_service_runs_beside_envoy(gateway: Topology) -> None:
    """No BBR and no picker process: the one service, over TLS, is Envoy's only ext_proc."""
    assert sorted(gateway.services) == ["envoy", "onehop", "simulator"]
    assert gateway.services["onehop"].listening["tls"] is True
    post(gateway.url, "/v1/completions", {"model": "model-a", "prompt": "hi"})
    stats = envoy_stats(gateway)
    assert stats["cluster.onehop.ssl.handshake"] > 0
    assert stats["http.gateway.ext_proc.onehop.streams_started"] > 0


def test_mixed_traffic_lands_in_the_right_pool_on_the_picked_endpoint(gateway: Topology) -> None:
    """80 requests, 16 at a time, long bodies among them: each reaches its model's pool on the
    endpoint picked, with the model header, the served-endpoint report and its body intact."""
    calls = mixed_calls(80, [model for pool in gateway.pools for model in pool.models])
    answers = asyncio.run(
        send_all(gateway.url, [(c.path, json.dumps(c.body()).encode()) for c in calls])
    )
    served: Counter[str] = Counter()
    for call, answer in zip(calls, answers, strict=True):
        assert answer.status == 200, (call, answer.body[:300])
        headers = answer.headers
        assert headers["x-sim-endpoint"] in pool_of(gateway, call.model).endpoints
        assert headers["x-sim-received-x-gateway-model-name"] == call.model
        assert headers["x-sim-received-x-gateway-destination-endpoint"] == headers["x-sim-endpoint"]
        assert headers["x-conformance-test-served-endpoint"] == headers["x-sim-endpoint"]
        if call.stream:
            assert answer.events()[-2]["usage"]["prompt_tokens"] == call.prompt_tokens()
        else:
            assert answer.json()["usage"]["prompt_tokens"] == call.prompt_tokens()
        served[headers["x-sim-endpoint"]] += 1
    assert served == {endpoint: 20 for pool in gateway.pools for endpoint in pool.endpoints}


def test_bad_json_is_refused_with_400(gateway: Topology) -> None:
    """BBR's refusal, from the one hop, reaches the client as an OpenAI-style JSON error."""
    answer = post(gateway.url, "/v1/completions", b'{"model": "model-a", "prompt": ')
    assert answer.status == 400
    error = openai_error(answer)
    assert error["message"].startswith("failed to parse request body: ")


def test_a_compressed_body_is_refused_with_415(gateway: Topology) -> None:
    """BBR's chain in the one hop names a gzip body's encoding (415), as behind two hops."""
    body = gzip.compress(json.dumps({"model": "model-a", "prompt": "hi"}).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    request = urllib.request.Request(f"{gateway.url}/v1/completions", body, headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 415
    error = json.loads(refused.value.read())["error"]
    refused.value.close()
    assert error["code"] == "UnsupportedMediaType"
    assert "content-encoding: gzip" in error["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "no-such-model", "prompt": "hi"}, "no pool serves model 'no-such-model'"),
        ({"prompt": "hi"}, "the request names no model"),
    ],
    ids=["unknown-model", "no-model"],
)
def test_requests_no_pool_serves_get_404_model_not_found(
    gateway: Topology, body: dict[str, object], message: str
) -> None:
    """A model no pool serves is left to the routes, whose 404 names it, as behind two hops."""
    answer = post(gateway.url, "/v1/completions", body)
    assert answer.status == 404
    assert openai_error(answer)["message"] == f"{message} (GET /v1/models lists the served ones)"


def test_the_model_list_and_health_are_answered_without_the_one_hop(gateway: Topology) -> None:
    """GET /v1/models and GET /health are Envoy's own answers: the one-hop filter is off on
    those routes."""
    before = envoy_stats(gateway)["http.gateway.ext_proc.onehop.streams_started"]
    listing = get(gateway.url + "/v1/models")
    assert listing.status == 200
    assert [card["id"] for card in listing.json()["data"]] == ["model-a", "model-b"]
    health = get(gateway.url + "/health")
    assert (health.status, health.body) == (200, b"")
    assert envoy_stats(gateway)["http.gateway.ext_proc.onehop.streams_started"] == before


def test_fail_open_is_refused_with_one_hop(tmp_path: Path) -> None:
    """--fail-open means nothing when one service reads every body: refused, saying why."""
    argv = [sys.executable, "-m", "demo", "--one-hop", "--fail-open", "b"]
    argv += ["--work-dir", str(tmp_path)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "--fail-open has no meaning with --one-hop" in result.stderr
