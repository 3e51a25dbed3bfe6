"""``approx-prefix-cache-producer``: which endpoint likely holds a prompt's prefix, computed once.

The llm-d router splits prefix-cache routing in two: this producer keeps the
index and finds, once per request, how many of the prompt's blocks each
endpoint holds; the plugins after it read what it found
(``PrefixCacheMatchInfo`` there, ``PrefixMatch`` here): ``prefix-cache-scorer``,
``prefix-cache-affinity-filter``, ``no-hit-lru-scorer``,
``inflight-load-producer``. Its part of a request:

1. prepare: hash the prompt once into ``request.state`` (``prefix_index``:
   chained xxhash64 of 4 × ``blockSizeTokens``-byte blocks, seeded with the
   model and ``cache_salt``);
2. ``prefix_match``, called by the first plugin that reads it (a filter or a scorer,
   with its candidates): walk the hashes from the first block; each endpoint
   holds ``matched[ip:port]`` blocks in a row from the start, of ``total``.
   The answer is kept in ``request.state`` under ``"<producer>.match"``, so
   every later reader gets the same ``PrefixMatch`` and nothing is hashed or
   walked twice;
3. picked: record the hashes as held by the primary pick (stamped, for
   ``learnCapacity``, with the pick's sequence number);
4. response complete: when the gateway reports a served endpoint other than
   the pick (it retried a fallback, or failed open), record them there too —
   that server did prefill the prompt. The pick keeps its entry.

Prompt text hashed, by body shape (the router's choices): chat ``messages``
→ their JSON; completions ``prompt`` → the string, or a list of strings
joined by spaces (token-id prompts are skipped); Responses → JSON of
``[{instructions}, {tools}, {input}]`` (the first two when present);
embeddings ``input`` → its JSON; conversations ``items`` → their JSON. A
body without a model, not JSON, or with no such field gets no hashes. The
router hashes the ids its ``token-producer`` made (by default its
``estimate`` backend: 4 bytes of the prompt a pseudo-token), which is this,
cut at the same 4-bytes-a-token boundaries; the index is local, so only
self-consistency matters.

Parameters (the router's names): ``autoTune`` (true): take the block size
from the candidates' ``cache_block_size`` and each endpoint's LRU capacity
from its ``cache_num_blocks`` when they are reported (> 0);
``blockSizeTokens`` (16) otherwise, or the deprecated ``blockSize`` in
characters (÷ 4); ``maxPrefixBlocksToMatch`` (256): text past this many
blocks is ignored (0: no cap); ``maxPrefixTokensToMatch`` (0 = unset)
overrides it as ``tokens // blockSizeTokens``; ``lruCapacityPerServer``
(31250); Switchyard's ``learnCapacity`` (false): learn the capacity of an
endpoint that reports none from the cached tokens its responses report
(``CapacityLearner``). Under ``autoTune`` a reported block size below 16 tokens is
raised to 16 (``MIN_TUNED_BLOCK_TOKENS``; SGLang's pages are 1 token
unless ``--page-size`` says otherwise, and 256 one-token blocks would match
only a prompt's first 256 tokens), and an endpoint's capacity is what it
reported converted to the index's blocks: blocks × block size ÷ the
index's block size, the tokens its cache holds. The router raises block
sizes to 64 tokens (to bound its memory) and keeps the reported block count
as the capacity, which overstates how much an endpoint holds by the factor
it raised the size by. Two departures, both about cost: the floor is 16
here, where each endpoint's LRU bounds memory (and the demo's short prompts
need small blocks), and a configured size is not raised; and the router's
caps default to 2,048 blocks and 131,072 tokens, where hashing on a Python
request path keeps 256 blocks (4,096 tokens at 16) unless told more.

Endpoints are keyed by ``ip:port`` (a data-parallel pod runs one cache per
port). Endpoints that left are forgotten: every 120 s (on the pipeline's
clock) the index drops those that were not a candidate since the last sweep.
Unknown data: without ``cache_block_size``/``cache_num_blocks`` the configured
sizes are used; they describe the server's configuration, not its load, so
their age does not matter.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lwepp.contracts import PREFIX_MATCH, Candidate, LLMRequest, Usage
from lwepp.plugins.prefix_index import PrefixIndex, block_hashes, seed
from plugin_api import NO_PARAMS, Params
from plugin_api.frozen import dumps
from pods.model import Endpoint

CHARS_PER_TOKEN: Final = 4
CLEANUP_SECONDS: Final = 120.0
LEARN_STEP: Final = 0.1
"""With ``learnCapacity``, the fraction an endpoint's capacity moves by on each response that
shows the index wrong about it (see ``CapacityLearner``)."""
MIN_LEARNED_BLOCKS: Final = 16
"""The least a learned capacity falls to: one short prompt's blocks."""
MAX_FLIGHTS: Final = 4096
"""Unanswered picks remembered per endpoint (a stream lost without an answer stays in
flight; past this many, the oldest is forgotten)."""
MIN_TUNED_BLOCK_TOKENS: Final = 16
"""Under ``autoTune``, the smallest block the index cuts prompts into (see the module docstring)."""
DEFAULT_PRODUCER: Final = "approx-prefix-cache-producer"
"""The producer's type, and the name its readers look for when they name none."""
INDEX_PARAMETERS: Final = (
    "autoTune",
    "blockSizeTokens",
    "maxPrefixBlocksToMatch",
    "maxPrefixTokensToMatch",
    "lruCapacityPerServer",
)


