"""What picker replicas (and ``--workers``) share through Redis: ``--shared-store-address``.

The design and the measurements that chose it are in ``docs/scale-out.md``.
In short, per signal of the recommended and precise configurations:

- **Approximate prefix index** (``approx-prefix-cache-producer``) and **no-hit LRU**
  (``no-hit-lru-scorer``): learned from picks, so a replica that hears only
  its own picks finds a prefix about one time in N. Shared as a log: every
  replica appends what it learned (endpoint, block hashes, capacity; a cold
  pick's endpoint) to one Redis stream and applies the others' entries to its
  own index. A replica that starts reads the stream from its start (bounded
  by ``STREAM_LENGTH``), so it catches up with what the others learned.
  Between two syncs the replicas would all send their cold requests to the
  same least recently used endpoint, so each takes its own turns in the LRU
  as synced (``NoHitLRUScorer.synced``: replica i of the N live ones).
- **In-flight requests and tokens** (``inflight-load-producer``): each
  replica publishes its own counts per endpoint under a key of its own that
  expires (``ttl``) unless refreshed, and reads the others' as ``peers``
  (``lwepp.plugins.inflight.Summed``). A request is counted only by the
  replica that picked it, so two replicas never count it twice; a replica
  that dies stops counting when its key expires.
- **Precise prefix index**: rebuilt by every replica from the engines' KV
  events (each subscribes to every engine): nothing to share.
- **Flow-control queues**: kept per replica (a queued request waits on the
  replica whose stream holds it); the pool's load they gate on is the shared
  in-flight count.

Everything with the store is off the request path, on the event loop every
``interval`` (a few milliseconds' freshness at the default 10 ms, the
trade-off measured in ``docs/scale-out.md``): a pick never waits for
Redis. When the store cannot be reached, the replica logs it once, sets
``switchyard_shared_store_up`` to 0, counts the outage, drops
the other replicas' counts and goes on with its own view (what it learned
itself stays in its index); requests are never refused for it. When the
store is back, it says so and reads the stream again from its start (a
restarted store may have lost it; applying an entry twice only refreshes it).

Addresses take the llm-d router's ``redisConfig.address`` forms: ``redis://``,
``rediss://``, ``unix://``, or a bare ``host:port`` (``redis://`` added).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any, Final

import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from lwepp.plugins.approx_prefix import ApproxPrefixCacheProducer
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.prefix import PrefixCacheScorer

log = structlog.get_logger()

STREAM_LENGTH: Final = 100_000
"""Learned entries the stream keeps (about), what a starting replica catches up from."""
SCHEMES: Final = ("redis://", "rediss://", "unix://")
ALIVE: Final = "_"
"""The field every replica's count hash carries, so that an idle replica's key still lives."""


def store_url(address: str) -> str:
    """The llm-d router's ``redisConfig.address`` rule: a bare ``host:port`` gets ``redis://``."""
    return address if address.startswith(SCHEMES) else f"redis://{address}"


def replica_name() -> str:
    """This process among the replicas and workers: host, pid (unique while it lives)."""
    return f"{socket.gethostname()}/{os.getpid()}"


