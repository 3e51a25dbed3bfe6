"""The conformance gateway's Envoy: Gateway API objects in, Envoy configuration out.

GIE's conformance suite runs on a cluster where a Gateway controller turns
Gateways, HTTPRoutes and InferencePools into its data plane's configuration.
Here this module is that controller, in miniature, for an Envoy:

- each ``Gateway`` (GIE's ``conformance-primary`` and ``conformance-secondary``,
  one HTTP listener each) is an Envoy listener whose routes come from a file
  (RDS over the filesystem), so routes can be applied and deleted while
  Envoy runs, as the suite applies each test's manifests and deletes them;
- each ``InferencePool`` is a picker cluster (its endpoint picker, dialled
  over TLS as GIE's gateways dial lwepp, gRPC health-checked on the
  ``inference-extension`` service as GIE's probes ask) and a cluster of the
  pool's endpoints that routes on the picker's ``envoy.lb`` metadata, as
  Istio's gateway does (Envoy's override-host load balancing policy): the
  first endpoint the picker named, the next of a fallback list on a retry,
  and Envoy's own round-robin when the picker named none (a FailOpen pool
  whose picker is down), over HTTP/2 for ``appProtocol: kubernetes.io/h2c``;
- a check after the pickers (``protocol_check_filter``) refuses a request
  whose ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata
  differ, so that a picker that sets only one of them, which some gateways
  route on and others ignore, fails here through the gateway too;
- each ``HTTPRoute`` rule is an Envoy route matching the rule's path prefix
  (Gateway API ``PathPrefix``: whole path segments) under a virtual host per
  hostname, sending to one pool or splitting by ``weight`` across several.

The filters and the picker clusters are the demo gateway's (``demo.envoy``),
minus BBR (GIE's conformance tests route by host and path, never by model),
plus the check; the pool clusters are this gateway's own: the demo's follow
the destination header (an ORIGINAL_DST cluster, as GIE's reference Envoy),
which cannot take a fallback list. As in the demo, each pool's picker filter
is off on every virtual host and switched on by the routes (or, for a
weighted rule, the cluster weights) that send to its pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import betterproto2
from envoy_data_plane.envoy.config.bootstrap import v3 as bootstrap_
from envoy_data_plane.envoy.config.cluster import v3 as cluster
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.config.listener import v3 as listener
from envoy_data_plane.envoy.config.route import v3 as route
from envoy_data_plane.envoy.extensions.filters.http.lua import v3 as lua
from envoy_data_plane.envoy.extensions.filters.http.router import v3 as router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import v3 as hcm
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host import (
    v3 as override_host,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin import (
    v3 as round_robin,
)
from envoy_data_plane.envoy.service.discovery import v3 as discovery
from envoy_data_plane.envoy.type.metadata import v3 as metadata
from envoy_data_plane.google.protobuf import Any as AnyMessage

from demo import envoy as demo

ROUTE_TYPE: Final = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
LB_NAMESPACE: Final = "envoy.lb"
"""The dynamic metadata namespace in which the picker names the endpoint (and Envoy, the one
that served)."""


@dataclass(frozen=True, slots=True)
class InferencePool:
    """An InferencePool as the gateway needs it.

    ``picker``: the address of its endpoint picker (GIE's EPP Service), which
    serves ext_proc on ``picker_port`` (over TLS unless ``tls`` is False) and
    gRPC health on ``health_port``, the ``inference-extension`` service.
    ``endpoints``: ``ip:port`` of each ready pod × target port, the hosts of
    the pool's cluster. ``h2c``: ``appProtocol: kubernetes.io/h2c`` (HTTP/2
    without TLS to the model servers).
    """

    name: str
    picker: str
    endpoints: tuple[str, ...] = ()
    fail_open: bool = False
    h2c: bool = False
    picker_port: int = 9002
    health_port: int = 9003
    tls: bool = True

    def demo_pool(self) -> demo.GatewayPool:
        """The same pool in the demo gateway's terms, whose building blocks are reused."""
        return demo.GatewayPool(
            self.name, (), self.picker_port, self.health_port, self.endpoints, self.fail_open
        )


@dataclass(frozen=True, slots=True)
class BackendRef:
    """An HTTPRoute backendRef to an InferencePool.

    ``port`` is accepted and ignored, as the Gateway API inference extension
    requires: the pool's target ports and its picker decide where a request
    goes (GIE's InferencePoolHTTPRoutePortValidation sends through routes with
    the port unset, matching and wrong).
    """

    pool: str
    weight: int = 1
    port: int | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One HTTPRoute rule: a ``PathPrefix`` match and where it sends."""

    path_prefix: str
    backends: tuple[BackendRef, ...]


@dataclass(frozen=True, slots=True)
class HTTPRoute:
    """An HTTPRoute attached to one Gateway (its ``parentRefs``)."""

    name: str
    gateway: str
    rules: tuple[Rule, ...]
    hostnames: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Gateway:
    """A Gateway with one HTTP listener; ``hostname`` limits it to that host, as GIE's secondary."""

    name: str
    hostname: str | None = None


