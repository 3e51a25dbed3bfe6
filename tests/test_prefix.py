"""``prefix-cache-scorer``: the hash chain, the bounded index, scoring, and learning from responses."""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import orjson
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lwepp.contracts import (
    Candidate,
    LLMRequest,
    Measurement,
    PickedHook,
    PrepareHook,
    ResponseCompleteHook,
    Scorer,
)
from lwepp.plugins import REGISTRY
from lwepp.plugins.approx_prefix import prompt_text
from lwepp.plugins.prefix import PrefixCacheScorer
from lwepp.plugins.prefix_index import PrefixIndex, block_hashes, seed
from plugin_api import ConfigError, Params
from pods.model import Endpoint
from tests.plugin_fakes import configured

BLOCK = 64  # 16 tokens × 4 characters


def chained(text: bytes, start: int, size: int) -> list[int]:
    """The chain written out plainly, to check ``block_hashes`` against."""
    out, previous = [], start
    for i in range(0, len(text), size):
        previous = xxhash.xxh64_intdigest(text[i : i + size] + previous.to_bytes(8, "little"))
        out.append(previous)
    return out


# --- hashing ---------------------------------------------------------------------


def test_seed_is_xxhash_of_model_and_salt() -> None:
    """The chain starts at xxh64(model + cache_salt): models and salts never share blocks."""
    assert seed("m") == xxhash.xxh64_intdigest(b"m")
    assert seed("m", "salt") == xxhash.xxh64_intdigest(b"msalt")
    assert len({seed("a"), seed("b"), seed("a", "s")}) == 3


@pytest.mark.parametrize(
    ("length", "max_blocks", "count"),
    [
        (BLOCK - 1, 256, 0),
        (BLOCK, 256, 1),
        (BLOCK + 1, 256, 2),
        (5 * BLOCK // 2, 256, 3),
        (10 * BLOCK, 4, 4),
        (10 * BLOCK, 0, 0),
    ],
    ids=[
        "short-skipped",
        "one-block",
        "partial-tail",
        "two-and-a-half",
        "truncated",
        "zero-disables",
    ],
)
def test_block_hashes_chain(length: int, max_blocks: int, count: int) -> None:
    """Each block hash covers the block bytes then the previous hash, 8 bytes little-endian."""
    text = bytes(i % 251 for i in range(length))
    hashes = block_hashes(text, 42, BLOCK, max_blocks)
    assert len(hashes) == count
    assert hashes == chained(text[: max_blocks * BLOCK], 42, BLOCK)[:count]


@settings(max_examples=50)
@given(st.binary(min_size=0, max_size=4 * BLOCK), st.binary(min_size=1, max_size=4 * BLOCK))
def test_equal_prefixes_share_hashes_and_diverge_after(common: bytes, tail: bytes) -> None:
    """Prompts agreeing on k whole blocks share exactly the first k hashes (no collisions)."""
    first = common + tail
    second = common + bytes((tail[0] + 1) % 256 for _ in range(1)) + tail[1:]
    a, b = block_hashes(first, 7, BLOCK, 256), block_hashes(second, 7, BLOCK, 256)
    same_blocks = len(common) // BLOCK
    shared = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert shared == min(same_blocks, len(a), len(b))


# --- what is hashed --------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": MESSAGES}, orjson.dumps(MESSAGES)),
        ({"prompt": "once upon a time"}, b"once upon a time"),
        ({"prompt": ["one", "two"]}, b"one two"),
        ({"prompt": [1, 2, 3]}, None),
        (
            {"input": "text", "instructions": "be brief"},
            b'[{"instructions":"be brief"},{"input":"text"}]',
        ),
        ({"input": ["a", "b"]}, b'["a","b"]'),
        ({"items": [{"x": 1}]}, b'[{"x":1}]'),
        ({"model": "m"}, None),
        (
            MappingProxyType(
                {"messages": (MappingProxyType({"role": "user", "content": "hello"}),)}
            ),
            orjson.dumps(MESSAGES),
        ),
    ],
    ids=[
        "chat",
        "prompt",
        "prompt-list",
        "token-ids",
        "responses",
        "embeddings",
        "conversation",
        "none",
        "read-only",
    ],
)
def test_prompt_text(body: Any, expected: bytes | None) -> None:
    """The bytes hashed per API shape; read-only views of the body serialise like plain JSON."""
    assert prompt_text(body) == expected


