"""The one-hop service: BBR's chain and the model's pool's pick in one stream, over real gRPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry, generate_latest

from bbr.server import BodyBasedRouter
from lwepp.metrics import PickerMetrics
from lwepp.picking import SUBSET_KEY, SUBSET_NAMESPACE, Admitted, Pool, RequestInfo, RoundRobin
from lwepp.server import EndpointPickerService
from onehop.__main__ import build_parser, main
from onehop.server import OneHop, Registries, with_changes
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    request_trailers,
    response_headers,
    running,
    set_headers,
)
from tests.fakes import StaticPods, pod
from tests.processes import start_events
from wire.exchange import Refusal
from wire.extproc import BodyMode, ProcessingResponse

PODS = (
    pod("a0", "10.0.0.1", 3000, pool="a"),
    pod("a1", "10.0.0.2", 3000, pool="a"),
    pod("b0", "10.0.1.1", 4000, pool="b"),
)
POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r-1"}
BUFFERED = (BodyMode.BUFFERED, BodyMode.NONE)


def body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "hello"}).encode()


@asynccontextmanager
async def one_hop(
    *pods: Any, max_body_bytes: int = 1 << 20
) -> AsyncIterator[tuple[ExtProcClient, CollectorRegistry, CollectorRegistry]]:
    source = StaticPods(*(pods or PODS))
    bbr_registry, picker_registry = CollectorRegistry(), CollectorRegistry()
    metrics = PickerMetrics(picker_registry, "a")
    # As GIE's conformance tests run them: the served endpoint reported back.
    picker_a = EndpointPickerService(
        Pool(source, {"pool": "a"}), RoundRobin(), metrics, report_served=True
    )
    picker_b = EndpointPickerService(
        Pool(source, {"pool": "b"}),
        RoundRobin(),
        PickerMetrics(CollectorRegistry(), "b"),
        report_served=True,
    )
    router = BodyBasedRouter(bbr_registry, streaming=True, max_body_bytes=max_body_bytes)
    handler = OneHop(router, {"m-a": picker_a, "m-b": picker_b}, max_body_bytes)
    async with (
        running("onehop", handler) as ports,
        ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
    ):
        yield client, bbr_registry, picker_registry


def exchange(*messages: Any, **options: Any) -> list[ProcessingResponse]:
    async def scenario() -> list[ProcessingResponse]:
        async with one_hop(**options) as (client, _, _):
            return await client.exchange(messages)

    return asyncio.run(scenario())


def metadata(reply: ProcessingResponse) -> dict[str, Any]:
    return dict(json_format.MessageToDict(reply.dynamic_metadata))


def test_full_duplex_answers_the_held_headers_with_model_and_endpoint_then_the_body() -> None:
    """One headers answer carries BBR's model header and the pick; the body streams back after."""
    data = body("m-b")
    replies = exchange(request_headers(POST), request_body(data))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    answer = replies[0].request_headers.response
    assert answer.clear_route_cache
    assert set_headers(replies[0]) == [
        ("X-Gateway-Model-Name", "m-b"),
        ("Content-Length", str(len(data))),
        ("x-gateway-destination-endpoint", "10.0.1.1:4000"),
        ("X-Echo-Set-Header", "x-conformance-test-served-endpoint:10.0.1.1:4000"),
    ]
    assert metadata(replies[0]) == {"envoy.lb": {"x-gateway-destination-endpoint": "10.0.1.1:4000"}}
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (data, True)


def test_each_model_goes_to_its_own_pool_in_turn() -> None:
    """Requests for a model rotate over that model's pool only (round-robin per pool)."""

    async def scenario() -> list[str]:
        picked = []
        async with one_hop() as (client, _, _):
            for model in ("m-a", "m-a", "m-b", "m-a"):
                replies = await client.exchange([request_headers(POST), request_body(body(model))])
                picked.append(dict(set_headers(replies[0]))["x-gateway-destination-endpoint"])
        return picked

    assert asyncio.run(scenario()) == [
        "10.0.0.2:3000",
        "10.0.0.1:3000",
        "10.0.1.1:4000",
        "10.0.0.2:3000",
    ]


def test_a_model_no_pool_serves_gets_the_model_header_and_no_endpoint() -> None:
    """An unknown model is left to the gateway's routes (their 404): BBR's changes only."""
    replies = exchange(request_headers(POST), request_body(body("gpt-9")))
    names = [name for name, _ in set_headers(replies[0])]
    assert names == ["X-Gateway-Model-Name", "Content-Length"]
    assert metadata(replies[0]) == {}


