"""LWEPP's ext_proc stream, driven by a real gRPC client exactly as Envoy drives it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from lwepp.assembly import HEALTH_SERVICES
from lwepp.metrics import PickerMetrics
from lwepp.picking import (
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    Choice,
    Pool,
    RequestInfo,
    RoundRobin,
    Strategy,
)
from lwepp.server import EndpointPickerService
from pods.model import Endpoint
from serving.server import Health
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    running,
    set_headers,
)
from tests.fakes import StaticPods, pod
from wire.extproc import BodyMode, ProcessingResponse

PODS = (
    pod("p0", "10.0.0.1", 3000, pool="a"),
    pod("p1", "10.0.0.2", 3000, 3002, 3004, pool="a"),
    pod("p2", "10.0.0.3", 3000, pool="a"),
    pod("other", "10.0.0.9", 3000, pool="b"),
)
GET = {":method": "GET", ":path": "/v1/models", "x-request-id": "r-1"}
POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
BODY = b'{"model": "m", "prompt": "hello"}'


@asynccontextmanager
async def picker(
    *pods: Any,
    max_body_bytes: int = 10 * 1024 * 1024,
    synced: bool = True,
    strategy: Strategy | None = None,
) -> AsyncIterator[tuple[ExtProcClient, CollectorRegistry, StaticPods, int]]:
    source = StaticPods(*(pods or PODS), synced=synced)
    registry = CollectorRegistry()
    # GIE's lwepp, whose behaviour these tests pin, honours the test header and
    # reports the served endpoint on every request: both switches on.
    service = EndpointPickerService(
        Pool(source, {"pool": "a"}),
        strategy or RoundRobin(),
        PickerMetrics(registry),
        max_body_bytes,
        test_selection=True,
        report_served=True,
    )
    health = Health(HEALTH_SERVICES, ready=lambda: source.synced, interval=0.01)
    async with (
        running("lwepp", service, health, registry) as ports,
        ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
    ):
        yield client, registry, source, ports.health


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def destination(reply: ProcessingResponse) -> str:
    headers = dict(set_headers(reply))
    return headers["x-gateway-destination-endpoint"]


def assert_routes_to(reply: ProcessingResponse, endpoint: str) -> None:
    """The reply names ``endpoint`` in the header, the echo header and envoy.lb metadata."""
    assert reply.WhichOneof("response") == "request_headers"
    assert reply.request_headers.response.clear_route_cache is True
    assert set_headers(reply) == [
        ("x-gateway-destination-endpoint", endpoint),
        ("X-Echo-Set-Header", f"x-conformance-test-served-endpoint:{endpoint}"),
    ]
    metadata = json_format.MessageToDict(reply.dynamic_metadata)
    assert metadata == {"envoy.lb": {"x-gateway-destination-endpoint": endpoint}}


def immediate(reply: ProcessingResponse) -> tuple[int, str]:
    """The refusal's status and message, after checking it is an OpenAI-style JSON error."""
    assert reply.WhichOneof("response") == "immediate_response"
    answer = reply.immediate_response
    headers = [(h.header.key, h.header.raw_value) for h in answer.headers.set_headers]
    assert ("content-type", b"application/json") in headers
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "code"}
    return answer.status.code, error["message"]


def test_headers_only_request_is_picked_at_once() -> None:
    """A request whose headers end the stream (a GET) gets one headers reply naming an endpoint."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            replies = await client.exchange([request_headers(GET, end_of_stream=True)])
            assert len(replies) == 1
            assert_routes_to(replies[0], "10.0.0.2:3000")  # the counter starts at 1

    run(scenario)


def test_full_duplex_body_defers_the_pick_and_returns_the_body() -> None:
    """With a streamed body the headers reply waits for the body's end, then the body follows."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            stream = client.open()
            await stream.send(request_headers(POST))
            await stream.send(request_body(BODY[:10], end_of_stream=False))
            await stream.send(request_body(BODY[10:], end_of_stream=True))
            await stream.close()
            replies = [r async for r in _drain(stream)]
            assert [r.WhichOneof("response") for r in replies] == [
                "request_headers",
                "request_body",
            ]
            assert_routes_to(replies[0], "10.0.0.2:3000")
            returned = replies[1].request_body.response.body_mutation.streamed_response
            assert returned.body == BODY
            assert returned.end_of_stream is True

    run(scenario)


