"""The processes of the gateway benchmarks: the upstream, the ext_proc servers, an Envoy per case.

``Rig`` starts, for a set of ``Case`` values, every process they need once
and keeps it for all rounds: the upstream (``upstream_bootstrap``: one Envoy
answering a fixed chat completion and a fixed ``/metrics`` page, unless model
servers already run), each ext_proc server kind a case names (BBR, LWEPP in
its configurations, the one hop, the do-nothing hops of ``bench.server`` and
``bench/noop_extproc.js``), one Envoy per case (``bootstrap``: the demo's
filters, clusters and processing modes from ``demo/envoy.py``) and the peer
routers (``bench/peers.py``). ``Placement`` and ``pinned`` put each process on
its CPU. What each case means, and why the processes sit where they do, is
``bench/overhead.py``'s docstring.

Its own module because four benchmarks measure through it
(``bench.overhead``, ``bench.overhead_engine``, ``bench.floor`` and
``bench.hops``), and ``bench.overhead`` hands its ``--engine llamacpp`` run to
``bench.overhead_engine``: the rig sits below all of them, so every import
between them points one way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import betterproto2
import yaml
from envoy_data_plane.envoy.config.bootstrap import v3 as bootstrap_
from envoy_data_plane.envoy.config.cluster import v3 as cluster
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.config.listener import v3 as listener
from envoy_data_plane.envoy.config.route import v3 as route
from envoy_data_plane.envoy.extensions.filters.http.buffer import v3 as buffer
from envoy_data_plane.envoy.extensions.filters.http.router import v3 as router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import v3 as hcm
from envoy_data_plane.google.protobuf import Any as AnyMessage

from bench import peers
from demo.envoy import (
    ONE_HOP,
    ROUTE_TIMEOUT,
    GatewayPool,
    bbr_filter,
    fallback_cluster,
    grpc_cluster,
    one_hop_filter,
    picked_endpoint_cluster,
    picker_filter,
    served_endpoint_filter,
    served_endpoint_header,
    strip_client_routing_filter,
)
from demo.topology import (
    HOST,
    Process,
    free_ports,
    listeners,
    listening_line,
    start_envoy,
    stop_all,
    wait_envoy_ready,
    wait_for,
    wants_response_headers,
)
from lwepp.plugins.prometheus import parse
from pods.file import dump_pods
from pods.model import Pod
from simulator import metrics

POOL: Final = GatewayPool("p", ("llama-3-8b",), picker_port=0)
"""The one pool: its picker filter is ``lwepp-p``, its ORIGINAL_DST cluster ``pool-p``."""


@dataclass(frozen=True, slots=True)
class Case:
    """One gateway configuration: which server, if any, sits behind each ext_proc filter."""

    key: str
    label: str
    bbr: str | None = None
    """Behind the ``bbr`` filter: ``"bbr"`` or ``"noop-bbr"``; None: no such filter."""
    picker: str | None = None
    """Behind the ``lwepp-p`` filter: ``"lwepp"``, ``"lwepp-tls"``, ``"lwepp-prefix"``,
    ``"lwepp-scrape"`` or ``"noop-picker"``; behind the one-hop filter: ``"onehop"`` or
    ``"onehop-scrape"``; None: no such filter."""
    peer: str | None = None
    """A peer router (``bench.peers``) in place of Envoy."""
    direct: bool = False
    """No proxy: the upstream itself."""

    @property
    def envoy(self) -> bool:
        """Whether this case runs through an Envoy of its own."""
        return self.peer is None and not self.direct

    @property
    def one_hop(self) -> bool:
        """Whether Envoy's one ext_proc filter is the one hop's (BBR's job and the pick)."""
        return self.picker is not None and self.picker.startswith("onehop")

    @property
    def picks(self) -> bool:
        """Whether a real picker chooses the replica (the route follows its header)."""
        return self.picker is not None and not self.picker.startswith("noop")


CASES: Final = (
    Case("plain", "Envoy → upstream (plain proxy)"),
    Case("noop-picker", "+ do-nothing hop, picker's mode", picker="noop-picker"),
    Case("lwepp", "+ LWEPP", picker="lwepp"),
    Case("lwepp-tls", "+ LWEPP over TLS", picker="lwepp-tls"),
    Case("noop-both", "+ two do-nothing hops", bbr="noop-bbr", picker="noop-picker"),
    Case("bbr+lwepp", "+ BBR + LWEPP", bbr="bbr", picker="lwepp"),
    Case("noop-bbr", "+ do-nothing hop, BBR's mode", bbr="noop-bbr"),
    Case("bbr", "+ BBR", bbr="bbr"),
    Case("one-hop", "+ one hop: BBR's job and LWEPP's pick", picker="onehop"),
    Case(
        "bbr+lwepp-prefix",
        "+ BBR + LWEPP prefix-aware (metrics read once)",
        bbr="bbr",
        picker="lwepp-prefix",
    ),
    Case(
        "bbr+lwepp-scrape",
        "+ BBR + LWEPP prefix-aware, scraping /metrics",
        bbr="bbr",
        picker="lwepp-scrape",
    ),
    Case("one-hop-scrape", "+ one hop prefix-aware, scraping /metrics", picker="onehop-scrape"),
    Case("direct", "no proxy: the upstream itself", direct=True),
    Case("sglang-router", "sglang-router (round_robin), no Envoy", peer="sglang-router"),
    Case("vllm-router", "vllm-router (round_robin), no Envoy", peer="vllm-router"),
)

PEERS: Final = {peer.name: peer for peer in peers.PEERS}
NODE_NOOP: Final = Path(__file__).with_name("noop_extproc.js")
"""A do-nothing ext_proc server in Node.js (``bench.floor``'s ``noop-node-picker``)."""
GRPC_JS: Final = Path(sys.prefix, "node", "node_modules", "@grpc", "grpc-js")
"""Where ``make node-grpc`` installs the gRPC library it runs on (the project's ``.venv``)."""

# --- where each process runs ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """CPU sets: Envoy, the load generator and the upstream on one; Python ext_proc on another."""

    gateway: frozenset[int]
    python: frozenset[int]

    @classmethod
    def detect(cls) -> Placement:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return cls(frozenset(cpus), frozenset(cpus))
        return cls(frozenset({cpus[0]}), frozenset({cpus[1]}))

    def describe(self) -> str:
        if self.gateway == self.python:
            return f"one CPU ({sorted(self.gateway)}) for everything: no pinning possible"
        return (
            f"CPU {min(self.gateway)}: every Envoy (--concurrency 1), the load generator and "
            f"the upstream Envoy; CPU {min(self.python)}: every Python ext_proc server"
        )


@contextlib.contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """Run the block, and whatever it starts, on ``cpus`` (children inherit the affinity)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# --- the Envoy configuration --------------------------------------------------------


def _any(message: betterproto2.Message) -> AnyMessage:
    return AnyMessage.pack(message)


def _address(port: int) -> core.Address:
    return core.Address(socket_address=core.SocketAddress(address=HOST, port_value=port))


DIRECT_BODY: Final = '{"object": "text_completion", "choices": [{"text": "hi"}]}'

COMPLETION: Final = (
    '{"id": "chatcmpl-0", "object": "chat.completion", "created": 1767225600, '
    '"model": "llama-3-8b", "choices": [{"index": 0, "message": {"role": "assistant", '
    '"content": "Hello! How can I help you today?"}, "finish_reason": "stop"}], '
    '"usage": {"prompt_tokens": 230, "completion_tokens": 9, "total_tokens": 239}}'
)
"""What every upstream replica answers: a non-streamed chat completion."""

PAGE_QUEUE: Final = 1
"""The queue length every replica's page reports."""

METRICS_PAGE: Final = metrics.render(
    "vllm",
    metrics.State(
        model=POOL.models[0],
        running=2,
        waiting=PAGE_QUEUE,
        max_running=64,
        kv_usage=0.25,
        kv_capacity=65536,
        prompt_tokens=123456,
        generation_tokens=23456,
        lora=None,
        now=1767225600.0,
        prefix_queries=123456,
        prefix_hits=61728,
    ),
)
"""What every upstream replica answers on ``/metrics``: a fixed page in vLLM's names.

Rendered once by the simulator's own exposition code (``simulator.metrics``),
so the scraping pickers parse a page with the families a vLLM-speaking picker
reads (queue, running batch, KV-cache use, cache geometry, prefix counters):
a real page in format, fixed in value. A real vLLM's page also carries
histograms, several times the text: parsing it costs more than this one.
"""

PREFIX_CONFIG: Final = Path(__file__).resolve().parent.parent / "demo/configs/prefix-aware.yaml"
"""The prefix-aware configuration the fast upstream's pickers run (the demo's)."""

QUEUE_GAUGE: Final = "llm_d_epp_average_queue_size"
"""The pool gauge a picker sets from the queue lengths it scraped (``lwepp.pipeline``)."""

ONCE: Final = 3600.0
"""The scrape interval of the ``-prefix`` pickers: longer than any run, so they read each
replica's metrics once, at start, and their pipelines score that reading ever after."""


def scraping_config(base: Path, target: Path, interval: float | None) -> Path:
    """``base`` (an EndpointPickerConfig) written to ``target`` with its metrics source's
    ``refreshIntervalSeconds`` set to ``interval`` (None: the base's own, or the default); a
    base that reads no metrics (``demo/configs/llamacpp.yaml``) is written as it is."""
    config = yaml.safe_load(base.read_text())
    sources = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    if interval is not None:
        for source in sources:
            source.setdefault("parameters", {})["refreshIntervalSeconds"] = interval
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def _json_answer(body: str, content_type: str = "application/json") -> route.Route:
    return route.Route(
        match=route.RouteMatch(prefix="/"),
        direct_response=route.DirectResponseAction(
            status=200, body=core.DataSource(inline_string=body)
        ),
        response_headers_to_add=[
            core.HeaderValueOption(header=core.HeaderValue(key="content-type", value=content_type))
        ],
    )


def _listener(name: str, port: int, manager: hcm.HttpConnectionManager) -> listener.Listener:
    network_filter = listener.Filter(
        name="envoy.filters.network.http_connection_manager", typed_config=_any(manager)
    )
    return listener.Listener(
        name=name,
        address=_address(port),
        filter_chains=[listener.FilterChain(filters=[network_filter])],
    )


def upstream_bootstrap(ports: Sequence[int]) -> dict[str, Any]:
    """The replicas: one Envoy answering a fixed chat completion on each of ``ports``,
    and ``METRICS_PAGE`` on ``GET /metrics``.

    The same upstream for every case, and a cheap one (tens of microseconds of
    C++ per answer), so it neither adds noise nor takes CPU from the hops
    under test; a model server's own time would be the same in every case.
    """
    page = _json_answer(METRICS_PAGE, "text/plain; version=0.0.4")
    page.match = route.RouteMatch(path="/metrics")
    listeners_ = []
    for i, port in enumerate(ports):
        host = route.VirtualHost(
            name="replica", domains=["*"], routes=[page, _json_answer(COMPLETION)]
        )
        manager = hcm.HttpConnectionManager(
            stat_prefix=f"replica-{i}",
            route_config=route.RouteConfiguration(name="replica", virtual_hosts=[host]),
            # The buffer filter reads the whole request before the route answers:
            # Envoy closes an HTTP/1.1 connection it answers mid-request, and the
            # gateway would then reconnect for every request.
            http_filters=[
                hcm.HttpFilter(
                    name="envoy.filters.http.buffer",
                    typed_config=_any(buffer.Buffer(max_request_bytes=1 << 20)),
                ),
                hcm.HttpFilter(
                    name="envoy.filters.http.router", typed_config=_any(router.Router())
                ),
            ],
        )
        listeners_.append(_listener(f"replica-{i}", port, manager))
    config = bootstrap_.Bootstrap(
        admin=bootstrap_.Admin(address=_address(0)),
        static_resources=bootstrap_.BootstrapStaticResources(listeners=listeners_),
    )
    return config.to_dict(casing=betterproto2.Casing.SNAKE)


def _routes(case: Case) -> list[route.Route]:
    """``/direct``: Envoy answers itself (the load generator's ceiling); the rest goes upstream.

    Through LWEPP the route's cluster is the pool's ORIGINAL_DST cluster, which
    connects wherever the picker's header points; otherwise it is the plain
    round-robin cluster over the same replicas (``fallback_cluster``, what a
    FailOpen pool uses while its picker is down).
    """
    target = f"pool-{POOL.name}" if case.picks else f"pool-{POOL.name}-fallback"
    direct = _json_answer(DIRECT_BODY)
    direct.match = route.RouteMatch(path="/direct")
    upstream = route.Route(
        name="upstream",
        match=route.RouteMatch(prefix="/"),
        route=route.RouteAction(cluster=target, timeout=ROUTE_TIMEOUT),
    )
    return [direct, upstream]


def bootstrap(
    case: Case,
    ports: dict[str, int],
    upstreams: Sequence[str],
    response_headers: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """The case's Envoy: the demo's filter chain with only the case's ext_proc filters.

    ``ports``: the ext_proc port of each server kind; ``upstreams``: ``ip:port``;
    ``response_headers``: whether each picker kind is sent the response headers,
    as the demo decides it (``demo.topology``: what the picker says it needs; a
    do-nothing picker needs none, as round-robin); a kind not named is sent them.
    """
    wants = (response_headers or {}).get(case.picker or "", True)
    pool = GatewayPool(
        POOL.name, POOL.models, 0, endpoints=tuple(upstreams), response_headers=wants
    )
    filters = [strip_client_routing_filter()]
    clusters: list[cluster.Cluster] = [fallback_cluster(pool), picked_endpoint_cluster(pool)]
    if case.bbr is not None:
        filters.append(bbr_filter())
        clusters.append(grpc_cluster("bbr", HOST, ports[case.bbr]))
    if case.picker is not None and case.one_hop:
        filters.append(one_hop_filter(wants))
        clusters.append(grpc_cluster(ONE_HOP, HOST, ports[case.picker]))
    elif case.picker is not None:
        filters.append(picker_filter(pool))
        tls = case.picker == "lwepp-tls"
        clusters.append(grpc_cluster(f"lwepp-{pool.name}", HOST, ports[case.picker], tls=tls))
    filters += [
        served_endpoint_filter(),
        hcm.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router.Router())),
    ]
    host = route.VirtualHost(
        name="gateway",
        domains=["*"],
        routes=_routes(case),
        response_headers_to_add=[served_endpoint_header()],
    )
    manager = hcm.HttpConnectionManager(
        stat_prefix="gateway",
        route_config=route.RouteConfiguration(name="gateway", virtual_hosts=[host]),
        http_filters=filters,
    )
    config = bootstrap_.Bootstrap(
        admin=bootstrap_.Admin(address=_address(0)),
        static_resources=bootstrap_.BootstrapStaticResources(
            listeners=[_listener("gateway", 0, manager)], clusters=clusters
        ),
    )
    return config.to_dict(casing=betterproto2.Casing.SNAKE)


