"""Fixtures for the end-to-end tests: the whole gateway on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.topology import Topology, free_ports

POOLS = {"a": "model-a", "b": "model-b"}
"""Two pools of two replicas; pool b is FailOpen, as GIE's conformance secondary pool."""


def write_pod_file(path: Path) -> Path:
    ports = iter(free_ports(2 * len(POOLS)))
    lines = ["pods:"]
    for pool, model in POOLS.items():
        for replica in range(2):
            lines += [
                f"- name: {pool}-{replica}",
                "  address: 127.0.0.1",
                f"  ports: [{next(ports)}]",
                f"  labels: {{pool: {pool}, model: {model}}}",
            ]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_gateway(work_dir: Path) -> Topology:
    """A ``Topology`` (enter it to start) over a fresh pod file, with fast replicas."""
    pods = write_pod_file(work_dir / "pods.yaml")
    return Topology(work_dir, pods, fail_open=["b"], simulator_args=["--time-scale", "0.1"])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """One running gateway shared by a module's tests; they must not stop its services."""
    with start_gateway(tmp_path_factory.mktemp("gateway")) as topology:
        yield topology


@pytest.fixture
def own_gateway(tmp_path: Path) -> Iterator[Topology]:
    """A running gateway for one test alone, which may stop its services."""
    with start_gateway(tmp_path) as topology:
        yield topology
