"""The whole request path through the real Envoy: BBR, the pool pickers, the simulated replicas.

Every service runs as its own process (``demo.topology``), exactly as ``make
demo`` starts them, on free ports.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from demo.envoy import GatewayPool
from demo.topology import Topology
from simulator.engine import count_tokens

pytestmark = pytest.mark.e2e

MAX_TOKENS = 4
CONCURRENCY = 16


@dataclass(frozen=True)
class Call:
    model: str
    chat: bool
    stream: bool
    prompt: str

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": MAX_TOKENS,
            "stream": self.stream,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body

    def prompt_tokens(self) -> int:
        """What the replica counts if it received the body unchanged (simulator's documented rule)."""
        return count_tokens(f"user: {self.prompt}" if self.chat else self.prompt)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of a server-sent-event stream, ``[DONE]`` included."""
        lines = self.body.decode().splitlines()
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        return [item if item == "[DONE]" else json.loads(item) for item in data]


def mixed_calls(count: int, models: list[str]) -> list[Call]:
    """Both models, both APIs, streamed or not, in turn; every prompt different.

    Every tenth prompt is ~70 KB, more than one 62,000-byte ext_proc chunk, so
    BBR and the picker each stream the body back in several pieces.
    """
    calls = []
    for i in range(count):
        words = 1800 if i % 10 == 3 else 5 + i % 20
        prompt = " ".join(f"r{i}w{k}{'x' * 30}" for k in range(words))
        model = models[i % len(models)]
        calls.append(Call(model, chat=bool(i // 2 % 2), stream=bool(i // 4 % 2), prompt=prompt))
    return calls


def lowered(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names as HTTP/2 and Envoy write them: lower case (aiohttp keeps the case sent)."""
    return {name.lower(): value for name, value in headers.items()}


async def send(session: aiohttp.ClientSession, url: str, path: str, data: bytes) -> Answer:
    headers = {"content-type": "application/json"}
    async with session.post(url + path, data=data, headers=headers) as response:
        return Answer(response.status, lowered(response.headers), await response.read())


async def send_all(url: str, calls: list[tuple[str, bytes]]) -> list[Answer]:
    limit = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(path: str, data: bytes) -> Answer:
            async with limit:
                return await send(session, url, path, data)

        return await asyncio.gather(*(one(path, data) for path, data in calls))


def post(url: str, path: str, body: Any) -> Answer:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    (answer,) = asyncio.run(send_all(url, [(path, data)]))
    return answer


def pool_of(gateway: Topology, model: str) -> GatewayPool:
    return next(pool for pool in gateway.pools if model in pool.models)


def test_mixed_traffic_lands_in_the_right_pool_on_the_picked_endpoint(gateway: Topology) -> None:
    """200 requests, 16 at a time: each reaches a replica of its model's pool, on the very
    endpoint its picker chose; the served-endpoint report comes back; the body is intact."""
    calls = mixed_calls(200, [model for pool in gateway.pools for model in pool.models])
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
        # The picker copies what Envoy reported in envoy.lb metadata into this
        # header; without the metadata it would read "fail: missing ...".
        assert headers["x-conformance-test-served-endpoint"] == headers["x-sim-endpoint"]
        assert headers["x-went-into-resp-headers"] == "true"
        assert "x-gateway-destination-endpoint-served" not in headers  # moved to metadata
        served[headers["x-sim-endpoint"]] += 1
        if call.stream:
            events = answer.events()
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["prompt_tokens"] == call.prompt_tokens()
            assert len([e for e in events[:-2] if e["choices"]]) == MAX_TOKENS
        else:
            result = answer.json()
            assert result["model"] == call.model
            assert result["usage"]["prompt_tokens"] == call.prompt_tokens()
    # Round-robin: each picker alternates over its pool's two replicas, 100 picks each.
    assert served == {endpoint: 50 for pool in gateway.pools for endpoint in pool.endpoints}


def openai_error(answer: Answer) -> dict[str, str]:
    """The ``error`` object of an OpenAI-style JSON error answer (checked to be one)."""
    assert answer.headers["content-type"] == "application/json"
    error: dict[str, str] = answer.json()["error"]
    assert set(error) == {"message", "type", "code"}
    return error


def envoy_stats(gateway: Topology) -> dict[str, int]:
    """Envoy's counters, from its admin page (``/stats?format=json``)."""
    with urllib.request.urlopen(f"{gateway.admin_url}/stats?format=json", timeout=5) as page:
        stats = json.load(page)["stats"]
    return {s["name"]: s["value"] for s in stats if isinstance(s.get("value"), int)}


def test_envoy_reaches_bbr_and_the_pickers_over_tls(gateway: Topology) -> None:
    """Each service serves TLS (its default), and Envoy's connections to it completed TLS
    handshakes; none fell back to plaintext (the services accept no plaintext there)."""
    for pool in gateway.pools:
        answer = post(gateway.url, "/v1/completions", {"model": pool.models[0], "prompt": "hi"})
        assert answer.status == 200
    stats = envoy_stats(gateway)
    for name in ["bbr", *(f"lwepp-{pool.name}" for pool in gateway.pools)]:
        assert gateway.services[name].listening["tls"] is True
        assert stats[f"cluster.{name}.ssl.handshake"] > 0, name
        assert stats[f"cluster.{name}.ssl.connection_error"] == 0, name


def test_bad_json_is_refused_by_bbr_with_400(gateway: Topology) -> None:
    """BBR's refusal reaches the client as an OpenAI-style JSON error."""
    answer = post(gateway.url, "/v1/completions", b'{"model": "model-a", "prompt": ')
    assert answer.status == 400
    assert "x-sim-pod" not in answer.headers
    error = openai_error(answer)
    assert error["message"].startswith("failed to parse request body: ")
    assert (error["type"], error["code"]) == ("invalid_request_error", "BadRequest")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "no-such-model", "prompt": "hi"}, "no pool serves model 'no-such-model'"),
        ({"prompt": "hi"}, "the request names no model"),
    ],
    ids=["unknown-model", "no-model"],
)
def test_requests_no_pool_serves_get_404_model_not_found(
    gateway: Topology, body: dict[str, Any], message: str
) -> None:
    """The gateway's own 404 names the model and points at the model list."""
    answer = post(gateway.url, "/v1/completions", body)
    assert answer.status == 404
    error = openai_error(answer)
    assert error["message"] == f"{message} (GET /v1/models lists the served ones)"
    assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")