# --- clusters -------------------------------------------------------------------------


def clusters(pools: Iterable[InferencePool]) -> list[cluster.Cluster]:
    """Per pool: its picker, and its endpoints as the picker's metadata chooses them."""
    result = []
    for pool in pools:
        result.append(
            demo.grpc_cluster(
                f"lwepp-{pool.name}", pool.picker, pool.picker_port, pool.health_port, tls=pool.tls
            )
        )
        result.append(pool_cluster(pool))
    return result


def _policy(name: str, config: betterproto2.Message) -> cluster.LoadBalancingPolicy:
    return cluster.LoadBalancingPolicy(
        policies=[
            cluster.LoadBalancingPolicyPolicy(
                typed_extension_config=core.TypedExtensionConfig(
                    name=name, typed_config=AnyMessage.pack(config)
                )
            )
        ]
    )


def pool_cluster(pool: InferencePool) -> cluster.Cluster:
    """The pool's endpoints, the request sent to the one its picker named in ``envoy.lb``.

    Envoy's override-host policy (``envoy.load_balancing_policies.override_host``,
    written for GIE's protocol) reads ``x-gateway-destination-endpoint`` from
    the ``envoy.lb`` dynamic metadata the picker returned, as Istio's
    gateway configures it. The value may be a fallback list
    (``ip:port,ip:port``, protocol v0.4.0): the first address that is one of
    the pool's endpoints serves, and a retry takes the next. With no
    address at all (a FailOpen pool whose picker is down, so nothing ran),
    the fallback policy, round robin, picks: GIE's FailOpen, "the gateway
    picks an endpoint itself". The hosts are the pool's endpoints, as a
    Gateway controller computes them from the InferencePool.
    """
    result = demo.fallback_cluster(pool.demo_pool())  # the endpoints, round robin
    result.name = f"pool-{pool.name}"
    assert result.load_assignment is not None
    result.load_assignment.cluster_name = result.name
    metadata_key = metadata.MetadataKey(
        key=LB_NAMESPACE, path=[metadata.MetadataKeyPathSegment(key=demo.ENDPOINT_HEADER)]
    )
    result.load_balancing_policy = _policy(
        "envoy.load_balancing_policies.override_host",
        override_host.OverrideHost(
            override_host_sources=[
                override_host.OverrideHostOverrideHostSource(metadata=metadata_key)
            ],
            fallback_policy=_policy(
                "envoy.load_balancing_policies.round_robin", round_robin.RoundRobin()
            ),
        ),
    )
    if pool.h2c:
        result.typed_extension_protocol_options = demo.http2_upstream()
    return result


PROTOCOL_CHECK: Final = """
-- The endpoint-picker protocol names the endpoint twice: in a request header, which some
-- gateways route on (GIE's reference Envoy, Envoy Gateway), and in envoy.lb dynamic metadata,
-- which others route on (Istio, and this gateway). Both must say the same.
function envoy_on_request(request)
  local header = request:headers():get("x-gateway-destination-endpoint")
  local lb = request:streamInfo():dynamicMetadata():get("envoy.lb")
  local named = lb and lb["x-gateway-destination-endpoint"]
  if header ~= named then
    request:respond(
      {[":status"] = "500", ["content-type"] = "text/plain"},
      "endpoint picker protocol: header x-gateway-destination-endpoint " .. tostring(header) ..
      ", envoy.lb metadata " .. tostring(named) .. ": they must be the same")
  end
end
"""
"""The check, in Lua (Envoy's ``envoy.filters.http.lua``): the one thing here no route or
cluster setting can do is compare two values."""


def protocol_check_filter() -> hcm.HttpFilter:
    """After the pickers: the endpoint named in the header and in ``envoy.lb`` agree.

    A request no picker named an endpoint for (a route with none, a FailOpen
    pool whose picker is down) has neither, and passes. One that has both, the
    same, passes. Otherwise the gateway answers 500, saying what it found, so
    the Gateway profile fails a picker that sets only the header (which a
    gateway routing on the metadata would not follow) or only the metadata
    (which a gateway routing on the header would not), not only the EPP one.
    """
    config = lua.Lua(default_source_code=core.DataSource(inline_string=PROTOCOL_CHECK))
    return hcm.HttpFilter(name="picker-protocol-check", typed_config=AnyMessage.pack(config))


# --- routes ---------------------------------------------------------------------------


