"""The precise prefix cache: an index of the engines' own KV-cache events, read by the scorer."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
import structlog

from blockhash.vllm import DEFAULT_SEED, BlockHasher, external
from lwepp.config import ConfigErrors, load_text
from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer, chain
from lwepp.plugins.prefix import PrecisePrefixCacheScorer, PrefixCacheScorer
from plugin_api import ConfigError, Params
from pods.model import Endpoint
from simulator.engine import Settings
from simulator.kv_events import KVEventsConfig
from simulator.openai import prompt_token_ids
from simulator.server import serve_pods
from tests.test_simulator import pod, post

TOKENIZER = "simulator.openai.prompt_token_ids"
A, B = Endpoint("a", "10.0.0.1", 8000, {}), Endpoint("b", "10.0.0.2", 8000, {})
TOPIC_A, TOPIC_B = b"kv@10.0.0.1@m", b"kv@10.0.0.2@m"


def producer(block: int = 4, **extra: Any) -> PrecisePrefixCacheProducer:
    params = {
        "tokenizer": TOKENIZER,
        "indexerConfig": {"tokenProcessorConfig": {"blockSizeTokens": block}},
        **extra,
    }
    return PrecisePrefixCacheProducer("precise", Params(params, "plugin 'precise'"))


def stored(
    hashes: Sequence[int | bytes], parent: int | None, ids: list[int], size: int = 4
) -> list[Any]:
    return ["BlockStored", hashes, parent, ids, size, None, "GPU", None]


def send(made: PrecisePrefixCacheProducer, topic: bytes, number: int, *events: Any) -> None:
    made.ingest(topic, number.to_bytes(8, "big"), msgpack.packb([1.0, list(events)]))


def keys(made: PrecisePrefixCacheProducer, ids: list[int]) -> list[int]:
    return chain(made.root, ids, made.block_size)


def test_stored_blocks_match_and_removed_ones_do_not() -> None:
    """BlockStored indexes blocks by their tokens (chained on the parent's key); BlockRemoved
    and AllBlocksCleared take them out."""
    made, ids = producer(), list(range(12))
    send(made, TOPIC_A, 0, stored([101, 102], None, ids[:8]))
    send(made, TOPIC_A, 1, stored([103], 102, ids[8:12]))
    assert made.match(keys(made, ids), [A, B]) == {A.hostport: 3, B.hostport: 0}
    send(made, TOPIC_A, 2, ["BlockRemoved", [102], "GPU"])
    assert made.match(keys(made, ids), [A])[A.hostport] == 1
    send(made, TOPIC_A, 3, ["AllBlocksCleared"])
    assert made.match(keys(made, ids), [A])[A.hostport] == 0


def test_a_restart_a_gap_and_a_late_batch() -> None:
    """Sequence 0 after others: the engine restarted (forgotten, then applied); a gap: blocks
    forgotten and the loss reported; an old number: dropped and reported."""
    made, ids = producer(), list(range(8))
    send(made, TOPIC_A, 0, stored([1, 2], None, ids))
    send(made, TOPIC_A, 1)
    send(made, TOPIC_A, 0, stored([5], None, ids[:4]))  # restarted: only its new block
    assert made.match(keys(made, ids), [A])[A.hostport] == 1
    send(made, TOPIC_A, 3)  # batches 1 and 2 lost
    assert made.match(keys(made, ids), [A])[A.hostport] == 0
    assert "batches 1–2 lost" in made.problems["10.0.0.1"]
    send(made, TOPIC_A, 2, stored([9, 10], None, ids))  # late: must not be applied
    assert made.match(keys(made, ids), [A])[A.hostport] == 0
    assert "arrived after 3: dropped" in made.problems["10.0.0.1"]


def test_a_block_size_that_does_not_match_is_an_error_not_silent_misses() -> None:
    """Events with another block size are refused, the problem naming both sizes."""
    made = producer(block=16)
    send(made, TOPIC_B, 0, stored([1], None, list(range(4)), size=4))
    assert made.index.blocks("10.0.0.2") == 0
    problem = made.problems["10.0.0.2"]
    assert "block_size 4" in problem
    assert "blockSizeTokens 16" in problem


def test_a_wrong_block_size_is_logged_once_per_engine() -> None:
    """Every batch of an engine with another block size is refused, but the warning is logged
    once for it (not once per batch); the latest refusal stays in ``problems``."""
    made = producer(block=16)
    with structlog.testing.capture_logs() as logs:
        for number in range(5):
            send(made, TOPIC_B, number, stored([number + 1], None, list(range(4)), size=4))
    refused = [entry for entry in logs if "refused" in str(entry.get("problem"))]
    assert len(refused) == 1
    assert made.problems["10.0.0.2"].startswith("batch 4 refused")


def hashed(hasher: BlockHasher, ids: list[int], size: int = 4) -> list[Any]:
    """A root BlockStored of ``ids`` with the hashes ``hasher`` gives them, as vLLM sends."""
    return stored([external(h) for h in hasher.chain(ids, size)], None, ids, size)


def warnings_of(logs: list[MutableMapping[str, Any]], engine: str) -> list[str]:
    return [e["problem"] for e in logs if e["log_level"] == "warning" and e["engine"] == engine]


def test_a_seed_that_is_not_the_engine_s_is_reported_once_and_routing_goes_on() -> None:
    """Root blocks hashed with another PYTHONHASHSEED: after three, one warning naming the
    configured seed and algorithm and what to set on each side; the blocks still match."""
    tokens = {"hashSeed": "1", "hashAlgorithm": "sha256_cbor", "blockSizeTokens": 4}
    made = producer(indexerConfig={"tokenProcessorConfig": tokens})
    engine = BlockHasher("sha256_cbor", "2")
    with structlog.testing.capture_logs() as logs:
        for number in range(2):
            send(made, TOPIC_A, number, hashed(engine, list(range(number, number + 8))))
        assert "10.0.0.1" not in made.problems  # a cache_salt may change one root block
        for number in range(2, 6):
            send(made, TOPIC_A, number, hashed(engine, list(range(number, number + 8))))
    [problem] = warnings_of(logs, "10.0.0.1")
    assert made.problems["10.0.0.1"] == problem
    assert "not vLLM's sha256_cbor seeded with hashSeed '1'" in problem
    assert "PYTHONHASHSEED=1 and --prefix-caching-hash-algo sha256_cbor" in problem
    assert "Routing here is unaffected" in problem
    assert made.match(keys(made, list(range(5, 13))), [A])[A.hostport] == 2


def test_a_matching_root_block_settles_and_an_unset_algorithm_names_the_one_that_matched() -> None:
    """With no hashAlgorithm, each of vLLM's is tried: the one that matches (64-bit or whole
    digests) is recorded, no problem reported, and no later block is hashed again."""
    made = producer()  # hashSeed "": an engine without PYTHONHASHSEED
    send(made, TOPIC_A, 0, hashed(BlockHasher("sha256", DEFAULT_SEED), list(range(8))))
    whole = BlockHasher("sha256_cbor", DEFAULT_SEED).chain(list(range(4)), 4)
    send(made, TOPIC_B, 0, stored(whole, None, list(range(4))))  # digests, not ints
    assert made.hashed_with == {"10.0.0.1": "sha256", "10.0.0.2": "sha256_cbor"}
    for number in range(1, 4):
        send(made, TOPIC_A, number, hashed(BlockHasher("sha256", "x"), [number] * 4))
    assert made.problems == {}


def test_an_unset_seed_that_does_not_match_says_what_vllm_does_without_one() -> None:
    """hashSeed '' against an engine with PYTHONHASHSEED set: the report explains vLLM's fixed
    seed and names both remedies."""
    made = producer()
    for number in range(3):
        send(made, TOPIC_A, number, hashed(BlockHasher("sha256", "7"), [number] * 4))
    problem = made.problems["10.0.0.1"]
    assert "any of vLLM's sha256, sha256_cbor, xxhash, xxhash_cbor" in problem
    assert "'vllm-none-hash'" in problem
    assert "set PYTHONHASHSEED on every engine and hashSeed to it" in problem


def test_an_endpoint_without_events_is_reported_once_after_the_grace_period() -> None:
    """A pool endpoint no event names is reported when eventsGracePeriod has passed since the
    subscriber started, once, naming where it listens and the topic to publish; its first
    event takes the report back."""
    made = producer(eventsGracePeriod=30)
    with structlog.testing.capture_logs() as logs:
        made.check([A, B], 100.0)
        send(made, TOPIC_A, 0)
        made.check([A, B], 129.0)
        assert made.problems == {}
        made.check([A, B], 130.0)
        made.check([A, B], 160.0)
    [problem] = warnings_of(logs, B.hostport)
    assert made.problems == {B.hostport: problem}
    assert "no KV events from this endpoint in 30 s" in problem
    assert "bound at tcp://*:5557" in problem
    assert "topics starting 'kv@'" in problem
    assert "kv@10.0.0.2@<model> (or kv@10.0.0.2:8000@<model>)" in problem
    send(made, TOPIC_B, 0)
    made.check([A, B], 161.0)
    assert made.problems == {}


def test_a_topic_naming_no_pool_endpoint_is_reported_once() -> None:
    """Events whose topic names no endpoint of the pool (another pool's engine, or a pod name
    instead of its IP) are reported once, quoting the topic, after the grace period."""
    made = producer(eventsGracePeriod=10)
    with structlog.testing.capture_logs() as logs:
        send(made, b"kv@pod-a@m", 0)
        send(made, TOPIC_A, 0)
        made.check([A], 0.0)
        made.check([A], 9.0)
        assert made.problems == {}
        made.check([A], 10.0)
        made.check([A], 20.0)
    [problem] = warnings_of(logs, "pod-a")
    assert "events on topic 'kv@pod-a@m' name 'pod-a', no endpoint of the pool" in problem
    assert set(made.problems) == {"pod-a"}


def test_the_scorer_reads_the_producer_it_names() -> None:
    """prefix-cache-scorer with prefixMatchInfoProducerName naming a precise producer scores
    blocks held / prompt blocks, and learns nothing from its picks."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- type: precise-prefix-cache-producer\n  parameters: {{tokenizer: {TOKENIZER}}}\n"
        "- type: prefix-cache-scorer\n"
        "  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}\n"
    )
    [scorer] = [p for p in config.running if isinstance(p, PrefixCacheScorer)]
    [made] = [p for p in config.running if isinstance(p, PrecisePrefixCacheProducer)]
    assert scorer.precise is made
    body = orjson.dumps({"model": "m", "prompt": "alpha beta " * 20})
    ids = prompt_token_ids(body) or []
    whole = len(ids) // 16
    send(made, TOPIC_A, 0, stored(list(range(whole)), None, ids[: whole * 16], size=16))
    request = LLMRequest("r", {}, body=body)
    made.prepare(request)
    scores = scorer.score(request, [Candidate(A), Candidate(B)], 0.0)
    assert list(scores) == [1.0, 0.0]
    assert not hasattr(scorer, "picked")  # a scorer only: the producer is what learns
    made.picked(request, [B])
    again = LLMRequest("r2", {}, body=body)
    made.prepare(again)
    assert list(scorer.score(again, [Candidate(A), Candidate(B)], 0.0)) == [1.0, 0.0]


