"""GIE's conformance tests, one function each, with the original's requests and pass criteria.

Each test is written once and run twice (``conformance.run``): through the
gateway (HTTP to Envoy, which calls the pool's LWEPP and forwards to the echo
pod) and against the picker alone (``conformance.picker``). A step whose
outcome is the gateway's alone (a failure mode, a weighted split, a deleted
route) runs only through the gateway; the test's note says so.

The names, hosts, paths, bodies, headers, request counts, concurrency and
tolerances are GIE's, from ``conformance/tests/*.go`` and their manifests at
GIE commit 84436a96; the comments say where Switchyard's run has to differ
from a cluster's, and why.

Every one of GIE's tests also checks status conditions that a Gateway
controller writes (a route Accepted and ResolvedRefs, a pool Accepted under
its Gateway, ...). There is no controller here, so only the traffic half of
a test runs; each ``Case`` lists its status half (``status``), which the
report names as not checked. ``NOT_APPLICABLE`` lists the tests that have
no traffic half at all, and ``SETUP_CHECKS`` what GIE's suite checks before
any test.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Final

from conformance.client import (
    SELECTION_HEADER,
    SERVED_HEADER,
    Expected,
    Failed,
    Observation,
    Request,
    Timing,
    Transport,
    eventually,
    send_many,
)
from conformance.envoy import BackendRef, HTTPRoute, Rule
from conformance.picker import PickerTransport
from conformance.topology import EchoPod, Topology
from conformance.upstream import RELEASED, Upstream

PRIMARY: Final = "primary-inference-model-server"
SECONDARY: Final = "secondary-inference-model-server"
APPPROTOCOL: Final = "appprotocol-inference-model-server"
DP: Final = "dp-inference-model-server"

BODY: Final = """{
            "model": "conformance-fake-model",
            "prompt": "Write as if you were a critic: San Francisco"
        }"""
"""The request body of GatewayDestinationEndpointServed and GatewayFollowingEPPRouting (and of
Switchyard's own tests): a Go raw string in the originals, so its indentation is part of it,
and each test's source indents it its own way (``FAIL_OPEN_BODY``, ``TABBED_BODY``)."""

FAIL_OPEN_BODY: Final = """{
                "model": "conformance-fake-model",
                "prompt": "Write as if you were a critic: San Francisco"
            }"""
"""EppUnAvailableFailOpen's body: the same JSON, indented four spaces more."""

TABBED_BODY: Final = (
    '{\n\t\t\t"model": "conformance-fake-model",\n'
    '\t\t\t"prompt": "Write as if you were a critic: San Francisco"\n\t\t}'
)
"""The body of the data-parallel and weighted tests, whose sources indent it with tabs."""

FIVE_XX: Final = (500, 501, 502, 503, 504)


class Skipped(Exception):
    """The test does not apply at this level (the message says why)."""


@dataclass(frozen=True, slots=True)
class Trial:
    """What a test runs with: a transport, the pods, the suite's timing, the topology, and
    which upstream behaviour to follow (``conformance.upstream``).

    ``topology`` is set only through the gateway: taking a picker down or
    deleting a route is something done to the gateway's world.
    """

    transport: Transport
    pods: Mapping[str, tuple[EchoPod, ...]]
    timing: Timing
    topology: Topology | None = None
    upstream: Upstream = RELEASED

    @property
    def through_gateway(self) -> bool:
        return self.topology is not None

    async def eventually(self, expected: Expected) -> None:
        await eventually(self.transport, expected, self.timing)

    async def apply(self, routes: Sequence[HTTPRoute]) -> None:
        """Replace the HTTPRoutes (gateway only), as deleting a route in the cluster does."""
        assert self.topology is not None
        await asyncio.to_thread(self.topology.apply, routes)

    @asynccontextmanager
    async def picker_down(self, pool: str) -> AsyncIterator[None]:
        """The pool's picker stopped for the block, restarted after (GIE's ``t.Cleanup``)."""
        assert self.topology is not None
        await asyncio.to_thread(self.topology.stop_picker, pool)
        try:
            yield
        finally:
            await asyncio.to_thread(self.topology.start_picker, pool)


class _FixedPool:
    """A picker transport that sends every request to one pool's picker."""

    checks_backend: Final = False

    def __init__(self, picker: PickerTransport, pool: str) -> None:
        self._picker, self._pool = picker, pool

    async def send(self, request: Request) -> Observation:
        return await self._picker.send(request, self._pool)


def _route(
    name: str,
    path: str,
    *backends: BackendRef,
    gateway: str = "conformance-primary",
    hostnames: tuple[str, ...] = ("primary.example.com",),
) -> HTTPRoute:
    """An HTTPRoute with one rule, as most of the tests' manifests have: unless told otherwise,
    on the primary gateway for ``primary.example.com``, to the primary pool."""
    rule = Rule(path, backends or (_pool("primary-inference-pool"),))
    return HTTPRoute(name, gateway, (rule,), hostnames)


def _pool(name: str, weight: int = 1, port: int | None = None) -> BackendRef:
    return BackendRef(name, weight, port)


def _post(
    path: str,
    host: str,
    selection: str,
    *,
    gateway: str = "conformance-primary",
    body: str = BODY,
) -> Request:
    return Request(path, host, "POST", {SELECTION_HEADER: selection}, body, gateway)


def _within(names: Sequence[str]) -> Callable[[Observation], str | None]:
    def accept(seen: Observation) -> str | None:
        return (
            None if seen.pod in names else f"request was handled by an unexpected pod {seen.pod!r}"
        )

    return accept


# --- EppUnAvailableFailOpen -----------------------------------------------------------

FAIL_OPEN_ROUTES: Final = (
    _route(
        "httproute-for-failopen-pool-gw",
        "/failopen-pool-test",
        _pool("secondary-inference-pool"),
        gateway="conformance-secondary",
        hostnames=("secondary.example.com",),
    ),
)


async def _fail_open(t: Trial, stopped: str) -> None:
    """EppUnAvailableFailOpen's two phases, with ``stopped``'s picker down in phase 2."""
    pods = t.pods[SECONDARY]
    request = _post(
        "/failopen-pool-test",
        "secondary.example.com",
        pods[0].ip,
        gateway="conformance-secondary",
        body=FAIL_OPEN_BODY,
    )
    await t.eventually(Expected(request, backend=pods[0].name))
    if not t.through_gateway:
        return
    async with t.picker_down(stopped):
        await t.eventually(Expected(request, backend=SECONDARY))


async def epp_unavailable_fail_open(t: Trial) -> str:
    """Pinned to pods[0] while the pickers run; served by a secondary pod with an EPP down.

    GIE's phase 2 makes the *primary* EPP's Service unavailable
    (``PrimaryEppServiceNN``) while the route goes to the secondary,
    FailOpen, pool, whose own picker stays up: the step checks that the
    secondary route keeps serving while another pool's picker is gone. That
    literal step runs here; ``epp_unavailable_fail_open_own_picker`` is the
    stricter variant the test's name describes.
    """
    await _fail_open(t, "primary-inference-pool")
    if not t.through_gateway:
        return "phase 1 only: with a picker down (phase 2) the outcome is the gateway's"
    return "phase 2 stops the primary pool's picker, as GIE's code does"


# --- GatewayDestinationEndpointServed -------------------------------------------------

SERVED_ROUTES: Final = (
    _route("httproute-for-destination-endpoint-served", "/destination-endpoint-served-test"),
)


async def gateway_destination_endpoint_served(t: Trial) -> str:
    """Each pinned pod serves, and the served-endpoint report names ``IP:3000``."""
    for pod in t.pods[PRIMARY]:
        request = _post("/destination-endpoint-served-test", "primary.example.com", pod.ip)
        served = {SERVED_HEADER: f"{pod.ip}:3000"}  # the echo server's port
        await t.eventually(Expected(request, headers=served, backend=pod.name))
    return ""


# --- GatewayFollowingEPPRouting -------------------------------------------------------

FOLLOWING_ROUTES: Final = (_route("httproute-for-primary-gw", "/primary-gateway-test"),)

TOTAL: Final = 100
CONCURRENCY: Final = 10


async def gateway_following_epp_routing(t: Trial) -> str:
    """With 1, 2 and 3 pods allowed, 100 requests (10 at a time) land only on those pods."""
    pods = t.pods[PRIMARY]
    path, host = "/primary-gateway-test", "primary.example.com"
    for pod in pods:  # warm-up: each pod pinned alone
        await t.eventually(Expected(_post(path, host, pod.ip), backend=pod.name))
    for allowed in ([pods[2]], [pods[0], pods[1]], [pods[0], pods[1], pods[2]]):
        request = _post(path, host, ",".join(pod.ip for pod in allowed))
        expected = Expected(request, backend=PRIMARY)
        await t.eventually(expected)
        names = [pod.name for pod in allowed]
        await send_many(
            t.transport,
            expected,
            t.timing,
            total=TOTAL,
            concurrency=CONCURRENCY,
            accept=_within(names),
        )
    return ""


# --- GatewayFollowingEPPRoutingWithDataParallelism ------------------------------------

DP_ROUTES: Final = (
    _route("httproute-for-primary-gw-dp", "/primary-gateway-dp-test", _pool("dp-inference-pool")),
)

DP_PORTS: Final = frozenset({"3000", "3002", "3004"})


def dp_header(allowed: Mapping[str, frozenset[str]]) -> str:
    """GIE's ``buildEPPHeader``: IPs sorted; a bare IP, or ``IP:port`` for each allowed port."""
    tokens: list[str] = []
    for ip in sorted(allowed):
        ports = allowed[ip]
        tokens += [f"{ip}:{port}" for port in sorted(ports)] if ports else [ip]
    return ",".join(tokens)


async def gateway_following_epp_routing_dp(t: Trial) -> str:
    """As above on the pool of three-port pods: the pod and its ``httpPort`` must be allowed."""
    pods = t.pods[DP]
    path, host = "/primary-gateway-dp-test", "primary.example.com"
    for pod in pods:
        await t.eventually(Expected(_post(path, host, pod.ip, body=TABBED_BODY), backend=pod.name))
    cases: list[dict[EchoPod, frozenset[str]]] = [
        {pods[1]: frozenset()},  # any rank of one pod
        {pods[0]: frozenset(), pods[2]: frozenset({"3002"})},  # one pod pinned to a rank
        {pods[0]: frozenset(), pods[1]: frozenset({"3000", "3004"}), pods[2]: frozenset()},
    ]
    for allowed in cases:
        by_ip = {pod.ip: ports for pod, ports in allowed.items()}
        by_name = {pod.name: ports or DP_PORTS for pod, ports in allowed.items()}
        expected = Expected(_post(path, host, dp_header(by_ip), body=TABBED_BODY), backend=DP)

        def accept(
            seen: Observation, by_name: Mapping[str, frozenset[str]] = by_name
        ) -> str | None:
            if seen.pod not in by_name:
                return f"unexpected pod {seen.pod!r} (expected one of {sorted(by_name)})"
            if not seen.http_port:
                return "missing httpPort in the echo's JSON"
            if seen.http_port not in by_name[seen.pod]:
                return f"unexpected httpPort {seen.http_port} for {seen.pod}"
            return None

        await t.eventually(expected)
        await send_many(
            t.transport, expected, t.timing, total=TOTAL, concurrency=CONCURRENCY, accept=accept
        )
    return ""


# --- GatewayWeightedAcrossTwoInferencePools -------------------------------------------

WEIGHTED_ROUTES: Final = (
    _route(
        "httproute-weighted-two-pools",
        "/weighted-two-pools-test",
        _pool("primary-inference-pool", 70),
        _pool("secondary-inference-pool", 30),
    ),
)

WEIGHTED_TOTAL: Final = 200
WEIGHTED_CONCURRENCY: Final = 5


def weighted_tolerance(expected_share: float, total: int) -> float:
    """GIE's bound on |observed − expected| primary share: max(0.10, 4.5 σ) of a binomial."""
    return max(0.10, 4.5 * math.sqrt(expected_share * (1 - expected_share) / total))


def _weighted_warmup(pod: EchoPod) -> Expected:
    """The warm-up request pinned to one pod (``IP:3000``), which must serve it."""
    selection = {SELECTION_HEADER: f"{pod.ip}:3000"}
    body = '{"model":"conformance-fake-model","prompt":"Warmup"}'
    request = Request("/weighted-two-pools-test", "primary.example.com", "POST", selection, body)
    return Expected(request, backend=pod.name)


async def gateway_weighted_across_two_pools(t: Trial) -> str:
    """200 requests (5 at a time) allowed on all six pods split 70/30 across the two pools,
    within GIE's tolerance, each served by a pod of the pool chosen."""
    path, host = "/weighted-two-pools-test", "primary.example.com"
    primary, secondary = t.pods[PRIMARY], t.pods[SECONDARY]
    everyone = ",".join(pod.ip for pod in (*primary, *secondary))
    expected = Expected(_post(path, host, everyone, body=TABBED_BODY))
    if not t.through_gateway:
        return await _weighted_at_the_pickers(t, expected)
    for pod in (*primary, *secondary) if t.upstream.weighted_warmup else ():
        # Pinned to one pod: the attempt fails whenever the split sends it to the
        # other pool, whose picker has no candidate (Switchyard's LWEPP answers 503,
        # the protocol's rule; GIE's lwepp ends the stream with an error, which the
        # gateway turns into a 5xx, or, the secondary pool being FailOpen, into a
        # request served by any of its pods), and the check tries again.
        await t.eventually(_weighted_warmup(pod))
    await t.eventually(expected)
    names = {pod.name for pod in (*primary, *secondary)}
    seen = await send_many(
        t.transport,
        expected,
        t.timing,
        total=WEIGHTED_TOTAL,
        concurrency=WEIGHTED_CONCURRENCY,
        accept=lambda o: None if o.pod in names else f"unexpected pod {o.pod!r}",
    )
    hits = sum(1 for o in seen if o.pod.startswith(PRIMARY))
    share, tolerance = hits / len(seen), weighted_tolerance(0.7, len(seen))
    if abs(share - 0.7) > tolerance:
        raise Failed(f"primary share {share:.3f} is not within 0.7 ± {tolerance:.3f}")
    return f"primary share {share:.3f} ({hits}/{len(seen)}), 0.7 ± {tolerance:.3f}"


async def _weighted_at_the_pickers(t: Trial, expected: Expected) -> str:
    """The split is the gateway's; each picker must honour the warm-up's pins to its own pods,
    and keep its share of the requests inside its own pool."""
    assert isinstance(t.transport, PickerTransport)
    for pool, app, count in (
        ("primary-inference-pool", PRIMARY, 140),
        ("secondary-inference-pool", SECONDARY, 60),
    ):
        picker = _FixedPool(t.transport, pool)
        for pod in t.pods[app] if t.upstream.weighted_warmup else ():
            await eventually(picker, _weighted_warmup(pod), t.timing)
        names = [pod.name for pod in t.pods[app]]
        await send_many(
            picker,
            replace(expected, backend=app),
            t.timing,
            total=count,
            concurrency=WEIGHTED_CONCURRENCY,
            accept=_within(names),
        )
    pins = "honours the warm-up's pins to its pods and, " if t.upstream.weighted_warmup else ""
    return (
        f"each picker {pins}given all six pods, stays in its pool (140 + 60 picks); the split "
        "is the gateway's"
    )


# --- HTTPRouteMultipleGatewaysDifferentPools ------------------------------------------

MULTIPLE_GATEWAYS_ROUTES: Final = (
    _route("route-for-primary-gateway", "/test-primary-gateway"),
    _route(
        "route-for-secondary-gateway",
        "/test-secondary-gateway",
        _pool("secondary-inference-pool"),
        gateway="conformance-secondary",
        hostnames=("secondary.example.com",),
    ),
)


async def httproute_multiple_gateways_different_pools(t: Trial) -> str:
    """A GET on each gateway reaches its own pool (the status checks need a controller)."""
    primary = Request("/test-primary-gateway", "primary.example.com")
    await t.eventually(Expected(primary, backend=PRIMARY))
    secondary = Request(
        "/test-secondary-gateway", "secondary.example.com", gateway="conformance-secondary"
    )
    await t.eventually(Expected(secondary, backend=SECONDARY))
    return ""


# --- InferencePoolAppProtocol ---------------------------------------------------------

APP_PROTOCOL_ROUTES: Final = (
    _route(
        "httproute-for-inferencepool-appprotocol-h2c",
        "/inferencepool-app-protocol-h2c",
        _pool("appprotocol-h2c-inference-pool"),
        hostnames=("appprotocol-h2c.example.com",),
    ),
    _route(
        "httproute-for-inferencepool-appprotocol-http",
        "/inferencepool-app-protocol-http",
        _pool("appprotocol-http-inference-pool"),
        hostnames=("appprotocol-http.example.com",),
    ),
    _route(
        "httproute-for-inferencepool-appprotocol-default",
        "/inferencepool-app-protocol-default",
        hostnames=("appprotocol-default.example.com",),
    ),
)

APP_PROTOCOL_BODY: Final = """{
            "model": "conformance-fake-model",
            "prompt": "Describe San Francisco in one sentence."
        }"""


async def inference_pool_app_protocol(t: Trial) -> str:
    """h2c to port 3001, HTTP/1.1 to 3000, and HTTP/1.1 when appProtocol is omitted.

    Port 3001 speaks only h2c (anything else gets 400), so a 200 from it
    with the served report ``IP:3001`` proves the gateway used HTTP/2.
    """
    pools = (("h2c", 3001, APPPROTOCOL), ("http", 3000, APPPROTOCOL), ("default", 3000, PRIMARY))
    for name, port, app in pools:
        for pod in t.pods[app]:
            endpoint = f"{pod.ip}:{port}"
            request = Request(
                f"/inferencepool-app-protocol-{name}",
                f"appprotocol-{name}.example.com",
                "POST",
                {SELECTION_HEADER: endpoint},
                APP_PROTOCOL_BODY,
            )
            await t.eventually(
                Expected(request, headers={SERVED_HEADER: endpoint}, backend=pod.name)
            )
    return "" if t.through_gateway else "the app protocol itself is the gateway's"


# --- InferencePoolHTTPRoutePortValidation ---------------------------------------------

PORT_ROUTES: Final = tuple(
    _route(
        f"httproute-pool-port-{name}",
        f"/test-port-{name}",
        _pool("primary-inference-pool", port=port),
        hostnames=(f"port-{name}.example.com",),
    )
    for name, port in (("unspecified", None), ("matching", 3000), ("non-matching", 8888))
)


async def inference_pool_httproute_port_validation(t: Trial) -> str:
    """A backendRef port unset, equal to the target port, or wrong (8888): all reach the pool.

    GETs without a body: the headers end the request, so the picker must
    pick at the headers.
    """
    for name in ("unspecified", "matching", "non-matching"):
        request = Request(f"/test-port-{name}", f"port-{name}.example.com")
        await t.eventually(Expected(request, backend=f"{PRIMARY}-deployment"))
    return ""


# --- InferencePoolInvalidEPPService ---------------------------------------------------

INVALID_EPP_ROUTES: Final = (
    _route(
        "httproute-for-invalid-epp-pool",
        "/invalid-epp-test",
        _pool("pool-with-invalid-epp"),
        hostnames=(),
    ),
)


async def inference_pool_invalid_epp_service(t: Trial) -> str:
    """A pool whose EPP Service does not exist: requests get a 5xx."""
    if not t.through_gateway:
        raise Skipped("the pool has no endpoint picker: that is what the test is about")
    await t.eventually(Expected(Request("/invalid-epp-test"), statuses=FIVE_XX))
    return ""


# --- HTTPRouteMultipleRulesDifferentPools ---------------------------------------------

MULTIPLE_RULES_ROUTES: Final = (
    HTTPRoute(
        "httproute-multiple-rules-different-pools",
        "conformance-primary",
        (
            Rule("/primary", (_pool("primary-inference-pool"),)),
            Rule("/secondary", (_pool("secondary-inference-pool"),)),
        ),
    ),
)


async def httproute_multiple_rules_different_pools(t: Trial) -> str:
    """GET ``/primary`` and ``/secondary`` (no host) reach their own pools."""
    await t.eventually(Expected(Request("/primary"), backend=PRIMARY))
    await t.eventually(Expected(Request("/secondary"), backend=SECONDARY))
    return ""


# --- InferencePoolResolvedRefsCondition -----------------------------------------------

RESOLVED_REFS_ROUTES: Final = (
    _route("httproute-for-primary-gw", "/primary-gateway-test"),
    _route(
        "httproute-for-secondary-gw",
        "/secondary-gateway-test",
        _pool("primary-inference-pool"),  # the same pool as the primary gateway's route
        gateway="conformance-secondary",
        hostnames=("secondary.example.com",),
    ),
)


async def inference_pool_resolved_refs_condition(t: Trial) -> str:
    """One pool behind two gateways serves through both; each route deleted leaves a 404.

    GIE waits a fixed 5 s after each deletion; here the wait ends when Envoy
    reports the new routes, after which the checks are eventually-consistent
    as in the original.
    """
    backend = f"{PRIMARY}-deployment"
    on_primary = Request("/primary-gateway-test", "primary.example.com")
    on_secondary = Request(
        "/secondary-gateway-test", "secondary.example.com", gateway="conformance-secondary"
    )
    await t.eventually(Expected(on_primary, backend=backend))
    await t.eventually(Expected(on_secondary, backend=backend))
    if not t.through_gateway:
        return "routable through both gateways; deleting routes is the gateway's"
    await t.apply(RESOLVED_REFS_ROUTES[1:])
    await t.eventually(Expected(on_secondary, backend=backend))
    await t.eventually(Expected(on_primary, statuses=(404,)))
    await t.apply(())
    await t.eventually(Expected(on_secondary, statuses=(404,)))
    return ""


# --- Switchyard's own: EppUnAvailableFailOpen with the FailOpen pool's own picker down --


async def epp_unavailable_fail_open_own_picker(t: Trial) -> str:
    """EppUnAvailableFailOpen with phase 2 stopping the secondary (FailOpen) pool's own picker:
    the pool's replicas must still serve, picked by the gateway itself."""
    await _fail_open(t, "secondary-inference-pool")
    if not t.through_gateway:
        return "phase 1 only: with the picker down the outcome is the gateway's"
    return ""


# --- Switchyard's own: the FailClose counterpart of EppUnAvailableFailOpen ------------

FAIL_CLOSE_ROUTES: Final = (_route("httproute-for-failclose-pool-gw", "/failclose-pool-test"),)


async def epp_unavailable_fail_close(t: Trial) -> str:
    """EppUnAvailableFailOpen's steps on the primary pool (FailClose, the API's default):
    with its picker down, requests get a 5xx instead of reaching a pod."""
    pods = t.pods[PRIMARY]
    request = _post("/failclose-pool-test", "primary.example.com", pods[0].ip)
    await t.eventually(Expected(request, backend=pods[0].name))
    if not t.through_gateway:
        return "phase 1 only: with the picker down the outcome is the gateway's"
    async with t.picker_down("primary-inference-pool"):
        await t.eventually(Expected(request, statuses=FIVE_XX))
    return ""


# --- the list -------------------------------------------------------------------------


def routes_accepted(routes: Sequence[HTTPRoute]) -> tuple[str, ...]:
    """The status half most of GIE's tests share: each HTTPRoute Accepted and ResolvedRefs by
    its Gateway (``HTTPRouteMustBeAcceptedAndResolved``), and each pool it sends to Accepted
    under that Gateway (``InferencePoolMustBeAcceptedByParent``)."""
    checks: dict[str, None] = {}
    for http_route in routes:
        gateway = http_route.gateway
        checks[f"HTTPRoute {http_route.name}: Accepted, ResolvedRefs (Gateway {gateway})"] = None
        for rule in http_route.rules:
            for ref in rule.backends:
                checks[f"InferencePool {ref.pool}: Accepted (Gateway {gateway})"] = None
    return tuple(checks)


@dataclass(frozen=True, slots=True)
class Case:
    """A conformance test: its name, its manifest's routes, what it runs, and where it is from.

    ``status`` is the test's status half in GIE's suite: the conditions a
    Gateway controller must have written before (or between) its requests,
    each ``True`` with the reason of the same name unless it says otherwise.
    Without a controller they are not checked here.
    """

    name: str
    routes: tuple[HTTPRoute, ...]
    run: Callable[[Trial], Awaitable[str]]
    origin: str = "GIE"
    status: tuple[str, ...] = ()


CASES: Final = (
    Case(
        "EppUnAvailableFailOpen",
        FAIL_OPEN_ROUTES,
        epp_unavailable_fail_open,
        status=routes_accepted(FAIL_OPEN_ROUTES),
    ),
    Case(
        "GatewayDestinationEndpointServed",
        SERVED_ROUTES,
        gateway_destination_endpoint_served,
        status=routes_accepted(SERVED_ROUTES),
    ),
    Case(
        "GatewayFollowingEPPRouting",
        FOLLOWING_ROUTES,
        gateway_following_epp_routing,
        status=routes_accepted(FOLLOWING_ROUTES),
    ),
    Case(
        "GatewayFollowingEPPRoutingWithDataParallelism",
        DP_ROUTES,
        gateway_following_epp_routing_dp,
        status=routes_accepted(DP_ROUTES),
    ),
    Case(
        "GatewayWeightedAcrossTwoInferencePools",
        WEIGHTED_ROUTES,
        gateway_weighted_across_two_pools,
        status=routes_accepted(WEIGHTED_ROUTES),
    ),
    Case(
        "HTTPRouteMultipleGatewaysDifferentPools",
        MULTIPLE_GATEWAYS_ROUTES,
        httproute_multiple_gateways_different_pools,
        status=routes_accepted(MULTIPLE_GATEWAYS_ROUTES),
    ),
    Case(
        "InferencePoolAppProtocol",
        APP_PROTOCOL_ROUTES,
        inference_pool_app_protocol,
        status=routes_accepted(APP_PROTOCOL_ROUTES),
    ),
    Case(
        "InferencePoolHTTPRoutePortValidation",
        PORT_ROUTES,
        inference_pool_httproute_port_validation,
        status=routes_accepted(PORT_ROUTES),
    ),
    Case(
        "InferencePoolInvalidEPPService",
        INVALID_EPP_ROUTES,
        inference_pool_invalid_epp_service,
        status=(
            "HTTPRoute httproute-for-invalid-epp-pool: Accepted (Gateway conformance-primary)",
            "InferencePool pool-with-invalid-epp: ResolvedRefs=False, any reason "
            "(Gateway conformance-primary)",
        ),
    ),
    Case(
        "HTTPRouteMultipleRulesDifferentPools",
        MULTIPLE_RULES_ROUTES,
        httproute_multiple_rules_different_pools,
        status=routes_accepted(MULTIPLE_RULES_ROUTES),
    ),
    Case(
        "InferencePoolResolvedRefsCondition",
        RESOLVED_REFS_ROUTES,
        inference_pool_resolved_refs_condition,
        status=(
            *routes_accepted(RESOLVED_REFS_ROUTES),
            "InferencePool primary-inference-pool: still Accepted (Gateway "
            "conformance-secondary) once the primary route is deleted",
            "InferencePool primary-inference-pool: no parents once both routes are deleted",
        ),
    ),
    Case(
        "EppUnAvailableFailOpenOwnPicker",
        FAIL_OPEN_ROUTES,
        epp_unavailable_fail_open_own_picker,
        "Switchyard",
    ),
    Case("EppUnAvailableFailClose", FAIL_CLOSE_ROUTES, epp_unavailable_fail_close, "Switchyard"),
)

SETUP_CHECKS: Final = (
    "GatewayClass: Accepted (GWCMustHaveAcceptedConditionTrue)",
    "Gateway conformance-primary: Accepted, Programmed, an address",
    "Gateway conformance-secondary: Accepted, Programmed, an address",
)
"""What GIE's suite checks before any test (``SetupConformanceTestSuite``) and that needs a
controller. Here the Gateways' addresses are their Envoy listeners', read from Envoy's admin,
and the namespaces' pods are ready when every echo pod listens and every picker is SERVING."""

NOT_APPLICABLE: Final = {
    "HTTPRouteInvalidInferencePoolRef": (
        "judged only by the HTTPRoute's status conditions (Accepted=True; ResolvedRefs=False, "
        "reason BackendNotFound), which a Gateway controller writes; the test sends no request"
    ),
    "InferencePoolAccepted": (
        "judged only by the InferencePool's status condition Accepted=True under its parent "
        "Gateway, which a Gateway controller writes; the test sends no request"
    ),
    "InferencePoolMissingEPPRef": (
        "judged only by status conditions (route Accepted=True; pool Accepted=True, or "
        "Accepted=False with reason EndpointPickerRefMissing), which a Gateway controller "
        "writes; the test sends no request"
    ),
}
"""GIE tests with no request path to reproduce, and why."""

GIE_ORDER: Final = (
    "EppUnAvailableFailOpen",
    "GatewayDestinationEndpointServed",
    "GatewayFollowingEPPRouting",
    "GatewayFollowingEPPRoutingWithDataParallelism",
    "GatewayWeightedAcrossTwoInferencePools",
    "HTTPRouteInvalidInferencePoolRef",
    "HTTPRouteMultipleGatewaysDifferentPools",
    "InferencePoolAccepted",
    "InferencePoolAppProtocol",
    "InferencePoolHTTPRoutePortValidation",
    "InferencePoolInvalidEPPService",
    "InferencePoolMissingEPPRef",
    "HTTPRouteMultipleRulesDifferentPools",
    "InferencePoolResolvedRefsCondition",
)
"""Every test of GIE's suite, in the order of its source files (the order it runs them)."""
