"""``prefix-cache-scorer``: prefer the endpoint likely to hold the prompt's prefix in its KV cache.

One plugin plays the four parts the llm-d router splits between
``prefix-cache-scorer`` and ``approx-prefix-cache-producer``:

1. prepare: hash the prompt once into ``request.state`` (``prefix_index``:
   chained xxhash64 of 4 × ``blockSizeTokens``-byte blocks, seeded with the
   model and ``cache_salt``);
2. score: walk the hashes from the first block; each candidate scores
   ``blocks it holds in a row from the start / total blocks`` (0 when the
   prompt gave no hashes);
3. picked: record the hashes as held by the primary pick;
4. response complete: when the gateway reports a served endpoint other than
   the pick (it retried a fallback, or failed open), record them there too —
   that server did prefill the prompt. The pick keeps its entry: the blocks
   may well have been there before.

Prompt text hashed, by body shape (the router's choices): chat ``messages``
→ their JSON; completions ``prompt`` → the string, or a list of strings
joined by spaces (token-id prompts are skipped, as the router skips them);
Responses → JSON of ``[{instructions}, {tools}, {input}]`` (the first two
when present); embeddings ``input`` → its JSON; conversations ``items`` →
their JSON. A body without a model, not JSON, or with no such field gets no
hashes. The JSON is this service's (orjson), not byte-identical to the
router's Go encoding: the index is local, so only self-consistency matters.

Parameters (the router's names and defaults). The index's, which the router
gives its ``approx-prefix-cache-producer`` (a configuration may list one, and
the scorer that names it in ``prefixMatchInfoProducerName`` takes them from
it; or set them on the scorer, as older router versions did):

- ``autoTune`` (true): take the block size from the candidates'
  ``cache_block_size`` and each endpoint's LRU capacity from its
  ``cache_num_blocks`` when they are reported (> 0);
- ``blockSizeTokens`` (16): block size otherwise (4 characters per token);
- ``maxPrefixBlocksToMatch`` (256): text past this many blocks is ignored
  (0 disables matching); ``maxPrefixTokensToMatch`` (0 = unset) overrides it
  as ``tokens // blockSizeTokens``;
- ``lruCapacityPerServer`` (31250): hashes remembered per endpoint otherwise.

The scorer's own (router v0.10):

- ``prefixMatchInfoProducerName``: the producer whose index settings apply
  (default ``approx-prefix-cache-producer``: the one of that name if listed,
  else the defaults);
- ``matchLengthWeight`` (0, at most 1) and ``matchLengthScaleTokens`` (8192):
  the score becomes ``w × min(1, matched tokens / scale)² + (1 − w) × ratio``,
  so a long match counts for more than a short one of the same ratio.

With ``prefixMatchInfoProducerName`` naming a ``precise-prefix-cache-producer``
(``lwepp.plugins.precise_prefix``), the scorer reads that producer instead:
the prompt's blocks as the engines' own tokenizer cuts them, matched against
the blocks each engine reported in its KV-cache events; it then hashes
nothing and learns nothing from its picks (the engines say what they hold).
``precise-prefix-cache-scorer``, the router's older single plugin, is both.

What it found is left for the plugins after it, as the router's producer
leaves ``PrefixCacheMatchInfo`` on each endpoint: ``request.state`` under
``"<producer>.match"`` (the producer named above) holds a ``PrefixMatch``, the
blocks each candidate holds in a row, the prompt's blocks and their size.
``no-hit-lru-scorer`` and ``inflight-load-producer`` read it.

Endpoints are keyed by ``ip:port`` (a data-parallel pod runs one cache per
port). Endpoints that left are forgotten: every 120 s (on the pipeline's
clock) the index drops those that were not a candidate since the last sweep.

Unknown data: without ``cache_block_size``/``cache_num_blocks`` the configured
sizes are used; those two attributes describe the server's configuration,
not its load, so their age does not matter. ``reads`` is empty because both
are optional: a configuration with no metrics source still works.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lwepp.contracts import (
    PREFIX_MATCH,
    AttributeWriter,
    Candidate,
    Clock,
    EndpointsNow,
    LLMRequest,
    Usage,
    Want,
)
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.prefix_index import PrefixIndex, block_hashes, seed
from plugin_api import NO_PARAMS, ConfigError, Params
from plugin_api.frozen import dumps
from pods.model import Endpoint

CHARS_PER_TOKEN: Final = 4
CLEANUP_SECONDS: Final = 120.0


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


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the prefix index found for one request (the router's ``PrefixCacheMatchInfo``).

    ``matched``: blocks each candidate (``ip:port``) holds in a row from the
    start; ``total``: the prompt's blocks; ``block_tokens``: tokens per block.
    """

    matched: Mapping[str, int]
    total: int
    block_tokens: int


