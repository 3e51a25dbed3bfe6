"""The conformance harness's parts, without the topology: routes, judging, and catching a bad picker.

The harness is only worth something if it fails a non-conformant picker or
gateway; the last tests here give it one and check it does.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
from envoy_data_plane.envoy.config.core import v3 as core

from conformance import cases
from conformance.cases import Trial, dp_header, weighted_tolerance
from conformance.client import Echo, Expected, Failed, Observation, Request, Timing, compare
from conformance.envoy import (
    LB_NAMESPACE,
    PROTOCOL_CHECK,
    BackendRef,
    Gateway,
    HTTPRoute,
    InferencePool,
    Rule,
    bootstrap,
    resolve,
    route_configuration,
    routes_file,
    write_routes,
)
from conformance.picker import PickerTransport, named_endpoints
from conformance.run import run_suite
from conformance.topology import EchoPod, Topology, cluster_objects
from demo import envoy as demo
from pods.kubernetes import pool_spec, to_pod
from serving.testing import running
from tests.broken_picker import Picker
from wire import extproc
from wire.stream import Stream

PRIMARY, SECONDARY = Gateway("conformance-primary"), Gateway("conformance-secondary", "sec.example")
POOLS = {
    "a": InferencePool("a", "127.0.0.1", ("127.0.0.1:3000",)),
    "b": InferencePool("b", "127.0.0.1", ("127.0.0.1:3001",), fail_open=True),
    "h": InferencePool("h", "127.0.0.1", ("127.0.0.1:3002",), h2c=True),
}


def route(
    name: str, gateway: Gateway, path: str, *pools: str, hosts: tuple[str, ...] = ()
) -> HTTPRoute:
    return HTTPRoute(name, gateway.name, (Rule(path, tuple(BackendRef(p) for p in pools)),), hosts)


def test_real_envoy_accepts_the_bootstrap_and_the_routes(tmp_path: Path) -> None:
    """``envoy --mode validate`` on the bootstrap, with a routes file of every kind of rule."""
    (tmp_path / "routes").mkdir()
    routes = [
        route("one", PRIMARY, "/a", "a", hosts=("a.example",)),
        route("fail-open", SECONDARY, "/b", "b"),
        HTTPRoute("split", PRIMARY.name, (Rule("/w", (BackendRef("a", 70), BackendRef("b", 30))),)),
    ]
    for gateway in (PRIMARY, SECONDARY):
        write_routes(routes_file(tmp_path, gateway), gateway, routes, POOLS, "1")
    config = tmp_path / "bootstrap.json"
    config.write_text(json.dumps(bootstrap([PRIMARY, SECONDARY], list(POOLS.values()), tmp_path)))
    envoy = Path(sys.executable).parent / "envoy"
    result = subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout


def vhosts(gateway: Gateway, routes: list[HTTPRoute]) -> dict[str, list[Any]]:
    config = route_configuration(gateway, routes, POOLS)
    return {vh.name: vh.routes for vh in config.virtual_hosts}


def test_routes_follow_gateway_api_precedence_and_end_in_the_gateways_404() -> None:
    """Longer prefixes first; hostname-less routes also under each named host; a 404 last."""
    hosts = vhosts(
        PRIMARY,
        [
            route("short", PRIMARY, "/x", "a"),
            route("long", PRIMARY, "/x/y", "a", hosts=("h.example",)),
        ],
    )
    assert [r.name for r in hosts["h.example"]] == ["long/rule-0", "short/rule-0", "no-route"]
    assert [r.name for r in hosts["*"]] == ["short/rule-0", "no-route"]


def test_a_listener_with_a_hostname_takes_only_its_hosts_routes() -> None:
    """A listener's hostname keeps only the routes for that host; other hosts get the no-route rule."""
    hosts = vhosts(
        SECONDARY,
        [
            route("mine", SECONDARY, "/m", "a", hosts=("sec.example",)),
            route("other", SECONDARY, "/o", "a", hosts=("x.example",)),
        ],
    )
    assert [r.name for r in hosts["sec.example"]] == ["mine/rule-0", "no-route"]
    assert [r.name for r in hosts["*"]] == ["no-route"]