def test_large_body_comes_back_in_chunks() -> None:
    """A body over 62,000 bytes is returned in chunks of at most 62,000, EoS on the last."""

    async def scenario() -> None:
        body = b"x" * 150_000
        async with picker() as (client, *_):
            replies = await client.exchange([request_headers(POST), request_body(body)])
            chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
            assert [len(c.body) for c in chunks] == [62_000, 62_000, 26_000]
            assert [c.end_of_stream for c in chunks] == [False, False, True]
            assert b"".join(c.body for c in chunks) == body

    run(scenario)


def test_buffered_mode_picks_at_headers_and_acknowledges_the_body() -> None:
    """When Envoy buffers the body itself, the pick needs no body: reply at headers, ack the body."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            modes = (BodyMode.BUFFERED, BodyMode.NONE)
            replies = await client.exchange(
                [request_headers(POST, body_modes=modes), request_body(BODY)]
            )
            assert_routes_to(replies[0], "10.0.0.2:3000")
            assert replies[1].WhichOneof("response") == "request_body"
            assert not replies[1].request_body.response.HasField("body_mutation")

    run(scenario)


def test_without_protocol_config_the_pick_is_deferred_as_in_gie() -> None:
    """An older proxy that does not say its body mode is treated as full-duplex."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            stream = client.open()
            await stream.send(request_headers(POST, body_modes=None))
            await stream.send(request_body(BODY))
            first = await stream.recv()
            assert first is not None
            assert_routes_to(first, "10.0.0.2:3000")
            stream.cancel()

    run(scenario)


@pytest.mark.parametrize(
    ("metadata", "header", "allowed"),
    [
        ({SUBSET_NAMESPACE: {SUBSET_KEY: ["10.0.0.3:3000"]}}, None, {"10.0.0.3:3000"}),
        (
            {SUBSET_NAMESPACE: {SUBSET_KEY: "10.0.0.1, 10.0.0.3"}},
            None,
            {"10.0.0.1:3000", "10.0.0.3:3000"},
        ),
        (None, "10.0.0.2", {"10.0.0.2:3000", "10.0.0.2:3002", "10.0.0.2:3004"}),
        (None, "10.0.0.1,10.0.0.2:3002", {"10.0.0.1:3000", "10.0.0.2:3002"}),
        ({SUBSET_NAMESPACE: {SUBSET_KEY: ["10.0.0.1"]}}, "10.0.0.3", {"10.0.0.3:3000"}),
    ],
    ids=["hint-list", "hint-string", "test-header-ip", "test-header-dp", "header-wins"],
)
def test_requests_stay_inside_the_allowed_subset(
    metadata: dict[str, Any] | None, header: str | None, allowed: set[str]
) -> None:
    """Over many requests, every pick lands inside the subset the hint or header allows."""

    async def scenario() -> None:
        headers = dict(GET) | ({"test-epp-endpoint-selection": header} if header else {})
        async with picker() as (client, *_):
            seen = set()
            for _ in range(12):
                replies = await client.exchange(
                    [request_headers(headers, end_of_stream=True, metadata=metadata)]
                )
                seen.add(destination(replies[0]))
            assert seen == allowed

    run(scenario)


@pytest.mark.parametrize(
    ("pods", "metadata", "header", "message"),
    [
        (PODS, {SUBSET_NAMESPACE: {SUBSET_KEY: ["10.9.9.9"]}}, None, "10.9.9.9"),
        (PODS, {SUBSET_NAMESPACE: {SUBSET_KEY: []}}, None, "allowed subset"),
        (PODS, None, "10.0.0.9", "10.0.0.9"),  # a pod of another pool
        ((pod("down", "10.0.0.1", 3000, ready=False, pool="a"),), None, None, "no ready endpoint"),
    ],
    ids=["hint-matches-nothing", "empty-hint", "header-outside-pool", "no-ready-endpoint"],
)
def test_no_eligible_endpoint_is_a_503(
    pods: Any, metadata: dict[str, Any] | None, header: str | None, message: str
) -> None:
    """The protocol's rule: no eligible endpoint → ImmediateResponse 503 (GIE's lwepp aborts)."""

    async def scenario() -> None:
        headers = dict(POST) | ({"test-epp-endpoint-selection": header} if header else {})
        async with picker(*pods) as (client, registry, _, _):
            replies = await client.exchange([request_headers(headers, metadata=metadata)])
            assert len(replies) == 1
            status, body = immediate(replies[0])
            assert status == 503
            assert message in body
            errors = sum(
                s.value
                for m in registry.collect()
                if m.name == "llm_d_epp_request_error"
                for s in m.samples
                if s.name == "llm_d_epp_request_error_total"
                and s.labels["error_code"] == "ServiceUnavailable"
            )
            assert errors == 1
            failed = registry.get_sample_value(
                "llm_d_epp_scheduler_attempts_total",
                {"status": "failure", "target_model_name": "", "endpoint_name": "",
                 "namespace": "", "port": ""},
            )  # fmt: skip
            assert failed == 1

    run(scenario)