def test_buffered_body_gets_one_body_answer_with_every_change() -> None:
    """With a buffered body the headers pass at once and the body answer carries the pick."""
    replies = exchange(request_headers(POST, body_modes=BUFFERED), request_body(body("m-a")))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert set_headers(replies[0]) == []
    common = replies[1].request_body.response
    assert common.clear_route_cache
    assert not common.body_mutation.body
    assert dict(set_headers(replies[1]))["x-gateway-destination-endpoint"] == "10.0.0.2:3000"
    assert metadata(replies[1]) == {"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.2:3000"}}


def test_the_subset_hint_narrows_the_pools_candidates() -> None:
    """The protocol's subset hint, sent with the headers, holds when the pick comes at the body."""
    hint = {SUBSET_NAMESPACE: {SUBSET_KEY: ["10.0.0.1:3000"]}}
    replies = exchange(request_headers(POST, metadata=hint), request_body(body("m-a")))
    assert dict(set_headers(replies[0]))["x-gateway-destination-endpoint"] == "10.0.0.1:3000"


def test_not_json_is_400_counted_by_bbr() -> None:
    """A body that is not a JSON object is BBR's 400, before any pool is chosen."""

    async def scenario() -> tuple[list[ProcessingResponse], bytes]:
        async with one_hop() as (client, bbr_registry, _):
            replies = await client.exchange([request_headers(POST), request_body(b'{"model": ')])
            return replies, generate_latest(bbr_registry)

    replies, page = asyncio.run(scenario())
    assert replies[0].immediate_response.status.code == 400
    assert b'bbr_errors_total{reason="BadRequest"} 1.0' in page


def test_a_pool_with_no_ready_endpoint_is_503_counted_by_its_picker() -> None:
    """The chosen pool's refusal (no endpoint) is the picker's 503, in the picker's metrics."""

    async def scenario() -> tuple[list[ProcessingResponse], bytes]:
        async with one_hop(pod("b0", "10.0.1.1", 4000, pool="b")) as (client, _, registry):
            replies = await client.exchange([request_headers(POST), request_body(body("m-a"))])
            return replies, generate_latest(registry)

    replies, page = asyncio.run(scenario())
    assert replies[0].immediate_response.status.code == 503
    assert b'error_code="ServiceUnavailable"' in page


def test_a_body_over_the_cap_is_413() -> None:
    """The held body's cap holds as in both services."""
    replies = exchange(request_headers(POST), request_body(b"x" * 200), max_body_bytes=100)
    assert replies[0].immediate_response.status.code == 413