# --- the index -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "candidates", "expected"),
    [
        ({"a": [1, 2, 3], "b": [1, 2]}, ["a", "b", "c"], {"a": 3, "b": 2, "c": 0}),
        ({"a": [1, 3]}, ["a"], {"a": 1}),
        ({"a": [2, 3]}, ["a"], {"a": 0}),
        ({"d": [1, 2, 3], "a": [1]}, ["a", "b"], {"a": 1, "b": 0}),
        ({"a": [1, 2, 3, 4]}, ["a", "b"], {"a": 4, "b": 0}),
        ({}, ["a"], {"a": 0}),
    ],
    ids=["longest", "consecutive-only", "first-missing", "non-candidates-ignored", "all", "empty"],
)
def test_match_counts_blocks_in_a_row(
    held: dict[str, list[int]], candidates: list[str], expected: dict[str, int]
) -> None:
    """Each candidate gets 1 per block it holds in a row from the first."""
    index = PrefixIndex()
    for endpoint, hashes in held.items():
        index.add(endpoint, hashes, 100)
    assert index.match([1, 2, 3, 4], candidates) == expected


def test_lru_evicts_the_tail_first_and_unlinks_the_endpoint() -> None:
    """Past capacity the least recent hash goes, and the endpoint leaves that hash's holders."""
    index = PrefixIndex()
    index.add("a", [1, 2, 3, 4], 3)
    assert index.size("a") == 3
    assert index.holders(4) == frozenset()  # the prompt's tail went first
    assert index.match([1, 2, 3, 4], ["a"]) == {"a": 3}
    index.add("a", [9], 3)
    assert index.holders(3) == frozenset()
    index.add("b", [1], 3)
    assert index.holders(1) == {"a", "b"}


def test_shrinking_capacity_evicts_at_once() -> None:
    """A smaller capacity reported later (the server restarted smaller) applies immediately."""
    index = PrefixIndex()
    index.add("a", list(range(10)), 10)
    index.add("a", [], 4)
    assert (index.size("a"), index.capacity("a")) == (4, 4)


def _consistent(index: PrefixIndex) -> None:
    lrus = {e: set(lru) for e, (lru, _) in index._lru.items()}
    for endpoint, hashes in lrus.items():
        assert len(hashes) <= index.capacity(endpoint)
    holders = {h: set(s) for h, s in index._holders.items()}
    assert all(holders.values())
    expected: dict[int, set[str]] = {}
    for endpoint, hashes in lrus.items():
        for h in hashes:
            expected.setdefault(h, set()).add(endpoint)
    assert holders == expected


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.integers(0, 30), max_size=12),
            st.integers(1, 8),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_index_memory_never_exceeds_capacity(ops: list[tuple[str, list[int], int, bool]]) -> None:
    """Whatever is added or removed, each endpoint holds at most its capacity and the map agrees."""
    index = PrefixIndex()
    for endpoint, hashes, capacity, remove in ops:
        if remove:
            index.remove(endpoint)
        else:
            index.add(endpoint, hashes, capacity)
        _consistent(index)
        assert index.size() <= 3 * 8


def test_retain_forgets_endpoints_that_left() -> None:
    """``retain`` removes every endpoint not listed, and their hashes with them."""
    index = PrefixIndex()
    index.add("a", [1, 2], 10)
    index.add("b", [1, 3], 10)
    assert index.retain(["b"]) == ["a"]
    assert index.endpoints() == ["b"]
    assert index.holders(1) == {"b"}
    assert index.holders(2) == frozenset()


# --- the plugin ------------------------------------------------------------------

PROMPT = "You are a helpful assistant. " * 20  # 580 characters: 9 full blocks and a tail


def ep(name: str) -> Endpoint:
    return Endpoint(name, f"10.0.0.{ord(name[0]) % 250}", 8000)


def cand(name: str, **values: float) -> Candidate:
    return Candidate(ep(name), {k: Measurement(v, 0.0) for k, v in values.items()})


def req(body: dict[str, Any] | None, model: str | None = "m") -> LLMRequest:
    return LLMRequest("r", {}, model=model, parsed=body)


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def serve(
    scorer: PrefixCacheScorer, body: dict[str, Any], candidates: Sequence[Candidate], pick: str
) -> list[float]:
    """One request through prepare → score → picked; returns its scores."""
    request = req(body)
    scorer.prepare(request)
    scores = list(scorer.score(request, candidates, 0.0))
    scorer.picked(request, [next(c.endpoint for c in candidates if c.endpoint.pod == pick)])
    return scores