def bootstrap_clusters(pools: list[InferencePool]) -> dict[str, Any]:
    """The clusters of a bootstrap, by name, as Envoy reads them."""
    found = bootstrap([PRIMARY], pools, Path("/unused"))["static_resources"]["clusters"]
    return {c["name"]: c for c in found}


def test_each_pool_routes_on_its_pickers_envoy_lb_metadata_over_its_endpoints() -> None:
    """The pool's cluster holds its endpoints and routes on envoy.lb's
    x-gateway-destination-endpoint (override host, as Istio), round robin when no picker named
    one: a FailOpen rule needs no route of its own for its picker's absence."""
    (rule, _) = vhosts(PRIMARY, [route("r", PRIMARY, "/f", "b")])["*"]
    assert rule.route.cluster == "pool-b"
    by_name = bootstrap_clusters(list(POOLS.values()))
    pool = by_name["pool-b"]
    (hosts,) = pool["load_assignment"]["endpoints"]
    assert [h["endpoint"]["address"]["socket_address"] for h in hosts["lb_endpoints"]] == [
        {"address": "127.0.0.1", "port_value": 3001}
    ]
    (policy,) = pool["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"
    assert "typed_extension_protocol_options" in by_name["pool-h"]  # h2c
    assert "typed_extension_protocol_options" not in by_name["pool-a"]


def test_the_pickers_are_dialled_over_tls_and_checked_on_gies_health_service() -> None:
    """TLS to each picker's ext_proc port (health checks on its plaintext port), asking about
    inference-extension; a plaintext pool is dialled without."""
    plain = InferencePool("p", "127.0.0.1", tls=False)
    by_name = bootstrap_clusters([POOLS["a"], plain])
    secure, insecure = by_name["lwepp-a"], by_name["lwepp-p"]
    assert secure["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    assert "transport_socket" not in insecure
    for picker in (secure, insecure):
        (check,) = picker["health_checks"]
        assert check["grpc_health_check"]["service_name"] == "inference-extension"


def test_the_protocol_check_compares_the_names_the_protocol_uses() -> None:
    """The Lua check reads the header and the metadata key the pickers set, and sits after the
    pickers, before the router."""
    assert PROTOCOL_CHECK.count(f'"{demo.ENDPOINT_HEADER}"') == 2
    assert f'get("{LB_NAMESPACE}")' in PROTOCOL_CHECK
    config = bootstrap([PRIMARY], [POOLS["a"]], Path("/tmp"))
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert names.index("lwepp-a") < names.index("picker-protocol-check") < len(names) - 1


def test_weighted_rules_switch_each_pools_picker_on_by_cluster_weight() -> None:
    """A rule split over two pools becomes weighted clusters, each enabling only its own pool's picker."""
    split = HTTPRoute("w", PRIMARY.name, (Rule("/w", (BackendRef("a", 70), BackendRef("h", 30))),))
    (rule, _) = vhosts(PRIMARY, [split])["*"]
    weights = rule.route.weighted_clusters.clusters
    assert [(w.name, w.weight) for w in weights] == [("pool-a", 70), ("pool-h", 30)]
    assert [list(w.typed_per_filter_config) for w in weights] == [["lwepp-a"], ["lwepp-h"]]


@pytest.mark.parametrize(
    ("host", "path", "expected"),
    [
        ("h.example", "/primary", "a"),
        ("h.example", "/primary/x?q=1", "a"),
        ("h.example", "/primary-gateway-test", None),  # PathPrefix matches whole segments
        ("h.example:8080", "/primary", "a"),  # the port is stripped
        (None, "/secondary", "b"),
        ("other.example", "/primary", None),
    ],
)
def test_resolve_reads_the_routes_as_envoy_does(
    host: str | None, path: str, expected: str | None
) -> None:
    """Route resolution matches host (port stripped) and whole-segment path prefixes as Envoy does."""
    routes = [
        route("p", PRIMARY, "/primary", "a", hosts=("h.example",)),
        route("s", PRIMARY, "/secondary", "b"),
    ]
    rule = resolve(PRIMARY, routes, host, path)
    assert (rule.backends[0].pool if rule else None) == expected


def test_dp_header_and_weighted_tolerance_are_gies() -> None:
    """buildEPPHeader sorts IPs and expands ports; the weighted bound is max(0.10, 4.5σ)."""
    allowed = {"10.0.0.3": frozenset({"3004", "3000"}), "10.0.0.1": frozenset()}
    assert dp_header(allowed) == "10.0.0.1,10.0.0.3:3000,10.0.0.3:3004"
    assert weighted_tolerance(0.7, 200) == pytest.approx(0.1458, abs=1e-4)
    assert weighted_tolerance(0.7, 100_000) == 0.10


ECHO = Echo("/p", "h.example", "POST", {"test-epp-endpoint-selection": ["10.0.0.1"]}, "ns")
REQUEST = Request("/p", "h.example", "POST", {"test-epp-endpoint-selection": "10.0.0.1"})


@pytest.mark.parametrize(
    ("seen", "problem"),
    [
        (Observation(200, {}, "pod-a-1", "3000", ECHO), None),
        (Observation(503), "expected status [200], got 503"),
        (Observation(200, {}, "pod-b-1", "3000", ECHO), "expected a pod named pod-a..."),
        (Observation(200, {}, "pod-a-1", "3000", None), "not the echo server's JSON"),
        (
            Observation(200, {}, "pod-a-1", "3000", Echo("/p", "h.example", "POST", {}, "ns")),
            "expected request header test-epp-endpoint-selection at the backend",
        ),
        (
            Observation(200, {"x-served": ["a", "b"]}, "pod-a-1", "3000", ECHO),
            "expected response header x-served: a, got a,b",
        ),
    ],
    ids=["ok", "status", "pod", "not-echo", "header-lost", "joined-values"],
)
def test_compare_is_compare_round_trip(seen: Observation, problem: str | None) -> None:
    """An observation is compared with the expectation as GIE's CompareRoundTrip does, naming the first mismatch."""
    headers = {"x-served": "a"} if "x-served" in seen.headers else {}
    expected = Expected(REQUEST, headers=headers, backend="pod-a", namespace="ns")
    found = compare(expected, seen)
    assert found == problem if problem is None else problem in (found or "")


@pytest.mark.parametrize(
    ("statuses", "seen", "passes"),
    [
        ((500, 501, 502, 503, 504), 408, True),  # InvalidEPPService: a 408 is a timeout too
        ((408,), 504, True),
        ((500, 501, 502, 503), 408, False),  # no timeout expected
        ((200,), 408, False),
        ((204,), 204, True),  # a 204 is judged as a 200 is: the echo, the pod
    ],
    ids=["408-for-504", "504-for-408", "no-timeout-expected", "ok-expected", "204"],
)
def test_a_timeout_passes_where_any_timeout_is_expected(
    statuses: tuple[int, ...], seen: int, passes: bool
) -> None:
    """The helpers' IsTimeoutError: 408 and 504 stand for each other in the expected codes."""
    expected = Expected(REQUEST, statuses=statuses, backend="pod-a", namespace="ns")
    found = compare(expected, Observation(seen, {}, "pod-a-1", "3000", ECHO))
    assert (found is None) == passes, found


def test_a_204_is_judged_as_a_200_is() -> None:
    """On a 204, as on a 200, the helpers check the echo (the pod, the request it saw)."""
    expected = Expected(REQUEST, statuses=(204,), backend="pod-a", namespace="ns")
    assert compare(expected, Observation(204)) == "a 204 that is not the echo server's JSON"


def test_a_wrong_status_says_what_the_gateway_said() -> None:
    """A failure names the text of an answer that was not an echo (the gateway's own)."""
    seen = Observation(500, note="endpoint picker protocol: they must be the same")
    found = compare(Expected(REQUEST), seen)
    assert (
        found == "expected status [200], got 500 (endpoint picker protocol: they must be the same)"
    )


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ("10.0.0.1:3000", ["10.0.0.1:3000"]),
        ("10.0.0.1:3000,10.0.0.2:3002", ["10.0.0.1:3000", "10.0.0.2:3002"]),
        ("10.0.0.1:3000, [2001:db8::1]:80", ["10.0.0.1:3000", "[2001:db8::1]:80"]),
        ("10.0.0.1", None),
        ("10.0.0.1:3000,", None),
        ("10.0.0.1:99999", None),
        ("pod-a:3000", None),
        ("2001:db8::1:80", None),  # IPv6 without brackets
        ("[10.0.0.1]:80", None),
    ],
    ids=["one", "list", "spaces-and-ipv6", "no-port", "empty-entry", "big-port", "name",
         "bare-ipv6", "bracketed-ipv4"],
)  # fmt: skip
def test_a_destination_is_one_endpoint_or_a_fallback_list(
    value: str, found: list[str] | None
) -> None:
    """``ip:port`` or ``ip:port,ip:port`` (protocol v0.4.0), as Envoy's override host reads it;
    anything else is a protocol failure naming the entry."""
    if found is None:
        with pytest.raises(Failed, match="is not ip:port"):
            named_endpoints(value)
    else:
        assert named_endpoints(value) == found


