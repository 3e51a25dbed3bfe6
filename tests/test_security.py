"""What a client or a neighbour on the network can learn and change: each claim of
``docs/security.md``, pinned.

The first half runs the services in process (flags, the picker's replies, the
metrics port's guard against the fake API server); the second runs the whole
gateway, with the services' production defaults, through the real Envoy.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from bbr.__main__ import parser as bbr_parser
from demo.envoy import GATEWAY_ONLY_HEADERS
from demo.topology import Topology
from lwepp.__main__ import build_parser
from lwepp.assembly import PickerOptions
from lwepp.explain import DECISION_HEADER, EXPLAIN_HEADER, ExplainMode
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import Pipeline
from lwepp.server import EndpointPickerService
from onehop.__main__ import build_parser as onehop_parser
from pods.kubeapi import ClusterConfig
from serving.cli import serving_problem
from serving.metrics_auth import MetricsAuth, bearer_token
from serving.testing import (
    ExtProcClient,
    request_headers,
    response_headers,
    running,
    set_headers,
)
from tests.conftest import write_pod_file
from tests.fake_kube import FakeKube, ThreadedFakeKube
from tests.fakes import StaticPods, pod
from tests.http_clients import Answer, http1
from tests.plugin_fakes import FakeScorer
from tests.processes import service

POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r-1"}
SERVED = {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:3000"}}


# --- the picker's switches, off by default -------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ([], "off"),
        (["--explain=header"], "header"),
        (["--emit-endpoint-scores"], "all"),
        (["--emit-endpoint-scores=false"], "off"),
        (["--emit-endpoint-scores", "--explain=off"], "off"),
    ],
    ids=["default", "on-request", "emit-scores", "emit-scores-false", "explain-wins"],
)
def test_decisions_are_explained_only_when_a_flag_says_so(flags: list[str], mode: str) -> None:
    """No ``x-switchyard-decision`` unless ``--explain`` or ``--emit-endpoint-scores`` asks."""
    args = build_parser().parse_args(["--pods", "p.yaml", *flags])
    assert PickerOptions.from_args(args).explain == mode


@pytest.mark.parametrize(
    ("flags", "mode"),
    [([], "off"), (["--explain=header"], "header")],
    ids=["default", "on-request"],
)
def test_the_one_hop_explains_only_when_a_flag_says_so(flags: list[str], mode: str) -> None:
    """The one hop's ``--explain`` is off unless given, as the picker's is."""
    args = onehop_parser().parse_args(["--pods", "p.yaml", "--pool", "a=m", *flags])
    assert PickerOptions.from_args(args).explain == mode


def test_the_one_hop_takes_a_kubeconfig_for_its_metrics_auth() -> None:
    """``--kubeconfig`` names the API server ``--metrics-endpoint-auth`` asks, as for the picker."""
    argv = ["--pods", "p.yaml", "--pool", "a=m", "--metrics-endpoint-auth", "--kubeconfig", "k"]
    assert onehop_parser().parse_args(argv).kubeconfig == "k"


@pytest.mark.parametrize(
    ("flags", "selection", "report", "debug", "auth"),
    [
        ([], False, False, False, False),
        (
            [
                "--enable-test-selection-header",
                "--report-served-endpoint",
                "--enable-debug-pages",
                "--metrics-endpoint-auth",
            ],
            True,
            True,
            True,
            True,
        ),
    ],
    ids=["default", "all-on"],
)
def test_the_pickers_exposures_are_off_unless_enabled(
    flags: list[str], selection: bool, report: bool, debug: bool, auth: bool
) -> None:
    """The test header, the served-endpoint report, debug pages and auth: each its own flag."""
    args = build_parser().parse_args(["--pods", "p.yaml", *flags])
    assert (args.test_selection, args.report_served_endpoint) == (selection, report)
    assert (bool(args.enable_debug_pages), bool(args.metrics_endpoint_auth)) == (debug, auth)


def test_bbr_serves_no_debug_page_and_takes_metrics_auth() -> None:
    """BBR shares the metrics port's switches: debug pages off, auth available."""
    args = bbr_parser().parse_args([])
    assert not args.enable_debug_pages
    assert not args.metrics_endpoint_auth
    assert bbr_parser().parse_args(["--metrics-endpoint-auth"]).metrics_endpoint_auth is True


