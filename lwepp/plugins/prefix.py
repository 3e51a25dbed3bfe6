"""``prefix-cache-scorer``: prefer the endpoint likely to hold the prompt's prefix in its KV cache.

The scorer reads what a prefix producer found for the request (the router's
``PrefixCacheMatchInfo``, ``PrefixMatch`` here) and scores each candidate
``blocks it holds in a row from the start / the prompt's blocks`` (0 when the
prompt gave none). The producer is the one ``prefixMatchInfoProducerName``
names (the router's ``approx-prefix-cache-producer`` by default):

- an ``approx-prefix-cache-producer`` (``lwepp.plugins.approx_prefix``):
  the index of what was sent where. With none listed, one of that name is
  added, as the router spawns it, and every plugin reading the default
  producer (the affinity filter, no-hit-lru, the in-flight producer) shares
  it;
- a ``precise-prefix-cache-producer`` (``lwepp.plugins.precise_prefix``): the
  blocks the engines report holding, in their KV-cache events.

Older router versions set the index's parameters on the scorer itself
(``autoTune``, ``blockSizeTokens``, ``maxPrefixBlocksToMatch``,
``maxPrefixTokensToMatch``, ``lruCapacityPerServer``); a scorer given any
keeps a producer of its own with them (its ``PrefixMatch`` still under the
producer's name), and a producer listed as well is an error: set them there.

The scorer's own parameters (router v0.10): ``prefixMatchInfoProducerName``;
``matchLengthWeight`` (0, at most 1) and ``matchLengthScaleTokens`` (8192):
the score becomes ``w × min(1, matched tokens / scale)² + (1 − w) × ratio``,
so a long match counts for more than a short one of the same ratio.
``precise-prefix-cache-scorer``, the router's older single plugin, is a
precise producer and this scorer in one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

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
from lwepp.plugins.approx_prefix import (
    DEFAULT_PRODUCER,
    INDEX_PARAMETERS,
    ApproxPrefixCacheProducer,
    IndexSettings,
    PrefixMatch,
    match_key,
)
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.tokens import TokenProducer
from plugin_api import NO_PARAMS, ConfigError, Params
from pods.model import Endpoint

__all__ = ["PrecisePrefixCacheScorer", "PrefixCacheScorer", "PrefixMatch", "match_key"]


class PrefixSource(Protocol):
    """What a prefix producer offers its readers: the request's match, computed once."""

    name: str

    def prefix_match(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> PrefixMatch | None: ...


class PrefixCacheScorer:
    needs_body = True
    # The private producer's hooks, set on the instance while it has one (``_private``).
    prepare: Callable[[LLMRequest], None]
    picked: Callable[[LLMRequest, Sequence[Endpoint]], None]
    response_complete: Callable[[LLMRequest, str | None, Usage | None], None]

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.own_settings = [key for key in INDEX_PARAMETERS if key in params]
        """The index parameters set on the scorer itself (then no producer may set them)."""
        self.producer = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        settings = IndexSettings.read(params)
        self.own = ApproxPrefixCacheProducer(name, match_as=self.producer, settings=settings)
        """Its private producer: used until the configuration hands it one (``use_producer``)."""
        self.source: PrefixSource = self.own
        self.wants: tuple[Want, ...] = (
            Want(
                "prefixMatchInfoProducerName",
                self.producer,
                PREFIX_MATCH,
                self.use_producer,
                default=DEFAULT_PRODUCER,
                add=not self.own_settings,
                quiet=True,
            ),
        )
        """Its producer; the default one is added when missing, unless the scorer has index
        settings of its own."""
        self._private(True)
        self.length_weight = params.get("matchLengthWeight", float, 0.0, at_least=0)
        if self.length_weight > 1:
            raise params.error("matchLengthWeight", "must be at most 1")
        self.length_scale = params.get("matchLengthScaleTokens", int, 8192)
        if self.length_weight > 0 and self.length_scale <= 0:
            raise params.error("matchLengthScaleTokens", "must be > 0 with a matchLengthWeight")

    def use_producer(self, producer: Any) -> None:
        """Read the named producer's match (``Want.give``)."""
        if self.own_settings:
            owner = (
                f"its producer {producer.name!r}: set them there only"
                if isinstance(producer, ApproxPrefixCacheProducer)
                else f"an approximate index; {producer.name!r} indexes the engines' own blocks"
            )
            raise ConfigError(f"parameters: {', '.join(self.own_settings)} belong to {owner}")
        self.source = producer
        self._private(False)

    def use_precise(self, producer: PrecisePrefixCacheProducer) -> None:
        """Score by the blocks the engines report (``lwepp.plugins.precise_prefix``)."""
        self.source = producer
        self._private(False)

    @property
    def precise(self) -> PrecisePrefixCacheProducer | None:
        """The precise producer this scorer reads, when its producer is one."""
        return self.source if isinstance(self.source, PrecisePrefixCacheProducer) else None

    @property
    def index_producer(self) -> ApproxPrefixCacheProducer:
        """The approximate producer it reads (its own when the configuration named none)."""
        return self.source if isinstance(self.source, ApproxPrefixCacheProducer) else self.own

    # The approximate index's settings, as the scorer reads with them (and tests look).
    @property
    def index(self) -> Any:
        return self.index_producer.index

    @property
    def auto_tune(self) -> bool:
        return self.index_producer.settings.auto_tune

    @property
    def block_tokens(self) -> int:
        return self.index_producer.settings.block_tokens

    @property
    def max_blocks(self) -> int:
        return self.index_producer.settings.max_blocks

    @property
    def max_tokens(self) -> int:
        return self.index_producer.settings.max_tokens

    @property
    def lru_capacity(self) -> int:
        return self.index_producer.settings.lru_capacity

    # --- the private producer's part of the request ---------------------------------

    def _private(self, on: bool) -> None:
        """Play the private producer's roles (prepare, picked, response complete), or not: a
        scorer reading a configured producer is a scorer only, as the router's is."""
        for role in ("prepare", "picked", "response_complete"):
            if on:
                setattr(self, role, getattr(self.own, role))
            else:
                vars(self).pop(role, None)

    # --- score -----------------------------------------------------------------

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        keys = [c.endpoint.hostport for c in candidates]
        found = self.source.prefix_match(request, candidates, now)
        if found is None or not found.total:
            return [0.0] * len(keys)
        ratios = [found.ratio(key) for key in keys]
        if self.length_weight == 0:
            return ratios
        w, scale = self.length_weight, self.length_scale
        lengths = [
            min(1.0, found.matched.get(key, 0) * found.block_tokens / scale) ** 2 for key in keys
        ]
        return [w * length + (1 - w) * ratio for length, ratio in zip(lengths, ratios, strict=True)]


PRECISE_PARAMETERS: Final = (
    "tokenProcessorConfig", "indexerConfig", "kvEventsConfig", "speculativeIndexing",
    "speculativeTTL", "tokenizer", "eventsGracePeriod",
)  # fmt: skip
"""The precise producer's parameters, which the older scorer takes as its own."""


class PrecisePrefixCacheScorer(PrefixCacheScorer):
    """The router's older ``precise-prefix-cache-scorer``: one plugin that is both the precise
    producer (its parameters) and the prefix scorer reading it.

    Where it applies, as in the router: ``indexerConfig.tokenizersPoolConfig`` tokenizes for
    it, its ``local`` files read with the ``tokenizers`` package (``modelName``,
    ``local.modelTokenizerMap`` or ``autoDiscoveryDir``: ``token-producer``'s ``local``
    backend). The pool's ``hf`` (a download from Hugging Face) and ``uds`` (the sidecar) are
    refused, naming what to use instead; without a pool it reads a ``token-producer``."""

    produces = PrecisePrefixCacheProducer.produces

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        given: dict[str, Any] = {
            key: params.get(key, bool if key == "speculativeIndexing" else object, None)
            for key in PRECISE_PARAMETERS
            if key in params
        }
        raw_indexer = given.get("indexerConfig")
        indexer = dict(raw_indexer) if isinstance(raw_indexer, dict) else {}
        pool = indexer.pop("tokenizersPoolConfig", None)
        tokens = None
        if pool is not None and raw_indexer is not None:
            given["indexerConfig"] = indexer
            tokens = _pool(Params(pool, params.subject, path="parameters.indexerConfig."
                                  "tokenizersPoolConfig"), name)  # fmt: skip
        producer = PrecisePrefixCacheProducer(name, Params(given or None, params.subject))
        super().__init__(name)
        if tokens is not None:
            producer.tokens, producer.wants = tokens, producer.wants[:1]  # the pool tokenizes
        self.wants = producer.wants
        self.use_precise(producer)
        self.producer_plugin = producer

    def prepare(self, request: LLMRequest) -> None:
        self.producer_plugin.prepare(request)

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        self.producer_plugin.picked(request, endpoints)

    def debug_page(self) -> bytes:
        return self.producer_plugin.debug_page()

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None:
        await self.producer_plugin.run(endpoints, store, clock)


def _pool(pool: Params, name: str) -> TokenProducer:
    """The older scorer's ``tokenizersPoolConfig``, as a local token producer."""
    for refused, why in (
        ("hf", "downloading tokenizers from Hugging Face is not done here"),
        ("uds", "the router's tokenizer sidecar is not supported"),
    ):
        if pool.get(refused, dict, None) is not None:
            raise pool.error(refused, f"{why}: use local (a tokenizer.json on disk) or a "
                             "token-producer (vllm.url: the engine's render endpoint)")  # fmt: skip
    model = pool.get("modelName", str, "")
    pool.get("workersCount", int, 5)
    local = pool.get("local", dict, None)
    if local is None:
        raise pool.error("local", "required: where the tokenizer.json files are")
    pool.done()
    raw = {"modelName": model, "local": local} if model else {"local": local}
    return TokenProducer(f"{name}.tokenizer", Params(raw, pool.subject, path=pool.path))
