"""``python -m bench.failover``: active-passive failover, from a killed leader to a serving standby.

Two ``python -m lwepp --leader-elect`` replicas campaign for one Lease on the
fake Kubernetes API server of ``tests/fake_kube.py`` (a real HTTP server
speaking the Lease API). Once one leads (its ``inference-extension`` health
service answers SERVING, the other NOT_SERVING), it gets SIGKILL at a random
phase of its renewals (no release); the time is measured from the signal to
the standby's health service answering SERVING, polled every ``POLL`` seconds.
That is when the standby would pass a readiness probe or a gateway's health
check; their own interval comes on top.

Also reported: the Lease calls per replica per second while both campaign
(every retry period each replica reads the Lease; the leader also writes it).

Two settings: the router's defaults (15 s / 10 s / 2 s) and the timings
``manifests/components/leader-election`` ships (``SHIPPED``), each against its
bound (``bound``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fake_kube import ThreadedFakeKube
from tests.processes import service
from tests.test_kubernetes import NS, PODS, POOLS, k8s_pod, k8s_pool

DEFAULTS = (15.0, 10.0, 2.0)
"""controller-runtime's and the llm-d router's Lease timings: duration, renew deadline, retry."""
SHIPPED = (1.0, 0.75, 0.25)
"""``manifests/components/leader-election``'s timings."""
POLL = 0.01
SERVING = health_pb2.HealthCheckResponse.SERVING


def bound(duration: float, retry: float) -> tuple[float, float]:
    """When a standby serves after a killed leader, from the death (API round trips aside).

    The standby sees the leader's last renewal at its next look (up to ``retry`` after
    it), and takes over at the first of its looks, ``retry`` apart, at least ``duration``
    after that sight: ``ceil(duration / retry) * retry`` after it. The leader died up to
    ``retry`` after its last renewal. Hence that product, plus or minus ``retry``: 0.75-1.25 s
    for 1 s / 0.25 s, 14-18 s for the router's 15 s / 2 s (7.5 retries, rounded up to 8).
    """
    looks = math.ceil(duration / retry - 1e-9) * retry
    return looks - retry, looks + retry


async def status(port: int) -> int:
    """The ``inference-extension`` health service's answer on ``port``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service="inference-extension"))
        return int(answer.status)


async def until_serving(port: int, limit: float) -> float:
    """Poll ``port`` until SERVING; the monotonic time it first answered so."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if await status(port) == SERVING:
            return time.monotonic()
        await asyncio.sleep(POLL)
    raise TimeoutError(f"no SERVING on {port} within {limit} s")


def one(work: Path, timings: tuple[float, float, float], rng: random.Random) -> tuple[float, float]:
    """One failover: seconds from the leader's SIGKILL to the standby serving; Lease calls
    per replica per second while both campaigned."""
    duration, deadline, retry = timings
    with ThreadedFakeKube() as kube:
        kube.do(lambda f: f.put(POOLS, k8s_pool()))
        kube.do(lambda f: f.put(PODS, k8s_pod("a", "10.1.0.1")))
        config = kube.kubeconfig(work / "config", namespace=NS)
        args = (
            *("--pool-name", "llama", "--kubeconfig", str(config), "--leader-elect"),
            *("--leader-elect-lease-duration", str(duration)),
            *("--leader-elect-renew-deadline", str(deadline)),
            *("--leader-elect-retry-period", str(retry)),
        )
        with service("lwepp", *args) as (first, one_), service("lwepp", *args) as (second, two):
            ports = [one_["health_port"], two["health_port"]]

            async def scenario() -> tuple[float, float]:
                index = await first_serving(ports, 3 * duration)
                calls_before, since = kube.do(lambda f: f.count("get", "leases")), time.monotonic()
                writes_before = kube.do(lambda f: f.count("update", "leases"))
                await asyncio.sleep(2 * retry + rng.uniform(0, retry))
                calls = kube.do(lambda f: f.count("get", "leases")) - calls_before
                calls += kube.do(lambda f: f.count("update", "leases")) - writes_before
                rate = calls / (time.monotonic() - since) / 2
                (first, second)[index].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                served = await until_serving(ports[1 - index], 3 * duration)
                return served - killed, rate

            return asyncio.run(scenario())


async def first_serving(ports: list[int], limit: float) -> int:
    """The index of the first of ``ports`` to answer SERVING."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for k, port in enumerate(ports):
            if await status(port) == SERVING:
                return k
        await asyncio.sleep(POLL)
    raise TimeoutError(f"no leader within {limit} s")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--defaults", action="store_true", help="also the router's defaults")
    args = parser.parse_args()
    rng = random.Random(0)
    settings = [("shipped", SHIPPED)] + ([("defaults", DEFAULTS)] if args.defaults else [])
    for label, timings in settings:
        low, high = bound(timings[0], timings[2])
        results = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as work:
                results.append(one(Path(work), timings, rng))
        seconds = [f"{s:.2f}" for s, _ in results]
        print(
            f"{label} {timings[0]:g} s / {timings[1]:g} s / {timings[2]:g} s: killed leader to "
            f"serving standby {', '.join(seconds)} s (bound {low:g}-{high:g} s); "
            "Lease calls per replica per second "
            f"{statistics.fmean(r for _, r in results):.1f}"
        )


if __name__ == "__main__":
    main()
