"""token-producer, and the precise prefix cache configured exactly as the router's guides do."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from demo.topology import free_ports
from lwepp.config import ConfigErrors, load_text
from lwepp.contracts import Candidate, LLMRequest
from lwepp.picking import Admitted, RequestInfo
from lwepp.pipeline import Pipeline
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.tokens import TokenProducer, estimate
from plugin_api import Params
from plugin_api.frozen import frozen
from pods.model import Endpoint
from simulator.engine import Settings
from simulator.kv_events import KVEventsConfig
from simulator.openai import prompt_token_ids
from simulator.server import serve_pods
from tests.test_simulator import pod, post

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def test_estimate_packs_four_bytes_a_pseudo_token() -> None:
    """The router's tokenizer-free backend: 4 bytes a little-endian id, the tail padded."""
    assert estimate(b"abcdef") == [
        struct.unpack("<I", b"abcd")[0],
        struct.unpack("<I", b"ef\0\0")[0],
    ]
    made = TokenProducer("t")
    request = LLMRequest("r", {}, body=b"{}", parsed=frozen({"prompt": "abcd"}))
    assert made.token_ids(request) == estimate(b"abcd")


def test_a_local_tokenizer_file(tmp_path: Path) -> None:
    """``local``: a tokenizer.json read by the tokenizers package gives the prompt's ids."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    made = TokenProducer(
        "t", Params({"modelName": "m", "local": {"modelTokenizerMap": {"m": str(path)}}}, "t")
    )
    request = LLMRequest("r", {}, body=b"{}", parsed=frozen({"prompt": "hello big world"}))
    assert made.token_ids(request) == [1, 0, 2]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            "{udsTokenizerConfig: {socketFile: /tmp/t.sock}}",
            "does not implement: the router's tokenizer sidecar",
        ),
        ("{vllm: {url: http://x}}", "modelName: required with vllm"),
        ("{modelName: m, vllm: {}, llamacpp: {}}", "one backend only: vllm and llamacpp"),
        ("{modelName: m, vllm: {timeout: soon}}", "vllm.timeout"),
        ("{local: {modelTokenizerMap: {m: /no/such.json}}, modelName: m}", "cannot load"),
    ],
    ids=["uds", "no-model", "two-backends", "timeout", "missing-file"],
)
def test_bad_parameters_name_the_field(parameters: str, message: str) -> None:
    """Each bad parameter is refused at load, naming the field (the sidecar: the feature)."""
    with pytest.raises(ConfigErrors, match=message):
        load_text(HEAD + f"plugins:\n- type: token-producer\n  parameters: {parameters}\n")


def test_the_legacy_name_loads_with_a_warning() -> None:
    """``tokenizer`` is the router's deprecated name of token-producer."""
    config = load_text(HEAD + "plugins:\n- type: tokenizer\n")
    assert isinstance(config.plugins[0].plugin, TokenProducer)
    assert any("type: deprecated: use token-producer" in w for w in config.warnings)


@contextlib.asynccontextmanager
async def background(pipeline: Pipeline, endpoints: list[Endpoint]) -> AsyncIterator[None]:
    """The pipeline's background tasks (the token producer's session, the subscriber)."""
    tasks = [asyncio.create_task(job()) for job in pipeline.background(lambda: endpoints)]
    try:
        await asyncio.sleep(0)
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepared(pipeline: Pipeline, body: bytes) -> LLMRequest:
    """One request as the service runs it: the request controls, then the prepare stage."""
    admitted = Admitted(RequestInfo((), body))
    for control in pipeline.controls:
        admitted = await control.admit(admitted)
    request = pipeline.request_of(admitted.request)
    for hook in pipeline.prepare:
        hook.prepare(request)
    return request


PRECISE = """\
plugins:
- type: token-producer
  parameters:
    modelName: {model}
    vllm:
      url: "http://127.0.0.1:{port}"
- type: endpoint-notification-source
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSizeTokens: 16
    speculativeIndexing: false
    kvEventsConfig:
      topicFilter: "kv@"
      concurrency: 32
      discoverPods: true
      podDiscoveryConfig:
        socketPort: {events}
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
dataLayer:
  sources:
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
"""
"""The shape of the router's own precise configuration (its test/perf precise-prefix.yaml):
the engine's render endpoint tokenizes, each pod's publisher is found from the pool."""