def match_key(producer: str) -> str:
    """The ``request.state`` key a prefix scorer leaves its ``PrefixMatch`` under."""
    return f"{producer}.match"


INDEX_PARAMETERS: Final = (
    "autoTune",
    "blockSizeTokens",
    "maxPrefixBlocksToMatch",
    "maxPrefixTokensToMatch",
    "lruCapacityPerServer",
)
DEFAULT_PRODUCER: Final = "approx-prefix-cache-producer"


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How prompts are cut into blocks and how many each endpoint's index remembers."""

    auto_tune: bool = True
    block_tokens: int = 16
    max_blocks: int = 256
    max_tokens: int = 0
    lru_capacity: int = 31250

    @classmethod
    def read(cls, params: Params) -> IndexSettings:
        auto_tune = params.get("autoTune", bool, True)
        # 0 is allowed with autoTune only: then the engines' reported block size is the only one.
        return cls(
            auto_tune,
            params.get("blockSizeTokens", int, 16, at_least=0 if auto_tune else 1),
            params.get("maxPrefixBlocksToMatch", int, 256, at_least=0),
            params.get("maxPrefixTokensToMatch", int, 0, at_least=0),
            params.get("lruCapacityPerServer", int, 31250, at_least=1),
        )


class ApproxPrefixCacheProducer:
    """The router's ``approx-prefix-cache-producer``: here, settings for the scorers that name it.

    It plays no role of its own: it is handed to each ``prefix-cache-scorer``
    whose ``prefixMatchInfoProducerName`` is its name, which indexes with its
    settings (``lwepp.contracts.Want``).
    """

    provides: Final = frozenset({PREFIX_MATCH})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.settings = IndexSettings.read(params)


