"""The approximate prefix-cache index: chained block hashes of a prompt, and who holds each hash.

No model server is asked what it has cached. The index remembers which
prompts were sent where, cut into blocks the size of a KV-cache block, and
guesses that a server still holds the blocks it was sent recently.

Hashing (the llm-d router's, xxhash64 throughout)::

    seed     = xxh64(model + cache_salt)
    block[i] = xxh64(text[i*B : (i+1)*B] + block[i-1] as 8 bytes little-endian)   block[-1] = seed

``B`` is the block size in bytes of prompt text (tokens × 4). Each hash
covers its block and, through the chain, everything before it, so equal
hashes at position i mean equal prefixes up to block i. A trailing partial
block is hashed too; a prompt shorter than one block gives no hashes; text
past ``max_blocks`` blocks is ignored. xxhash64 rather than a cryptographic
hash: the index needs speed, not collision resistance against an attacker
(a forged collision only misroutes the forger's own request).

The index maps each hash to the set of endpoints holding it, and keeps one
LRU of hashes per endpoint with a fixed capacity (its KV-cache block count,
or a default). Inserting past capacity evicts that endpoint's least recently
used hash and removes the endpoint from the hash's set, so memory is
bounded by the sum of the capacities, whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import xxhash

_xxh64 = xxhash.xxh64_intdigest


def seed(model: str, cache_salt: str = "") -> int:
    """The hash the chain starts from: different models (or salts) never share blocks."""
    return _xxh64((model + cache_salt).encode())


def block_hashes(text: bytes, start: int, block_bytes: int, max_blocks: int) -> list[int]:
    """The chained hash of each block of ``text`` (see the module docstring)."""
    if block_bytes <= 0 or len(text) < block_bytes:
        return []
    text = text[: max_blocks * block_bytes]
    hashes: list[int] = []
    previous = start
    for offset in range(0, len(text), block_bytes):
        previous = _xxh64(text[offset : offset + block_bytes] + previous.to_bytes(8, "little"))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Hash → endpoints holding it, with a bounded LRU of hashes per endpoint."""

    __slots__ = ("_holders", "_lru")

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, tuple[OrderedDict[int, int], int]] = {}

    def add(self, endpoint: str, hashes: Sequence[int], capacity: int, stamp: int = 0) -> None:
        """Record that ``endpoint`` holds ``hashes``; it keeps at most ``capacity`` of them.

        The capacity of an endpoint follows the latest call (its block count
        may change when the server restarts). Hashes are touched last block
        first, so a prompt's first block is its most recently used and the
        tail is evicted first, as a model server frees a request's blocks.
        Each hash keeps the ``stamp`` of the call that last touched it (a
        caller's sequence number; ``stamp`` reads it back).
        """
        lru, _ = self._lru.get(endpoint, (None, 0))
        if lru is None:
            lru = OrderedDict()
        self._lru[endpoint] = (lru, capacity)
        while len(lru) > capacity:
            self._evict(endpoint, lru)
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
                if stamp:
                    lru[block] = stamp
                continue
            if len(lru) >= capacity:
                if capacity <= 0:
                    return
                self._evict(endpoint, lru)
            lru[block] = stamp
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = {endpoint}
            else:
                holders.add(endpoint)

    def _evict(self, endpoint: str, lru: OrderedDict[int, int]) -> None:
        block, _ = lru.popitem(last=False)
        holders = self._holders[block]
        holders.discard(endpoint)
        if not holders:
            del self._holders[block]

    def match(self, hashes: Sequence[int], endpoints: Collection[str]) -> dict[str, int]:
        """For each of ``endpoints``, how many blocks from the start it holds in a row.

        The walk stops at the first hash none of the still-matching endpoints
        holds; an endpoint drops out at the first block it lacks.
        """
        matched = dict.fromkeys(endpoints, 0)
        alive = set(matched)
        if not alive:
            return matched
        depth = 0
        for block in hashes:
            holders = self._holders.get(block)
            if not holders:
                break
            if not holders.issuperset(alive):  # usually all still match: no new set then
                still = alive & holders
                if not still:
                    break
                for gone in alive - still:
                    matched[gone] = depth
                alive = still
            depth += 1
        for endpoint in alive:
            matched[endpoint] = depth
        return matched

    def remove(self, endpoint: str) -> None:
        """Forget everything ``endpoint`` holds (it left the pool)."""
        lru, _ = self._lru.pop(endpoint, (None, 0))
        while lru:
            block, _ = lru.popitem()
            holders = self._holders[block]
            holders.discard(endpoint)
            if not holders:
                del self._holders[block]

    def retain(self, endpoints: Iterable[str]) -> list[str]:
        """Remove every endpoint not in ``endpoints``; returns those removed."""
        keep = set(endpoints)
        gone = [endpoint for endpoint in self._lru if endpoint not in keep]
        for endpoint in gone:
            self.remove(endpoint)
        return gone

    def endpoints(self) -> list[str]:
        return list(self._lru)

    def size(self, endpoint: str | None = None) -> int:
        """Hashes held by ``endpoint``, or by all endpoints together."""
        if endpoint is not None:
            return len(self._lru[endpoint][0]) if endpoint in self._lru else 0
        return sum(len(lru) for lru, _ in self._lru.values())

    def capacity(self, endpoint: str) -> int:
        return self._lru[endpoint][1] if endpoint in self._lru else 0

    def stamp(self, endpoint: str, block: int) -> int | None:
        """The stamp of the call that last touched ``block`` at ``endpoint``; None if not held."""
        entry = self._lru.get(endpoint)
        return entry[0].get(block) if entry is not None else None

    def holders(self, block: int) -> frozenset[str]:
        return frozenset(self._holders.get(block, ()))