class Broken:
    """A strategy with a bug: every pick raises."""

    hears_response = False

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        raise RuntimeError("a bug in the strategy")


def test_unexpected_exception_is_logged_with_request_id_and_answered_500() -> None:
    """A bug while picking is logged (with the request id and the traceback) and answered 500,
    counted as an Internal error; the stream ends cleanly and the next request is served."""

    async def scenario() -> None:
        async with picker(strategy=Broken()) as (client, registry, _, _):
            with capture_logs() as logs:
                replies = await client.exchange([request_headers(GET, end_of_stream=True)])
            assert len(replies) == 1
            assert immediate(replies[0]) == (500, "endpoint picker: internal error")
            (error,) = [entry for entry in logs if entry["log_level"] == "error"]
            assert error["event"] == "request failed"
            assert error["request_id"] == "r-1"
            assert error["exc_info"] is True  # log.exception: the traceback goes with it
            internal = registry.get_sample_value(
                "llm_d_epp_request_error_total",
                {"model_name": "", "target_model_name": "", "fairness_id": "default-flow",
                 "priority": "0", "error_code": "Internal"},
            )  # fmt: skip
            assert internal == 1
            again = await client.exchange([request_headers(GET, end_of_stream=True)])
            assert immediate(again[0])[0] == 500

    run(scenario)


@pytest.mark.parametrize(("size", "refused"), [(1000, False), (1001, True)], ids=["at", "over"])
def test_body_cap(size: int, refused: bool) -> None:
    """A body up to the cap is fine; one byte more is a 413 naming the limit."""

    async def scenario() -> None:
        async with picker(max_body_bytes=1000) as (client, *_):
            replies = await client.exchange(
                [
                    request_headers(POST),
                    request_body(b"x" * 600, end_of_stream=False),
                    request_body(b"x" * (size - 600)),
                ]
            )
            if refused:
                assert len(replies) == 1
                assert immediate(replies[0]) == (
                    413,
                    "request body exceeds the 1000-byte limit (--max-body-bytes)",
                )
            else:
                assert [r.WhichOneof("response") for r in replies] == [
                    "request_headers",
                    "request_body",
                ]

    run(scenario)


