"""``python -m lwepp --pool-name``: the picker fed by an InferencePool, against a fake API server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lwepp.__main__ import build_parser, pod_source
from pods.file import PodFileError
from pods.kubeapi import KubeconfigError
from serving.testing import ExtProcClient, request_headers, set_headers
from tests.fake_kube import ThreadedFakeKube
from tests.processes import service
from tests.test_kubernetes import NS, PODS, POOLS, k8s_pod, k8s_pool

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def lwepp(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    return subprocess.run(
        [sys.executable, "-m", "lwepp", *args], capture_output=True, text=True, env=env, check=False
    )


def test_help_documents_the_kubernetes_flags() -> None:
    """--help documents the InferencePool, kubeconfig and leader-election flags."""
    out = lwepp("--help").stdout
    for flag in (
        "--pool-name",
        "--pool-namespace",
        "--pool-group",
        "--kubeconfig",
        "--leader-elect",
        "--leader-elect-lease-duration",
        "--leader-elect-renew-deadline",
        "--leader-elect-retry-period",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --pods --pool-name --endpoint-selector is required"),
        (["--pods", "p.yaml", "--pool-name", "x"], "not allowed with argument"),
        (["--pool-name", "x"], "not running in a cluster"),
        (["--pool-name", "x", "--kubeconfig", "/nonexistent"], "/nonexistent: cannot read"),
        (["--pool-name", "x", "--selector", "a=b"], "--selector is for --pods"),
        (["--pods", "{pods}", "--leader-elect"], "--leader-elect needs the Kubernetes API"),
        (["--endpoint-selector", "app=x", "--kubeconfig", "{config}"], "needs --endpoint-target"),
        (["--endpoint-selector", "app in ()"], "in needs at least one value"),
        (["--endpoint-selector", "a", "--endpoint-target-ports", "1,2,3,4,5,6,7,8,9"], "1 to 8"),
        (
            ["--pool-name", "x", "--kubeconfig", "{config}", "--leader-elect",
             "--leader-elect-renew-deadline", "20"],
            "lease duration > renew deadline",
        ),
    ],
    ids=["no-source", "two-sources", "not-in-cluster", "no-kubeconfig", "selector", "lease-file",
         "selector-without-ports", "bad-endpoint-selector", "nine-ports", "bad-timings"],
)  # fmt: skip
def test_exactly_one_source_with_a_clear_error(
    tmp_path: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flags are checked before anything starts (in process: no server is reached)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    (tmp_path / "pods.yaml").write_text("pods: []\n")
    config = tmp_path / "config"
    config.write_text(
        "current-context: c\ncontexts: [{name: c, context: {cluster: c}}]\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
    )
    argv = [a.format(pods=tmp_path / "pods.yaml", config=config) for a in args]
    # What main() does before it configures logging and serves.
    with pytest.raises((SystemExit, KubeconfigError, PodFileError, ValueError)) as refused:
        pod_source(build_parser().parse_args(argv))
    if isinstance(refused.value, SystemExit):
        assert refused.value.code == 2
        assert message in capsys.readouterr().err
    else:
        assert message in str(refused.value)


async def wait_serving(port: int, name: str = "inference-extension") -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=name)
        )
        async for answer in watch:
            if answer.status == SERVING:
                break
        watch.cancel()


async def status(port: int, name: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        return int(answer.status)


async def pick(port: int) -> str:
    async with ExtProcClient(f"127.0.0.1:{port}") as client:
        replies = await client.exchange(
            [request_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)]
        )
    return dict(set_headers(replies[0]))["x-gateway-destination-endpoint"]


def test_picks_among_the_pool_pods_and_follows_changes(tmp_path: Path) -> None:
    """Ready when the pool is read; picks its pods' ip:targetPort; a pod leaving is never picked."""
    with ThreadedFakeKube() as kube:
        kube.do(lambda f: f.put(POOLS, k8s_pool(ports=(8000,))))
        kube.do(lambda f: f.put(PODS, k8s_pod("a", "10.1.0.1")))
        kube.do(lambda f: f.put(PODS, k8s_pod("b", "10.1.0.2", ready=False)))
        config = kube.kubeconfig(tmp_path / "config", namespace=NS)
        with service("lwepp", "--pool-name", "llama", "--kubeconfig", str(config)) as (_, ports):

            async def scenario() -> None:
                await asyncio.wait_for(wait_serving(ports["health_port"]), 10)
                assert {await pick(ports["grpc_port"]) for _ in range(4)} == {"10.1.0.1:8000"}
                kube.do(lambda f: f.put(PODS, k8s_pod("b", "10.1.0.2")))
                kube.do(lambda f: f.put(PODS, k8s_pod("a", "10.1.0.1", ready=False)))
                # The change reaches the picker through the watch: poll picks, with a deadline.
                deadline = time.monotonic() + 10
                while await pick(ports["grpc_port"]) != "10.1.0.2:8000":
                    assert time.monotonic() < deadline, "the pod change never reached the picks"
                    await asyncio.sleep(0.01)
                assert {await pick(ports["grpc_port"]) for _ in range(4)} == {"10.1.0.2:8000"}

            asyncio.run(scenario())
        # The namespace came from the kubeconfig context; the token was sent. Beside the pool
        # and its pods, the picker reads the pool's InferenceObjectives (each group, listed).
        assert all(r.authorization == "Bearer fake-token" for r in kube.fake.requests)
        objectives = {
            f"/apis/{group}/v1alpha2/namespaces/{NS}/inferenceobjectives"
            for group in ("llm-d.ai", "inference.networking.x-k8s.io")
        }
        assert {r.path for r in kube.fake.requests} == {PODS, POOLS, *objectives}


