"""The simulator's KV-cache events: vLLM's block hashes, its batch format, its ZMQ framing."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import xxhash
import zmq
import zmq.asyncio

from blockhash.vllm import (
    DEFAULT_SEED,
    HASH_ALGORITHMS,
    BlockHasher,
    cbor,
    external,
    hash_seed,
)
from simulator.__main__ import _parser
from simulator.engine import Settings
from simulator.kv_events import KVEventLog, KVEventsConfig
from simulator.server import serve_pods
from tests.test_engine_model import H100, Run, prompt
from tests.test_simulator import pod, post

CBOR2_VECTORS = [
    (None, "f6"),
    (0, "00"),
    (23, "17"),
    (24, "1818"),
    (256, "190100"),
    (65536, "1a00010000"),
    (2**32, "1b0000000100000000"),
    (-25, "3818"),
    ("abc", "63616263"),
    (
        (b"\x02" * 32, (70000, 5), ("lora-a",)),
        "835820" + "02" * 32 + "821a000111700581666c6f72612d61",
    ),
]
"""Each value and ``cbor2.dumps(value, canonical=True).hex()`` (cbor2 6.3.0)."""


@pytest.mark.parametrize(
    ("value", "expected"), CBOR2_VECTORS, ids=[repr(v)[:12] for v, _ in CBOR2_VECTORS]
)
def test_cbor_is_cbor2_s_canonical_encoding(value: Any, expected: str) -> None:
    """The hand-written encoder writes what cbor2 writes, byte for byte, for what vLLM hashes."""
    assert cbor(value).hex() == expected


def test_sha256_cbor_chain_matches_a_vector_computed_with_cbor2() -> None:
    """NONE_HASH = sha256(cbor("vllm-none-hash")); block 0 of tokens 0..15 chains on it."""
    hasher = BlockHasher("sha256_cbor", DEFAULT_SEED)
    assert hasher.none_hash.hex().startswith("9bd96a485ad84efd")
    first = hasher.block(None, range(16))
    assert first.hex().startswith("dc918a88b139e5af")
    assert external(first) == 2233398808101521225


def test_sha256_is_vllm_s_pickle_hash_of_the_tuple() -> None:
    """The default algorithm: sha256(pickle((parent, tokens, extra_keys))), LoRA name as key."""
    hasher = BlockHasher("sha256", "0")
    seed = hashlib.sha256(pickle.dumps("0", pickle.HIGHEST_PROTOCOL)).digest()
    tokens = tuple(range(100, 116))
    expected = hashlib.sha256(pickle.dumps((seed, tokens, ("a",)), pickle.HIGHEST_PROTOCOL))
    assert hasher.block(None, tokens, "a") == expected.digest()
    assert hasher.chain(list(range(40)), 16) == [
        hasher.block(None, range(16)),
        hasher.block(hasher.block(None, range(16)), range(16, 32)),
    ]


def test_the_seed_is_pythonhashseed_as_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTHONHASHSEED when set, else vLLM's fixed seed for cryptographic hashes."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hash_seed() == DEFAULT_SEED
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert BlockHasher("sha256").none_hash == BlockHasher("sha256", "42").none_hash


def test_xxhash_algorithms_and_their_per_process_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """xxhash and xxhash_cbor are XXH3-128 of the pickle and of the CBOR; without PYTHONHASHSEED
    vLLM seeds them at random per process (the SHA-256 ones keep the fixed seed)."""
    tokens = tuple(range(16))
    seed = xxhash.xxh3_128_digest(pickle.dumps("0", pickle.HIGHEST_PROTOCOL))
    expected = xxhash.xxh3_128_digest(pickle.dumps((seed, tokens, None), pickle.HIGHEST_PROTOCOL))
    assert BlockHasher("xxhash", "0").block(None, tokens) == expected
    assert BlockHasher("xxhash_cbor", "0").none_hash == xxhash.xxh3_128_digest(cbor("0"))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hash_seed("xxhash_cbor") != hash_seed("xxhash_cbor")
    assert hash_seed("sha256_cbor") == DEFAULT_SEED


def batches(payloads: list[bytes]) -> list[list[Any]]:
    return [msgpack.unpackb(p) for p in payloads]


def test_an_engine_reports_stored_blocks_with_vllm_hashes_and_their_tokens() -> None:
    """A 40-token prompt fills two 16-token blocks: one BlockStored with both hashes (the
    chain vLLM computes over the prompt's token ids), no parent, their 32 token ids."""
    run, sent = Run(), list[bytes]()
    hasher = BlockHasher("sha256_cbor", "7")
    run.engine.publish_kv_events(KVEventLog(16, sent.append, hasher))
    tokens = prompt(1, 40)
    run.submit("r", tokens, max_tokens=1)
    run.run()
    events = [event for _ts, batch in batches(sent) for event in batch]
    [stored] = [e for e in events if e[0] == "BlockStored"]
    chain = hasher.chain(tokens, 16)
    assert stored == ["BlockStored", [external(h) for h in chain], None, tokens[:32], 16, None,
                      "GPU", None]  # fmt: skip


def test_a_later_block_names_its_parent_and_evictions_are_reported() -> None:
    """A prompt extending a cached one stores only its new block, naming the cached one as its
    parent; a full cache evicts a block for reuse and says so in a BlockRemoved."""
    run, sent = Run(H100.replace(num_blocks=4)), list[bytes]()
    hasher = BlockHasher("sha256", "0")
    run.engine.publish_kv_events(KVEventLog(16, sent.append, hasher))
    first = prompt(1, 33)
    run.submit("a", first)
    run.run()
    run.submit("b", [*first[:32], *prompt(2, 17)])
    run.run()
    stored = [e for _ts, b in batches(sent) for e in b if e[0] == "BlockStored"]
    chain = hasher.chain([*first[:32], *prompt(2, 17)], 16)
    assert stored[-1][1:3] == [[external(chain[2])], external(chain[1])]
    run.submit("c", prompt(3, 60))  # needs all four blocks: cached ones are evicted
    run.run()
    removed = [e for _ts, b in batches(sent) for e in b if e[0] == "BlockRemoved"]
    assert removed
    assert all(e[2] == "GPU" and len(e[1]) == 1 for e in removed)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": true, "tpoic": "kv"}', "unknown field 'tpoic'"),
        ('{"publisher": "kafka"}', "publisher: expected zmq"),
        ('{"topic": 3}', "topic: expected str"),
    ],
    ids=["not-json", "typo", "publisher", "type"],
)
def test_bad_kv_events_config_is_refused_naming_the_field(text: str, message: str) -> None:
    """vLLM's --kv-events-config JSON, checked: each problem names its field."""
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(text)


