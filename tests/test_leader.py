"""Leader election on a Lease, against the fake API server, with an injected clock."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from lwepp.leader import LeaderElector, LeaseTimings, micro_time
from pods.kubeapi import ClusterConfig, KubeApi
from serving.server import Health
from tests.fake_kube import FakeKube, eventually

LEASE = "/apis/coordination.k8s.io/v1/namespaces/models/leases/lwepp-llama"


class Clock:
    """Monotonic and wall time that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime.datetime:
        return datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(
            seconds=self.now
        )


def elector(fake: FakeKube, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(
        ClusterConfig(fake.url),
        "models",
        "lwepp-llama",
        identity,
        LeaseTimings(duration=15, renew_deadline=10, retry_period=2),
        clock=clock.monotonic,
        wall=clock.wall,
    )


def lease(fake: FakeKube) -> dict[str, Any]:
    return fake.collections[LEASE.rsplit("/", 1)[0]]["lwepp-llama"]["spec"]  # type: ignore[no-any-return]


def run(scenario: Callable[[FakeKube, KubeApi, Clock], Awaitable[None]]) -> None:
    async def main() -> None:
        async with FakeKube() as fake, KubeApi(ClusterConfig(fake.url)) as api:
            await asyncio.wait_for(scenario(fake, api, Clock()), 20)

    asyncio.run(main())


def test_one_leader_and_the_standby_takes_over_when_it_stops_renewing() -> None:
    """Two electors: one leads; when it stops renewing, the other leads after a lease duration."""

    async def scenario(fake: FakeKube, api: KubeApi, clock: Clock) -> None:
        a, b = elector(fake, clock, "a"), elector(fake, clock, "b")
        assert await a.step(api)
        assert not await b.step(api)
        assert lease(fake)["holderIdentity"] == "a"
        assert lease(fake)["renewTime"] == micro_time(clock.wall())
        for _ in range(5):  # a renews every retry period; b keeps standing by
            clock.now += 2
            assert await a.step(api)
            assert not await b.step(api)
        # a stops renewing (hung, partitioned). b measures the lease's age on its
        # own clock from when it last saw the record change.
        clock.now += 14
        assert not await b.step(api)
        clock.now += 1
        assert await b.step(api)
        assert lease(fake)["holderIdentity"] == "b"
        assert lease(fake)["leaseTransitions"] == 1
        # a comes back: it sees another holder and stands down at once.
        assert not await a.step(api)
        assert not a.is_leader

    run(scenario)


def test_a_leader_that_cannot_renew_steps_down_at_the_renew_deadline() -> None:
    """Renewals failing: still leader before the renew deadline, standby from it on."""

    async def scenario(fake: FakeKube, api: KubeApi, clock: Clock) -> None:
        a = elector(fake, clock, "a")
        assert await a.step(api)
        fake.failing = 500
        clock.now += 9
        assert await a.step(api)  # failed, but within the deadline
        clock.now += 1
        assert not await a.step(api)
        fake.failing = None
        clock.now += 2
        assert await a.step(api)  # its own lease: renewed at once
        assert lease(fake)["leaseTransitions"] == 0

    run(scenario)


def test_candidates_racing_for_a_new_lease_get_one_leader() -> None:
    """Two create (or update) attempts at once: the API server's conflict check picks one."""

    async def scenario(fake: FakeKube, api: KubeApi, clock: Clock) -> None:
        electors = [elector(fake, clock, name) for name in "abc"]
        results = await asyncio.gather(*(e.step(api) for e in electors))
        assert sorted(results) == [False, False, True]
        assert lease(fake)["holderIdentity"] == "abc"[results.index(True)]

    run(scenario)


def test_release_on_shutdown_lets_a_standby_take_over_at_once() -> None:
    """A leader that stops cleanly gives the lease up; no lease duration to wait out."""

    async def scenario(fake: FakeKube, api: KubeApi, clock: Clock) -> None:
        sleeps: list[float] = []

        async def sleep(delay: float) -> None:
            sleeps.append(delay)
            await asyncio.sleep(0.001)  # lets the loop run; not a timing assertion

        a = LeaderElector(
            ClusterConfig(fake.url),
            "models",
            "lwepp-llama",
            "a",
            clock=clock.monotonic,
            wall=clock.wall,
            sleep=sleep,
        )
        task = asyncio.create_task(a.run())
        await eventually(lambda: a.is_leader, "leadership")
        assert sleeps[0] == 2.0  # retry period
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not a.is_leader
        assert "holderIdentity" not in lease(fake)
        b = elector(fake, clock, "b")
        assert await b.step(api)  # same instant: nothing to wait for

    run(scenario)


def test_rbac_verbs_for_leases_are_get_create_update() -> None:
    """Leader election uses only get, create and update on leases (what the RBAC grants)."""

    async def scenario(fake: FakeKube, api: KubeApi, clock: Clock) -> None:
        a = elector(fake, clock, "a")
        await a.step(api)
        clock.now += 2
        await a.step(api)
        await a.release(api)
        assert {v for g, r, v in fake.verbs() if r == "leases"} == {"get", "create", "update"}

    run(scenario)


@pytest.mark.parametrize(
    "timings",
    [LeaseTimings(10, 10, 2), LeaseTimings(15, 2, 2), LeaseTimings(15, 10, 0)],
    ids=["deadline-equals-duration", "retry-equals-deadline", "zero-retry"],
)
def test_timings_that_allow_two_leaders_are_refused(timings: LeaseTimings) -> None:
    """Lease timings not ordered duration > renew deadline > retry period are refused."""
    with pytest.raises(ValueError, match="lease duration > renew deadline > retry period"):
        timings.check()


def test_a_fractional_lease_is_written_rounded_up() -> None:
    """``leaseDurationSeconds`` is whole seconds: 1.5 s is written as 2, never cut to 1, which
    a standby would wait while the leader (renew deadline 1 s) may still serve."""
    assert LeaseTimings(1.5, 1, 0.25).lease_seconds == 2
    assert LeaseTimings(1, 0.75, 0.25).lease_seconds == 1


def test_health_reports_standbys_not_ready_but_alive() -> None:
    """Readiness names follow ``ready()`` both ways; live names stay SERVING."""
    state = {"leader": False}

    async def status(health: Health, name: str) -> int:
        request = health_pb2.HealthCheckRequest(service=name)
        return int((await health.servicer.Check(request, None)).status)

    async def scenario() -> None:
        health = Health(
            ["readiness"], ready=lambda: state["leader"], live=["liveness"], interval=0.001
        )
        await health.set_all(False)
        watcher = asyncio.create_task(health.watch_ready())
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )

        async def until(name: str, wanted: int) -> None:
            for _ in range(5000):
                if await status(health, name) == wanted:
                    return
                await asyncio.sleep(0.001)
            raise AssertionError(f"{name} never became {wanted}")

        await until("liveness", serving)
        assert await status(health, "readiness") == not_serving
        state["leader"] = True
        await until("readiness", serving)
        state["leader"] = False
        await until("readiness", not_serving)
        assert await status(health, "liveness") == serving
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))
