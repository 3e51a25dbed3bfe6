"""The KV cache as vLLM V1 manages it: fixed-size token blocks, reference counts, prefix caching.

The cache is ``num_blocks`` blocks of ``block_size`` tokens. A sequence holds
the blocks its tokens' keys and values live in. vLLM's automatic prefix
caching (its ``BlockPool`` and ``KVCacheManager``) works like this, and so
does this module:

- **Only full blocks are hashed.** A block's hash covers its tokens, the hash
  of the block before it (so a hash names the whole prefix up to and
  including the block) and the LoRA adapter's name (so adapters never share
  KV). ``block_hashes`` computes the chain.
- **Blocks are reference counted.** Sequences that share a prefix share its
  blocks; a block is in use while its count is above zero.
- **Freed blocks stay cached.** A block whose count drops to zero goes to the
  tail of a free queue but keeps its hash, so a later request with the same
  prefix can take it back (a hit). A new block is taken from the head of the
  queue: the least recently freed block is evicted first, and its hash is
  forgotten then. A sequence frees its blocks last block first, so the tail
  of a prompt is evicted before its head, which other prompts are more likely
  to share.
- **Usage counts blocks in use**, not cached free blocks
  (``vllm:kv_cache_usage_perc``).

The free queue is an ``OrderedDict`` (O(1) pop at the head, append at the
tail, and removal from the middle when a hit takes a free block back).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


def block_hash(parent: int, adapter: str, tokens: Sequence[int]) -> int:
    """The hash of one full block: its tokens, chained on its parent's hash and the adapter.

    ``extend_hashes`` computes the same formula inline for prompt blocks.

    Python's tuple hash of ints is stable across processes; the adapter's
    name is a string, whose hash is salted per process, which is fine
    because hashes never leave the process.
    """
    return hash((parent, adapter, tuple(tokens)))


ROOT_HASH = 0
"""The parent hash of a sequence's first block."""


class BlockPool:
    """``num_blocks`` KV blocks: reference counts, the hash table of full blocks, the free queue."""

    __slots__ = ("_cached", "_free", "_hash", "_ref", "num_blocks", "on_evict")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.on_evict: Callable[[int], None] | None = None
        """Told the hash of each cached block evicted for reuse (KV-cache events)."""
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    def copy(self) -> BlockPool:
        """An independent copy: the same blocks, counts, hashes and free-queue order."""
        twin = BlockPool.__new__(BlockPool)
        twin.num_blocks = self.num_blocks
        twin._ref = self._ref.copy()
        twin._hash = self._hash.copy()
        twin._free = self._free.copy()
        twin._cached = self._cached.copy()
        twin.on_evict = None  # a copy's evictions are what-ifs: nothing to publish
        return twin

    @property
    def free(self) -> int:
        """Blocks not in use (cached or empty): what new blocks can be taken from."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def cached(self) -> int:
        """Blocks that carry a hash, in use or not."""
        return len(self._cached)

    def hits(self, hashes: Sequence[int], limit: int) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``, at most ``limit`` of them."""
        found: list[int] = []
        cached = self._cached
        for index in range(min(limit, len(hashes))):
            block = cached.get(hashes[index])
            if block is None:
                break
            found.append(block)
        return found

    def hit_length(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading ``hashes`` (at most ``limit``) are cached, without touching anything."""
        cached = self._cached
        count = 0
        for index in range(min(limit, len(hashes))):
            if hashes[index] not in cached:
                break
            count += 1
        return count

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them back shrinks it)."""
        ref = self._ref
        return sum(1 for block in blocks if ref[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), out of the free queue if need be."""
        ref, free = self._ref, self._free
        for block in blocks:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` new blocks from the head of the free queue, evicting their hashes; or None."""
        if count > len(self._free):
            return None
        free, ref, hashes, cached = self._free, self._ref, self._hash, self._cached
        blocks = []
        for _ in range(count):
            block, _ = free.popitem(last=False)
            old = hashes[block]
            if old is not None:
                del cached[old]
                hashes[block] = None
                if self.on_evict is not None:
                    self.on_evict(old)
            ref[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a reference on each block, last first; unused blocks join the free queue's tail."""
        ref, free = self._ref, self._free
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None

    def register(self, block: int, digest: int) -> bool:
        """Record that ``block`` is full and holds the prefix named by ``digest``.

        When two sequences computed the same block at once, the first one
        registered is the cached copy; the other stays an unhashed duplicate
        and is simply freed later, as in vLLM. True when ``block`` became the cached copy.
        """
        if digest not in self._cached and self._hash[block] is None:
            self._cached[digest] = block
            self._hash[block] = digest
            return True
        return False


def extend_hashes(
    hashes: list[int],
    blocks: int,
    block_size: int,
    adapter: str,
    prefix: Sequence[int],
    tokens: Callable[[int, int], Sequence[int]] | None = None,
) -> None:
    """Grow the hash chain ``hashes`` to ``blocks`` entries.

    Blocks that lie within ``prefix`` (a prompt) are sliced from it
    directly; later ones come from ``tokens(start, end)`` (the prompt's tail
    and the generated tokens). Each block is hashed once per request and the
    result kept, so a long prompt costs one tuple hash per block, once.
    """
    parent = hashes[-1] if hashes else ROOT_HASH
    append = hashes.append
    index = len(hashes)
    direct = min(blocks, len(prefix) // block_size)
    while index < direct:
        start = index * block_size
        parent = hash((parent, adapter, tuple(prefix[start : start + block_size])))
        append(parent)
        index += 1
    while index < blocks:
        assert tokens is not None, "blocks beyond the prefix need a token source"
        start = index * block_size
        parent = block_hash(parent, adapter, tokens(start, start + block_size))
        append(parent)
        index += 1


def block_hashes(tokens: Sequence[int], block_size: int = 16, adapter: str = "") -> list[int]:
    """The hash of every full block of ``tokens``, each chained on the one before."""
    hashes: list[int] = []
    extend_hashes(hashes, len(tokens) // block_size, block_size, adapter, tokens)
    return hashes