class PrefixCacheScorer:
    needs_body = True

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.own_settings = [key for key in INDEX_PARAMETERS if key in params]
        """The index parameters set on the scorer itself (then no producer may set them)."""
        self.producer = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        self.wants = (
            Want(
                "prefixMatchInfoProducerName",
                self.producer,
                PREFIX_MATCH,
                self.use_producer,
                default=DEFAULT_PRODUCER,
            ),
        )
        """Its producer, when the configuration has one of that name (``use_producer``)."""
        self.length_weight = params.get("matchLengthWeight", float, 0.0, at_least=0)
        if self.length_weight > 1:
            raise params.error("matchLengthWeight", "must be at most 1")
        self.length_scale = params.get("matchLengthScaleTokens", int, 8192)
        if self.length_weight > 0 and self.length_scale <= 0:
            raise params.error("matchLengthScaleTokens", "must be > 0 with a matchLengthWeight")
        self.use(IndexSettings.read(params))
        self.index = PrefixIndex()
        self.on_learn: Callable[[str, list[int], int], None] | None = None
        """Told of every block list learned from a pick (``lwepp.sharing`` publishes it)."""
        self._key = f"{name}.prompt"
        self._match = match_key(self.producer)
        self.precise: PrecisePrefixCacheProducer | None = None
        """The precise producer this scorer reads, when its producer is one (``use_precise``)."""
        self._seen: set[str] = set()
        self._swept: float | None = None

    def use_producer(self, producer: Any) -> None:
        """Index as the named producer says: an approximate one's settings, or a precise
        one's index of the engines' own blocks (``Want.give``)."""
        approximate = isinstance(producer, ApproxPrefixCacheProducer)
        if self.own_settings:
            owner = (
                f"its producer {producer.name!r}: set them there only"
                if approximate
                else f"an approximate index; {producer.name!r} indexes the engines' own blocks"
            )
            raise ConfigError(f"parameters: {', '.join(self.own_settings)} belong to {owner}")
        if approximate:
            self.use(producer.settings)
        else:
            self.use_precise(producer)

    def use(self, settings: IndexSettings) -> None:
        """Index with ``settings`` (the producer's, when the configuration names one)."""
        self.settings = settings
        self.auto_tune, self.block_tokens = settings.auto_tune, settings.block_tokens
        self.max_blocks, self.max_tokens = settings.max_blocks, settings.max_tokens
        self.lru_capacity = settings.lru_capacity
        # The block size prompts are hashed with before candidates are known:
        # the last one the candidates reported (they rarely change).
        self._tuned_tokens = self.block_tokens

    def use_precise(self, producer: PrecisePrefixCacheProducer) -> None:
        """Score by the blocks the engines report (``lwepp.plugins.precise_prefix``) instead
        of the approximate index; the pick then teaches nothing."""
        self.precise = producer

    # --- prepare ---------------------------------------------------------------

    def prepare(self, request: LLMRequest) -> None:
        if self.precise is not None:
            return  # the producer tokenizes the prompt
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
        blocks = self.max_tokens // tokens if self.max_tokens > 0 else self.max_blocks
        return block_hashes(text, start, tokens * CHARS_PER_TOKEN, blocks)

    # --- score -----------------------------------------------------------------

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        keys = [c.endpoint.hostport for c in candidates]
        if self.precise is not None:
            return self._precise(request, candidates, keys)
        self._sweep(keys, now)
        prepared: Prepared | None = request.state.get(self._key)
        if prepared is None:
            return [0.0] * len(keys)
        if self.auto_tune:
            prepared.candidates = candidates  # for the LRU size of the pick
            tokens = self._reported(candidates, "cache_block_size") or self.block_tokens
            if tokens != prepared.block_tokens:
                self._tuned_tokens = prepared.block_tokens = tokens
                prepared.hashes = self._hash(prepared.text, prepared.seed, tokens)
        total = len(prepared.hashes)
        if not total:
            return [0.0] * len(keys)
        matched = self.index.match(prepared.hashes, keys)
        request.state[self._match] = PrefixMatch(matched, total, prepared.block_tokens)
        ratios = [matched[key] / total for key in keys]
        if self.length_weight == 0:
            return ratios
        w, scale = self.length_weight, self.length_scale
        lengths = [min(1.0, matched[key] * prepared.block_tokens / scale) ** 2 for key in keys]
        return [w * length + (1 - w) * ratio for length, ratio in zip(lengths, ratios, strict=True)]

    def _precise(
        self, request: LLMRequest, candidates: Sequence[Candidate], keys: list[str]
    ) -> list[float]:
        """Blocks each candidate's engine reported holding, in a row, over the prompt's."""
        assert self.precise is not None
        blocks = self.precise.request_keys(request)
        if not blocks:
            return [0.0] * len(keys)
        matched = self.precise.match(blocks, [c.endpoint for c in candidates])
        request.state[self._match] = PrefixMatch(matched, len(blocks), self.precise.block_size)
        return [matched[key] / len(blocks) for key in keys]

    @staticmethod
    def _reported(candidates: Sequence[Candidate], attribute: str) -> int:
        """The first positive value of a configuration attribute among ``candidates``, or 0."""
        for candidate in candidates:
            value = candidate.value(attribute, 0.0, math.inf)
            if value is not None and value >= 1:
                return int(value)
        return 0

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
        if endpoints:
            self._learn(request, endpoints[0].hostport)

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        self._learn(request, served)

    def _learn(self, request: LLMRequest, endpoint: str | None) -> None:
        """Record the prompt's blocks as held by ``endpoint`` (once per request and endpoint)."""
        prepared: Prepared | None = request.state.get(self._key)
        if prepared is None or not prepared.hashes or endpoint in (None, prepared.learned):
            return  # (always so with a precise producer: prepare left nothing)
        same = [c for c in prepared.candidates if c.endpoint.hostport == endpoint]
        capacity = self._reported(same, "cache_num_blocks") or self.lru_capacity
        self.index.add(endpoint, prepared.hashes, capacity)
        if self.on_learn is not None:  # lwepp.sharing: the other replicas learn it too
            self.on_learn(endpoint, prepared.hashes, capacity)
        self._seen.add(endpoint)
        prepared.learned = endpoint


class PrecisePrefixCacheScorer(PrefixCacheScorer):
    """The router's older ``precise-prefix-cache-scorer``: one plugin that is both the precise
    producer (its parameters) and the prefix scorer reading it."""

    produces = PrecisePrefixCacheProducer.produces

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.source = PrecisePrefixCacheProducer(name, params)
        super().__init__(name)
        self.use_precise(self.source)

    def prepare(self, request: LLMRequest) -> None:
        self.source.prepare(request)

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        super().picked(request, endpoints)
        self.source.picked(request, endpoints)

    def debug_page(self) -> bytes:
        return self.source.debug_page()

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None:
        await self.source.run(endpoints, store, clock)
