"""KV-cache events as vLLM publishes them (``--kv-events-config``), so a router can index them.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@<pod>@<model>"}'``
tells subscribers which blocks its prefix cache holds. Each scheduler step's
events go out as one ZMQ PUB message of three frames:

    topic          the configured topic, UTF-8 (llm-d's subscriber reads
                   ``kv@<pod>@<model>`` from it)
    sequence       8 bytes, big-endian, counting from 0 per publisher: a
                   subscriber that sees a gap knows it missed a batch
    payload        msgpack of the batch, positional as vLLM's ``array_like``
                   msgspec structs encode it: ``[ts, [event, ...]]``

and the events, each a tagged array with trailing defaults left out::

    ["BlockStored", [hash, ...], parent_hash | None, [token_id, ...], block_size,
     lora_id | None, medium, lora_name | None]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

**Block hashes are vLLM's** (``vllm/v1/core/kv_cache_utils.py``): a block's
hash is ``H((parent_hash, tuple(token_ids), extra_keys))`` with the first
block's parent ``NONE_HASH = H(seed)``; ``H`` is SHA-256 of the tuple's pickle
(vLLM's default ``--prefix-caching-hash-algo sha256``) or of its canonical
CBOR (``sha256_cbor``, the one to use across languages); the seed is
``PYTHONHASHSEED`` when set, else vLLM's fixed ``"vllm-none-hash"``;
``extra_keys`` is ``(lora_name,)`` for an adapter's blocks and None
otherwise. On the wire each hash is the low 64 bits of the digest read
big-endian, vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). So a
subscriber that hashes a prompt's tokens the same way finds the same keys,
and a real vLLM can replace the simulator behind it.

The simulated engine reports into a ``KVEventLog`` (``Engine.publish_kv_events``):
a block stored when it fills and enters the prefix cache, removed when it is
evicted for reuse. At the end of every step the log hands its batch, if any,
to a sink: ``ZmqPublisher.send`` in the server, a list in tests.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import orjson
import zmq

HASH_ALGORITHMS: Final = ("sha256", "sha256_cbor")
DEFAULT_SEED: Final = "vllm-none-hash"
"""vLLM's NONE_HASH seed for cryptographic hashes when ``PYTHONHASHSEED`` is unset."""
MEDIUM: Final = "GPU"
DEFAULT_ENDPOINT: Final = "tcp://*:5557"
_MASK: Final = (1 << 64) - 1


# --- hashing, as vLLM does it --------------------------------------------------------------


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1) of None, ints, str, bytes, and tuples or lists of them:
    what ``cbor2.dumps(value, canonical=True)`` writes for the values vLLM hashes."""
    out = bytearray()
    _cbor(value, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out.append(major << 5 | 25)
        out += struct.pack(">H", n)
    elif n < 1 << 32:
        out.append(major << 5 | 26)
        out += struct.pack(">I", n)
    else:
        out.append(major << 5 | 27)
        out += struct.pack(">Q", n)


def _cbor(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif isinstance(value, bool):
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        _head(0, value, out) if value >= 0 else _head(1, -1 - value, out)
    elif isinstance(value, bytes):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode()
        _head(3, len(data), out)
        out += data
    elif isinstance(value, tuple | list):
        _head(4, len(value), out)
        for item in value:
            _cbor(item, out)
    else:
        raise TypeError(f"cannot hash a {type(value).__name__} as vLLM does")


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's ``--prefix-caching-hash-algo`` of that name."""
    if algorithm == "sha256":
        return lambda value: hashlib.sha256(pickle.dumps(value, pickle.HIGHEST_PROTOCOL)).digest()
    if algorithm == "sha256_cbor":
        return lambda value: hashlib.sha256(cbor(value)).digest()
    raise ValueError(
        f"hash algorithm: expected one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}"
    )


def hash_seed() -> str:
    """The NONE_HASH seed vLLM would use in this environment (``PYTHONHASHSEED``, else fixed)."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


class BlockHasher:
    """vLLM's block-hash chain for one algorithm and seed."""

    __slots__ = ("function", "none_hash")

    def __init__(self, algorithm: str = "sha256", seed: str | None = None) -> None:
        self.function = hash_function(algorithm)
        self.none_hash = self.function(hash_seed() if seed is None else seed)

    def block(self, parent: bytes | None, tokens: Sequence[int], adapter: str = "") -> bytes:
        """One full block's hash, chained on its parent's (None: the first block)."""
        extra = (adapter,) if adapter else None
        return self.function((parent or self.none_hash, tuple(tokens), extra))

    def chain(self, tokens: Sequence[int], block_size: int, adapter: str = "") -> list[bytes]:
        """Every full block's hash of ``tokens``, in order."""
        hashes: list[bytes] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = self.block(parent, tokens[start : start + block_size], adapter)
            hashes.append(parent)
        return hashes


def external(digest: bytes) -> int:
    """A block hash as it goes on the wire: the digest's low 64 bits, read big-endian."""
    return int.from_bytes(digest, "big") & _MASK


# --- the events ----------------------------------------------------------------------------


def encode_batch(ts: float, events: Sequence[Sequence[Any]]) -> bytes:
    """One batch's payload: msgpack of ``[ts, events]`` (vLLM's array-like ``KVEventBatch``)."""
    payload: bytes = msgpack.packb([ts, list(events)], use_bin_type=True)
    return payload


