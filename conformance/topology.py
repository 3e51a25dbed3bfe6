"""GIE's conformance resources as local processes: echo pods, one LWEPP per pool, one Envoy.

GIE's ``conformance/resources/base.yaml`` deploys, in namespace
``inference-conformance-app-backend``, four echo-server Deployments of three
pods each and five InferencePools, each with its own lwepp. Here:

==================================  ==========================  ===================
Deployment (pods)                   ports                       "pod IPs"
==================================  ==========================  ===================
primary-inference-model-server      3000                        127.X.Y.11-13
secondary-inference-model-server    3000                        127.X.Y.21-23
appprotocol-inference-model-server  3000 (HTTP/1.1), 3001 (h2c) 127.X.Y.31-33
dp-inference-model-server           3000, 3002, 3004            127.X.Y.41-43
==================================  ==========================  ===================

Every pod has an address of its own, because the tests select pods by IP,
and the ports are GIE's, because the tests check them (``IP:3000`` in the
served-endpoint report, the DP ranks 3000/3002/3004). Linux routes all of
127.0.0.0/8 to the loopback interface, so ``127.X.Y.0/24`` is a private
little network; ``X.Y`` is drawn at random and checked free, so two runs on
one machine do not collide. One ``python -m simulator`` process serves every
pod (``--h2c-port 3001`` makes port 3001 speak h2c, as echo-basic does).

Each InferencePool gets its picker at ``127.X.Y.101+`` on GIE's ports (ext_proc
9002, TLS unless the run is plaintext; health 9003). A picker that reads its
pool (``Discovery.POOL``, Switchyard's LWEPP by default) is given a
kubeconfig for the harness's API server (``conformance.cluster``), which
serves the InferencePools and the pods; one handed its endpoints
(``Discovery.HANDED``) is given the pool's view of the world, computed here:
the pods its selector matches, each with the pool's target ports (what GIE's
lwepp builds from the InferencePool and its Pod watch), as a pod file and as
a list of endpoints. The picker is whatever ``PickerCommand`` starts
(``conformance.command``); it is ready once its health port reports
``inference-extension`` SERVING, the service GIE's probes ask about.
``pool-with-invalid-epp`` (from ``InferencePoolInvalidEPPService``) gets an
address where nothing listens, like an EPP Service that does not exist.

Envoy has a listener per Gateway (``conformance-primary``,
``conformance-secondary``) on free 127.0.0.1 ports, and reads each one's
routes from a file (``conformance.envoy``): ``apply`` rewrites them and waits
until Envoy serves the new version, as the suite applies a test's manifests.
"""

from __future__ import annotations

import functools
import json
import random
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conformance.cluster import ApiServer, pod_object, pool_object
from conformance.command import SWITCHYARD, Discovery, PickerCommand
from conformance.envoy import (
    Gateway,
    HTTPRoute,
    InferencePool,
    bootstrap,
    routes_file,
    write_routes,
)
from demo.topology import (
    Process,
    Processes,
    TopologyError,
    cluster_healthy,
    http_get,
    listeners,
    listening_line,
    start_envoy,
    stop_all,
    wait_envoy_ready,
    wait_for,
)
from pods.file import dump_pods
from pods.model import Pod

NAMESPACE: Final = "inference-conformance-app-backend"
REPLICAS: Final = 3
HEALTH_SERVICE: Final = "inference-extension"
"""The service GIE's liveness and readiness probes ask the picker's health port about."""
PICKER_PORTS: Final = {"grpc_port": 9002, "health_port": 9003, "metrics_port": 9090}
"""The ports GIE's base.yaml gives each pool's picker."""


H2C: Final = "kubernetes.io/h2c"


@dataclass(frozen=True, slots=True)
class Deployment:
    """An echo-server Deployment of ``base.yaml``: its ``app`` label and container ports
    (``container_per_port``: one container per port, as the data-parallel pods run)."""

    app: str
    ports: tuple[int, ...]
    h2c_ports: tuple[int, ...] = ()
    container_per_port: bool = False

    @property
    def name(self) -> str:
        return f"{self.app}-deployment"

    @property
    def containers(self) -> tuple[tuple[int, ...], ...]:
        """Each container's ports, in order."""
        return tuple((port,) for port in self.ports) if self.container_per_port else (self.ports,)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """An InferencePool of the suite: selector (``app``), target ports, failure mode,
    ``appProtocol`` as the manifest gives it, its EPP Service, and whether that exists."""

    name: str
    app: str
    target_ports: tuple[int, ...]
    fail_open: bool = False
    app_protocol: str = ""
    has_picker: bool = True
    picker_service: str = ""

    @property
    def h2c(self) -> bool:
        return self.app_protocol == H2C


