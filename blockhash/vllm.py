"""vLLM's prefix-cache block hashes, as its KV-cache events carry them.

vLLM names each full block of ``block_size`` tokens by a hash chained on its
parent's (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``)::

    hash = H((parent_hash, tuple(token_ids), extra_keys))

with the first block's parent ``NONE_HASH = H(seed)`` and ``extra_keys``
``(lora_name,)`` for an adapter's blocks, None otherwise. ``H`` is
``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``): ``sha256`` (the
default; SHA-256 of the tuple's pickle), ``sha256_cbor`` (of its canonical
CBOR, the one to reproduce across languages), ``xxhash`` and ``xxhash_cbor``
(XXH3-128 of the same). The seed is ``PYTHONHASHSEED`` when set; otherwise the
fixed ``"vllm-none-hash"`` for the SHA-256 algorithms (vLLM PR #51875, 2026-08;
releases before it drew a random seed per process for every algorithm) and a
random one per process for the xxhash ones, whose collision resistance needs a
secret seed. On the wire each hash is the low 64 bits of the digest read
big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default), or the
whole digest.

The simulator publishes these hashes; the precise prefix producer recomputes
one per engine to tell an operator when its configured seed or algorithm is
not the engine's.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import xxhash

HASH_ALGORITHMS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``--prefix-caching-hash-algo`` choices."""
DEFAULT_SEED: Final = "vllm-none-hash"
"""vLLM's NONE_HASH seed for the SHA-256 algorithms when ``PYTHONHASHSEED`` is unset."""
_MASK: Final = (1 << 64) - 1


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


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's ``--prefix-caching-hash-algo`` of that name."""
    if algorithm == "sha256":
        return lambda value: hashlib.sha256(_pickle(value)).digest()
    if algorithm == "sha256_cbor":
        return lambda value: hashlib.sha256(cbor(value)).digest()
    if algorithm == "xxhash":
        return lambda value: xxhash.xxh3_128_digest(_pickle(value))
    if algorithm == "xxhash_cbor":
        return lambda value: xxhash.xxh3_128_digest(cbor(value))
    raise ValueError(
        f"hash algorithm: expected one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}"
    )


def hash_seed(algorithm: str = "sha256") -> str:
    """The NONE_HASH seed vLLM would use in this environment (``resolve_none_hash_seed``):
    ``PYTHONHASHSEED``, else the fixed seed, else (xxhash) a random one."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return os.urandom(32).hex() if algorithm.startswith("xxhash") else DEFAULT_SEED


class BlockHasher:
    """vLLM's block-hash chain for one algorithm and seed (None: this environment's)."""

    __slots__ = ("function", "none_hash")

    def __init__(self, algorithm: str = "sha256", seed: str | None = None) -> None:
        self.function = hash_function(algorithm)
        self.none_hash = self.function(hash_seed(algorithm) if seed is None else seed)

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