def test_the_debug_page_shows_each_engine_and_its_problems() -> None:
    """The picker's /debug/<producer name> page (either plugin shape) lists each engine heard,
    with its sequence number, blocks and matched algorithm, and every problem."""
    for plugins in (
        f"- type: precise-prefix-cache-producer\n  parameters: {{tokenizer: {TOKENIZER}}}\n"
        "- type: prefix-cache-scorer\n"
        "  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}\n",
        f"- type: precise-prefix-cache-scorer\n  parameters: {{tokenizer: {TOKENIZER}}}\n",
    ):
        config = load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n" + plugins
        )
        name = plugins.split()[2]
        [made] = [p if isinstance(p, PrecisePrefixCacheProducer) else p.producer_plugin
                  for p in config.running if p.name == name]  # fmt: skip
        page = config.pipeline().debug_pages()[f"/debug/{name}"]
        send(made, TOPIC_A, 0, hashed(BlockHasher("sha256_cbor", DEFAULT_SEED), [1] * 16, 16))
        send(made, TOPIC_A, 5)
        shown = json.loads(page())
        assert shown["engines"] == {
            "10.0.0.1": {"topic": "kv@10.0.0.1@m", "sequence": 5, "blocks": 0,
                         "hashed_with": "sha256_cbor"},
        }  # fmt: skip
        assert shown["problems"] == {"10.0.0.1": "batches 1–4 lost; blocks forgotten"}
        assert (shown["zmqEndpoint"], shown["topicFilter"]) == ("tcp://*:5557", "kv@")


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            "{indexerConfig: {tokenizersPoolConfig: {modelName: x}}}",
            "tokenizersPoolConfig: not supported by precise-prefix-cache-producer",
        ),
        ("{tokenizer: no.such.function}", "tokenizer: cannot load 'no.such.function'"),
        (
            "{tokenizer: " + TOKENIZER + ", indexerConfig: {tokenProcessorConfig: {blocksize: 4}}}",
            "unknown field 'blocksize'",
        ),
        (
            "{tokenizer: " + TOKENIZER + ", indexerConfig: {tokenProcessorConfig: "
            "{hashAlgorithm: md5}}}",
            r"tokenProcessorConfig.hashAlgorithm: expected one of cbor-fnv, xxh64, sha256,",
        ),
        ("{tokenizer: " + TOKENIZER + ", eventsGracePeriod: -1}", "eventsGracePeriod: must be"),
    ],
    ids=["tokenizer-pool", "bad-tokenizer", "typo", "hash-algorithm", "grace"],
)
def test_bad_producer_parameters_name_the_field(parameters: str, message: str) -> None:
    """Each problem is refused at load, naming the field."""
    with pytest.raises(ConfigErrors, match=message):
        load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
            f"- type: precise-prefix-cache-producer\n  parameters: {parameters}\n"
        )


