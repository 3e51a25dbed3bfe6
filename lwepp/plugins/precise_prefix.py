"""``precise-prefix-cache-producer``: which blocks each engine holds, as the engines themselves say.

The approximate prefix index guesses: it records a prompt as cached where it
was sent. Engines know: vLLM started with ``--kv-events-config`` publishes
every block its prefix cache stores or evicts (``simulator.kv_events`` has
the wire format; the simulator publishes it too). This producer subscribes,
keeps an exact index of each engine's blocks, and tokenizes each prompt so
the ``prefix-cache-scorer`` that names it in ``prefixMatchInfoProducerName``
scores by blocks truly held, as in the llm-d router.

**Keys.** Blocks are indexed by keys computed here from the token ids each
``BlockStored`` event carries (and a prompt's by the same function of its
own token ids): an xxhash64 chain over ``blockSizeTokens`` tokens a block,
rooted at ``hashSeed``, with the block's LoRA adapter. The engine's own hash
of each block is kept only to apply its ``BlockRemoved`` events, so the
engine's hash algorithm and seed never decide a match; what must agree is
the block size and the tokenizer.

**Seed and algorithm, checked.** They still matter to anyone else who reads
the engine's hashes as keys (the llm-d router, too, keys blocks by their
token ids and maps the engine's hashes to them). So the first root blocks
(no parent, no adapter) of each engine are hashed as vLLM does
(``blockhash.vllm``) with ``hashSeed`` ("" meaning an engine without
``PYTHONHASHSEED``: vLLM's fixed ``"vllm-none-hash"``) and ``hashAlgorithm``
(unset, or the router's own key hashes ``cbor-fnv``/``xxh64``: each of
vLLM's, and the one that matches is logged). The first match settles it;
three misses in a row (one could carry a ``cache_salt`` this cannot see)
give one warning naming the seed, the algorithm and what to set on the
engine or here. SGLang's engines (``kvEventsConfig.engineType: sglang``)
publish the same batches, their trailing fields optional, with hashes of
their own: nothing is checked there.

**Events.** One ZMQ SUB socket, subscribed to ``topicFilter``. With
``kvEventsConfig.discoverPods`` (the router's default) and an
``endpoint-notification-source`` paired with it in ``dataLayer.sources``
(or the only one), it connects to each endpoint's publisher at
``podDiscoveryConfig.socketPort`` (5557) as the pool lists it, and
disconnects, forgetting its blocks, when it leaves (the engines bind:
``--kv-events-config '{"endpoint": "tcp://*:5557", ...}'``). Otherwise it
binds ``zmqEndpoint`` when that has a wildcard (``tcp://*:5557`` when unset:
the engines connect their PUB to it) and connects to it otherwise (to one
engine that binds); the topic names the
engine, ``kv@<pod ip>@<model>`` (or ``kv@<ip:port>@<model>`` for one engine
of several on a pod). Each message's 8-byte sequence number is checked per
engine: the next one is applied; 0 after others means the engine restarted
(its cache is empty: its blocks are forgotten, then the batch applied); a
gap means batches were lost (the engine's blocks are forgotten rather than
trusted: misses, never false hits, until it stores them again); an old or
repeated number is a late message and is dropped. A batch whose
``block_size`` differs from ``blockSizeTokens`` is refused with an error
naming both: it would never match a prompt's blocks.

**Silence, reported.** A wrong ``topicFilter`` or ``zmqEndpoint``, or an
engine started without ``--kv-events-config``, would only score 0. Once
``eventsGracePeriod`` seconds have passed since the subscriber started, each
pool endpoint no event has named is reported once, with where the subscriber
listens and the topic the engine should publish; so is an engine whose topic
names no pool endpoint. Every report is a ``kv events`` warning in the log
and stays in ``problems``, by engine or endpoint, which the picker's
``/debug/<name>`` page shows with each engine heard (``--enable-debug-pages``).

**Speculation** (``speculativeIndexing``, off by default, as in the router).
An engine's events for a prompt arrive only after the step that stored its
blocks; until then every request of the same prefix sees a miss and may go
elsewhere, so a burst of one new prefix scatters over the pool, each engine
prefilling it again. With speculation on, a pick records the request's
blocks as held by the picked engine for ``speculativeTTL`` (a Go duration,
``2s``), the router's blind-spot cover; the engine's own events confirm or,
once the entry lapses, overrule it. The approximate index records every
pick for the same reason.

**Tokens.** From the ``token-producer`` in the file (``lwepp.plugins.tokens``:
the engine's own tokenizer endpoint, a local tokenizer file, or the
estimate), as in the router; one with the estimate backend is added when
the file has none, with a warning, since its pseudo-token ids match no
engine's blocks. Or Switchyard's ``tokenizer`` parameter: a dotted path to
a function from the raw request body to its prompt token ids (None: not a
prompt), such as the simulator's own ``simulator.openai.prompt_token_ids``.

Parameters (the router's shape): ``indexerConfig.tokenProcessorConfig``
``blockSizeTokens`` (or the older ``blockSize``; 16), ``hashSeed`` (""),
``hashAlgorithm`` (the router's or vLLM's names; unset),
``indexerConfig.kvBlockIndexConfig.maxPrefixTokensToMatch`` (0: all) and
``enableMetrics`` (accepted); ``kvEventsConfig.zmqEndpoint``
(``tcp://*:5557``), ``topicFilter`` (``kv@``) and ``engineType`` (``vllm``
or ``sglang``); ``speculativeIndexing``
(false) and ``speculativeTTL`` (``2s``); ``discoverPods`` (true),
``podDiscoveryConfig.socketPort`` (5557), ``concurrency`` (accepted: one
reader keeps batches in order); Switchyard's own ``tokenizer`` (optional)
and ``eventsGracePeriod`` (seconds, 30).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import msgpack
import orjson
import structlog
import xxhash
import zmq
import zmq.asyncio

from blockhash.vllm import DEFAULT_SEED, HASH_ALGORITHMS, BlockHasher, external
from lwepp.contracts import (
    ENDPOINT_EVENTS,
    PREFIX_MATCH,
    TOKENS,
    AttributeWriter,
    Candidate,
    Clock,
    EndpointsNow,
    LLMRequest,
    Want,
)
from lwepp.plugins.approx_prefix import PrefixMatch, match_key
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint, join_host_port
from serving.cli import duration

log = structlog.get_logger()

PRODUCER: Final = "precise-prefix-cache-producer"
TOKEN_PRODUCER: Final = "token-producer"
"""The producer of prompt ids the router adds when none is configured (its estimate backend)."""
ROOT_CHECKS: Final = 3
"""Root blocks of an engine checked against vLLM's hash before a mismatch is reported: a
request's ``cache_salt`` or images change its first block's hash, invisibly here."""
ROUTER_KEY_HASHES: Final = ("cbor-fnv", "xxh64")
"""``hashAlgorithm``'s values in the router: how it hashes its own index keys. Keys here are
this producer's own as well, so either is accepted and changes nothing."""
DEFAULT_ENDPOINT: Final = "tcp://*:5557"
"""Where the subscriber binds when neither ``zmqEndpoint`` nor pod discovery says where."""
CHECK_EVERY: Final = 1.0
"""Seconds between the subscriber's looks for silent endpoints and unknown engines."""
Tokenizer = Callable[[bytes], Sequence[int] | None]