@pytest.mark.parametrize(
    ("metadata", "served"),
    [
        (
            {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.3:3000"}},
            "10.0.0.3:3000",
        ),
        (None, "fail: missing envoy lb metadata"),
        ({"envoy.lb": {"other": "x"}}, "fail: missing destination endpoint served metadata"),
        (
            {"envoy.lb": {"x-gateway-destination-endpoint-served": 7}},
            "fail: missing destination endpoint served metadata",
        ),
    ],
    ids=["reported", "no-namespace", "no-key", "not-a-string"],
)
def test_served_endpoint_is_reported_on_the_response(
    metadata: dict[str, Any] | None, served: str
) -> None:
    """The endpoint the gateway reports in envoy.lb metadata comes back as a response header."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            replies = await client.exchange(
                [
                    request_headers(GET, end_of_stream=True),
                    response_headers({":status": "200"}, metadata=metadata),
                ]
            )
            assert replies[1].WhichOneof("response") == "response_headers"
            assert set_headers(replies[1]) == [
                ("x-conformance-test-served-endpoint", served),
                ("x-went-into-resp-headers", "true"),
            ]

    run(scenario)


def test_response_body_and_trailers_are_answered() -> None:
    """Full-duplex response chunks are returned as they came; trailers get an empty answer."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            modes = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
            replies = await client.exchange(
                [
                    request_headers(POST, body_modes=modes),
                    request_body(BODY, end_of_stream=False),
                    request_trailers(),
                    response_headers({":status": "200"}),
                    response_body(b"data: 1\n\n", end_of_stream=False),
                    response_body(b"data: [DONE]\n\n"),
                ]
            )
            kinds = [r.WhichOneof("response") for r in replies]
            assert kinds == [
                "request_headers",
                "request_body",
                "request_trailers",
                "response_headers",
                "response_body",
                "response_body",
            ]
            held = replies[1].request_body.response.body_mutation.streamed_response
            assert (held.body, held.end_of_stream) == (BODY, False)  # the trailers end it
            echoed = [r.response_body.response.body_mutation.streamed_response for r in replies[4:]]
            assert [(c.body, c.end_of_stream) for c in echoed] == [
                (b"data: 1\n\n", False),
                (b"data: [DONE]\n\n", True),
            ]

    run(scenario)


def test_concurrent_streams_share_one_fair_counter() -> None:
    """40 concurrent streams over 5 endpoints give each endpoint exactly 8 requests."""

    async def scenario() -> None:
        async with picker() as (client, registry, _, _):

            async def one() -> str:
                replies = await client.exchange([request_headers(POST), request_body(BODY)])
                return destination(replies[0])

            picks = await asyncio.gather(*(one() for _ in range(40)))
            assert sorted(set(picks)) == [
                "10.0.0.1:3000",
                "10.0.0.2:3000",
                "10.0.0.2:3002",
                "10.0.0.2:3004",
                "10.0.0.3:3000",
            ]
            assert all(picks.count(p) == 8 for p in set(picks))
            picked = {
                "status": "success",
                "target_model_name": "",
                "endpoint_name": "p2",
                "namespace": "",
                "port": "3000",
            }
            assert registry.get_sample_value("llm_d_epp_scheduler_attempts_total", picked) == 8
            routed = {
                "model_name": "",
                "target_model_name": "",
                "fairness_id": "default-flow",
                "priority": "0",
            }
            assert registry.get_sample_value("llm_d_epp_request_total", routed) == 40

    run(scenario)


def test_client_cancel_mid_stream_leaves_the_service_healthy() -> None:
    """Envoy giving up halfway through a body does not disturb the next stream."""

    async def scenario() -> None:
        async with picker() as (client, *_):
            stream = client.open()
            await stream.send(request_headers(POST))
            await stream.send(request_body(b'{"model":', end_of_stream=False))
            stream.cancel()
            assert await stream.code() == grpc.StatusCode.CANCELLED
            replies = await client.exchange([request_headers(GET, end_of_stream=True)])
            assert replies[0].WhichOneof("response") == "request_headers"

    run(scenario)


def test_pod_changes_apply_to_the_next_request() -> None:
    """Replacing the pod list changes the candidates without a restart."""

    async def scenario() -> None:
        async with picker() as (client, _, source, _):
            source.replace(pod("new", "10.0.1.1", 8000, pool="a"))
            replies = await client.exchange([request_headers(GET, end_of_stream=True)])
            assert destination(replies[0]) == "10.0.1.1:8000"

    run(scenario)


def test_health_turns_serving_once_the_pods_are_known() -> None:
    """Health reports NOT_SERVING until the pod source has synced, then SERVING."""

    async def scenario() -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        async with picker(synced=False) as (_, _, source, health_port):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{health_port}")
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> Any:
                request = health_pb2.HealthCheckRequest(service=service)
                return (await stub.Check(request)).status

            assert await status("inference-extension") == health_pb2.HealthCheckResponse.NOT_SERVING
            changes = stub.Watch(health_pb2.HealthCheckRequest(service="inference-extension"))
            assert (await anext(aiter(changes))).status != serving  # no pods yet: still not
            source.replace(*PODS)
            # Watch streams each change; the wait ends when SERVING arrives (10 s bounds a bug).
            async with asyncio.timeout(10):
                async for change in changes:
                    if change.status == serving:
                        break
            changes.cancel()
            for service in HEALTH_SERVICES:
                assert await status(service) == serving
            await channel.close()

    run(scenario)


async def _drain(stream: Any) -> AsyncIterator[ProcessingResponse]:
    while (reply := await stream.recv()) is not None:
        yield reply