def get(url: str) -> Answer:
    async def one() -> Answer:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return Answer(response.status, lowered(response.headers), await response.read())

    return asyncio.run(one())


def test_the_gateway_answers_the_model_list_and_each_model(gateway: Topology) -> None:
    """GET /v1/models lists every pool's models in OpenAI's format; /v1/models/{id} is one
    of them, and an id no pool serves is a 404 model_not_found."""
    listing = get(gateway.url + "/v1/models?limit=5")
    assert (listing.status, listing.headers["content-type"]) == (200, "application/json")
    assert listing.json()["object"] == "list"
    cards = listing.json()["data"]
    assert [(c["id"], c["owned_by"], c["object"]) for c in cards] == [
        ("model-a", "a", "model"),
        ("model-b", "b", "model"),
    ]
    assert all(isinstance(c["created"], int) and c["created"] > 0 for c in cards)
    one = get(gateway.url + "/v1/models/model-b")
    assert (one.status, one.json()) == (200, cards[1])
    missing = get(gateway.url + "/v1/models/gpt-9")
    assert missing.status == 404
    error = openai_error(missing)
    assert error["code"] == "model_not_found"
    assert "'/v1/models/gpt-9'" in error["message"]


def test_health_is_answered_by_the_gateway_without_calling_bbr(gateway: Topology) -> None:
    """GET /health, which load generators ask before they start (guidellm stops on a 404),
    is 200 with an empty body, as vLLM answers it; no BBR stream is opened for it."""
    before = envoy_stats(gateway)["http.gateway.ext_proc.bbr.streams_started"]
    answer = get(gateway.url + "/health")
    assert (answer.status, answer.body) == (200, b"")
    assert envoy_stats(gateway)["http.gateway.ext_proc.bbr.streams_started"] == before


def test_fail_open_pool_serves_without_its_picker_fail_close_pool_does_not(
    own_gateway: Topology,
) -> None:
    """GIE failure modes: pool b (FailOpen) keeps serving with its picker down, the
    gateway choosing the replica; pool a (FailClose) answers 5xx with its picker down."""
    gateway = own_gateway
    a, b = gateway.pools
    assert (a.fail_open, b.fail_open) == (False, True)

    def ask(pool: GatewayPool) -> Answer:
        body = {"model": pool.models[0], "prompt": "hello there", "max_tokens": MAX_TOKENS}
        return post(gateway.url, "/v1/completions", body)

    gateway.stop("lwepp-b")
    for _ in range(4):
        answer = ask(b)
        assert answer.status == 200
        assert answer.headers["x-sim-endpoint"] in b.endpoints
        assert "x-sim-received-x-gateway-destination-endpoint" not in answer.headers
    assert ask(a).status == 200

    gateway.stop("lwepp-a")
    answer = ask(a)
    assert answer.status == 503
    assert "x-sim-pod" not in answer.headers
    error = openai_error(answer)  # Envoy's own answer, rewritten as OpenAI's JSON
    assert (error["type"], error["code"]) == ("server_error", "ext_proc_error")
    assert ask(b).status == 200
