"""The InferencePool pod source: the real client against a fake API server on the wire format."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pods.kubeapi import ApiError, Backoff, ClusterConfig, KubeApi, reflect
from pods.kubernetes import (
    ACTIVE_PORTS,
    InferencePoolSource,
    PoolSpecError,
    active_ports,
    is_ready,
    pool_spec,
)
from tests.fake_kube import FakeKube, eventually

NS = "models"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"


def k8s_pod(
    name: str,
    ip: str | None = None,
    *,
    ready: bool = True,
    deleting: bool = False,
    annotations: dict[str, str] | None = None,
    **labels: str,
) -> dict[str, Any]:
    """A pod as the API server returns it (the fields the source reads)."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "labels": labels or {"app": "llama"},
        "annotations": annotations or {},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def k8s_pool(
    name: str = "llama", ports: tuple[int, ...] = (8000,), **labels: str
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels or {"app": "llama"}},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


class Sleeps:
    """An injected sleep: records each backoff delay and yields without waiting for it."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0.001)  # let the event loop run; not a timing assertion


@contextlib.asynccontextmanager
async def tracking(
    fake: FakeKube, sleeps: Sleeps | None = None, name: str = "llama"
) -> AsyncIterator[InferencePoolSource]:
    sleeps = sleeps or Sleeps()
    source = InferencePoolSource(
        ClusterConfig(fake.url), name, NS, backoff=lambda: Backoff(sleep=sleeps)
    )
    task = asyncio.create_task(source.run())
    try:
        yield source
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def endpoints(source: InferencePoolSource) -> set[str]:
    return {f"{p.name}@{p.address}:{port}" for p in source.pods for port in p.ports}


def run(scenario: Callable[[FakeKube], Any]) -> None:
    async def main() -> None:
        async with FakeKube() as fake:
            await asyncio.wait_for(scenario(fake), 20)

    asyncio.run(main())


# --- pure reading of the objects -----------------------------------------------------------


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (None, (8000, 8001, 8002)),
        ("8000,8002", (8000, 8002)),
        (" 8002 , 8000", (8000, 8002)),
        ("8001,9999", (8001,)),
        ("8001abc", (8001,)),
        ("", ()),
        ("x,y", ()),
    ],
    ids=["absent", "two", "spaces", "unknown-port", "go-sscanf", "empty", "garbage"],
)
def test_active_ports_follow_gie(annotation: str | None, expected: tuple[int, ...]) -> None:
    """The active-ports annotation limits a pod to those target ports; empty leaves none."""
    pod = k8s_pod(
        "a", "10.0.0.1", annotations={} if annotation is None else {ACTIVE_PORTS: annotation}
    )
    assert active_ports(pod, (8000, 8001, 8002)) == expected


@pytest.mark.parametrize(
    ("pod", "ready"),
    [
        (k8s_pod("a", "10.0.0.1"), True),
        (k8s_pod("a", "10.0.0.1", ready=False), False),
        (k8s_pod("a", "10.0.0.1", deleting=True), False),
        ({"metadata": {"name": "a"}, "status": {"phase": "Pending"}}, False),
    ],
    ids=["ready", "not-ready", "terminating", "no-conditions"],
)
def test_ready_means_not_deleting_and_ready_condition_true(
    pod: dict[str, Any], ready: bool
) -> None:
    """A pod is ready only with a true Ready condition and no deletion under way."""
    assert is_ready(pod) is ready


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"targetPorts": [{"number": 8000}]}, "matchLabels: required"),
        ({"selector": {"matchLabels": {"a": "b"}}}, "targetPorts: required"),
        (
            {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]},
            "targetPorts[0].number",
        ),
    ],
    ids=["no-selector", "no-ports", "bad-port"],
)
def test_unusable_pool_specs_are_named(spec: dict[str, Any], message: str) -> None:
    """An InferencePool spec missing its selector or ports, or with a bad port, is refused naming the field."""
    with pytest.raises(PoolSpecError, match=message.replace("[", r"\[")):
        pool_spec({"spec": spec})


def test_pool_spec_reads_selector_ports_and_picker() -> None:
    """A pool spec gives its selector, target ports and endpoint picker reference."""
    spec = pool_spec(k8s_pool(ports=(3000, 3002)))
    assert str(spec.selector) == "app=llama"
    assert spec.ports == (3000, 3002)
    assert spec.picker == "llama-epp:9002"


def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    """Reconnect delays grow 0.5, 1, 2 … (with up to 20% jitter below), capped; progress resets."""
    sleeps = Sleeps()
    backoff = Backoff(initial=0.5, cap=4, sleep=sleeps)

    async def scenario() -> None:
        for _ in range(6):
            await backoff.wait()
        backoff.reset()
        await backoff.wait()

    asyncio.run(scenario())
    nominal = [0.5, 1, 2, 4, 4, 4, 0.5]
    assert all(0.8 * n <= d <= n for d, n in zip(sleeps.delays, nominal, strict=True))


# --- tracking pods through the wire format ---------------------------------------------------


def test_tracks_exactly_the_ready_matching_pods() -> None:
    """Every target port of every ready, matching pod with an IP is an endpoint; nothing else."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool(ports=(8000, 8001)))
        fake.put(POOLS, k8s_pool("other", app="other"))
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        fake.put(PODS, k8s_pod("b", "10.0.0.2", ready=False))
        fake.put(PODS, k8s_pod("c", "10.0.0.3", app="other"))
        fake.put(PODS, k8s_pod("d"))  # ready but no IP yet
        fake.put(PODS, k8s_pod("e", "10.0.0.5", deleting=True))
        fake.put(PODS, k8s_pod("f", "10.0.0.6", annotations={ACTIVE_PORTS: "8001"}))
        fake.put("/api/v1/namespaces/elsewhere/pods", k8s_pod("g", "10.0.0.7"))
        async with tracking(fake) as source:
            await eventually(lambda: source.synced, "sync")
            assert endpoints(source) == {"a@10.0.0.1:8000", "a@10.0.0.1:8001", "f@10.0.0.6:8001"}
            assert all(pod.ready for pod in source.pods)
            assert dict(source.pods[0].labels) == {"app": "llama"}
        # The pool is read by name only, pods in the pool's namespace only.
        pool_lists = [r for r in fake.requests if r.group_resource[1] == "inferencepools"]
        assert {r.query.get("fieldSelector") for r in pool_lists} == {"metadata.name=llama"}
        assert all(
            r.path.startswith(f"/api/v1/namespaces/{NS}/")
            for r in fake.requests
            if r.group_resource[1] == "pods"
        )

    run(scenario)