def _path_match(prefix: str) -> route.RouteMatch:
    """Gateway API ``PathPrefix``: ``/primary`` matches ``/primary`` and ``/primary/x`` but
    not ``/primary-gateway-test``, which is Envoy's ``path_separated_prefix``."""
    if prefix.rstrip("/") == "":
        return route.RouteMatch(prefix="/")
    return route.RouteMatch(path_separated_prefix=prefix.rstrip("/"))


def _to_pools(name: str, rule: Rule, pools: Mapping[str, InferencePool]) -> route.Route:
    """A route that sends to the rule's pool, or splits across its pools by weight."""
    match = _path_match(rule.path_prefix)
    if len(rule.backends) == 1:
        (ref,) = rule.backends
        return route.Route(
            name=name,
            match=match,
            route=route.RouteAction(cluster=f"pool-{ref.pool}", timeout=demo.ROUTE_TIMEOUT),
            typed_per_filter_config=demo.picker_on(pools[ref.pool].demo_pool()),
        )
    # Envoy picks the weighted cluster from the stream's id, so the choice made
    # before the picker ran stands when the picker's clear_route_cache makes
    # Envoy match again: the pool whose picker chose is the pool that is used.
    # The cluster weight, not the route, switches that pool's picker on.
    weights = [
        route.WeightedClusterClusterWeight(
            name=f"pool-{ref.pool}",
            weight=ref.weight,
            typed_per_filter_config=demo.picker_on(pools[ref.pool].demo_pool()),
        )
        for ref in rule.backends
    ]
    return route.Route(
        name=name,
        match=match,
        route=route.RouteAction(
            weighted_clusters=route.WeightedCluster(clusters=weights), timeout=demo.ROUTE_TIMEOUT
        ),
    )


def envoy_routes(http_route: HTTPRoute, pools: Mapping[str, InferencePool]) -> list[route.Route]:
    """The Envoy routes of one HTTPRoute, one per rule.

    A FailOpen pool needs no route of its own for its picker's absence: the
    pool's cluster balances a request no picker named an endpoint for
    (``pool_cluster``).
    """
    return [
        _to_pools(f"{http_route.name}/rule-{i}", rule, pools)
        for i, rule in enumerate(http_route.rules)
    ]


def _precedence(envoy_route: route.Route) -> int:
    """Gateway API: longer path prefixes first."""
    match = envoy_route.match
    assert match is not None
    return -len(match.path_separated_prefix or match.prefix or "")


def _not_found() -> route.Route:
    """The last route of every virtual host: the gateway's own 404.

    Not only for the message: a request that matches no route gets no
    per-route filter config at all, not even the virtual host's, so every
    pool's picker filter would run on it (and a FailClose one that is down
    would turn the 404 into a 503). A matched route keeps them all off.
    """
    return route.Route(
        name="no-route",
        match=route.RouteMatch(prefix="/"),
        direct_response=route.DirectResponseAction(
            status=404, body=core.DataSource(inline_string="no route matches\n")
        ),
    )


def _attached(
    gateway: Gateway, http_routes: Iterable[HTTPRoute]
) -> Iterator[tuple[HTTPRoute, tuple[str, ...]]]:
    """Each HTTPRoute attached to ``gateway``, with the hostnames it serves there: its own, or
    the listener's when the listener has one (a route with no hostname in common with such a
    listener is not attached). One reading, for both Envoy's routes and ``resolve``."""
    for http_route in http_routes:
        if http_route.gateway != gateway.name:
            continue
        hostnames = http_route.hostnames
        if gateway.hostname is not None:
            if hostnames and gateway.hostname not in hostnames:
                continue  # not attached: no hostname in common with the listener
            hostnames = (gateway.hostname,)
        yield http_route, hostnames


def route_configuration(
    gateway: Gateway, http_routes: Iterable[HTTPRoute], pools: Mapping[str, InferencePool]
) -> route.RouteConfiguration:
    """The routes of the HTTPRoutes attached to ``gateway``, one virtual host per hostname.

    A route without hostnames matches every host the listener accepts, so
    its routes are also added, after the host's own, to each named virtual
    host. A listener with a hostname accepts only routes for that host.
    Anything else gets the gateway's 404.
    """
    by_host: dict[str, list[route.Route]] = {}
    anywhere: list[route.Route] = []
    for http_route, hostnames in _attached(gateway, http_routes):
        routes = envoy_routes(http_route, pools)
        if hostnames:
            for hostname in hostnames:
                by_host.setdefault(hostname, []).extend(routes)
        else:
            anywhere.extend(routes)
    hosts = {host: sorted(routes + anywhere, key=_precedence) for host, routes in by_host.items()}
    hosts["*"] = sorted(anywhere, key=_precedence) if gateway.hostname is None else []
    all_pools = [pool.demo_pool() for pool in pools.values()]
    virtual_hosts = [
        route.VirtualHost(
            name=host,
            domains=[host],
            routes=[*routes, _not_found()],
            response_headers_to_add=[demo.served_endpoint_header()],
            typed_per_filter_config=demo.pickers_off(all_pools),
        )
        for host, routes in hosts.items()
    ]
    return route.RouteConfiguration(name=gateway.name, virtual_hosts=virtual_hosts)