class SharedView:
    """One replica's link to the others through one Redis: publish own, apply theirs."""

    def __init__(
        self,
        address: str,
        plugins: Sequence[Any],
        registry: CollectorRegistry,
        pool: str,
        *,
        replica: str | None = None,
        interval: float = 0.01,
        ttl: float = 2.0,
    ) -> None:
        self.url, self.interval, self.ttl = store_url(address), interval, ttl
        self.replica = replica or replica_name()
        prefix = f"switchyard:{pool}"
        self.stream, self.members, self.counts = (
            f"{prefix}:learned",
            f"{prefix}:replicas",
            f"{prefix}:inflight:",
        )
        self.indexes = approximate_indexes(plugins)
        self.lrus = [p for p in plugins if isinstance(p, NoHitLRUScorer)]
        self.producers = [p for p in plugins if isinstance(p, InFlightLoadProducer)]
        self.outbox: list[dict[str, bytes | str | int]] = []
        for producer in self.indexes:
            producer.on_learn = self._learned
        for lru in self.lrus:
            lru.on_cold = self._cold
        self.last_id = "0"
        self.up: bool | None = None
        self.applied = 0
        self._up = Gauge(
            "switchyard_shared_store_up",
            "1 while the shared store (--shared-store-address) answers; 0: own view only",
            ["name"],
            registry=registry,
        ).labels(pool)
        self._outages = Counter(
            "switchyard_shared_store_outages",
            "Times the shared store stopped answering and the replica fell back to its own view",
            ["name"],
            registry=registry,
        ).labels(pool)

    # --- what this replica learned ------------------------------------------------

    def _learned(self, endpoint: str, hashes: list[int], capacity: int) -> None:
        packed = struct.pack(f"<{len(hashes)}Q", *hashes)
        self.outbox.append({"r": self.replica, "k": "p", "e": endpoint, "c": capacity, "h": packed})

    def _cold(self, endpoint: str) -> None:
        self.outbox.append({"r": self.replica, "k": "c", "e": endpoint})

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"r", b"").decode() == self.replica:
            return
        endpoint = fields.get(b"e", b"").decode()
        if fields.get(b"k") == b"p":
            packed = fields.get(b"h", b"")
            hashes = list(struct.unpack(f"<{len(packed) // 8}Q", packed))
            capacity = int(fields.get(b"c", b"0"))
            for producer in self.indexes:
                producer.index.add(endpoint, hashes, capacity)
        else:
            for lru in self.lrus:
                lru.touch(endpoint)
        self.applied += 1

    # --- one round with the store -------------------------------------------------

    async def sync(self, client: Any) -> None:
        """Publish what is new here, read what is new elsewhere (raises if the store fails)."""
        outbox, self.outbox = self.outbox, []
        pipe = client.pipeline(transaction=False)
        for fields in outbox:
            pipe.xadd(self.stream, fields, maxlen=STREAM_LENGTH, approximate=True)
        if self.producers or self.lrus:
            own = self.counts + self.replica
            pipe.delete(own)
            counts = _own_counts(self.producers[0]) if self.producers else {}
            pipe.hset(own, mapping={ALIVE: "", **counts})  # the key says it lives, idle or not
            pipe.pexpire(own, int(self.ttl * 1000))
            pipe.sadd(self.members, self.replica)
            pipe.smembers(self.members)
        results = await pipe.execute()
        alive = [self.replica]
        if self.producers or self.lrus:
            alive = await self._read_peers(client, sorted(m.decode() for m in results[-1]))
        if self.indexes or self.lrus:
            while True:
                batch = await client.xread({self.stream: self.last_id}, count=1000)
                if not batch:
                    break
                for entry_id, fields in batch[0][1]:
                    self._apply(fields)
                    self.last_id = entry_id.decode()
        for lru in self.lrus:
            lru.synced(alive.index(self.replica), len(alive))

    async def _read_peers(self, client: Any, members: list[str]) -> list[str]:
        """Sum the other live replicas' counts into ``peers``; the live replicas, sorted."""
        others = [m for m in members if m != self.replica]
        alive = [self.replica]
        requests: dict[str, int] = {}
        tokens: dict[str, int] = {}
        if others:
            pipe = client.pipeline(transaction=False)
            for other in others:
                pipe.hgetall(self.counts + other)
            for other, values in zip(others, await pipe.execute(), strict=True):
                if not values:  # expired: that replica is gone
                    await client.srem(self.members, other)
                    continue
                alive.append(other)
                for endpoint, value in values.items():
                    if endpoint == ALIVE.encode():
                        continue
                    n, t = (int(x) for x in value.split(b" "))
                    key = endpoint.decode()
                    requests[key] = requests.get(key, 0) + n
                    tokens[key] = tokens.get(key, 0) + t
        for producer in self.producers:
            producer.requests.peers, producer.tokens.peers = requests, tokens
        return sorted(alive)

    # --- the loop -----------------------------------------------------------------

    def _mark(self, up: bool, error: BaseException | None = None) -> None:
        if up == self.up:
            return
        if up:
            log.info("shared store answering", store=self.url, replica=self.replica)
        else:
            log.warning(
                "shared store unreachable: routing on this replica's own view",
                store=self.url,
                replica=self.replica,
                error=str(error),
            )
            self._outages.inc()
            for producer in self.producers:
                producer.requests.peers = producer.tokens.peers = {}
            for lru in self.lrus:
                lru.synced(0, 1)  # alone until the store answers
            self.outbox.clear()
            self.last_id = "0"  # the store may come back empty: read it again from its start
        self.up = up
        self._up.set(1 if up else 0)

    async def run(self) -> None:
        """Sync every ``interval`` until cancelled; never raises for the store's sake."""
        client = aioredis.from_url(
            self.url, socket_timeout=max(self.interval * 10, 0.2), socket_connect_timeout=0.5
        )
        try:
            while True:
                try:
                    await self.sync(client)
                except (RedisError, OSError) as error:
                    self._mark(False, error)
                else:
                    self._mark(True)
                await asyncio.sleep(self.interval)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.delete(self.counts + self.replica)
                await client.srem(self.members, self.replica)
            await client.aclose()


def approximate_indexes(plugins: Sequence[object]) -> list[ApproxPrefixCacheProducer]:
    """The approximate prefix indexes among ``plugins``: the producers configured, and the ones
    a ``prefix-cache-scorer`` with index settings of its own keeps privately; each once."""
    found = [p for p in plugins if isinstance(p, ApproxPrefixCacheProducer)]
    found += [p.own for p in plugins if isinstance(p, PrefixCacheScorer) and p.source is p.own]
    return list({id(p): p for p in found}.values())


def _own_counts(producer: InFlightLoadProducer) -> dict[str, str]:
    """This replica's counts per endpoint, as stored: ``"<requests> <tokens>"``."""
    requests, tokens = producer.requests.own, producer.tokens.own
    return {e: f"{requests.get(e, 0)} {tokens.get(e, 0)}" for e in requests.keys() | tokens.keys()}