def test_trailers_end_a_full_duplex_body() -> None:
    """A last chunk without end_of_stream is ended by the trailers: answer, body, trailers."""
    data = body("m-a")
    replies = exchange(
        request_headers(POST), request_body(data, end_of_stream=False), request_trailers()
    )
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert not replies[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_the_response_side_reports_the_served_endpoint() -> None:
    """Once a pool picked, the response headers get the picker's served-endpoint report."""
    lb = {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.2:3000"}}
    replies = exchange(
        request_headers(POST),
        request_body(body("m-a")),
        response_headers({":status": "200"}, metadata=lb, end_of_stream=True),
    )
    assert ("x-conformance-test-served-endpoint", "10.0.0.2:3000") in set_headers(replies[-1])


def test_headers_only_request_is_routed_on_the_clients_model_header() -> None:
    """A request with no body is routed at once, on the model header the client sent."""
    headers = {**POST, "x-gateway-model-name": "m-b"}
    replies = exchange(request_headers(headers, end_of_stream=True))
    assert dict(set_headers(replies[0]))["x-gateway-destination-endpoint"] == "10.0.1.1:4000"


def test_with_changes_applies_sets_and_removals() -> None:
    """The request's headers as Envoy has them after a mutation: sets overwrite, removals go."""
    headers = [("a", "1"), ("x-gateway-model-name", "old"), ("b", "2")]
    changed = with_changes(headers, [("X-Gateway-Model-Name", "new")], ["b"])
    assert changed == [("a", "1"), ("x-gateway-model-name", "new")]


def test_registries_show_each_family_once_with_every_pools_samples() -> None:
    """Two pools' metrics on one page: one family, both pools' samples, shared samples once."""
    first, second = CollectorRegistry(), CollectorRegistry()
    PickerMetrics(first, "a").ready.set(2)
    PickerMetrics(second, "b").ready.set(3)
    page = CollectorRegistry()
    page.register(Registries([first, second]))
    text = generate_latest(page).decode()
    assert text.count("# TYPE llm_d_epp_ready_endpoints gauge") == 1
    assert 'llm_d_epp_ready_endpoints{name="a"} 2.0' in text
    assert 'llm_d_epp_ready_endpoints{name="b"} 3.0' in text
    assert text.count("llm_d_epp_info{") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pool", "a"], "expected NAME=MODEL"),
        (["--pool", "a="], "expected NAME=MODEL"),
        (["--pool", "a=m", "--pool", "b=m"], "model 'm' is in two pools"),
        (["--pool", "a=m", "--pool", "a=n"], "pool 'a' is given twice"),
    ],
    ids=["no-models", "empty-models", "model-twice", "pool-twice"],
)
def test_bad_pool_flags_are_refused_naming_the_flag(
    flags: Sequence[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed --pool, or a model in two pools, stops the start with a clear message."""
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods: []\n")
    with pytest.raises(SystemExit) as stopped:
        main(["--pods", str(pods), *flags])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_parser_takes_several_pools() -> None:
    """--pool is repeatable and splits its models on commas."""
    args = build_parser().parse_args(["--pods", "p", "--pool", "a=m1, m2", "--pool", "b=m3"])
    assert args.pools == [("a", ("m1", "m2")), ("b", ("m3",))]


def test_the_any_model_pool_takes_what_no_other_pool_names() -> None:
    """``--pool NAME=*``: models no pool names, and requests naming none, go to that pool."""

    async def scenario() -> list[str | None]:
        source = StaticPods(*PODS)
        router = BodyBasedRouter(CollectorRegistry(), streaming=True)

        def picker(name: str) -> EndpointPickerService:
            metrics = PickerMetrics(CollectorRegistry(), name)
            return EndpointPickerService(Pool(source, {"pool": name}), RoundRobin(), metrics)

        handler = OneHop(router, {"m-a": picker("a"), "*": picker("b")})
        picked = []
        async with (
            running("onehop", handler) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            for data in (body("m-a"), body("gpt-9"), b'{"prompt": "no model"}'):
                replies = await client.exchange([request_headers(POST), request_body(data)])
                picked.append(dict(set_headers(replies[0])).get("x-gateway-destination-endpoint"))
        return picked

    assert asyncio.run(scenario()) == ["10.0.0.2:3000", "10.0.1.1:4000", "10.0.1.1:4000"]


def test_a_pool_no_pod_belongs_to_is_warned_about_at_start(tmp_path: Path) -> None:
    """A --pool whose name no pod's pool label carries (a typo) is a warning naming the pool and
    the file before the service listens; it still starts (the file may gain such pods)."""
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n- {name: a-0, address: 127.0.0.1, ports: [18001], labels: {pool: a}}\n")
    events = start_events("onehop", "--pods", str(pods), "--pool", "a=m1", "--pool", "zzz=m2")
    warned = [e for e in events if e["event"] == "no pod matches the pool"]
    assert [(e["pool"], e["selector"], e["level"]) for e in warned] == [
        ("zzz", "pool=zzz", "warning")
    ]
    assert events[-1]["event"] == "listening"


def test_the_pools_request_controls_run_after_bbr_and_before_its_pick() -> None:
    """The model BBR read names the pool; that pool's controls see the request as BBR changed
    it, may refuse it (answered and counted by that pool's picker) or change the body that
    goes upstream (its length with it), and the pick sees what they let through."""

    class Control:
        hears_response = False
        reads_response_body = False

        def __init__(self) -> None:
            self.seen: list[str | None] = []

        async def admit(self, admitted: Admitted) -> Admitted:
            headers = dict(admitted.request.headers)
            self.seen.append(headers.get("x-gateway-model-name"))
            if headers.get("x-refuse"):
                raise Refusal(429, "queue full", reason="rejected-saturated")
            changed = (admitted.request.body or b"").replace(b"m-a", b"m-z")
            return Admitted(RequestInfo(admitted.request.headers, changed), changed)

    control = Control()

    async def scenario() -> tuple[list[ProcessingResponse], list[ProcessingResponse]]:
        source = StaticPods(*PODS)
        metrics = PickerMetrics(CollectorRegistry(), "a")
        picker = EndpointPickerService(
            Pool(source, {"pool": "a"}), RoundRobin(), metrics, controls=[control]
        )
        handler = OneHop(BodyBasedRouter(CollectorRegistry(), streaming=True), {"m-a": picker})
        async with (
            running("onehop", handler) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            served = await client.exchange([request_headers(POST), request_body(body("m-a"))])
            refused = await client.exchange(
                [request_headers({**POST, "x-refuse": "1"}), request_body(body("m-a"))]
            )
            return served, refused

    served, refused = asyncio.run(scenario())
    assert control.seen == ["m-a", "m-a"]
    sent = served[1].request_body.response.body_mutation.streamed_response.body
    assert sent == body("m-z")
    assert ("content-length", str(len(sent))) in set_headers(served[0])
    assert refused[0].immediate_response.status.code == 429