def test_metrics_auth_needs_a_single_process() -> None:
    """With ``--workers``, the supervisor's merged page has no guard: refused at start."""
    args = build_parser().parse_args(["--pods", "p.yaml", "--metrics-endpoint-auth"])
    args.workers = 2
    assert "--metrics-endpoint-auth" in (serving_problem(args) or "")


def picker_replies(
    strategy: Strategy | None = None, headers: dict[str, str] | None = None, **switches: bool
) -> tuple[dict[str, str], dict[str, str]]:
    """The headers a picker (round-robin by default) sets on a request and on its response."""
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    picker = EndpointPickerService(
        pool,
        strategy or RoundRobin(),
        PickerMetrics(CollectorRegistry()),
        test_selection=switches.get("test_selection", False),
        report_served=switches.get("report_served", False),
    )

    async def go() -> tuple[dict[str, str], dict[str, str]]:
        async with (
            running("lwepp", picker) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            request, response = await client.exchange(
                [
                    request_headers({**POST, **(headers or {})}, end_of_stream=True),
                    response_headers({":status": "200"}, metadata=SERVED),
                ]
            )
        return dict(set_headers(request)), dict(set_headers(response))

    return asyncio.run(go())


def test_by_default_no_response_names_its_replica() -> None:
    """The picker routes with one header and adds nothing to the response."""
    request, response = picker_replies()
    assert request == {"x-gateway-destination-endpoint": "10.0.0.1:3000"}
    assert response == {}


@pytest.mark.parametrize(("explain", "told"), [(None, False), ("header", True)])
def test_a_pipeline_explains_only_when_built_to(explain: ExplainMode | None, told: bool) -> None:
    """``x-switchyard-explain: 1`` is ignored by a pipeline built without ``explain``."""
    options: dict[str, Any] = {} if explain is None else {"explain": explain}
    pipeline = Pipeline([FakeScorer("s", {"10.0.0.1:3000": 1.0})], **options)
    _request, response = picker_replies(pipeline, {EXPLAIN_HEADER: "1"})
    assert (DECISION_HEADER in response) is told


def test_the_served_endpoint_is_reported_when_enabled() -> None:
    """``report_served``: GIE's echo request and its two response headers."""
    request, response = picker_replies(report_served=True)
    assert request["X-Echo-Set-Header"] == "x-conformance-test-served-endpoint:10.0.0.1:3000"
    assert response == {
        "x-conformance-test-served-endpoint": "10.0.0.1:3000",
        "x-went-into-resp-headers": "true",
    }


def test_traced_messages_hold_whole_requests(tmp_path: Path) -> None:
    """``--trace-messages`` writes each message whole: headers such as Authorization too."""
    pods, trace = tmp_path / "pods.yaml", tmp_path / "trace"
    pods.write_text("pods:\n- {name: p0, address: 10.0.0.1, ports: [3000]}\n")
    with service("lwepp", "--pods", str(pods), "--trace-messages", str(trace)) as (_, ports):

        async def ask() -> None:
            async with ExtProcClient(f"127.0.0.1:{ports['grpc_port']}") as client:
                headers = {**POST, "authorization": "Bearer traced-secret"}
                await client.exchange([request_headers(headers, end_of_stream=True)])

        asyncio.run(ask())
    assert "traced-secret" in trace.read_text()


# --- the metrics port's guard -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Bearer", None),
        ("Basic abc", None),
        ("", None),
    ],
    ids=["bearer", "any-case", "empty", "basic", "none"],
)
def test_only_a_bearer_token_is_taken(header: str, token: str | None) -> None:
    """``Authorization: Bearer <token>``, the scheme in any case; anything else is no token."""
    assert bearer_token(header) == token