def test_readiness_deletion_and_labels_apply_at_once() -> None:
    """A pod turning unready, deleted, or relabelled out of the selector leaves; back in, returns."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        fake.put(PODS, k8s_pod("b", "10.0.0.2", ready=False))
        async with tracking(fake) as source:
            await eventually(lambda: endpoints(source) == {"a@10.0.0.1:8000"}, "initial list")
            a, b = "a@10.0.0.1:8000", "b@10.0.0.2:8000"
            steps: list[tuple[dict[str, Any] | str, set[str]]] = [
                (k8s_pod("b", "10.0.0.2"), {a, b}),  # b turns ready
                (k8s_pod("a", "10.0.0.1", ready=False), {b}),  # a turns unready
                (k8s_pod("a", "10.0.0.1"), {a, b}),
                (k8s_pod("b", "10.0.0.2", app="retired"), {a}),  # b's label leaves the selector
                (k8s_pod("b", "10.0.0.9"), {a, "b@10.0.0.9:8000"}),  # back, with a new IP
                (k8s_pod("a", "10.0.0.1", deleting=True), {"b@10.0.0.9:8000"}),  # terminating
                ("delete a", {"b@10.0.0.9:8000"}),
                (k8s_pod("b", "10.0.0.9", annotations={ACTIVE_PORTS: ""}), set()),
            ]
            for number, (change, expected) in enumerate(steps):
                if isinstance(change, str):
                    fake.delete(PODS, change.removeprefix("delete "))
                else:
                    fake.put(PODS, change)
                await eventually(lambda e=expected: endpoints(source) == e, f"step {number}")  # type: ignore[misc]
            assert fake.count("list", "pods") == 1  # all of it over one watch

    run(scenario)


def test_selector_change_relists_and_port_change_applies_at_once() -> None:
    """A new selector starts a new list+watch; a new port list re-derives endpoints, no relist."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        fake.put(PODS, k8s_pod("n", "10.0.0.2", app="llama-next"))
        async with tracking(fake) as source:
            await eventually(lambda: endpoints(source) == {"a@10.0.0.1:8000"})
            fake.put(POOLS, k8s_pool(ports=(8000, 8002)))
            await eventually(lambda: endpoints(source) == {"a@10.0.0.1:8000", "a@10.0.0.1:8002"})
            assert fake.count("list", "pods") == 1

            fake.put(POOLS, k8s_pool(ports=(8002,), app="llama-next"))
            await eventually(lambda: endpoints(source) == {"n@10.0.0.2:8002"}, "new selector")
            lists = [r for r in fake.requests if r.verb == "list" and r.group_resource[1] == "pods"]
            assert [r.query["labelSelector"] for r in lists] == ["app=llama", "app=llama-next"]
            # The old watch is gone: a change to an old-selector pod is not seen.
            await eventually(lambda: fake.watching(PODS) == 1, "one pod watch")
            fake.put(PODS, k8s_pod("n2", "10.0.0.3", app="llama-next"))
            await eventually(lambda: len(source.pods) == 2)

    run(scenario)