def test_replicas_publish_on_their_own_endpoints() -> None:
    """Replica i's endpoint is the configured port + i (a path gets _dp<i>), as vLLM's DP ranks."""
    config = KVEventsConfig(enabled=True, endpoint="tcp://*:5557")
    assert [config.endpoint_for(i) for i in range(3)] == [
        "tcp://*:5557",
        "tcp://*:5558",
        "tcp://*:5559",
    ]
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").endpoint_for(1) == "ipc:///tmp/kv_dp1"


def test_a_served_request_s_blocks_arrive_over_zmq_in_vllm_s_framing(tmp_path: Path) -> None:
    """Through a real PUB socket: [topic, 8-byte big-endian sequence, one more each batch,
    msgpack batch]."""
    config = KVEventsConfig(enabled=True, endpoint=f"ipc://{tmp_path}/kv", topic="kv@pod-a@m")

    async def scenario() -> list[list[bytes]]:
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        try:
            async with serve_pods(
                (pod(),), Settings(time_scale=0), grace=1.0, kv_events=config
            ) as reps:
                sub.connect(reps[0].kv_events_endpoint or "")
                async with aiohttp.ClientSession() as session:
                    got: list[list[bytes]] = []
                    attempt = 0
                    while len(got) < 2:  # PUB drops what it sends before the SUB has joined
                        attempt += 1  # a new prompt each time: a cached one stores nothing
                        text = f"attempt {attempt} " * 40
                        body = {"model": reps[0].model, "prompt": text, "max_tokens": 1}
                        await post(session, reps[0], "/v1/completions", body)
                        if await sub.poll(200):
                            got.append(await sub.recv_multipart())
                    return got
        finally:
            sub.close(linger=0)
            context.term()

    first, second = asyncio.run(asyncio.wait_for(scenario(), 20))
    topic, sequence, payload = first
    assert int.from_bytes(second[1], "big") == int.from_bytes(sequence, "big") + 1
    assert topic == b"kv@pod-a@m"
    assert len(sequence) == 8
    ts, events = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    assert events[0][0] == "BlockStored"
    assert events[0][4] == 16


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_the_simulator_takes_every_hash_algorithm_vllm_offers(algorithm: str) -> None:
    """``--prefix-caching-hash-algo`` accepts each of vLLM's four choices and the events config
    it builds hashes with that algorithm."""
    args = _parser().parse_args(["--pods", "p.yaml", "--prefix-caching-hash-algo", algorithm])
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}', args.prefix_caching_hash_algo)
    assert config.algorithm == algorithm