# --- the processes ---------------------------------------------------------------


def _first_line_port(service: Process) -> dict[str, Any] | None:
    """``bench.server`` prints its port as its first line."""
    text = service.log.read_text(errors="replace").split("\n", 1)[0].strip()
    return {"grpc_port": int(text)} if text.isdigit() else None


class Rig:
    """Every process of the benchmark, started once and kept for all rounds.

    ``cases``: what to measure (each server kind is started only if a case uses
    it); ``config``: the prefix-aware EndpointPickerConfig of the ``-prefix`` and
    ``-scrape`` pickers; ``upstream_ports``: model servers already running (one
    replica each); None starts the fast upstream (``upstream_bootstrap``) with two.
    """

    def __init__(
        self,
        work_dir: Path,
        placement: Placement,
        timeout: float = 30.0,
        *,
        cases: Sequence[Case] = CASES,
        config: Path = PREFIX_CONFIG,
        upstream_ports: Sequence[int] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.placement = placement
        self.timeout = timeout
        self.all_cases = tuple(cases)
        self.config = config
        self.upstream_ports = list(upstream_ports) if upstream_ports is not None else None
        self.services: list[Process] = []
        self.servers: dict[str, Process] = {}
        """Each ext_proc server by kind."""
        self.ports: dict[str, int] = {}
        self.response_headers: dict[str, bool] = {}
        """Whether each server kind is sent the response headers (``bootstrap``)."""
        self.envoys: dict[str, int] = {}
        """The port each case's load goes to: its Envoy's, a peer's, or a replica's."""
        self.upstreams: list[str] = []
        self.missing: dict[str, str] = {}
        """Cases left out (a peer not installed, or that did not start), and why."""

    @property
    def cases(self) -> list[Case]:
        """The cases this run measures."""
        return [case for case in self.all_cases if case.key not in self.missing]

    def _spawn(self, name: str, argv: Sequence[str], cpus: frozenset[int]) -> Process:
        with pinned(cpus):
            service = Process(name, argv, self.work_dir / f"{name}.log")
        self.services.append(service)
        return service

    def _wait(self, service: Process, probe: Callable[[Process], dict[str, Any] | None]) -> None:
        service.listening = wait_for(service, "listening", lambda: probe(service), self.timeout)

    def _argv(self, kind: str, pods: Path) -> list[str]:
        """The command line of one server kind (``Case.bbr`` and ``Case.picker`` values)."""
        python = sys.executable
        if kind == "noop-node-picker":  # bench.floor's: the same hop, in Node.js
            return ["node", str(NODE_NOOP), str(GRPC_JS)]
        if kind == "noop-sync-picker":  # and on grpc's synchronous server
            return [python, "-m", "bench.server", "passthrough-sync"]
        if kind.startswith("noop"):
            return [python, "-m", "bench.server", "passthrough"]
        ports = ["--host", HOST, "--grpc-port", "0", "--grpc-health-port", "0"]
        ports += ["--metrics-port", "0", "--log-level", "info"]
        plaintext = [*ports, "--secure-serving=false"]
        if kind == "bbr":
            return [python, "-m", "bbr", *plaintext]
        config: list[str] = []
        suffix = kind.rpartition("-")[2]
        if suffix in ("prefix", "scrape"):  # the prefix-aware config, scraping once or on
            interval = ONCE if suffix == "prefix" else None
            path = scraping_config(self.config, self.work_dir / f"{suffix}.yaml", interval)
            config = ["--config", str(path)]
        if kind.startswith("onehop"):
            pool = ["--pool", f"{POOL.name}=*"]
            return [python, "-m", "onehop", "--pods", str(pods), *pool, *config, *plaintext]
        serving = ports if kind == "lwepp-tls" else plaintext
        return [python, "-m", "lwepp", "--pods", str(pods), *config, *serving]

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        upstream: Process | None = None
        upstream_dir = self.work_dir / "upstream"
        if self.upstream_ports is None:
            self.upstream_ports = free_ports(2)
            upstream_dir.mkdir(exist_ok=True)
            path = upstream_dir / "envoy-bootstrap.json"
            path.write_text(json.dumps(upstream_bootstrap(self.upstream_ports)))
            with pinned(self.placement.gateway):
                upstream = start_envoy(upstream_dir, path, "--concurrency", "1")
            upstream.name = "envoy-upstream"
            self.services.append(upstream)
        pods = self.work_dir / "pods.yaml"
        labels = {"pool": POOL.name, "model": POOL.models[0]}
        pods.write_text(
            dump_pods(
                Pod(f"replica-{i}", HOST, (port,), labels)
                for i, port in enumerate(self.upstream_ports)
            )
        )
        self.upstreams = [f"{HOST}:{port}" for port in self.upstream_ports]
        kinds = [k for c in self.all_cases for k in (c.bbr, c.picker) if k is not None]
        self.servers = servers = {
            kind: self._spawn(kind, self._argv(kind, pods), self.placement.python)
            for kind in dict.fromkeys(kinds)
        }
        if upstream is not None:
            wait_envoy_ready(upstream, upstream_dir, self.timeout)
        for kind, service in servers.items():
            self._wait(service, _first_line_port if kind.startswith("noop") else listening_line)
            self.ports[kind] = int(service.listening["grpc_port"])
            noop = kind.startswith("noop")
            self.response_headers[kind] = not noop and wants_response_headers(service)
        envoys: dict[str, Process] = {}
        for case in [case for case in self.all_cases if case.envoy]:
            case_dir = self.work_dir / case.key
            case_dir.mkdir(exist_ok=True)
            path = case_dir / "envoy-bootstrap.json"
            config = bootstrap(case, self.ports, self.upstreams, self.response_headers)
            path.write_text(json.dumps(config))
            with pinned(self.placement.gateway):
                envoy = start_envoy(case_dir, path, "--concurrency", "1")
            envoy.name = f"envoy-{case.key}"
            self.services.append(envoy)
            envoys[case.key] = envoy
        for key, envoy in envoys.items():
            admin = wait_envoy_ready(envoy, self.work_dir / key, self.timeout)
            ((_, port),) = listeners(admin).values()
            self.envoys[key] = port
        self.envoys["direct"] = self.upstream_ports[0]
        for case in self.all_cases:
            if case.peer is not None:
                self._start_peer(case.key, PEERS[case.peer])

    def _start_peer(self, key: str, peer: peers.Peer) -> None:
        """A peer router in front of the replicas, on the Python services' CPU: like them, a
        process with a core of its own beside Envoy's."""
        workers = [f"http://{upstream}" for upstream in self.upstreams]
        try:
            with pinned(self.placement.python):
                router = peers.start(peer, "round_robin", workers, self.work_dir / "peers")
        except peers.PeerError as error:
            self.missing[key] = str(error).splitlines()[0]
            return
        self.services.append(router.service)
        self.envoys[key] = int(router.url.rpartition(":")[2])

    def pool_queue(self) -> dict[str, float | None]:
        """What each scraping picker last read: its pool's mean queue length
        (``llm_d_epp_average_queue_size`` on its metrics port; None if absent), the proof that
        its scrapes reach the replicas' ``/metrics`` and parse."""
        found: dict[str, float | None] = {}
        for kind, service in self.servers.items():
            if not kind.endswith("-scrape"):
                continue
            url = f"http://{HOST}:{service.listening['metrics_port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            series = parse(text, [QUEUE_GAUGE]).get(QUEUE_GAUGE, [])
            found[kind] = series[0][1] if series else None
        return found

    def close(self) -> None:
        stop_all(list(reversed(self.services)))