def get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """GET ``path`` on the metrics port: the status and the body."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as page:
            return page.status, page.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_auth_asks_the_api_server_who_and_whether() -> None:
    """No token or an unknown one: 401; a user RBAC does not allow: 403; allowed: 200; the API
    server failing: 500. The reviews carry the token, then the user and the path and verb."""

    async def scenario() -> None:
        async with FakeKube() as fake:
            prometheus = {"username": "system:serviceaccount:monitoring:prometheus", "uid": "u1"}
            fake.tokens = {"scraper": {**prometheus, "groups": ["system:serviceaccounts"]}}
            fake.tokens["someone"] = {"username": "someone"}
            fake.allowed = {(prometheus["username"], "/metrics", "get")}
            auth = MetricsAuth(ClusterConfig(fake.url))
            pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
            picker = EndpointPickerService(pool, RoundRobin(), PickerMetrics(CollectorRegistry()))
            async with running("lwepp", picker, json_routes={}, metrics_auth=auth) as ports:

                async def status(path: str, token: str | None = None) -> int:
                    return (await asyncio.to_thread(get, ports.metrics, path, token))[0]

                assert await status("/metrics") == 401
                assert await status("/metrics", "forged") == 401
                assert await status("/metrics", "someone") == 403
                assert await status("/debug/runtime", "scraper") == 403
                fake.reviews.clear()
                assert await status("/metrics", "scraper") == 200
                token_review, access_review = fake.reviews
                assert token_review["spec"] == {"token": "scraper"}
                assert access_review["spec"] == {
                    "user": prometheus["username"],
                    "uid": "u1",
                    "groups": ["system:serviceaccounts"],
                    "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
                }
                fake.failing = 503
                assert await status("/metrics", "scraper") == 500

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize(
    ("module", "extra"),
    [("lwepp", []), ("onehop", ["--pool", "p=model-a"])],
    ids=["picker", "one-hop"],
)
def test_lwepp_guards_its_metrics_port_with_the_flag(
    tmp_path: Path, module: str, extra: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m lwepp --metrics-endpoint-auth --kubeconfig F``, and the one hop with the
    same flag finding the API server through $KUBECONFIG: /metrics needs a token the API
    allows."""
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n- {name: p0, address: 10.0.0.1, ports: [3000]}\n")
    with ThreadedFakeKube() as kube:
        kube.do(lambda fake: fake.tokens.update({"t": {"username": "scraper"}}))
        kube.do(lambda fake: fake.allowed.add(("scraper", "/metrics", "get")))
        config = kube.kubeconfig(tmp_path / "kubeconfig")
        flags = ["--pods", str(pods), "--metrics-endpoint-auth"]
        if module == "lwepp":
            flags += ["--kubeconfig", str(config)]
        else:
            monkeypatch.setenv("KUBECONFIG", str(config))
        with service(module, *flags, *extra) as (_process, listening):
            port = listening["metrics_port"]
            assert get(port, "/metrics")[0] == 401
            status, page = get(port, "/metrics", "t")
            assert status == 200
            assert "llm_d_epp_ready_endpoints" in page


# --- the whole gateway, with production defaults, through the real Envoy ----------------------

PATH = "/v1/completions"
SECRET = "Bearer sk-do-not-log-7f3a9c"
PROMPT = "my card number is 4111-2222-3333-4444"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work = tmp_path_factory.mktemp("security")
    pods = write_pod_file(work / "pods.yaml")
    with Topology(
        work,
        pods,
        fail_open=["b"],
        simulator_args=["--time-scale", "0.1"],
        demo_flags=False,
    ) as topology:
        yield topology


def ask(
    gateway: Topology, model: str = "model-a", headers: dict[str, str] | None = None, **body: Any
) -> Answer:
    request = {"model": model, "prompt": "hello there", "max_tokens": 2, **body}
    return http1(gateway.port, PATH, json.dumps(request).encode(), headers)


def endpoints(gateway: Topology, pool: str) -> list[str]:
    (found,) = [p.endpoints for p in gateway.pools if p.name == pool]
    return list(found)


@pytest.mark.e2e
def test_no_response_names_its_replica_by_default(gateway: Topology) -> None:
    """Neither the served-endpoint report nor GIE's debug header reaches a client."""
    answer = ask(gateway)
    assert answer.status == 200
    assert answer.headers["x-sim-endpoint"] in endpoints(gateway, "a")
    for name in (
        "x-conformance-test-served-endpoint",
        "x-went-into-resp-headers",
        "x-gateway-destination-endpoint-served",
        "x-switchyard-decision",
    ):
        assert name not in answer.headers, name


@pytest.mark.e2e
def test_a_client_cannot_pin_a_replica_by_default(gateway: Topology) -> None:
    """``test-epp-endpoint-selection`` is ignored: requests go round-robin over the pool."""
    chosen = endpoints(gateway, "a")[1]
    pinned = [ask(gateway, headers={"test-epp-endpoint-selection": chosen}) for _ in range(4)]
    assert {answer.headers["x-sim-endpoint"] for answer in pinned} == set(endpoints(gateway, "a"))