class KVEventLog:
    """One engine's block-cache events since the last step, in vLLM's shape.

    The engine names blocks by its own digests; the log keeps each cached
    block's vLLM hash under that digest until the block is removed.
    """

    __slots__ = ("_hashes", "_pending", "block_size", "hasher", "sink")

    def __init__(
        self,
        block_size: int,
        sink: Callable[[bytes], None],
        hasher: BlockHasher | None = None,
    ) -> None:
        self.block_size, self.sink = block_size, sink
        self.hasher = hasher or BlockHasher()
        self._hashes: dict[int, bytes] = {}
        self._pending: list[list[Any]] = []

    def stored(
        self,
        digests: Sequence[int],
        start: int,
        end: int,
        tokens: Callable[[int, int], Sequence[int]],
        adapter: str = "",
    ) -> None:
        """Blocks ``start`` to ``end - 1`` of a sequence (``digests`` its engine digests, from the
        first block) entered the cache; ``tokens(a, b)`` gives the sequence's token ids."""
        if start >= end:
            return
        size, known = self.block_size, self._hashes
        parent = known.get(digests[start - 1]) if start else None
        if start and parent is None:  # the parent left the cache: rebuild the chain to it
            parent = self.hasher.chain(tokens(0, start * size), size, adapter)[-1]
        parent_wire = external(parent) if parent is not None else None
        hashes: list[int] = []
        ids: list[int] = []
        for index in range(start, end):
            block = tokens(index * size, (index + 1) * size)
            parent = self.hasher.block(parent, block, adapter)
            known[digests[index]] = parent
            hashes.append(external(parent))
            ids += block
        lora = adapter or None
        self._pending.append(["BlockStored", hashes, parent_wire, ids, size, None, MEDIUM, lora])

    def removed(self, digest: int) -> None:
        """The block the engine named ``digest`` was evicted from the cache."""
        digest_hash = self._hashes.pop(digest, None)
        if digest_hash is not None:
            self._pending.append(["BlockRemoved", [external(digest_hash)], MEDIUM])

    def cleared(self) -> None:
        """Every block left the cache (vLLM's reset of the prefix cache)."""
        self._hashes.clear()
        self._pending.append(["AllBlocksCleared"])

    def flush(self, ts: float) -> None:
        """End of a step: the events since the last one, as one batch, to the sink."""
        if self._pending:
            events, self._pending = self._pending, []
            self.sink(encode_batch(ts, events))


# --- the publisher -------------------------------------------------------------------------


CONFIG_FIELDS: Final = frozenset(
    {
        "enable_kv_cache_events", "publisher", "endpoint", "topic", "replay_endpoint",
        "buffer_steps", "hwm", "max_queue_size",
    }
)  # fmt: skip
"""The fields of vLLM's ``KVEventsConfig``."""


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON: the fields this simulator acts on.

    ``endpoint`` is bound when it has a wildcard (``tcp://*:5557``) and
    connected to otherwise, as vLLM does. ``replay_endpoint``,
    ``buffer_steps``, ``hwm`` and ``max_queue_size`` are vLLM's too: accepted,
    and only ``hwm`` is used (no replay socket here).
    """

    enabled: bool = False
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""
    hwm: int = 100_000
    algorithm: str = "sha256"

    @classmethod
    def parse(cls, text: str, algorithm: str = "sha256") -> KVEventsConfig:
        """The flag's JSON; ValueError names the field at fault."""
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config: not JSON: {error}") from None
        if not isinstance(raw, Mapping):
            raise ValueError("--kv-events-config: expected a JSON object")
        for name in sorted(set(raw) - CONFIG_FIELDS):
            raise ValueError(f"--kv-events-config: unknown field {name!r}")
        publisher = raw.get("publisher", "zmq")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher: expected zmq, got {publisher!r}")
        checks = {"enable_kv_cache_events": bool, "endpoint": str, "topic": str, "hwm": int}
        for name, kind in checks.items():
            if name in raw and not isinstance(raw[name], kind):
                raise ValueError(f"--kv-events-config: {name}: expected {kind.__name__}")
        hash_function(algorithm)  # a bad algorithm fails here, naming itself
        return cls(
            enabled=raw.get("enable_kv_cache_events", False) and publisher == "zmq",
            endpoint=raw.get("endpoint", DEFAULT_ENDPOINT),
            topic=raw.get("topic", ""),
            hwm=raw.get("hwm", 100_000),
            algorithm=algorithm,
        )

    def endpoint_for(self, index: int) -> str:
        """Replica ``index``'s endpoint: the port moved up by ``index`` (a path suffixed
        ``_dp<index>``), as vLLM moves it by data-parallel rank, so replicas in one process
        each publish on their own."""
        if index == 0:
            return self.endpoint
        if not self.endpoint.startswith("tcp://"):  # ipc:// and inproc:// paths: a suffix
            return f"{self.endpoint}_dp{index}"
        base, _, port = self.endpoint.rpartition(":")
        return f"{base}:{int(port) + index}"


class ZmqPublisher:
    """A ZMQ PUB socket sending each batch as ``[topic, sequence, payload]``."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where it listens or connects (a bound ``tcp://*:0`` becomes its real port)."""
        self._topic = topic.encode()
        self._sequence = 0

    def send(self, payload: bytes) -> None:
        """Publish one batch (never blocks: past the high-water mark PUB drops, as in vLLM)."""
        frames = (self._topic, self._sequence.to_bytes(8, "big"), payload)
        self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        self._sequence += 1

    def close(self) -> None:
        self._socket.close(linger=0)