class Mismatch(ValueError):
    """The engine's events describe blocks this index cannot match (another block size)."""


class BlockIndex:
    """Each engine's cached blocks: engine hash → key per engine, and key → engines."""

    def __init__(self) -> None:
        self._keys: dict[str, dict[int, int]] = {}
        self._holders: dict[int, set[str]] = {}

    def stored(self, engine: str, hashes: Sequence[int], keys: Sequence[int]) -> None:
        held = self._keys.setdefault(engine, {})
        for engine_hash, key in zip(hashes, keys, strict=True):
            held[engine_hash] = key
            self._holders.setdefault(key, set()).add(engine)

    def removed(self, engine: str, hashes: Sequence[int]) -> None:
        held = self._keys.get(engine, {})
        for engine_hash in hashes:
            key = held.pop(engine_hash, None)
            if key is not None:
                self._drop(key, engine)

    def key_of(self, engine: str, engine_hash: int) -> int | None:
        return self._keys.get(engine, {}).get(engine_hash)

    def clear(self, engine: str) -> None:
        for key in self._keys.pop(engine, {}).values():
            self._drop(key, engine)

    def _drop(self, key: int, engine: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(engine)
            if not holders:
                del self._holders[key]

    def match(self, keys: Sequence[int], engines: Sequence[str]) -> dict[str, int]:
        """For each engine, how many of ``keys`` it holds in a row from the first."""
        matched = dict.fromkeys(engines, 0)
        alive = set(engines)
        for depth, key in enumerate(keys):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for engine in alive:
                matched[engine] = depth + 1
        return matched

    def blocks(self, engine: str) -> int:
        return len(self._keys.get(engine, {}))

    def holds(self, engine: str, key: int) -> bool:
        return engine in self._holders.get(key, ())


def chain(root: int, tokens: Sequence[int], block_size: int, adapter: str = "") -> list[int]:
    """The key of every full block of ``tokens``: xxhash64 of the parent key (8 bytes), the
    block's token ids (4 bytes each) and the adapter's name, little-endian, chained from
    ``root``."""
    pack = struct.Struct(f"<Q{block_size}I").pack
    tail = adapter.encode()
    keys: list[int] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = xxhash.xxh64_intdigest(pack(parent, *tokens[start : start + block_size]) + tail)
        keys.append(parent)
    return keys


def _tokenizer(path: str, params: Params) -> Tokenizer:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise params.error("tokenizer", f"cannot load {path!r}: {error}") from None
    if not callable(found):
        raise params.error("tokenizer", f"{path!r} is not a function")
    tokenizer: Tokenizer = found
    return tokenizer


class PrecisePrefixCacheProducer:
    needs_body = True
    produces: ClassVar[frozenset[str]] = frozenset()
    """It writes no endpoint attribute: its index is read by the prefix scorer directly."""
    provides: Final = frozenset({PREFIX_MATCH})
    """The prefix scorer that names it reads its index (``lwepp.contracts.Want``)."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        indexer = params.entry("indexerConfig", params.get("indexerConfig", dict, {}))
        if "tokenizersPoolConfig" in indexer:
            raise indexer.error(
                "tokenizersPoolConfig",
                "not supported by precise-prefix-cache-producer (nor by the router's since "
                "v0.10): configure a token-producer plugin instead",
            )
        # tokenProcessorConfig: at the top since the router's v0.10, inside indexerConfig before.
        tokens = params.entry(
            "tokenProcessorConfig", params.get("tokenProcessorConfig", dict, None)
        )
        if "tokenProcessorConfig" in indexer:
            if "tokenProcessorConfig" in params:
                raise indexer.error("tokenProcessorConfig", "set at the top already: once only")
            tokens = indexer.entry(
                "tokenProcessorConfig", indexer.get("tokenProcessorConfig", dict, {})
            )
        older = tokens.get("blockSize", int, 0, at_least=0)
        self.block_size = tokens.get("blockSizeTokens", int, older or 16, at_least=1)
        seed = tokens.get("hashSeed", str, "")
        algorithm = tokens.get("hashAlgorithm", str, "")
        if algorithm in ROUTER_KEY_HASHES:
            algorithm = ""  # the router's own keys; this producer's are its own too
        elif algorithm and algorithm not in HASH_ALGORITHMS:
            raise tokens.error(
                "hashAlgorithm",
                f"expected one of {', '.join(ROUTER_KEY_HASHES + HASH_ALGORITHMS)} (the "
                f"router's keys, or vLLM's --prefix-caching-hash-algo) or none, got {algorithm!r}",
            )
        tokens.done()
        index = indexer.entry("kvBlockIndexConfig", indexer.get("kvBlockIndexConfig", dict, {}))
        self.max_tokens = index.get("maxPrefixTokensToMatch", int, 0, at_least=0)
        index.get("enableMetrics", bool, False)
        index.get("metricsLoggingInterval", object, 0)  # nanoseconds, or a duration string
        index.get("inMemoryConfig", dict, {})  # the index is in this process's memory
        index.get("costAwareMemoryConfig", dict, {})
        if "redisConfig" in index:
            raise index.error(
                "redisConfig",
                "an index shared in Redis is not implemented: each picker keeps its own, fed by "
                "every engine's events (the llm-d guide's active-active recipe does the same)",
            )
        index.done()
        indexer.get("kvCacheBackendConfigs", object, None)  # device tiers: one tier here
        indexer.get("prefixStoreConfig", dict, {})  # the older tokenizer's cache
        indexer.done()
        events = params.entry("kvEventsConfig", params.get("kvEventsConfig", dict, {}))
        self.endpoint = events.get("zmqEndpoint", str, "")
        self.topic_filter = events.get("topicFilter", str, "kv@")
        events.get("concurrency", int, 4, at_least=1)  # one reader here: batches stay in order
        engine = events.get("engineType", str, "vllm")
        if engine not in ("vllm", "sglang"):
            raise events.error("engineType", f"expected vllm or sglang, got {engine!r}")
        self.vllm_hashes = engine == "vllm"
        """Are the engines' own block hashes vLLM's (checked against the seed), or SGLang's?"""
        self.discover = events.get("discoverPods", bool, True)
        pods = events.entry("podDiscoveryConfig", events.get("podDiscoveryConfig", dict, {}))
        self.socket_port = pods.get("socketPort", int, 5557, at_least=1)
        pods.get("podLabelSelector", str, "")  # the pool's endpoints are the pods here
        pods.get("podNamespace", str, "")
        pods.get("replaySocketPort", int, 0)
        pods.done()
        events.done()
        self.events: Any = None
        """The ``endpoint-notification-source`` paired with it (``Want``): with ``discoverPods``,
        each endpoint's publisher is subscribed to as the pool lists it."""
        self.tokens: Any = None
        """The ``token-producer`` whose ids it hashes (``Want``), unless ``tokenizer`` is set."""
        path = params.get("tokenizer", str, "")
        self.tokenizer: Tokenizer | None = _tokenizer(path, params) if path else None
        wants = [Want("endpoint-notification-source", None, ENDPOINT_EVENTS, self._use_events)]
        if self.tokenizer is None:
            wants.append(
                Want(
                    "tokenizer",
                    None,
                    TOKENS,
                    self._use_tokens,
                    default=TOKEN_PRODUCER,
                    add=True,
                    note="the prompt's token ids. The router adds one too, with its estimate "
                    "backend, whose pseudo-token ids match no engine's blocks: configure a "
                    "token-producer with the engine's tokenizer (vllm.url, or llamacpp.url)",
                )
            )
        self.wants: tuple[Want, ...] = tuple(wants)
        self.grace = params.get("eventsGracePeriod", float, 30.0, at_least=0)
        self.speculative = params.get("speculativeIndexing", bool, False)
        ttl = params.get("speculativeTTL", str, "2s")
        try:
            self.speculative_ttl = duration(ttl)
        except argparse.ArgumentTypeError as error:
            raise params.error("speculativeTTL", str(error)) from None
        self._guesses: dict[str, dict[int, float]] = {}
        """Speculative entries: per picked endpoint (``ip:port``: the engine may not have
        named itself yet), block key → when the entry lapses."""
        self._sweep_at = 0.0
        self.clock: Callable[[], float] = time.monotonic
        """What a speculative entry's age is read on (``run`` sets the pipeline's)."""
        self.hash_seed, self.hash_algorithm = seed, algorithm
        self._hashers = {
            name: BlockHasher(name, seed or DEFAULT_SEED)
            for name in ((algorithm,) if algorithm else HASH_ALGORITHMS)
        }
        self.root = xxhash.xxh64_intdigest(seed.encode())
        self.index = BlockIndex()
        self.sequence: dict[str, int] = {}
        """The last sequence number applied, per engine."""
        self.problems: dict[str, str] = {}
        """The last problem each engine (or endpoint) had: refused, lost or late batches, a
        hash seed or algorithm not the engine's, no events at all, a topic naming no endpoint."""
        self._refusing: set[str] = set()
        """Engines whose block size was refused and logged: every later batch would be too."""
        self.hashed_with: dict[str, str] = {}
        """Per engine, the vLLM algorithm its root blocks matched ("": none did)."""
        self._root_checks: dict[str, int] = {}
        self._topics: dict[str, str] = {}
        """The first topic each engine published on (to name it in a report)."""
        self._started: float | None = None
        self._unknown_since: dict[str, float] = {}
        self._reported: set[str] = set()
        """Endpoints reported silent and engines reported unknown: each is told once."""
        self._key = f"{name}.keys"
        self._match = match_key(name)

    # --- the request side: what the prefix scorer calls ------------------------------

    def _use_events(self, source: Any) -> None:
        self.events = source

    def _use_tokens(self, producer: Any) -> None:
        self.tokens = producer

    def prepare(self, request: LLMRequest) -> None:
        """The prompt's ids (its token producer's, or ``tokenizer``'s) cut into block keys, once
        (the scorer reads ``request_keys``)."""
        if self.tokenizer is not None:
            ids = self.tokenizer(request.body) if request.body is not None else None
        else:
            ids = self.tokens.token_ids(request) if self.tokens is not None else None
        if not ids:
            return
        if self.max_tokens:
            ids = ids[: self.max_tokens]
        request.state[self._key] = chain(self.root, ids, self.block_size)

    def request_keys(self, request: LLMRequest) -> list[int]:
        keys: list[int] = request.state.get(self._key, [])
        return keys

    def prefix_match(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> PrefixMatch | None:
        """Blocks each candidate's engine holds in a row, of the prompt's (None: no prompt
        blocks): what the prefix scorer and the affinity filter read, computed once a request."""
        found: PrefixMatch | None = request.state.get(self._match)
        if found is not None:
            return found
        keys = self.request_keys(request)
        if not keys:
            return None
        found = PrefixMatch(self.match(keys, [c.endpoint for c in candidates]), len(keys),
                            self.block_size)  # fmt: skip
        request.state[self._match] = found
        return found

    def match(self, keys: Sequence[int], endpoints: Sequence[Endpoint]) -> dict[str, int]:
        """Blocks in a row each endpoint (``ip:port``) holds, by its own events and, with
        ``speculativeIndexing``, by the picks sent there.

        An engine is named by its topic: ``ip:port``, or the pod's IP alone; a pick is
        kept by the endpoint picked, so it counts before the engine first names itself.
        """
        names = {e.hostport: self._engine(e) for e in endpoints}
        found = self.index.match(keys, list(set(names.values())))
        matched = {hostport: found[name] for hostport, name in names.items()}
        if self._guesses:
            now = self.clock()
            for hostport in names.keys() & self._guesses.keys():
                depth = matched[hostport]
                matched[hostport] = self._guessed(keys, hostport, names[hostport], depth, now)
        return matched

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        """With ``speculativeIndexing``: the prompt's blocks are taken as held by the picked
        endpoint for ``speculativeTTL``, beside what its engine's events say, while those are
        on their way."""
        keys = self.request_keys(request)
        if not self.speculative or not endpoints or not keys:
            return
        now = self.clock()
        if now >= self._sweep_at:  # lapsed entries go in one pass every TTL or so
            for guesses in self._guesses.values():
                for key in [k for k, until in guesses.items() if until <= now]:
                    del guesses[key]
            self._sweep_at = now + self.speculative_ttl
        guesses = self._guesses.setdefault(endpoints[0].hostport, {})
        until = now + self.speculative_ttl
        for key in keys:
            guesses[key] = until

    def _engine(self, endpoint: Endpoint) -> str:
        """The engine an endpoint is, as topics name it: ``ip:port``, or the pod's IP alone."""
        return endpoint.hostport if endpoint.hostport in self.sequence else endpoint.address

    def _guessed(
        self, keys: Sequence[int], hostport: str, engine: str, depth: int, now: float
    ) -> int:
        """Blocks in a row from the first ``hostport`` holds, its speculative entries counted:
        from ``depth``, what its engine's events alone gave."""
        guesses = self._guesses[hostport]
        for key in keys[depth:]:
            if guesses.get(key, 0.0) <= now and not self.index.holds(engine, key):
                break
            depth += 1
        return depth

    # --- the event side ------------------------------------------------------------------

    def ingest(self, topic: bytes, sequence: bytes, payload: bytes) -> None:
        """Apply one message ``[topic, sequence, payload]`` (see the module docstring)."""
        parts = topic.decode(errors="replace").split("@")
        engine = parts[1] if len(parts) > 1 and parts[1] else parts[0]
        number = int.from_bytes(sequence, "big")
        last = self.sequence.get(engine)
        if last is None:
            self._topics[engine] = topic.decode(errors="replace")
        elif number != last + 1:
            if number == 0:
                self.index.clear(engine)  # the engine restarted: its cache is empty
            elif number > last + 1:
                self.index.clear(engine)  # lost batches: its blocks are no longer known
                self._problem(engine, f"batches {last + 1}–{number - 1} lost; blocks forgotten")
            else:
                self._problem(engine, f"batch {number} arrived after {last}: dropped")
                return
        self.sequence[engine] = number
        try:
            _ts, events, *_ = msgpack.unpackb(payload)
            for event in events:
                self._apply(engine, event)
        except Mismatch as error:
            # A misconfigured engine has every batch refused alike: warn once, keep counting.
            problem = f"batch {number} refused: {error}"
            if engine in self._refusing:
                self.problems[engine] = problem
            else:
                self._refusing.add(engine)
                self._problem(engine, problem)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as error:
            self._problem(engine, f"batch {number} is not a vLLM event batch: {error}")

    def _apply(self, engine: str, event: Sequence[Any]) -> None:
        kind = event[0]
        if kind == "BlockStored":
            hashes, parent, ids, size = event[1], event[2], event[3], event[4]
            lora = event[7] if len(event) > 7 and event[7] else ""
            if size != self.block_size:
                raise Mismatch(
                    f"block_size {size} in the engine's events, blockSizeTokens "
                    f"{self.block_size} in indexerConfig.tokenProcessorConfig: set them equal"
                )
            root = self.root if parent is None else self.index.key_of(engine, parent)
            if root is None:
                return  # its parent is not indexed (lost, or evicted): nothing can reach it
            plain = not lora and (len(event) < 6 or event[5] is None)  # no adapter in the key
            checked = engine in self.hashed_with or not self.vllm_hashes
            if parent is None and plain and hashes and not checked:
                self._check_hash(engine, hashes[0], ids[:size])
            self.index.stored(engine, hashes, chain(root, ids, size, lora))
        elif kind == "BlockRemoved":
            self.index.removed(engine, event[1])
        elif kind == "AllBlocksCleared":
            self.index.clear(engine)

    def _check_hash(self, engine: str, engine_hash: object, tokens: Sequence[int]) -> None:
        """Is this root block's hash vLLM's with the configured seed and algorithm (each of
        vLLM's, when none is configured)? Settled by the first match or after ``ROOT_CHECKS``
        misses, so it costs a few hashes per engine, ever."""
        for algorithm, hasher in self._hashers.items():
            digest = hasher.block(None, tokens)
            if engine_hash in (external(digest), digest):  # 64-bit ints, or whole digests
                self.hashed_with[engine] = algorithm
                log.info("kv events hashed as configured", producer=self.name, engine=engine,
                         hashAlgorithm=algorithm, hashSeed=self.hash_seed)  # fmt: skip
                return
        self._root_checks[engine] = tried = self._root_checks.get(engine, 0) + 1
        if tried >= ROOT_CHECKS:
            self.hashed_with[engine] = ""
            self._problem(engine, self._hash_mismatch())

    def _hash_mismatch(self) -> str:
        seed, algorithm = self.hash_seed, self.hash_algorithm
        which = f"vLLM's {algorithm}" if algorithm else f"any of vLLM's {', '.join(self._hashers)}"
        if seed:
            engine_side = f"PYTHONHASHSEED={seed}"
            meaning = f"hashSeed {seed!r}"
        else:
            engine_side = "no PYTHONHASHSEED"
            meaning = (
                f"hashSeed '' (an engine without PYTHONHASHSEED: vLLM's fixed {DEFAULT_SEED!r}; "
                "xxhash algorithms and vLLM releases before 2026-08 seed each process at random "
                "there, so set PYTHONHASHSEED on every engine and hashSeed to it)"
            )
        if algorithm:
            engine_side += f" and --prefix-caching-hash-algo {algorithm}"
        return (
            f"block hashes are not {which} seeded with {meaning}: start the engine with "
            f"{engine_side}, or set indexerConfig.tokenProcessorConfig.hashSeed"
            f"{'' if algorithm else ' (and hashAlgorithm)'} to the engine's. Routing here is "
            "unaffected (blocks are keyed from the events' token ids, as in the llm-d router); "
            "a reader keying blocks by the engine's own hashes would miss every block"
        )

    def check(self, endpoints: Sequence[Endpoint], now: float) -> None:
        """Report, once each, a pool endpoint no event has named for ``eventsGracePeriod``
        seconds since the subscriber started, and an engine whose topic has named no pool
        endpoint for as long (a pod just added may publish before the pool lists it)."""
        if self._started is None:
            self._started = now
        heard = self.sequence.keys()
        known: set[str] = set()
        for e in endpoints:
            known |= {e.hostport, e.address}
            silent = e.hostport not in heard and e.address not in heard
            if silent and now - self._started >= self.grace and e.hostport not in self._reported:
                self._reported.add(e.hostport)
                self._problem(e.hostport, self._silence(e))
            elif not silent and e.hostport in self._reported:
                self._reported.discard(e.hostport)
                if self.problems.pop(e.hostport, None) is not None:
                    log.info("kv events arriving", producer=self.name, engine=e.hostport)
        for engine in heard - known:
            since = self._unknown_since.setdefault(engine, now)
            if now - since >= self.grace and engine not in self._reported:
                self._reported.add(engine)
                topic = self._topics.get(engine, "")
                self._problem(
                    engine,
                    f"events on topic {topic!r} name {engine!r}, no endpoint of the pool: "
                    "another pool's engine, or a topic whose second part is not the pod's "
                    "IP (or ip:port) as the pool lists it; its events are indexed but never "
                    "read",
                )
        for engine in known & self._unknown_since.keys():
            del self._unknown_since[engine]

    def _silence(self, endpoint: Endpoint) -> str:
        at = self.endpoint or DEFAULT_ENDPOINT
        if self.discovering:
            where = (
                f"connected to {self.publisher(endpoint)} (kvEventsConfig.podDiscoveryConfig."
                "socketPort: the engine's --kv-events-config endpoint must bind there)"
            )
        elif "*" in at or "::" in at:
            where = (
                f"bound at {at} (the engine's --kv-events-config endpoint must connect to this "
                "picker's address on that port)"
            )
        else:
            where = f"connected to {at} (the engine must bind there)"
        return (
            f"no KV events from this endpoint in {self.grace:g} s: it scores 0 on the prefix "
            f"cache. The subscriber is {where}, subscribed to topics starting "
            f"{self.topic_filter!r}; the engine should run with --kv-events-config enabled, "
            f"publishing topic kv@{endpoint.address}@<model> (or kv@{endpoint.hostport}@<model>)"
        )

    def debug_page(self) -> bytes:
        """``/debug/<name>``: where it listens, each engine heard (last sequence number, blocks
        held, the vLLM algorithm its hashes matched) and every problem, as JSON."""
        engines = {
            engine: {
                "topic": self._topics.get(engine),
                "sequence": number,
                "blocks": self.index.blocks(engine),
                "hashed_with": self.hashed_with.get(engine),
            }
            for engine, number in sorted(self.sequence.items())
        }
        return orjson.dumps(
            {
                "zmqEndpoint": self.endpoint or DEFAULT_ENDPOINT,
                "topicFilter": self.topic_filter,
                "hashSeed": self.hash_seed,
                "hashAlgorithm": self.hash_algorithm,
                "engines": engines,
                "problems": dict(sorted(self.problems.items())),
            }
        )

    def _problem(self, engine: str, problem: str) -> None:
        self.problems[engine] = problem
        log.warning("kv events", producer=self.name, engine=engine, problem=problem)

    # --- the subscriber ------------------------------------------------------------------

    @property
    def discovering(self) -> bool:
        """Does it subscribe to each endpoint's publisher (``discoverPods`` with an
        ``endpoint-notification-source``), rather than one socket at ``zmqEndpoint``?"""
        return self.discover and self.events is not None and not self.endpoint

    def publisher(self, endpoint: Endpoint) -> str:
        """Where ``endpoint``'s engine publishes, by ``podDiscoveryConfig.socketPort``."""
        return f"tcp://{join_host_port(endpoint.address, self.socket_port)}"

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None:
        """Receive the engines' events until cancelled, on one SUB socket: connected to each
        endpoint's publisher as the pool lists it, and disconnected (its blocks forgotten) when
        it leaves (``discovering``); else bound to ``zmqEndpoint`` when it has a wildcard (the
        engines connect; ``tcp://*:5557`` when none is set), or connected to the one engine
        publishing there. About once a second (``CHECK_EVERY``), ``check`` the pool for silent
        endpoints and unknown engines, and follow the pool's changes."""
        self.clock = clock
        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        connected: dict[str, Endpoint] = {}
        try:
            socket.setsockopt(zmq.SUBSCRIBE, self.topic_filter.encode())
            where = self.endpoint or DEFAULT_ENDPOINT
            if not self.discovering:
                socket.bind(where) if "*" in where or "::" in where else socket.connect(where)
            due = clock()
            while True:
                if (now := clock()) >= due:
                    pool = endpoints()
                    if self.discovering:
                        self._follow(socket, pool, connected)
                    self.check(pool, now)
                    due = now + CHECK_EVERY
                if await socket.poll(int(CHECK_EVERY * 1000)):
                    frames = await socket.recv_multipart()
                    if len(frames) == 3:
                        self.ingest(*frames)
        except asyncio.CancelledError:
            raise
        finally:
            socket.close(linger=0)

    def _follow(
        self, socket: Any, pool: Sequence[Endpoint], connected: dict[str, Endpoint]
    ) -> None:
        """Connect to the publishers of endpoints that came, disconnect from those that left."""
        current = {self.publisher(e): e for e in pool}
        for url in connected.keys() - current.keys():
            gone = connected.pop(url)
            socket.disconnect(url)
            for engine in (gone.hostport, gone.address):
                self.index.clear(engine)
                self.sequence.pop(engine, None)
            log.info("kv events: unsubscribed", producer=self.name, endpoint=gone.hostport)
        for url in current.keys() - connected.keys():
            socket.connect(url)
            connected[url] = current[url]
            log.info("kv events: subscribed", producer=self.name, publisher=url)