def prompt_text(body: Mapping[str, Any]) -> bytes | None:
    """The bytes the prefix hashes cover (see the module docstring), or None."""
    if "messages" in body:
        return dumps(body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt).encode()
    if "input" in body:
        if "instructions" in body or "tools" in body:
            parts = [{key: body[key]} for key in ("instructions", "tools") if key in body]
            return dumps([*parts, {"input": body["input"]}])
        return dumps(body["input"])
    if "items" in body:
        return dumps(body["items"])
    return None


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What a prefix producer found for one request (the router's ``PrefixCacheMatchInfo``).

    ``matched``: blocks each endpoint (``ip:port``) holds in a row from the
    start, for the candidates it was asked about (an endpoint not listed holds
    none); ``total``: the prompt's blocks; ``block_tokens``: tokens per block.
    """

    matched: Mapping[str, int]
    total: int
    block_tokens: int

    def ratio(self, endpoint: str) -> float:
        """The share of the prompt's blocks ``endpoint`` holds (0 when there are none)."""
        return self.matched.get(endpoint, 0) / self.total if self.total else 0.0


def match_key(producer: str) -> str:
    """The ``request.state`` key a prefix producer leaves its ``PrefixMatch`` under."""
    return f"{producer}.match"


@dataclass(slots=True)
class Prepared:
    """What one request keeps in its state: the prompt's hashes (recomputed if the block
    size turns out different), the candidates that reported sizes, and where it was learned."""

    text: bytes
    seed: int
    block_tokens: int
    hashes: list[int]
    candidates: Sequence[Candidate] = ()
    learned: str | None = None
    flight: tuple[str, int, int | None] | None = None
    """With ``learnCapacity``: the pick's endpoint, stamp, and the blocks predicted there
    (None when the prediction rests on a block still in flight)."""


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How prompts are cut into blocks and how many each endpoint's index remembers."""

    auto_tune: bool = True
    block_tokens: int = 16
    max_blocks: int = 256
    max_tokens: int = 0
    lru_capacity: int = 31250

    @classmethod
    def read(cls, params: Params, *, characters: bool = False) -> IndexSettings:
        """The settings in ``params``; with ``characters``, also the router's deprecated
        ``blockSize`` (characters: 4 a token), which ``blockSizeTokens`` overrides."""
        auto_tune = params.get("autoTune", bool, True)
        default = 16
        if characters and (chars := params.get("blockSize", int, 0, at_least=0)):
            default = max(1, chars // CHARS_PER_TOKEN)
        # 0 is allowed with autoTune only: then the engines' reported block size is the only one.
        return cls(
            auto_tune,
            params.get("blockSizeTokens", int, default, at_least=0 if auto_tune else 1),
            params.get("maxPrefixBlocksToMatch", int, 256, at_least=0),
            params.get("maxPrefixTokensToMatch", int, 0, at_least=0),
            params.get("lruCapacityPerServer", int, 31250, at_least=1),
        )


class CapacityLearner:
    """How many blocks each endpoint really keeps, learned from what it says it had cached.

    The index assumes an endpoint keeps ``lruCapacityPerServer`` blocks unless
    its metrics report a cache size. When the real cache is smaller (an engine
    that publishes no size, such as llama.cpp's server, or a config that reads
    no metrics), the index keeps prompts the server evicted long ago and counts
    them as hits, and the picker sends requests after caches that are gone.
    Most engines say in each response how many prompt tokens they found cached
    (``usage.prompt_tokens_details.cached_tokens``; vLLM with
    ``--enable-prompt-tokens-details``, llama.cpp's server, SGLang). Compared
    with the blocks the index predicted at the pick, a response tells one of
    three things:

    - the server had markedly *less* than predicted: the index remembers
      blocks the server evicted. That endpoint's capacity becomes 0.9× the
      smaller of its capacity and the blocks its index holds now (the first
      such response brings a default far too large down to the right scale
      at once; later ones step);
    - it had markedly *more*, and the prediction was not cut short by
      ``maxPrefixBlocksToMatch``: the index forgot blocks the server kept, so
      the capacity grows by 10%, never past ``lruCapacityPerServer``;
    - about what was predicted (within two blocks): nothing.

    The prediction is compared in the server's tokens: the matched share of
    the prompt's text times the ``prompt_tokens`` it reported. A prediction
    that rests on a block a request still in flight on that endpoint put in
    the index teaches nothing: the server may still be computing that block
    (a burst of one prefix), which is not an eviction. A response without
    cached tokens teaches nothing either, so an engine that does not report
    them keeps the configured capacity, and a reported cache size
    (``autoTune``) always wins. Capacities are in the index's blocks, which
    count only each prompt's first ``maxPrefixBlocksToMatch`` blocks, so one
    may settle below the server's block count, as it should. Switchyard's
    parameter (``learnCapacity``), off by default: the router has no such
    learning.
    """

    __slots__ = ("_ceiling", "_flights", "_sequence", "capacity")

    def __init__(self, ceiling: int) -> None:
        self._ceiling = ceiling
        self.capacity: dict[str, float] = {}
        """The learned capacity of each endpoint that taught one, in the index's blocks."""
        self._flights: dict[str, OrderedDict[int, None]] = {}
        """Per endpoint, the stamps of the picks not yet answered, oldest first."""
        self._sequence = itertools.count(1)

    def of(self, endpoint: str) -> int:
        return int(self._current(endpoint))

    def _current(self, endpoint: str) -> float:
        """``endpoint``'s learned capacity; until it teaches one, the others' (the servers
        of a pool are usually alike), their median; else the ceiling."""
        own = self.capacity.get(endpoint)
        if own is not None:
            return own
        return statistics.median(self.capacity.values()) if self.capacity else float(self._ceiling)

    def picked(self, endpoint: str, prepared: Prepared, predicted: int, index: PrefixIndex) -> int:
        """Register a pick of ``endpoint``; the stamp to learn its blocks with."""
        stamp = next(self._sequence)
        flights = self._flights.setdefault(endpoint, OrderedDict())
        touched = index.stamp(endpoint, prepared.hashes[predicted - 1]) if predicted else None
        racing = touched is not None and bool(flights) and touched >= next(iter(flights))
        prepared.flight = (endpoint, stamp, None if racing else predicted)
        flights[stamp] = None
        if len(flights) > MAX_FLIGHTS:  # answers lost with their streams: forget the oldest
            flights.popitem(last=False)
        return stamp

    def answered(
        self, prepared: Prepared, served: str | None, usage: Usage | None, held: int
    ) -> None:
        """The response to a registered pick is over: learn from it (see the class docstring)."""
        if prepared.flight is None:
            return
        endpoint, stamp, predicted = prepared.flight
        prepared.flight = None
        flights = self._flights.get(endpoint)
        if flights is not None:
            flights.pop(stamp, None)
        if predicted is None or served != endpoint:
            return
        if usage is None or usage.cached_tokens is None or not usage.prompt_tokens:
            return
        block_bytes = prepared.block_tokens * CHARS_PER_TOKEN
        tokens_per_byte = usage.prompt_tokens / len(prepared.text)
        expected = min(predicted * block_bytes, len(prepared.text)) * tokens_per_byte
        slack = 2 * block_bytes * tokens_per_byte
        capacity = self._current(endpoint)
        if usage.cached_tokens + slack < expected:
            capacity = max(MIN_LEARNED_BLOCKS, min(capacity, held) * (1 - LEARN_STEP))
        elif predicted < len(prepared.hashes) and usage.cached_tokens > expected + slack:
            capacity = min(self._ceiling, capacity * (1 + LEARN_STEP))
        else:
            return
        self.capacity[endpoint] = capacity


class ApproxPrefixCacheProducer:
    """The index and the once-per-request match; see the module docstring.

    ``match_as``: the name its ``PrefixMatch`` is kept under when it is not its
    own, and ``settings`` instead of ``params``: a ``prefix-cache-scorer`` with
    index settings of its own keeps a private producer with them, whose
    readers still look under the producer's name.
    """

    needs_body = True
    provides: Final = frozenset({PREFIX_MATCH})
    """The plugins that name it read its match (``lwepp.contracts.Want``)."""

    def __init__(
        self,
        name: str,
        params: Params = NO_PARAMS,
        *,
        match_as: str | None = None,
        settings: IndexSettings | None = None,
    ) -> None:
        self.name = name
        self.settings = settings or IndexSettings.read(params, characters=True)
        # The block size prompts are hashed with before candidates are known:
        # the last one the candidates reported (they rarely change).
        self._tuned_tokens = self.settings.block_tokens
        self.index = PrefixIndex()
        self.learner: CapacityLearner | None = None
        if params.get("learnCapacity", bool, False):
            self.learner = CapacityLearner(self.settings.lru_capacity)
        self.on_learn: Callable[[str, list[int], int], None] | None = None
        """Told of every block list learned from a pick (``lwepp.sharing`` publishes it)."""
        self._key = f"{name}.prompt"
        self._match = match_key(match_as or name)
        self._seen: set[str] = set()
        self._swept: float | None = None

    # --- prepare ---------------------------------------------------------------

    def prepare(self, request: LLMRequest) -> None:
        body = request.parsed
        if body is None:
            return
        text = prompt_text(body)
        model = request.model or body.get("model")
        if text is None or not isinstance(model, str) or not model:
            return
        salt = body.get("cache_salt")
        start = seed(model, salt if isinstance(salt, str) else "")
        tokens = self._tuned_tokens
        request.state[self._key] = Prepared(text, start, tokens, self._hash(text, start, tokens))

    def _hash(self, text: bytes, start: int, tokens: int) -> list[int]:
        if tokens <= 0:
            return []
        settings = self.settings
        if settings.max_tokens > 0:
            blocks = settings.max_tokens // tokens
        else:
            blocks = settings.max_blocks or math.ceil(len(text) / (tokens * CHARS_PER_TOKEN))
        return block_hashes(text, start, tokens * CHARS_PER_TOKEN, blocks)

    # --- the match: once per request ----------------------------------------------

    def prefix_match(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> PrefixMatch | None:
        """Blocks each of ``candidates`` holds in a row, of the prompt's; None when the prompt
        gave no hashes. The first call of a request computes it, later ones read it back."""
        found: PrefixMatch | None = request.state.get(self._match)
        if found is not None:
            return found
        keys = [c.endpoint.hostport for c in candidates]
        self._sweep(keys, now)
        prepared: Prepared | None = request.state.get(self._key)
        if prepared is None:
            return None
        if self.settings.auto_tune:
            prepared.candidates = candidates  # for the LRU size of the pick
            reported = _reported(candidates, "cache_block_size")
            tokens = (
                max(reported, MIN_TUNED_BLOCK_TOKENS) if reported else self.settings.block_tokens
            )
            if tokens != prepared.block_tokens:
                self._tuned_tokens = prepared.block_tokens = tokens
                prepared.hashes = self._hash(prepared.text, prepared.seed, tokens)
        if not prepared.hashes:
            return None
        matched = self.index.match(prepared.hashes, keys)
        found = PrefixMatch(matched, len(prepared.hashes), prepared.block_tokens)
        request.state[self._match] = found
        return found

    def _sweep(self, keys: list[str], now: float) -> None:
        self._seen.update(keys)
        if self._swept is None:
            self._swept = now
        elif now - self._swept >= CLEANUP_SECONDS:
            self.index.retain(self._seen)
            self._seen = set(keys)
            self._swept = now

    # --- learn -----------------------------------------------------------------

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            return
        endpoint, stamp = endpoints[0].hostport, 0
        prepared: Prepared | None = request.state.get(self._key)
        if self.learner is not None and prepared is not None and prepared.hashes:
            found: PrefixMatch | None = request.state.get(self._match)
            predicted = found.matched.get(endpoint, 0) if found is not None else 0
            stamp = self.learner.picked(endpoint, prepared, predicted, self.index)
        self._learn(request, endpoint, stamp)

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        if self.learner is not None and served is not None:
            prepared: Prepared | None = request.state.get(self._key)
            if prepared is not None:
                self.learner.answered(prepared, served, usage, self.index.size(served))
        self._learn(request, served)

    def _learn(self, request: LLMRequest, endpoint: str | None, stamp: int = 0) -> None:
        """Record the prompt's blocks as held by ``endpoint`` (once per request and endpoint)."""
        prepared: Prepared | None = request.state.get(self._key)
        if prepared is None or not prepared.hashes or endpoint in (None, prepared.learned):
            return
        same = [c for c in prepared.candidates if c.endpoint.hostport == endpoint]
        capacity = _capacity(same, prepared.block_tokens) or (
            self.learner.of(endpoint) if self.learner else self.settings.lru_capacity
        )
        self.index.add(endpoint, prepared.hashes, capacity, stamp)
        if self.on_learn is not None:  # lwepp.sharing: the other replicas learn it too
            self.on_learn(endpoint, prepared.hashes, capacity)
        self._seen.add(endpoint)
        prepared.learned = endpoint


def _capacity(candidates: Sequence[Candidate], block_tokens: int) -> int:
    """The blocks of ``block_tokens`` the reported cache holds (0 when none is reported):
    its block count, times its block size over ``block_tokens`` when it reports one."""
    blocks = _reported(candidates, "cache_num_blocks")
    size = _reported(candidates, "cache_block_size")
    if not blocks or not size or size == block_tokens:
        return blocks
    return max(1, blocks * size // block_tokens)


def _reported(candidates: Sequence[Candidate], attribute: str) -> int:
    """The first positive value of a configuration attribute among ``candidates``, or 0."""
    for candidate in candidates:
        value = candidate.value(attribute, 0.0, math.inf)
        if value is not None and value >= 1:
            return int(value)
    return 0
