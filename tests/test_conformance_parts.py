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
from conformance.picker import PickerTransport
from conformance.run import run_suite
from conformance.topology import EchoPod
from demo import envoy as demo
from serving.testing import running
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


def test_fail_open_rules_get_a_picked_route_and_a_fallback_route() -> None:
    """FailOpen: with the picker's header → ORIGINAL_DST; without → the pool's replicas."""
    (picked, fallback, _) = vhosts(PRIMARY, [route("r", PRIMARY, "/f", "b")])["*"]
    assert picked.match.headers[0].name == "x-gateway-destination-endpoint"
    assert picked.route.cluster == "pool-b"
    assert fallback.route.cluster == "pool-b-fallback"


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
