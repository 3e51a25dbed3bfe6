"""Leader election on a Kubernetes Lease: one replica serves, the others stand by.

Optional (``--leader-elect``). Without it every replica serves, as GIE's lwepp
does: round-robin needs no shared state. With it, standbys report NOT_SERVING
on the readiness health services, so the pool's Service sends traffic to the
leader only, and a standby takes over within a lease duration when the
leader stops renewing.

The algorithm is client-go's ``leaderelection`` with a ``LeaseLock``:

- Every ``retry_period`` each replica reads the Lease
  (``coordination.k8s.io/v1``, ``spec.holderIdentity``, ``renewTime``…).
- The lease is free when it has no holder, or when its record has not changed
  for ``lease_duration`` as measured on *this* replica's clock since it last
  saw a change. Expiry is never computed from ``renewTime``: clocks of
  different nodes disagree, but durations on one clock do not.
- A free lease (or our own) is written back with us as holder; the write
  carries the ``resourceVersion`` read, so of two replicas racing only one
  succeeds (the other gets 409 Conflict).
- A leader that cannot renew for ``renew_deadline`` (shorter than the lease
  duration) steps down before anyone else may take over.
- On shutdown the leader releases the lease (no holder, 1 s duration), so a
  standby takes over at its next retry rather than after a full lease.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import structlog

from pods.kubeapi import ApiError, ClusterConfig, KubeApi, Object

log = structlog.get_logger()

LEASES: Final = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """controller-runtime's defaults: 15 s lease, 10 s renew deadline, 2 s between tries."""

    duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    @property
    def lease_seconds(self) -> int:
        """The duration written in the Lease, whole seconds (``leaseDurationSeconds`` is an
        int32), rounded up: standbys wait what the record says, and a duration cut below the
        renew deadline would let one take over while the leader still serves."""
        return math.ceil(self.duration)

    def check(self) -> None:
        """Reject timings under which two leaders could overlap (client-go's rules)."""
        if not self.duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{self.duration} > {self.renew_deadline} > {self.retry_period}"
            )


def micro_time(moment: datetime.datetime) -> str:
    """Kubernetes ``MicroTime``: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    """The pod name plus a random suffix, as client-go's examples: ``POD_NAME`` (which the llm-d
    router's chart sets from the pod), else the hostname (the pod name, in a pod)."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4()}"


class LeaderElector:
    """Campaigns for one Lease; ``is_leader`` says whether this replica holds it now."""

    def __init__(
        self,
        config: ClusterConfig,
        namespace: str,
        name: str,
        identity: str | None = None,
        timings: LeaseTimings = LeaseTimings(),
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        timings.check()
        self.config, self.name, self.timings = config, name, timings
        self.identity = identity or default_identity()
        self.path = LEASES.format(namespace=namespace) + f"/{name}"
        self.collection = LEASES.format(namespace=namespace)
        self.is_leader = False
        self._clock, self._wall, self._sleep = clock, wall, sleep
        self._observed: dict[str, Any] | None = None  # the lease spec last seen
        self._observed_at = 0.0  # when it last changed, on our clock
        self._renewed_at = 0.0  # our last successful acquire or renew

    async def run(self) -> None:
        """Campaign until cancelled; release the lease on the way out if we hold it."""
        async with KubeApi(self.config) as api:
            try:
                while True:
                    await self.step(api)
                    await self._sleep(self.timings.retry_period)
            finally:
                if self.is_leader:
                    await asyncio.shield(self.release(api))

    async def step(self, api: KubeApi) -> bool:
        """One try to acquire or renew; updates and returns ``is_leader``."""
        try:
            held = await self._try_acquire_or_renew(api)
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("lease: cannot reach the API server", lease=self.name, error=str(error))
            held = False
        holder = (self._observed or {}).get("holderIdentity")
        now = self._clock()
        if held:
            if not self.is_leader:
                log.info("lease acquired: leading", lease=self.name, identity=self.identity)
            self.is_leader, self._renewed_at = True, now
        elif self.is_leader and (
            (holder and holder != self.identity)
            or now - self._renewed_at >= self.timings.renew_deadline
        ):
            log.warning("lease lost: standing by", lease=self.name, holder=holder)
            self.is_leader = False
        return self.is_leader

    async def _try_acquire_or_renew(self, api: KubeApi) -> bool:
        moment = micro_time(self._wall())
        try:
            lease = await api.request("GET", self.path)
        except ApiError as error:
            if error.code != 404:
                raise
            return await self._create(api, moment)
        spec: dict[str, Any] = lease.get("spec") or {}
        now = self._clock()
        if spec != self._observed:
            self._observed, self._observed_at = spec, now
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self.timings.duration)
        if holder and holder != self.identity and now < self._observed_at + duration:
            return False  # held by another, and renewed within its duration
        mine = holder == self.identity
        lease["spec"] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.timings.lease_seconds,
            "acquireTime": spec.get("acquireTime") if mine else moment,
            "renewTime": moment,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if mine else 1),
        }
        try:
            updated = await api.request("PUT", self.path, body=lease)
        except ApiError as error:
            if error.code == 409:  # another replica wrote first
                return False
            raise
        self._observed, self._observed_at = updated.get("spec") or {}, self._clock()
        return True

    async def _create(self, api: KubeApi, moment: str) -> bool:
        lease: Object = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.timings.lease_seconds,
                "acquireTime": moment,
                "renewTime": moment,
                "leaseTransitions": 0,
            },
        }
        try:
            created = await api.request("POST", self.collection, body=lease)
        except ApiError as error:
            if error.code == 409:  # created by another replica meanwhile
                return False
            raise
        self._observed, self._observed_at = created.get("spec") or {}, self._clock()
        return True

    async def release(self, api: KubeApi) -> None:
        """Give the lease up: no holder, so any standby may take it at once."""
        try:
            lease = await api.request("GET", self.path)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            moment = micro_time(self._wall())
            lease["spec"] = {
                "leaseDurationSeconds": 1,
                "acquireTime": moment,
                "renewTime": moment,
                "leaseTransitions": spec.get("leaseTransitions", 0),
            }
            await api.request("PUT", self.path, body=lease)
            log.info("lease released", lease=self.name)
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("lease: release failed", lease=self.name, error=str(error))
        finally:
            self.is_leader = False