@pytest.mark.e2e
@pytest.mark.parametrize("service_name", ["lwepp-a", "bbr"])
def test_debug_pages_are_off_by_default(gateway: Topology, service_name: str) -> None:
    """The metrics port serves /metrics and nothing under /debug."""
    port = gateway.services[service_name].listening["metrics_port"]
    assert get(port, "/metrics")[0] == 200
    for page in ("/debug/runtime", "/debug/decisions", "/debug/attributes"):
        assert get(port, page)[0] == 404, page


CLIENT_VALUES = {
    "x-gateway-destination-endpoint": "127.0.0.1:9",
    "x-gateway-model-name": "forged-model",
    "x-gateway-destination-endpoint-served": "127.0.0.1:9",
    "x-conformance-test-served-endpoint": "127.0.0.1:9",
    "x-echo-set-header": "x-forged:1",
}
"""What a client might put in each header only the gateway may set."""


def test_every_gateway_only_header_is_covered() -> None:
    """The table below names exactly the headers the gateway's first filter removes."""
    assert set(CLIENT_VALUES) == set(GATEWAY_ONLY_HEADERS)


def received(answer: Answer, header: str) -> str | None:
    """What the replica saw of ``header`` (the simulator echoes ``x-gateway-*`` and
    ``x-conformance-*`` request headers, and what ``x-echo-set-header`` asks for)."""
    if header == "x-echo-set-header":
        return answer.headers.get("x-forged")
    return answer.headers.get(f"x-sim-received-{header}")


@pytest.mark.e2e
@pytest.mark.parametrize("header", list(CLIENT_VALUES))
def test_a_clients_gateway_header_never_reaches_a_replica(gateway: Topology, header: str) -> None:
    """On the picker's route the replica sees the gateway's value or none, never the client's."""
    answer = ask(gateway, headers={header: CLIENT_VALUES[header]})
    assert answer.status == 200, answer
    assert answer.headers["x-sim-endpoint"] in endpoints(gateway, "a")
    assert received(answer, header) in {
        "x-gateway-destination-endpoint": {answer.headers["x-sim-endpoint"]},
        "x-gateway-model-name": {"model-a"},
    }.get(header, {None})


@pytest.mark.e2e
def test_a_request_naming_no_model_is_not_routed_by_a_clients_model_header(
    gateway: Topology,
) -> None:
    """Routes match on BBR's model header: a client's own, with no model in the body, is
    dropped, and the request is answered 404 instead of reaching pool b."""
    body = json.dumps({"prompt": "hello"}).encode()
    answer = http1(gateway.port, PATH, body, {"x-gateway-model-name": "model-b"})
    assert answer.status == 404
    assert "names no model" in answer.body.decode()


@pytest.mark.e2e
def test_no_secret_or_prompt_is_logged_at_the_default_level(gateway: Topology) -> None:
    """A request's Authorization header and prompt appear in no service's log, nor Envoy's."""
    answer = ask(gateway, headers={"authorization": SECRET}, prompt=PROMPT)
    assert answer.status == 200
    access_log = gateway.work_dir / "envoy-access.log"
    deadline = time.monotonic() + 10
    while PATH not in (access_log.read_text() if access_log.exists() else ""):
        assert time.monotonic() < deadline, "the request never reached the access log"
        time.sleep(0.1)
    logs = [access_log, *(s.log for s in gateway.services.values())]
    assert len(logs) == 6  # the access log, Envoy, the simulator, two pickers, BBR
    for log in logs:
        text = log.read_text(errors="replace")
        assert "sk-do-not-log" not in text, log.name
        assert "4111-2222" not in text, log.name


@pytest.mark.e2e
@pytest.mark.parametrize("header", list(CLIENT_VALUES))
def test_with_the_picker_down_the_fail_open_route_drops_them_too(
    gateway: Topology, header: str
) -> None:
    """FailOpen, picker down: Envoy picks the replica, and the client's header is gone."""
    if gateway.services["lwepp-b"].running():
        gateway.stop("lwepp-b")  # the last tests of the module: they may stop a picker
    answer = ask(gateway, "model-b", headers={header: CLIENT_VALUES[header]})
    assert answer.status == 200, answer
    assert answer.headers["x-sim-endpoint"] in endpoints(gateway, "b")
    expected = {None, "model-b"} if header == "x-gateway-model-name" else {None}
    assert received(answer, header) in expected