def test_the_older_single_plugin_loads() -> None:
    """precise-prefix-cache-scorer: the producer and the scorer in one plugin."""
    config = load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"- type: precise-prefix-cache-scorer\n  parameters: {{tokenizer: {TOKENIZER}}}\n"
    )
    [scorer] = config.running
    assert isinstance(scorer, PrecisePrefixCacheScorer)
    assert scorer.precise is scorer.source
    assert config.pipeline().sources == (scorer,)


def test_a_simulator_s_events_reach_the_index_over_zmq(tmp_path: Path) -> None:
    """A simulator publishing as vLLM does, the producer subscribed: after one request the
    engine's blocks of that prompt match it in full."""
    endpoint = f"ipc://{tmp_path}/kv"
    events = KVEventsConfig(enabled=True, endpoint=endpoint, topic="kv@127.0.0.1@m")
    made = producer(block=16, kvEventsConfig={"zmqEndpoint": endpoint})

    async def scenario() -> dict[str, int]:
        async with serve_pods((pod(),), Settings(time_scale=0), grace=1.0, kv_events=events) as (
            replica,
        ):
            task = asyncio.create_task(made.run(lambda: (), NoStore(), lambda: 0.0))
            endpoint_of = Endpoint("pod-a", "127.0.0.1", replica.port, {})
            body = {"model": replica.model, "prompt": "", "max_tokens": 1}
            try:
                async with aiohttp.ClientSession() as session:
                    for attempt in range(200):  # PUB drops what it sends before SUB joins
                        body["prompt"] = f"try {attempt} " * 30
                        await post(session, replica, "/v1/completions", body)
                        await asyncio.sleep(0.02)  # a poll with a deadline: the SUB is async
                        request = LLMRequest("r", {}, body=orjson.dumps(body))
                        made.prepare(request)
                        found = made.match(made.request_keys(request), [endpoint_of])
                        if found[endpoint_of.hostport]:
                            return {"matched": found[endpoint_of.hostport],
                                    "blocks": len(made.request_keys(request))}  # fmt: skip
                    return {}
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    result = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert result
    assert result["matched"] == result["blocks"] > 0