def test_the_router_s_precise_configuration_runs_against_an_engine() -> None:
    """No Switchyard-only parameter: the token producer asks the engine's render endpoint (its
    ids are the engine's), the producer subscribes to the engine's KV-event publisher found
    from the pool (discoverPods), and a prompt the engine served matches in full."""
    events_port = free_ports(1)[0]
    kv = KVEventsConfig(enabled=True, endpoint=f"tcp://*:{events_port}", topic="kv@127.0.0.1@m")

    async def scenario() -> tuple[int, int, list[int] | None, list[int]]:
        async with serve_pods((pod(),), Settings(time_scale=0), grace=1.0, kv_events=kv) as (
            replica,
        ):
            text = HEAD + PRECISE.format(model=replica.model, port=replica.port, events=events_port)
            config = load_text(text)
            assert not [w for w in config.warnings if "added" in w]
            pipeline = config.pipeline()
            [producer] = [p for p in pipeline.plugins if isinstance(p, PrecisePrefixCacheProducer)]
            assert producer.discovering
            endpoint = Endpoint("pod-a", "127.0.0.1", replica.port)
            async with background(pipeline, [endpoint]), aiohttp.ClientSession() as session:
                for attempt in range(200):  # PUB drops what it sends before SUB joins
                    body = {
                        "model": replica.model,
                        "prompt": f"try {attempt} " * 30,
                        "max_tokens": 1,
                    }
                    await post(session, replica, "/v1/completions", body)
                    await asyncio.sleep(0.02)  # a poll with a deadline: the SUB is async
                    raw = orjson.dumps(body)
                    request = await prepared(pipeline, raw)
                    found = producer.prefix_match(request, [Candidate(endpoint)], 0.0)
                    if found is not None and found.matched[endpoint.hostport]:
                        [tokens] = [p for p in pipeline.plugins if isinstance(p, TokenProducer)]
                        ids = tokens.token_ids(request)
                        return (
                            found.matched[endpoint.hostport],
                            found.total,
                            ids,
                            list(prompt_token_ids(raw) or []),
                        )
            raise AssertionError("no event matched")

    matched, total, ids, engine_ids = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert matched == total > 0
    assert ids == engine_ids


def test_a_tokenizer_that_does_not_answer_leaves_the_request_without_ids() -> None:
    """A render endpoint that refuses: the request has no ids (the precise cache scores
    nothing for it), the failure is counted, and the pick still happens."""
    port = free_ports(1)[0]
    config = load_text(
        HEAD + "plugins:\n- type: token-producer\n  parameters:\n    modelName: m\n"
        f"    vllm: {{url: 'http://127.0.0.1:{port}', timeout: 2s}}\n"
    )
    pipeline = config.pipeline()
    [made] = pipeline.controls
    assert isinstance(made, TokenProducer)

    async def scenario() -> Any:
        async with background(pipeline, []):
            request = await prepared(pipeline, orjson.dumps({"model": "m", "prompt": "hi"}))
            return made.token_ids(request)

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) is None
    assert made.failures == 1


def test_the_older_scorer_s_tokenizer_pool_reads_local_files(tmp_path: Path) -> None:
    """precise-prefix-cache-scorer with indexerConfig.tokenizersPoolConfig.local: its producer
    tokenizes with that file, and no token producer is added; hf (a download) is refused."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    pool = f"{{modelName: m, local: {{modelTokenizerMap: {{m: {tmp_path / 'tokenizer.json'}}}}}}}"
    config = load_text(
        HEAD + "plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n"
        f"    indexerConfig: {{tokenizersPoolConfig: {pool}}}\n"
    )
    assert not [w for w in config.warnings if "added" in w]
    [scorer] = config.running
    producer = scorer.producer_plugin
    assert isinstance(producer, PrecisePrefixCacheProducer)
    request = LLMRequest("r", {}, body=b"{}", parsed=frozen({"prompt": "hello hello x"}))
    assert producer.tokens.token_ids(request) == [1, 1, 0]
    with pytest.raises(ConfigErrors, match=r"tokenizersPoolConfig\.hf: downloading tokenizers"):
        load_text(
            HEAD + "plugins:\n- type: precise-prefix-cache-scorer\n  parameters:\n"
            "    indexerConfig: {tokenizersPoolConfig: {hf: {tokenizersCacheDir: /mnt/t}}}\n"
        )