DEPLOYMENTS: Final = (
    Deployment("primary-inference-model-server", (3000,)),
    Deployment("secondary-inference-model-server", (3000,)),
    Deployment("appprotocol-inference-model-server", (3000, 3001), h2c_ports=(3001,)),
    Deployment("dp-inference-model-server", (3000, 3002, 3004), container_per_port=True),
)

POOLS: Final = (
    PoolSpec(
        "primary-inference-pool",
        "primary-inference-model-server",
        (3000,),
        picker_service="primary-endpoint-picker-svc",
    ),
    PoolSpec(
        "secondary-inference-pool",
        "secondary-inference-model-server",
        (3000,),
        fail_open=True,
        picker_service="secondary-endpoint-picker-svc",
    ),
    PoolSpec(
        "appprotocol-http-inference-pool",
        "appprotocol-inference-model-server",
        (3000,),
        app_protocol="http",
        picker_service="appprotocol-http-endpoint-picker-svc",
    ),
    PoolSpec(
        "appprotocol-h2c-inference-pool",
        "appprotocol-inference-model-server",
        (3001,),
        app_protocol=H2C,
        picker_service="appprotocol-h2c-endpoint-picker-svc",
    ),
    PoolSpec(
        "dp-inference-pool",
        "dp-inference-model-server",
        (3000, 3002, 3004),
        picker_service="dp-endpoint-picker-svc",
    ),
    PoolSpec(
        "pool-with-invalid-epp",
        "primary-inference-model-server",
        (3000,),
        has_picker=False,
        picker_service="non-existent-epp-svc",
    ),
)

GATEWAYS: Final = (
    Gateway("conformance-primary"),
    Gateway("conformance-secondary", hostname="secondary.example.com"),
)


@dataclass(frozen=True, slots=True)
class EchoPod:
    """One echo pod: its name (the deployment's, plus an index), address and app label."""

    name: str
    ip: str
    app: str
    ports: tuple[int, ...]


def _subnet_is_free(prefix: str, wanted: Iterable[tuple[str, int]]) -> bool:
    for host, port in wanted:
        with socket.socket() as probe:
            try:
                probe.bind((f"{prefix}.{host}", port))
            except OSError:
                return False
    return True


def pick_subnet(wanted: Sequence[tuple[str, int]], tries: int = 50) -> str:
    """A ``127.X.Y`` prefix where every ``(last octet, port)`` in ``wanted`` can be bound."""
    for _ in range(tries):
        prefix = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
        if _subnet_is_free(prefix, wanted):
            return prefix
    raise TopologyError("no free 127.X.Y.0/24 network on this machine")


def _health(address: str, service: str) -> bool | None:
    """True once the picker's health port reports ``service`` SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            )
        except grpc.RpcError:
            return None
    return True if reply.status == health_pb2.HealthCheckResponse.SERVING else None


def cluster_objects(
    pods: Mapping[str, Sequence[EchoPod]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The InferencePools of ``POOLS`` and the echo pods (by ``app``), as Kubernetes objects."""
    deployments = {d.app: d for d in DEPLOYMENTS}
    pools = [
        pool_object(
            spec.name,
            NAMESPACE,
            spec.app,
            spec.target_ports,
            fail_open=spec.fail_open,
            app_protocol=spec.app_protocol,
            picker_service=spec.picker_service,
        )
        for spec in POOLS
    ]
    objects = [
        pod_object(pod.name, NAMESPACE, pod.ip, {"app": pod.app}, deployments[app].containers)
        for app, members in pods.items()
        for pod in members
    ]
    return pools, objects