def test_a_repeated_prompt_goes_back_where_it_was_cached() -> None:
    """The first request scores 0 everywhere; the same prompt then scores 1 on the pick."""
    scorer = PrefixCacheScorer("prefix")
    pool = [cand("a"), cand("b")]
    assert serve(scorer, {"model": "m", "prompt": PROMPT}, pool, "b") == [0.0, 0.0]
    assert serve(scorer, {"model": "m", "prompt": PROMPT}, pool, "b") == [0.0, 1.0]


@pytest.mark.parametrize(
    ("second", "expected_b"),
    [
        ({"model": "m", "prompt": PROMPT + "and one more question " * 10}, 9 / 13),
        ({"model": "m", "prompt": PROMPT[:256]}, 1.0),
        ({"model": "other", "prompt": PROMPT}, 0.0),
        ({"model": "m", "prompt": PROMPT, "cache_salt": "tenant-2"}, 0.0),
        ({"model": "m", "prompt": "X" + PROMPT}, 0.0),
        ({"model": "m", "prompt": "short"}, 0.0),
    ],
    ids=[
        "longer-prompt",
        "shorter-prompt",
        "other-model",
        "other-salt",
        "differs-at-start",
        "under-one-block",
    ],
)
def test_scores_are_matched_over_total_blocks(second: dict[str, Any], expected_b: float) -> None:
    """Score = blocks held in a row from the start / blocks of this prompt."""
    scorer = PrefixCacheScorer("prefix")
    pool = [cand("a"), cand("b")]
    serve(scorer, {"model": "m", "prompt": PROMPT}, pool, "b")
    request = LLMRequest("r2", {}, model=second["model"], parsed=second)
    scorer.prepare(request)
    assert [round(s, 6) for s in scorer.score(request, pool, 0.0)] == [0.0, round(expected_b, 6)]


@pytest.mark.parametrize(
    "request_",
    [req(None), req({"messages": MESSAGES}, model=None)],
    ids=["no-body", "no-model"],
)
def test_nothing_to_hash_scores_zero(request_: LLMRequest) -> None:
    """No parsed body or no model: no hashes, every candidate scores 0, nothing is learned."""
    scorer = PrefixCacheScorer("prefix")
    scorer.prepare(request_)
    assert list(scorer.score(request_, [cand("a")], 0.0)) == [0.0]
    scorer.picked(request_, [ep("a")])
    assert scorer.index.size() == 0


@pytest.mark.parametrize(
    ("served", "holders"),
    [("10.0.0.98:8000", {"a", "b"}), ("10.0.0.97:8000", {"a"}), (None, {"a"})],
    ids=["retried-elsewhere", "served-by-pick", "not-reported"],
)
def test_learns_from_the_served_endpoint(served: str | None, holders: set[str]) -> None:
    """When the gateway served elsewhere (a fallback), that endpoint learns the prompt too."""
    scorer = PrefixCacheScorer("prefix")
    a, b = cand("a"), cand("b")  # 10.0.0.97 and 10.0.0.98
    request = req(chat(PROMPT))
    scorer.prepare(request)
    scorer.score(request, [a, b], 0.0)
    scorer.picked(request, [a.endpoint, b.endpoint])
    scorer.response_complete(request, served, None)
    first_block = request.state["prefix.prompt"].hashes[0]
    pods = {a.endpoint.hostport: "a", b.endpoint.hostport: "b"}
    assert {pods[e] for e in scorer.index.holders(first_block)} == holders


def test_auto_tune_block_size_and_capacity_from_metrics() -> None:
    """``autoTune``: the candidates' block size re-cuts the prompt; the pick's block count sizes its LRU."""
    scorer = PrefixCacheScorer("prefix")
    pool = [cand("a", cache_block_size=32, cache_num_blocks=5), cand("b")]
    request = req({"model": "m", "prompt": PROMPT})
    scorer.prepare(request)
    assert len(request.state["prefix.prompt"].hashes) == 10  # 64-byte blocks before tuning
    scorer.score(request, pool, 0.0)
    assert len(request.state["prefix.prompt"].hashes) == 5  # 128-byte blocks
    scorer.picked(request, [pool[0].endpoint])
    assert scorer.index.capacity(pool[0].endpoint.hostport) == 5
    later = req({"model": "m", "prompt": PROMPT})
    scorer.prepare(later)
    assert later.state["prefix.prompt"].block_tokens == 32  # prepared with the tuned size