class NoStore:
    def write(self, endpoint: str, values: Any) -> None:
        raise AssertionError("the precise producer writes no attribute")


def test_a_simulator_with_another_pythonhashseed_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator publishing over ZMQ with PYTHONHASHSEED=12345, the producer configured with
    hashSeed 0: the mismatch is reported for that engine, its blocks still match, and the
    subscriber reports the pool's endpoint that sends nothing."""
    monkeypatch.setenv("PYTHONHASHSEED", "12345")  # read as the simulator's engine starts
    endpoint = f"ipc://{tmp_path}/kv"
    events = KVEventsConfig(enabled=True, endpoint=endpoint, topic="kv@127.0.0.1@m")
    tokens = {"blockSizeTokens": 16, "hashSeed": "0", "hashAlgorithm": "sha256"}
    made = producer(
        indexerConfig={"tokenProcessorConfig": tokens},
        kvEventsConfig={"zmqEndpoint": endpoint},
        eventsGracePeriod=0,
    )
    silent = Endpoint("pod-b", "10.9.9.9", 8000, {})

    async def scenario() -> int:
        async with serve_pods((pod(),), Settings(time_scale=0), grace=1.0, kv_events=events) as (
            replica,
        ):
            endpoint_of = Endpoint("pod-a", "127.0.0.1", replica.port, {})
            pool = (endpoint_of, silent)
            task = asyncio.create_task(made.run(lambda: pool, NoStore(), lambda: 0.0))
            body = {"model": replica.model, "prompt": "", "max_tokens": 1}
            try:
                async with aiohttp.ClientSession() as session:
                    for attempt in range(200):  # a new root block each time, until reported
                        body["prompt"] = f"seed {attempt} " * 30
                        await post(session, replica, "/v1/completions", body)
                        await asyncio.sleep(0.02)  # a poll with a deadline: the SUB is async
                        if "127.0.0.1" in made.problems:
                            request = LLMRequest("r", {}, body=orjson.dumps(body))
                            made.prepare(request)
                            return made.match(made.request_keys(request), [endpoint_of])[
                                endpoint_of.hostport
                            ]
                    return -1
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    matched = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert "seeded with hashSeed '0'" in made.problems["127.0.0.1"]
    assert matched > 0
    assert "kv@10.9.9.9@<model>" in made.problems[silent.hostport]