# --- a non-conformant picker is caught ------------------------------------------------

PODS = tuple(
    EchoPod(f"primary-inference-model-server-deployment-{i}", f"10.9.0.{i + 1}", "primary", (3000,))
    for i in range(3)
)


@asynccontextmanager
async def bad_picker(choose: str, metadata: str | None = None) -> AsyncIterator[str]:
    """An ext_proc picker that always names ``choose`` (header) and ``metadata`` (envoy.lb)."""

    async def handle(stream: Stream) -> None:
        body = b""
        while (message := await stream.recv()) is not None:
            kind = extproc.kind(message)
            if kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    await stream.send(
                        extproc.headers_response(
                            "request",
                            [("x-gateway-destination-endpoint", choose)],
                            clear_route_cache=True,
                            dynamic_metadata={
                                "envoy.lb": {"x-gateway-destination-endpoint": metadata or choose}
                            },
                        )
                    )
                    for reply in extproc.streamed_body_responses("request", body):
                        await stream.send(reply)
            elif kind == "response_headers":
                served = [("x-conformance-test-served-endpoint", choose)]
                await stream.send(extproc.headers_response("response", served))

    async with running("bad-picker", handle) as ports:
        yield f"127.0.0.1:{ports.grpc}"


async def run_case(target: str, case: cases.Case) -> None:
    pods_by_ip = {pod.ip: pod.name for pod in PODS}
    picker = PickerTransport(
        {"conformance-primary": PRIMARY}, {"primary-inference-pool": target}, pods_by_ip
    )
    picker.routes = case.routes
    pods: Mapping[str, tuple[EchoPod, ...]] = {cases.PRIMARY: PODS}
    timing = Timing(max_time_to_consistency=0.5, retry_for=0.5)
    try:
        await case.run(Trial(picker, pods, timing))
    finally:
        await picker.close()