def test_auto_tune_raises_small_pages_and_converts_the_capacity() -> None:
    """SGLang's one-token pages are indexed as 16-token blocks; the page count becomes blocks of
    16, so the pick's index holds the tokens its cache holds (320 pages: 20 blocks)."""
    scorer = PrefixCacheScorer("prefix")
    pool = [cand("a", cache_block_size=1, cache_num_blocks=320)]
    request = req({"model": "m", "prompt": PROMPT})
    scorer.prepare(request)
    scorer.score(request, pool, 0.0)
    scorer.picked(request, [pool[0].endpoint])
    assert request.state["prefix.prompt"].block_tokens == 16
    assert scorer.index.capacity(pool[0].endpoint.hostport) == 20


def test_without_auto_tune_the_configuration_is_used() -> None:
    """``autoTune: false`` ignores what the servers report."""
    scorer = REGISTRY["prefix-cache-scorer"](
        "p", Params({"autoTune": False, "blockSizeTokens": 8, "lruCapacityPerServer": 7}, "p")
    )
    pool = [cand("a", cache_block_size=32, cache_num_blocks=5)]
    request = req({"model": "m", "prompt": PROMPT})
    scorer.prepare(request)
    scorer.score(request, pool, 0.0)
    scorer.picked(request, [pool[0].endpoint])
    assert len(request.state["p.prompt"].hashes) == 19  # 32-byte blocks
    assert scorer.index.capacity(pool[0].endpoint.hostport) == 7


def test_max_prefix_tokens_overrides_blocks() -> None:
    """``maxPrefixTokensToMatch`` caps the hashed text at that many tokens."""
    scorer = REGISTRY["prefix-cache-scorer"]("p", Params({"maxPrefixTokensToMatch": 32}, "p"))
    request = req({"model": "m", "prompt": PROMPT})
    scorer.prepare(request)
    assert len(request.state["p.prompt"].hashes) == 2


def test_endpoints_that_left_are_forgotten() -> None:
    """Every 120 s the index drops endpoints that were not a candidate since the last sweep."""
    scorer = PrefixCacheScorer("prefix")
    a, b = cand("a"), cand("b")
    for pick, now in (("a", 0.0), ("b", 1.0)):
        request = req(chat(PROMPT + pick))
        scorer.prepare(request)
        scorer.score(request, [a, b], now)
        scorer.picked(request, [ep(pick)])
    idle = req(None)
    scorer.score(idle, [b], 60.0)  # a is gone from the pool, but the sweep is not due
    assert sorted(scorer.index.endpoints()) == [a.endpoint.hostport, b.endpoint.hostport]
    scorer.score(idle, [b], 121.0)  # a was still seen in the previous period
    assert len(scorer.index.endpoints()) == 2
    scorer.score(idle, [b], 242.0)
    assert scorer.index.endpoints() == [b.endpoint.hostport]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"autoTune": False, "blockSizeTokens": 0},
            "blockSizeTokens: must be >= 1, got 0",
        ),
        ({"blockSizeTokens": -1}, "blockSizeTokens: must be >= 0, got -1"),
        ({"maxPrefixBlocksToMatch": -1}, "maxPrefixBlocksToMatch: must be >= 0"),
        ({"maxPrefixTokensToMatch": -5}, "maxPrefixTokensToMatch: must be >= 0"),
        ({"lruCapacityPerServer": 0}, "lruCapacityPerServer: must be >= 1, got 0"),
        ({"autoTune": "yes"}, "autoTune: expected bool"),
        ({"blockSize": 64}, "unknown field 'blockSize'"),
    ],
    ids=[
        "zero-block",
        "negative-block",
        "blocks",
        "tokens",
        "capacity",
        "type",
        "deprecated-field",
    ],
)
def test_bad_parameters_name_the_field(parameters: dict[str, Any], message: str) -> None:
    """Every configuration error names the plugin and the field."""
    with pytest.raises(ConfigError, match=rf"plugin 'p' \(prefix-cache-scorer\): .*{message}"):
        configured("prefix-cache-scorer", parameters)


def test_defaults_are_the_routers() -> None:
    """autoTune true, 16-token blocks, 256 blocks, 31250 hashes per endpoint; body needed."""
    scorer = REGISTRY["prefix-cache-scorer"]("p", Params(None, "p"))
    assert (scorer.auto_tune, scorer.block_tokens, scorer.max_blocks, scorer.lru_capacity) == (
        True,
        16,
        256,
        31250,
    )
    assert PrefixCacheScorer.needs_body
    # It plays all four parts of the plugin contract.
    hooks: tuple[PrepareHook, Scorer, PickedHook, ResponseCompleteHook] = (scorer,) * 4
    assert len(hooks) == 4