def prompt_request(made: PrecisePrefixCacheProducer, text: str) -> LLMRequest:
    """A completion request, prepared by ``made`` (its block keys in its state)."""
    body = orjson.dumps({"model": "m", "prompt": text})
    request = LLMRequest("r", {}, body=body)
    made.prepare(request)
    return request


def test_a_pick_is_taken_as_cached_there_until_the_speculative_ttl_lapses() -> None:
    """With speculativeIndexing, a pick's blocks count as held by the picked engine before any
    event (beyond what its events hold), and no longer once speculativeTTL has passed; off,
    a pick changes nothing."""
    now, text = [100.0], "the same long system prompt, again and again " * 4
    made = producer(speculativeIndexing=True, speculativeTTL="500ms")
    made.clock = lambda: now[0]
    request = prompt_request(made, text)
    blocks = len(made.request_keys(request))
    assert blocks > 2
    first = prompt_token_ids(request.body or b"") or []
    send(made, TOPIC_A, 0, stored([7], None, list(first[:4])))  # A's events: the first block
    made.picked(request, [B, A])
    assert made.match(made.request_keys(request), [A, B]) == {A.hostport: 1, B.hostport: blocks}
    now[0] += 0.4
    assert made.match(made.request_keys(request), [B])[B.hostport] == blocks
    now[0] += 0.2
    assert made.match(made.request_keys(request), [A, B]) == {A.hostport: 1, B.hostport: 0}
    off = producer()
    again = prompt_request(off, text)
    off.picked(again, [B])
    assert off.match(off.request_keys(again), [B])[B.hostport] == 0


def test_a_speculative_ttl_that_is_no_duration_is_refused() -> None:
    """speculativeTTL takes Go's duration syntax; anything else names the field."""
    with pytest.raises(ConfigError, match="speculativeTTL") as refused:
        producer(speculativeIndexing=True, speculativeTTL="soon")
    assert "'soon' is not a duration" in str(refused.value)


def test_a_pick_made_before_the_engine_names_itself_still_counts() -> None:
    """A speculative entry is kept by the picked endpoint: when the engine's first event then
    names it by ``ip:port`` (not the pod's IP), the pick made before still counts."""
    made = producer(speculativeIndexing=True)
    made.clock = lambda: 5.0
    text = "a prompt picked before its engine published anything " * 3
    request = prompt_request(made, text)
    made.picked(request, [B])
    send(made, b"kv@10.0.0.2:8000@m", 0, stored([9], None, [1, 2, 3, 4]))
    assert made.match(made.request_keys(request), [A, B]) == {
        A.hostport: 0,
        B.hostport: len(made.request_keys(request)),
    }