def case(name: str) -> cases.Case:
    (found,) = [c for c in cases.CASES if c.name == name]
    return found


def test_a_picker_that_ignores_the_selection_header_fails_following_epp_routing() -> None:
    """Always naming pod 0 cannot honour a request pinned to pod 1."""

    async def test() -> None:
        async with bad_picker(f"{PODS[0].ip}:3000") as target:
            with pytest.raises(Failed, match="primary-inference-model-server-deployment-0"):
                await run_case(target, case("GatewayFollowingEPPRouting"))

    asyncio.run(asyncio.wait_for(test(), 30))


def test_a_picker_whose_header_and_metadata_disagree_breaks_the_protocol() -> None:
    """The endpoint must be named identically in the header and in envoy.lb metadata."""

    async def test() -> None:
        async with bad_picker(f"{PODS[0].ip}:3000", metadata=f"{PODS[1].ip}:3000") as target:
            with pytest.raises(Failed, match=r"header .* and envoy\.lb metadata .* differ"):
                await run_case(target, case("GatewayDestinationEndpointServed"))

    asyncio.run(asyncio.wait_for(test(), 30))


def test_a_fallback_list_is_followed_at_the_picker_alone() -> None:
    """A picker that names up to three allowed endpoints, the chosen one first, passes
    GatewayFollowingEPPRouting at the picker alone: the list is the protocol's, its first
    entry serves."""

    async def test() -> None:
        picker = Picker([f"{pod.ip}:3000" for pod in PODS], [], fallbacks=3)
        async with running("list-picker", picker) as ports:
            await run_case(f"127.0.0.1:{ports.grpc}", case("GatewayFollowingEPPRouting"))

    asyncio.run(asyncio.wait_for(test(), 60))