class Topology(Processes):
    """Echo pods, pickers and Envoy, as a context manager; ``apply`` sets the routes."""

    def __init__(
        self,
        work_dir: Path,
        startup_timeout: float = 30.0,
        picker: PickerCommand | None = None,
        *,
        plaintext: bool = False,
    ) -> None:
        """``picker``: the command of each pool's picker (Switchyard's LWEPP by default);
        ``plaintext``: Envoy dials the pickers without TLS (GIE's gateways dial TLS)."""
        self.work_dir = work_dir
        self.timeout = startup_timeout
        self.picker = picker or PickerCommand.parse(SWITCHYARD)
        self.plaintext = plaintext
        self.services: dict[str, Process] = {}
        self.api: ApiServer | None = None
        """The Kubernetes API the pickers read their pools from (``Discovery.POOL`` only)."""
        self.prefix = ""
        self.pods: dict[str, tuple[EchoPod, ...]] = {}
        """Pods by ``app`` label, in order (GIE's tests take ``pods[0]``, ``pods[1]``...)."""
        self.pools: dict[str, InferencePool] = {}
        self.gateways: dict[str, str] = {}
        """Gateway name → the ``host:port`` of its listener."""
        self.admin = ""
        self._routes_version = 0

    # --- addresses ------------------------------------------------------------------

    def _layout(self, prefix: str) -> None:
        self.prefix = prefix
        self.pods = {
            d.app: tuple(
                EchoPod(f"{d.name}-{i}", f"{prefix}.{10 * (k + 1) + i + 1}", d.app, d.ports)
                for i in range(REPLICAS)
            )
            for k, d in enumerate(DEPLOYMENTS)
        }
        self.pools = {
            spec.name: InferencePool(
                spec.name,
                picker=f"{prefix}.{101 + j}",
                endpoints=tuple(
                    f"{pod.ip}:{port}" for pod in self.pods[spec.app] for port in spec.target_ports
                ),
                fail_open=spec.fail_open,
                h2c=spec.h2c,
                tls=not self.plaintext,
            )
            for j, spec in enumerate(POOLS)
        }

    @staticmethod
    def _wanted() -> list[tuple[str, int]]:
        """Every (last octet, port) the layout binds, for ``pick_subnet``."""
        wanted = [
            (str(10 * (k + 1) + i + 1), port)
            for k, d in enumerate(DEPLOYMENTS)
            for i in range(REPLICAS)
            for port in d.ports
        ]
        wanted += [(str(101 + j), port) for j in range(len(POOLS)) for port in (9002, 9003, 9090)]
        return wanted

    # --- life cycle -----------------------------------------------------------------

    def _run(self, name: str, argv: Sequence[str]) -> Process:
        log = self.work_dir / f"{name}.log"
        restarts = 1
        while log.exists():  # a restarted picker keeps its earlier logs
            log, restarts = self.work_dir / f"{name}.{restarts}.log", restarts + 1
        service = Process(name, argv, log)
        self.services[name] = service
        return service

    def _pod_file(self, name: str, pods: Iterable[tuple[EchoPod, tuple[int, ...]]]) -> Path:
        path = self.work_dir / f"{name}.yaml"
        path.write_text(dump_pods(Pod(p.name, p.ip, ports, {"app": p.app}) for p, ports in pods))
        return path

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._layout(pick_subnet(self._wanted()))
        if self.picker.discovery is Discovery.POOL:
            self._start_api()
        all_pods = [(pod, pod.ports) for pods in self.pods.values() for pod in pods]
        h2c = [str(port) for d in DEPLOYMENTS for port in d.h2c_ports]
        echo = self._run(
            "echo-pods",
            [
                *(sys.executable, "-m", "simulator"),
                *("--pods", str(self._pod_file("echo-pods", all_pods))),
                *("--namespace", NAMESPACE, "--time-scale", "0", "--log-level", "info"),
                *(arg for port in sorted(set(h2c)) for arg in ("--h2c-port", port)),
            ],
        )
        for spec in POOLS:
            if spec.has_picker:
                self.start_picker(spec.name, wait=False)
        # All started at once, so they come up in parallel; now wait for each.
        echo.listening = wait_for(
            echo, "listening", functools.partial(listening_line, echo), self.timeout
        )
        for name in self.services:
            if name in self.pools:
                self._wait_serving(name)
        self._start_envoy()

    def _start_api(self) -> None:
        """The API server with base.yaml's pools and pods, before any picker reads it."""
        self.api = ApiServer(NAMESPACE)
        self.api.start()
        self.api.apply(*cluster_objects(self.pods))
        self.api.kubeconfig(self.work_dir / "kubeconfig")

    def picker_file(self, pool: str) -> Path:
        """The pool's view of the pods: those its selector matches, with its target ports."""
        spec = next(spec for spec in POOLS if spec.name == pool)
        return self._pod_file(pool, [(pod, spec.target_ports) for pod in self.pods[spec.app]])

    def picker_fields(self, pool: str) -> dict[str, str]:
        """What the picker template's fields stand for, for ``pool`` (``command.FIELDS``): the
        API server's kubeconfig, or the endpoints the harness computed, as the template asks."""
        spec = next(spec for spec in POOLS if spec.name == pool)
        fields = {
            "python": sys.executable,
            "host": self.pools[pool].picker,
            **{name: str(port) for name, port in PICKER_PORTS.items()},
            "secure_serving": "false" if self.plaintext else "true",
            "pool": pool,
            "namespace": NAMESPACE,
        }
        if self.picker.discovery is Discovery.POOL:
            return {**fields, "kubeconfig": str(self.work_dir / "kubeconfig")}
        return {
            **fields,
            "pods": str(self.picker_file(pool)),
            "endpoints": ",".join(self.pools[pool].endpoints),
            "selector": f"app={spec.app}",
        }

    def start_picker(self, pool: str, *, wait: bool = True) -> None:
        """Start (or restart) a pool's picker from the picker template."""
        self._run(pool, self.picker.argv(self.picker_fields(pool)))
        if wait:
            self._wait_serving(pool)
            if "envoy" in self.services:
                self.wait_envoy_sees(pool, healthy=True)

    def _wait_serving(self, pool: str) -> None:
        address = f"{self.pools[pool].picker}:{PICKER_PORTS['health_port']}"
        probe = functools.partial(_health, address, HEALTH_SERVICE)
        what = f"SERVING on gRPC health service {HEALTH_SERVICE!r} at {address}"
        wait_for(self.services[pool], what, probe, self.timeout)

    def stop_picker(self, pool: str) -> None:
        """Stop a pool's picker, and wait until Envoy's health check has noticed.

        GIE's EppUnAvailableFailOpen takes the EPP Service down to zero
        endpoints and waits 10 s; waiting for Envoy's own view instead means
        the next request already takes the failure-mode path.
        """
        self.services.pop(pool).stop()
        self.wait_envoy_sees(pool, healthy=False)

    def _start_envoy(self) -> None:
        routes = self.work_dir / "routes"
        routes.mkdir(exist_ok=True)
        pools = list(self.pools.values())
        for gateway in GATEWAYS:
            write_routes(routes_file(self.work_dir, gateway), gateway, [], self.pools, "0")
        config = self.work_dir / "envoy-bootstrap.json"
        config.write_text(json.dumps(bootstrap(GATEWAYS, pools, self.work_dir), indent=2))
        envoy = self.services["envoy"] = start_envoy(self.work_dir, config)
        self.admin = wait_envoy_ready(envoy, self.work_dir, self.timeout)
        self.gateways = {
            name: f"{address}:{port}" for name, (address, port) in listeners(self.admin).items()
        }

    # --- what the tests do ------------------------------------------------------------

    def apply(self, routes: Sequence[HTTPRoute]) -> None:
        """Make ``routes`` the only HTTPRoutes, and wait until Envoy serves them."""
        self._routes_version += 1
        version = str(self._routes_version)
        for gateway in GATEWAYS:
            write_routes(routes_file(self.work_dir, gateway), gateway, routes, self.pools, version)
        wait_for(
            self.services["envoy"],
            f"serving routes version {version}",
            functools.partial(self._routes_at, version),
            self.timeout,
        )

    def _routes_at(self, version: str) -> bool | None:
        """True once every listener's RDS reports ``version`` accepted.

        The stat, not the config dump: a file whose routes did not change
        (the secondary gateway's, often) is acknowledged without a reload.
        """
        stats = http_get(f"{self.admin}/stats?filter=rds\\..*\\.version_text$") or ""
        seen = {line.split(".rds.")[1].split(".")[0]: line for line in stats.splitlines()}
        ok = all(seen.get(g.name, "").endswith(f': "{version}"') for g in GATEWAYS)
        return True if ok else None

    def envoy_sees_healthy(self, pool: str) -> bool:
        """Whether Envoy's health check of the pool's picker passes (admin ``/clusters``)."""
        return cluster_healthy(self.admin, f"lwepp-{pool}")

    def wait_envoy_sees(self, pool: str, *, healthy: bool) -> None:
        def noticed() -> bool | None:
            return True if self.envoy_sees_healthy(pool) == healthy else None

        state = "healthy" if healthy else "unhealthy"
        wait_for(self.services["envoy"], f"seeing {pool} {state}", noticed, self.timeout)

    def close(self) -> None:
        """Stop everything: Envoy first (no new requests), then the rest together, then the
        API server the pickers watched."""
        stop_all(list(self.services.values()))
        if self.api is not None:
            self.api.stop()
            self.api = None