def write_routes(
    path: Path,
    gateway: Gateway,
    http_routes: Iterable[HTTPRoute],
    pools: Mapping[str, InferencePool],
    version: str,
) -> None:
    """Write a gateway's routes as the RDS file Envoy watches, replacing it in one step.

    Envoy reloads the file when a new one is moved into its directory, so the
    new routes are written next to it and renamed over it: Envoy never reads
    a half-written file.
    """
    response = discovery.DiscoveryResponse(
        version_info=version,
        type_url=ROUTE_TYPE,
        resources=[AnyMessage.pack(route_configuration(gateway, http_routes, pools))],
    )
    staging = path.with_name(f".{path.name}.new")
    staging.write_text(json.dumps(response.to_dict(casing=betterproto2.Casing.SNAKE)) + "\n")
    os.replace(staging, path)


def routes_file(work_dir: Path, gateway: Gateway) -> Path:
    return work_dir / "routes" / f"{gateway.name}.json"


# --- listeners and the bootstrap ------------------------------------------------------


def _listener(
    gateway: Gateway, pools: Sequence[InferencePool], work_dir: Path
) -> listener.Listener:
    path = routes_file(work_dir, gateway)
    rds = hcm.Rds(
        route_config_name=gateway.name,
        config_source=core.ConfigSource(
            path_config_source=core.PathConfigSource(
                path=str(path), watched_directory=core.WatchedDirectory(path=str(path.parent))
            ),
            resource_api_version=core.ApiVersion.V3,
        ),
    )
    filters = [
        demo.strip_client_routing_filter(),
        *(demo.picker_filter(pool.demo_pool()) for pool in pools),
        protocol_check_filter(),
        demo.served_endpoint_filter(),
        hcm.HttpFilter(
            name="envoy.filters.http.router", typed_config=AnyMessage.pack(router.Router())
        ),
    ]
    manager = hcm.HttpConnectionManager(
        stat_prefix=gateway.name,
        rds=rds,
        http_filters=filters,
        # Hosts are matched without a port, as Gateway API hostnames have none.
        strip_any_host_port=True,
        access_log=[demo.access_log(str(work_dir / f"access-{gateway.name}.log"))],
    )
    return listener.Listener(
        name=gateway.name,
        address=core.Address(socket_address=core.SocketAddress(address="127.0.0.1", port_value=0)),
        filter_chains=[
            listener.FilterChain(
                filters=[
                    listener.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=AnyMessage.pack(manager),
                    )
                ]
            )
        ],
    )


def bootstrap(
    gateways: Sequence[Gateway], pools: Sequence[InferencePool], work_dir: Path
) -> dict[str, Any]:
    """Envoy's bootstrap: a listener per gateway on a free 127.0.0.1 port, every pool's
    clusters; the routes are read from ``routes_file`` (write them first)."""
    config = bootstrap_.Bootstrap(
        # Dynamic (file-based) resources need a node identity, even with no control plane.
        node=core.Node(id="conformance-gateway", cluster="conformance"),
        admin=bootstrap_.Admin(
            address=core.Address(
                socket_address=core.SocketAddress(address="127.0.0.1", port_value=0)
            )
        ),
        static_resources=bootstrap_.BootstrapStaticResources(
            listeners=[_listener(gateway, pools, work_dir) for gateway in gateways],
            clusters=clusters(pools),
        ),
    )
    return config.to_dict(casing=betterproto2.Casing.SNAKE)


# --- the same routing, for requests that skip the gateway ---------------------------


def _prefix_matches(prefix: str, path: str) -> bool:
    prefix, path = prefix.rstrip("/"), path.split("?", 1)[0]
    return not prefix or path == prefix or path.startswith(prefix + "/")


def resolve(
    gateway: Gateway, http_routes: Iterable[HTTPRoute], host: str | None, path: str
) -> Rule | None:
    """The rule ``route_configuration`` makes Envoy apply to a request, or None (a 404).

    For the picker-alone runs, which must know which pool's picker a request
    would reach: the same attachment and precedence rules, read directly.
    """
    host = host.rsplit(":", 1)[0] if host else ""  # Envoy strips the port (strip_any_host_port)
    best: tuple[int, int, Rule] | None = None
    for http_route, hostnames in _attached(gateway, http_routes):
        if hostnames and host not in hostnames:
            continue
        for rule in http_route.rules:
            if _prefix_matches(rule.path_prefix, path):
                rank = (len(rule.path_prefix.rstrip("/")), 1 if hostnames else 0, rule)
                if best is None or rank[:2] > best[:2]:
                    best = rank
    return best[2] if best else None