def test_deleted_pool_empties_the_list_and_a_new_one_fills_it() -> None:
    """Deleting the pool empties the pod list (readiness stays); a new pool fills it again with its ports."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        async with tracking(fake) as source:
            await eventually(lambda: len(source.pods) == 1)
            fake.delete(POOLS, "llama")
            await eventually(lambda: source.pods == (), "pool deleted")
            assert source.synced  # readiness, once reached, stays (as GIE's health)
            fake.put(POOLS, k8s_pool(ports=(9000,)))
            await eventually(lambda: endpoints(source) == {"a@10.0.0.1:9000"}, "pool back")

    run(scenario)


def test_not_synced_until_the_pool_exists() -> None:
    """No pool, no readiness: GIE's picker reports NOT_SERVING until its pool is known."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        async with tracking(fake) as source:
            await eventually(lambda: fake.watching(POOLS) == 1, "pool watch")
            assert not source.synced
            assert source.pods == ()
            fake.put(POOLS, k8s_pool())
            await eventually(lambda: source.synced and len(source.pods) == 1)

    run(scenario)


# --- lost watches ----------------------------------------------------------------------------


def test_dropped_watch_resumes_from_the_last_version_without_relisting() -> None:
    """A connection cut mid-event reconnects and watches from the last version it fully read."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        async with tracking(fake) as source:
            await eventually(lambda: len(source.pods) == 1)
            fake.put(PODS, k8s_pod("b", "10.0.0.2"))
            await eventually(lambda: len(source.pods) == 2)
            last_seen = fake.version
            fake.failing = 503  # keep it out while the cluster changes
            fake.drop_watches()
            await eventually(lambda: fake.watching(PODS) == 0)
            fake.delete(PODS, "a")
            fake.put(PODS, k8s_pod("c", "10.0.0.3"))
            fake.failing = None
            await eventually(lambda: endpoints(source) == {"b@10.0.0.2:8000", "c@10.0.0.3:8000"})
            pod_watches = [r for r in fake.requests if r.verb == "watch" and r.path == PODS]
            assert pod_watches[-1].query["resourceVersion"] == str(last_seen)
            assert pod_watches[-1].query["allowWatchBookmarks"] == "true"
            assert fake.count("list", "pods") == 1

    run(scenario)


def test_bookmark_moves_the_resume_point() -> None:
    """After a BOOKMARK, a watch that ends resumes from the bookmark's version."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        async with tracking(fake) as source:
            await eventually(lambda: len(source.pods) == 1)
            await eventually(lambda: fake.watching(PODS) == 1)
            for _ in range(3):
                fake.bump()  # history moves on without touching these pods
            fake.bookmark()
            fake.end_watches()  # timeoutSeconds ran out
            await eventually(lambda: fake.count("watch", "pods") == 2, "re-watch")
            pod_watches = [r for r in fake.requests if r.verb == "watch" and r.path == PODS]
            assert pod_watches[-1].query["resourceVersion"] == str(fake.version)
            assert fake.count("list", "pods") == 1
            assert len(source.pods) == 1

    run(scenario)


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
def test_too_old_version_relists_and_replaces_the_list(as_status: bool) -> None:
    """410 Gone ("too old resource version") lists again; pods deleted meanwhile are dropped."""

    async def scenario(fake: FakeKube) -> None:
        fake.gone_as_status = as_status
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        fake.put(PODS, k8s_pod("b", "10.0.0.2"))
        async with tracking(fake) as source:
            await eventually(lambda: len(source.pods) == 2)
            fake.failing = 503
            fake.drop_watches()
            await eventually(lambda: fake.watching(PODS) == 0 and fake.watching(POOLS) == 0)
            fake.delete(PODS, "a")
            fake.put(PODS, k8s_pod("c", "10.0.0.3"))
            fake.compact()
            fake.failing = None
            # The pool and the pod reflectors recover each on its own: wait for both relists
            # (waiting for the pods alone once met a pool list still on its way, under load).
            await eventually(
                lambda: (
                    endpoints(source) == {"b@10.0.0.2:8000", "c@10.0.0.3:8000"}
                    and fake.count("list", "inferencepools") == 2
                ),
                "both relists",
            )
            assert fake.count("list", "pods") == 2

    run(scenario)