def test_what_a_picker_reads_from_the_api_is_what_another_is_handed(tmp_path: Path) -> None:
    """Each InferencePool and the pods the harness serves, read as a picker reads them
    (LWEPP's reader: the selector, the target ports, ready pods), give the endpoints the
    harness hands a picker in the other mode."""
    topology = Topology(tmp_path)
    topology._layout("127.1.2")
    pools, pods = cluster_objects(topology.pods)
    assert {pool["metadata"]["name"] for pool in pools} == set(topology.pools)
    for pool in pools:
        spec = pool_spec(pool)
        read = [to_pod(pod, spec) for pod in pods]
        found = [f"{p.address}:{port}" for p in read if p is not None for port in p.ports]
        assert sorted(found) == sorted(topology.pools[pool["metadata"]["name"]].endpoints)


# --- a wiring fault is caught through the gateway only --------------------------------


@pytest.mark.e2e
def test_a_gateway_that_does_not_report_the_served_endpoint_fails_only_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the served-endpoint header (so no envoy.lb metadata), the picker still passes
    GatewayDestinationEndpointServed alone, and the gateway fails it: the table points at the
    gateway's wiring."""
    unrelated = core.HeaderValueOption(header=core.HeaderValue(key="x-unrelated", value="x"))
    monkeypatch.setattr(demo, "served_endpoint_header", lambda: unrelated)
    suite = asyncio.run(
        run_suite(
            tmp_path, Timing(max_time_to_consistency=1.0), ["GatewayDestinationEndpointServed"]
        )
    )
    (result,) = suite.results
    assert result.picker.outcome == "passed"
    assert result.gateway.outcome == "failed"
    assert "fail: missing destination endpoint served metadata" in result.gateway.detail


# --- which picker EppUnAvailableFailOpen takes down ---------------------------------------


class RecordingTopology:
    """Stands in for the topology: records which pool's picker is stopped and restarted."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def stop_picker(self, pool: str) -> None:
        self.calls.append(("stop", pool))

    def start_picker(self, pool: str) -> None:
        self.calls.append(("start", pool))


class AlwaysServes:
    """A gateway that always answers with the echo of the request from pods[0]."""

    checks_backend = True

    async def send(self, request: Request) -> Observation:
        echo = Echo(
            request.path,
            request.host or "",
            request.method,
            {k.lower(): [v] for k, v in request.headers.items()},
            "inference-conformance-app-backend",
        )
        return Observation(200, {}, "secondary-inference-model-server-deployment-0", "3000", echo)


@pytest.mark.parametrize(
    ("name", "stopped"),
    [
        ("EppUnAvailableFailOpen", "primary-inference-pool"),  # GIE's code, to the letter
        ("EppUnAvailableFailOpenOwnPicker", "secondary-inference-pool"),  # the stricter variant
    ],
)
def test_fail_open_phase_2_stops_the_picker_gie_stops(name: str, stopped: str) -> None:
    """GIE's phase 2 takes the primary pool's EPP down while the route uses the secondary pool;
    the stricter variant takes the secondary's own picker down. Each restarts it afterwards."""
    pods = {
        cases.SECONDARY: tuple(
            EchoPod(f"secondary-inference-model-server-deployment-{i}", f"10.9.1.{i}", "s", (3000,))
            for i in range(3)
        )
    }
    topology = RecordingTopology()
    trial = Trial(AlwaysServes(), pods, Timing(), cast(Any, topology))

    async def run() -> None:
        await case(name).run(trial)

    asyncio.run(run())
    assert topology.calls == [("stop", stopped), ("start", stopped)]
