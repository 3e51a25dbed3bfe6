"""The harness's Kubernetes API: GIE's InferencePools and echo pods, for pickers that read them.

In GIE's suite each pool's lwepp is started with ``--pool-name`` and
``--pool-namespace`` and finds its endpoints itself: it reads the
InferencePool (its selector, its target ports) and watches the pods the
selector matches. A picker held to the tests that way gets its selector and
target ports right or fails, where a picker handed a ready-made list of
endpoints cannot get them wrong.

Here the API server is the one the tests use (``tests/fake_kube.py``, which
speaks the real list/watch wire format, so a picker's client cannot tell it
from a cluster's for what it reads), run on its own thread for as long as the
topology. The harness runs from a Switchyard checkout, where that module is.
It serves, in ``inference-conformance-app-backend``:

- the InferencePools of GIE's ``resources/base.yaml`` and
  ``pool-with-invalid-epp`` (``inferencepool_invalid_epp_service.yaml``), as
  those manifests spell them: ``selector.matchLabels``, ``targetPorts``,
  ``appProtocol`` where given, ``endpointPickerRef`` (with ``failureMode:
  FailOpen`` for the secondary pool);
- one pod per echo pod, as its Deployment makes it (its ``app`` label, its
  containers and their ports: the data-parallel pods run one container per
  port, the appprotocol pods one container with 3000 and 3001), running, with
  its loopback address as ``status.podIP`` and the ``Ready`` condition
  ``True``, as kubelet reports a pod whose readiness probe passes.

A picker reaches it with the kubeconfig ``kubeconfig`` writes (no
credentials are checked); nothing else in the topology reads it: the
gateway's configuration is still computed by ``conformance.envoy``, as a
Gateway controller would from the same objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from tests.fake_kube import FakeKube, ThreadedFakeKube

POOL_GROUP: Final = "inference.networking.k8s.io"
POOL_VERSION: Final = "v1"


def pool_object(
    name: str,
    namespace: str,
    app: str,
    target_ports: Iterable[int],
    *,
    fail_open: bool = False,
    app_protocol: str = "",
    picker_service: str = "",
) -> dict[str, Any]:
    """An InferencePool as GIE's manifests write it (``inference.networking.k8s.io/v1``)."""
    ref: dict[str, Any] = {"name": picker_service or f"{name}-epp", "port": {"number": 9002}}
    if fail_open:
        ref["failureMode"] = "FailOpen"
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": app}},
        "targetPorts": [{"number": port} for port in target_ports],
        "endpointPickerRef": ref,
    }
    if app_protocol:
        spec["appProtocol"] = app_protocol
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pod_object(
    name: str,
    namespace: str,
    ip: str,
    labels: Mapping[str, str],
    containers: Iterable[Iterable[int]],
) -> dict[str, Any]:
    """A running, ready pod: ``containers`` lists each container's ports, in order."""
    specs = []
    for container in containers:
        ports = list(container)
        suffix = f"-{ports[0]}" if len(ports) == 1 else ""  # GIE's: echoserver-3000, ...
        specs.append(
            {
                "name": f"echoserver{suffix}",
                "ports": [{"containerPort": port, "protocol": "TCP"} for port in ports],
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"containers": specs},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }


class ApiServer:
    """The fake API server with the suite's objects, and its kubeconfig: ``start``, ``stop``."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._server = ThreadedFakeKube()

    def start(self) -> None:
        self._server.__enter__()

    def stop(self) -> None:
        self._server.__exit__()

    def apply(self, pools: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> None:
        """Create the pools and pods (before any picker starts, as base.yaml is applied)."""
        pool_path = f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{self.namespace}/inferencepools"
        pod_path = f"/api/v1/namespaces/{self.namespace}/pods"
        objects = [(pool_path, pool) for pool in pools] + [(pod_path, pod) for pod in pods]

        def create(fake: FakeKube) -> None:
            for path, obj in objects:
                fake.put(path, obj)

        self._server.do(create)

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for the server, its context's namespace the suite's."""
        return self._server.kubeconfig(path, self.namespace)
