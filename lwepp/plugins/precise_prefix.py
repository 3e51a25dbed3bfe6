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

**Events.** One ZMQ SUB socket at ``kvEventsConfig.zmqEndpoint``, bound
when it has a wildcard (``tcp://*:5557``: the engines connect their PUB to
it, as with the router) and connected otherwise (to one engine that binds),
subscribed to ``topicFilter``; the topic names the
engine, ``kv@<pod ip>@<model>`` (or ``kv@<ip:port>@<model>`` for one engine
of several on a pod). Each message's 8-byte sequence number is checked per
engine: the next one is applied; 0 after others means the engine restarted
(its cache is empty: its blocks are forgotten, then the batch applied); a
gap means batches were lost (the engine's blocks are forgotten rather than
trusted: misses, never false hits, until it stores them again); an old or
repeated number is a late message and is dropped. A batch whose
``block_size`` differs from ``blockSizeTokens`` is refused with an error
naming both: it would never match a prompt's blocks.

**Tokens.** ``tokenizer``, Switchyard's parameter: a dotted path to a
function from the raw request body to its prompt token ids (None: not a
prompt). ``simulator.openai.prompt_token_ids`` is the simulator's own; for
vLLM, a function calling the model's tokenizer and chat template. (The
router can also call the engine's render endpoint; a pick here does no I/O,
so that is not offered.)

Parameters (the router's shape): ``indexerConfig.tokenProcessorConfig``
``blockSizeTokens`` (or the older ``blockSize``; 16), ``hashSeed`` (""),
``indexerConfig.kvBlockIndexConfig.maxPrefixTokensToMatch`` (0: all) and
``enableMetrics`` (accepted); ``kvEventsConfig.zmqEndpoint``
(``tcp://*:5557``) and ``topicFilter`` (``kv@``); ``tokenizer`` (required).
"""

from __future__ import annotations

import asyncio
import importlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import msgpack
import structlog
import xxhash
import zmq
import zmq.asyncio

from lwepp.contracts import AttributeWriter, LLMRequest
from plugin import NO_PARAMS, Params
from pods.model import Endpoint

log = structlog.get_logger()

PRODUCER: Final = "precise-prefix-cache-producer"
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

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        indexer = params.entry("indexerConfig", params.get("indexerConfig", dict, {}))
        tokens = indexer.entry(
            "tokenProcessorConfig", indexer.get("tokenProcessorConfig", dict, {})
        )
        older = tokens.get("blockSize", int, 0, at_least=0)
        self.block_size = tokens.get("blockSizeTokens", int, older or 16, at_least=1)
        seed = tokens.get("hashSeed", str, "")
        tokens.get("hashAlgorithm", str, "")
        tokens.done()
        index = indexer.entry("kvBlockIndexConfig", indexer.get("kvBlockIndexConfig", dict, {}))
        self.max_tokens = index.get("maxPrefixTokensToMatch", int, 0, at_least=0)
        index.get("enableMetrics", bool, False)
        index.get("metricsLoggingInterval", int, 0)
        index.done()
        indexer.done()
        events = params.entry("kvEventsConfig", params.get("kvEventsConfig", dict, {}))
        self.endpoint = events.get("zmqEndpoint", str, "tcp://*:5557")
        self.topic_filter = events.get("topicFilter", str, "kv@")
        events.done()
        path = params.get("tokenizer", str, "")
        if not path:
            raise params.error(
                "tokenizer",
                "required: a dotted path to a function from the request body to its prompt "
                "token ids (simulator.openai.prompt_token_ids for the simulator)",
            )
        self.tokenizer = _tokenizer(path, params)
        self.root = xxhash.xxh64_intdigest(seed.encode())
        self.index = BlockIndex()
        self.sequence: dict[str, int] = {}
        """The last sequence number applied, per engine."""
        self.problems: dict[str, str] = {}
        """The last problem each engine's events had (refused, lost or late batches)."""
        self._key = f"{name}.keys"

    # --- the request side: what the prefix scorer calls ------------------------------

    def prepare(self, request: LLMRequest) -> None:
        """Tokenize the prompt once, into its block keys (the scorer reads ``request_keys``)."""
        if request.body is None:
            return
        ids = self.tokenizer(request.body)
        if not ids:
            return
        if self.max_tokens:
            ids = ids[: self.max_tokens]
        request.state[self._key] = chain(self.root, ids, self.block_size)

    def request_keys(self, request: LLMRequest) -> list[int]:
        keys: list[int] = request.state.get(self._key, [])
        return keys

    def match(self, keys: Sequence[int], endpoints: Sequence[Endpoint]) -> dict[str, int]:
        """Blocks in a row each endpoint (``ip:port``) holds, by its own events.

        An engine is named by its topic: ``ip:port``, or the pod's IP alone.
        """
        names = {e.hostport: e.hostport if e.hostport in self.sequence else e.address
                 for e in endpoints}  # fmt: skip
        found = self.index.match(keys, list(set(names.values())))
        return {hostport: found[name] for hostport, name in names.items()}

    # --- the event side ------------------------------------------------------------------

    def ingest(self, topic: bytes, sequence: bytes, payload: bytes) -> None:
        """Apply one message ``[topic, sequence, payload]`` (see the module docstring)."""
        parts = topic.decode(errors="replace").split("@")
        engine = parts[1] if len(parts) > 1 and parts[1] else parts[0]
        number = int.from_bytes(sequence, "big")
        last = self.sequence.get(engine)
        if last is not None and number != last + 1:
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
            self._problem(engine, f"batch {number} refused: {error}")
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
            self.index.stored(engine, hashes, chain(root, ids, size, lora))
        elif kind == "BlockRemoved":
            self.index.removed(engine, event[1])
        elif kind == "AllBlocksCleared":
            self.index.clear(engine)

    def _problem(self, engine: str, problem: str) -> None:
        self.problems[engine] = problem
        log.warning("kv events", producer=self.name, engine=engine, problem=problem)

    # --- the subscriber ------------------------------------------------------------------

    async def run(
        self,
        endpoints: Callable[[], Sequence[Endpoint]],
        store: AttributeWriter,
        clock: Callable[[], float],
    ) -> None:
        """Receive the engines' events until cancelled: bound to a wildcard endpoint (the
        engines connect), else connected to the one engine publishing there."""
        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, self.topic_filter.encode())
            if "*" in self.endpoint or "::" in self.endpoint:
                socket.bind(self.endpoint)
            else:
                socket.connect(self.endpoint)
            while True:
                frames = await socket.recv_multipart()
                if len(frames) == 3:
                    self.ingest(*frames)
        except asyncio.CancelledError:
            raise
        finally:
            socket.close(linger=0)