def test_unreachable_api_backs_off_then_recovers() -> None:
    """While the API server fails, retries wait with a growing backoff; then the list arrives."""
    sleeps = Sleeps()

    async def scenario(fake: FakeKube) -> None:
        fake.failing = 500
        fake.put(POOLS, k8s_pool())
        fake.put(PODS, k8s_pod("a", "10.0.0.1"))
        async with tracking(fake, sleeps) as source:
            await eventually(lambda: len(sleeps.delays) >= 4, "retries")
            assert not source.synced
            fake.failing = None
            await eventually(lambda: source.synced and len(source.pods) == 1)
        assert sleeps.delays[1] > sleeps.delays[0]

    run(scenario)


def test_reflect_raises_nothing_on_a_broken_connection_and_stops_on_cancel() -> None:
    """``reflect`` itself: connection refused is retried, cancellation ends it cleanly."""
    sleeps = Sleeps()

    class Nothing:
        def replace(self, items: list[dict[str, Any]]) -> None:
            raise AssertionError("nothing can be listed")

        def apply(self, kind: str, obj: dict[str, Any]) -> None:
            raise AssertionError("nothing can be watched")

    async def scenario() -> None:
        async with FakeKube() as fake:
            url = fake.url
        async with KubeApi(ClusterConfig(url)) as api:
            task = asyncio.create_task(reflect(api, PODS, {}, Nothing(), Backoff(sleep=sleeps)))
            await eventually(lambda: len(sleeps.delays) >= 3, "retries")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()

    asyncio.run(scenario())


def test_api_errors_carry_the_status() -> None:
    """An API error carries the HTTP status and reason; a 404 is not "gone" (that is 410)."""

    async def scenario(fake: FakeKube) -> None:
        async with KubeApi(ClusterConfig(fake.url)) as api:
            with pytest.raises(ApiError) as caught:
                await api.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/x")
        assert (caught.value.code, caught.value.reason) == (404, "NotFound")
        assert not caught.value.gone

    run(scenario)
