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

**Block hashes are vLLM's** (``blockhash.vllm``, which the picker's precise
prefix producer shares to check an engine's seed and algorithm): the chain
vLLM computes over each block's token ids, seeded from ``PYTHONHASHSEED`` as
vLLM is, sent as the digest's low 64 bits. So a subscriber that hashes a
prompt's tokens the same way finds the same keys, and a real vLLM can replace
the simulator behind it.

The simulated engine reports into a ``KVEventLog`` (``Engine.publish_kv_events``):
a block stored when it fills and enters the prefix cache, removed when it is
evicted for reuse. At the end of every step the log hands its batch, if any,
to a sink: ``ZmqPublisher.send`` in the server, a list in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import orjson
import zmq

from blockhash.vllm import BlockHasher, external, hash_function

MEDIUM: Final = "GPU"
DEFAULT_ENDPOINT: Final = "tcp://*:5557"


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