def test_leader_election_one_replica_ready_and_a_standby_takes_over(tmp_path: Path) -> None:
    """With --leader-elect one replica is ready, the other alive (only "liveness" SERVING) but
    not; SIGTERM hands over."""
    with ThreadedFakeKube() as kube:
        kube.do(lambda f: f.put(POOLS, k8s_pool()))
        kube.do(lambda f: f.put(PODS, k8s_pod("a", "10.1.0.1")))
        config = kube.kubeconfig(tmp_path / "config", namespace=NS)
        args = (
            "--pool-name", "llama", "--kubeconfig", str(config), "--leader-elect",
            "--leader-elect-lease-duration", "3", "--leader-elect-renew-deadline", "2",
            "--leader-elect-retry-period", "0.2",
        )  # fmt: skip
        with service("lwepp", *args) as (first, one), service("lwepp", *args) as (second, two):

            async def ready(port: int) -> bool:
                return bool(await status(port, "inference-extension") == SERVING)

            async def scenario() -> None:
                # One of them wins; the other is alive and stays not ready.
                await asyncio.wait_for(
                    asyncio.wait(
                        [asyncio.create_task(wait_serving(p["health_port"])) for p in (one, two)],
                        return_when=asyncio.FIRST_COMPLETED,
                    ),
                    10,
                )
                states = [await ready(p["health_port"]) for p in (one, two)]
                assert sorted(states) == [False, True]
                standby = (one, two)[states.index(False)]
                assert await status(standby["health_port"], "liveness") == SERVING
                # The llm-d router's rule: "" (what a load balancer asks) follows readiness.
                for name in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                    assert await status(standby["health_port"], name) == NOT_SERVING
                leader = (first, second)[states.index(True)]
                leader.send_signal(signal.SIGTERM)  # it releases the lease on the way out
                assert await asyncio.to_thread(leader.wait, 10) == 0
                await asyncio.wait_for(wait_serving(standby["health_port"]), 10)

            asyncio.run(scenario())
        lease = kube.fake.collections[f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"]
        assert "lwepp-llama" in lease
