"""InferenceObjectives: a request's priority by header, from a file or from the Kubernetes API."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from lwepp.objectives import (
    Objective,
    ObjectiveFile,
    ObjectiveWatch,
    parse,
    priority_of,
)
from plugin_api.document import ConfigErrors
from pods.kubeapi import Backoff, ClusterConfig
from tests.fake_kube import FakeKube, eventually

NS = "models"
OBJECTIVES = """\
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10, poolRef: {name: a}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: a}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: unset}
spec: {poolRef: {name: a}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: elsewhere}
spec: {priority: 99, poolRef: {name: b}}
"""


def test_a_request_names_its_objective_and_gets_its_priority() -> None:
    """The header (or its deprecated alias, read second) names the objective; no header, an
    unknown name, or an objective without a priority give 0; another pool's is not seen."""
    found = parse(OBJECTIVES, "objectives.yaml", pool="a")
    assert set(found) == {"interactive", "batch", "unset"}
    assert priority_of([("x-llm-d-inference-objective", "interactive")], found) == 10
    assert priority_of([("X-Gateway-Inference-Objective", "batch")], found) == -1
    both = [("x-gateway-inference-objective", "batch"), ("x-llm-d-inference-objective", "unset")]
    assert priority_of(both, found) == 0
    assert priority_of([("x-llm-d-inference-objective", "nobody")], found) == 0
    assert priority_of([], found) == 0
    assert parse(OBJECTIVES, "o.yaml")["elsewhere"] == Objective("elsewhere", 99, "b")


def test_a_list_is_read_too() -> None:
    """``kind: List`` with ``items``, as ``kubectl get -o yaml`` writes it."""
    listed = "apiVersion: v1\nkind: List\nitems:\n" + "".join(
        f"- {{apiVersion: llm-d.ai/v1alpha2, kind: InferenceObjective, metadata: {{name: o{n}}}, "
        f"spec: {{priority: {n}, poolRef: {{name: a}}}}}}\n"
        for n in range(3)
    )
    assert {name: o.priority for name, o in parse(listed, "l.yaml").items()} == {
        "o0": 0,
        "o1": 1,
        "o2": 2,
    }


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (OBJECTIVES.replace("priority: 10", "priority: high"), "o.yaml:4: spec.priority: expected"),
        (
            OBJECTIVES.replace("{name: a}}\n---", "{}}\n---", 1),
            "o.yaml:4: spec.poolRef.name: required",
        ),
        (
            OBJECTIVES.replace("priority: -1,", "priority: -1, criticality: x,"),
            "o.yaml:9: spec: unknown field",
        ),
        (
            OBJECTIVES.replace("v1alpha2", "v1", 1),
            "o.yaml:1: apiVersion: expected llm-d.ai/v1alpha2",
        ),
        (
            OBJECTIVES.replace("name: batch", "name: Batch!"),
            "o.yaml:8: metadata.name: not a Kubernetes",
        ),
        (
            OBJECTIVES + "---\n" + OBJECTIVES.split("---")[0],
            "o.yaml:23: 'interactive': listed twice",
        ),
        ("a: [", "o.yaml:1: not YAML"),
    ],
    ids=["priority", "pool", "unknown", "version", "name", "twice", "yaml"],
)
def test_a_broken_file_names_the_line(text: str, problem: str) -> None:
    """Every mistake is reported with the file and the line of the field."""
    with pytest.raises(ConfigErrors) as raised:
        parse(text, "o.yaml")
    assert problem in str(raised.value)


def test_the_file_is_reread_on_change_keeping_the_last_good_set(tmp_path: Path) -> None:
    """A good edit replaces the set; a broken one is logged and the last good set stays."""
    path = tmp_path / "objectives.yaml"
    path.write_text(OBJECTIVES)
    source = ObjectiveFile(path, "a")
    assert source.reload()
    assert source.objectives["interactive"].priority == 10

    def edit(text: str, stamp: int) -> None:
        path.write_text(text)
        os.utime(path, ns=(stamp, stamp))  # a new modification time, however fast the test runs

    edit(OBJECTIVES.replace("priority: 10", "priority: 20"), 10**18)
    assert source.reload()
    assert source.objectives["interactive"].priority == 20
    edit("kind: [", 2 * 10**18)
    assert not source.reload()
    assert source.objectives["interactive"].priority == 20
    assert source.error is not None
    assert "objectives.yaml:1: not YAML" in source.error


def objective(name: str, priority: int | None, pool: str = "a") -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "llm-d.ai/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS, "generation": 1},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]},
    }


def path(group: str) -> str:
    return f"/apis/{group}/v1alpha2/namespaces/{NS}/inferenceobjectives"


async def watching(fake: FakeKube) -> tuple[ObjectiveWatch, asyncio.Task[None]]:
    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    watch = ObjectiveWatch(
        ClusterConfig(fake.url), "a", NS, backoff=lambda: Backoff(sleep=no_wait), retry=0.01
    )
    return watch, asyncio.create_task(watch.run())


def test_the_pools_objectives_are_followed_in_the_kubernetes_api() -> None:
    """llm-d.ai's objectives of the pool, listed then watched: a new one, a changed priority,
    a deleted one; another pool's are not taken, nor the legacy group's when both exist."""

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.put(path("llm-d.ai"), objective("interactive", 10))
            fake.put(path("llm-d.ai"), objective("other-pool", 5, pool="b"))
            fake.put(path("inference.networking.x-k8s.io"), objective("legacy", 1))
            watch, task = await watching(fake)
            try:
                await eventually(lambda: "interactive" in watch.objectives, "listed")
                assert set(watch.objectives) == {"interactive"}
                assert watch.group == "llm-d.ai"
                fake.put(path("llm-d.ai"), objective("batch", -1))
                fake.put(path("llm-d.ai"), objective("interactive", 20))
                await eventually(lambda: set(watch.objectives) == {"interactive", "batch"})
                await eventually(lambda: watch.objectives["interactive"].priority == 20)
                fake.delete(path("llm-d.ai"), "batch")
                await eventually(lambda: set(watch.objectives) == {"interactive"}, "deleted")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_the_legacy_group_is_read_when_only_it_is_installed_and_none_means_priority_0() -> None:
    """No CRD installed: no objective, looked for again; the legacy group once it appears."""

    async def scenario() -> None:
        async with FakeKube() as fake:
            fake.uninstalled = {"llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"}
            legacy = objective("batch", -1)
            legacy["apiVersion"] = "inference.networking.x-k8s.io/v1alpha2"
            fake.put(path("inference.networking.x-k8s.io"), legacy)
            watch, task = await watching(fake)
            try:
                await eventually(lambda: fake.count("list", "inferenceobjectives") >= 4, "retried")
                assert watch.objectives == {}
                fake.uninstalled = {"llm-d.ai/v1alpha2"}
                await eventually(lambda: "batch" in watch.objectives, "legacy group read")
                assert watch.group == "inference.networking.x-k8s.io"
                assert (
                    priority_of([("x-llm-d-inference-objective", "batch")], watch.objectives) == -1
                )
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 20))
