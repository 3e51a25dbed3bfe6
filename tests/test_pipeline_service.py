"""The pipeline as LWEPP's strategy, over real gRPC: equivalence with the core, explain, hooks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from lwepp.contracts import Usage
from lwepp.explain import DECISION_HEADER, EXPLAIN_HEADER, DecisionLog
from lwepp.metrics import PickerMetrics
from lwepp.picking import SUBSET_KEY, SUBSET_NAMESPACE, Pool, RoundRobin, Strategy
from lwepp.pipeline import Pipeline
from lwepp.plugins.pickers import MaxScorePicker
from lwepp.server import EndpointPickerService
from plugin_api import Params
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
from tests.plugin_fakes import FakeFilter, FakeScorer, RecordingHook
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse
from wire.stream import Handler

PODS = (
    pod("p0", "10.0.0.1", 3000, pool="a"),
    pod("p1", "10.0.0.2", 3000, 3002, pool="a"),
    pod("p2", "10.0.0.3", 3000, pool="a"),
)
A, B, B2, C = "10.0.0.1:3000", "10.0.0.2:3000", "10.0.0.2:3002", "10.0.0.3:3000"
POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r-1"}
BODY = b'{"model": "m", "prompt": "hello"}'
LB = "envoy.lb"
SERVED = {LB: {"x-gateway-destination-endpoint-served": C}}
STREAM_RESPONSE = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)


def pool() -> Pool:
    return Pool(StaticPods(*PODS), {"pool": "a"})


def service(
    strategy: Strategy, max_body_bytes: int = 1024, *, report_served: bool = False
) -> EndpointPickerService:
    """The core service with ``strategy`` plugged in: the one seam."""
    return EndpointPickerService(
        pool(),
        strategy,
        PickerMetrics(CollectorRegistry()),
        max_body_bytes,
        report_served=report_served,
    )


@asynccontextmanager
async def serving(handler: Handler, **options: Any) -> AsyncIterator[tuple[ExtProcClient, int]]:
    async with (
        running("lwepp", handler, **options) as ports,
        ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
    ):
        yield client, ports.metrics


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def destination(reply: ProcessingResponse) -> str:
    return dict(set_headers(reply))["x-gateway-destination-endpoint"]


def added_headers(replies: Sequence[ProcessingResponse]) -> dict[str, str]:
    (reply,) = [r for r in replies if r.WhichOneof("response") == "response_headers"]
    return dict(set_headers(reply))


# --- with no scorers, exactly the core ------------------------------------------------

SCENARIOS: list[list[ProcessingRequest]] = [
    # a GET: picked at the headers
    [request_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)],
    # the demo's shape: full-duplex body in two chunks, then the response headers
    [
        request_headers(POST),
        request_body(BODY[:9], end_of_stream=False),
        request_body(BODY[9:]),
        response_headers({":status": "200"}, metadata=SERVED),
    ],
    # a buffered body: picked at the headers, the body acknowledged
    [
        request_headers(POST, body_modes=(BodyMode.BUFFERED, BodyMode.NONE)),
        request_body(BODY),
        response_headers({":status": "200"}),
    ],
    # trailers end a full-duplex body; the response body streams back
    [
        request_headers(POST, body_modes=STREAM_RESPONSE),
        request_body(BODY, end_of_stream=False),
        request_trailers(),
        response_headers({":status": "200"}, metadata=SERVED),
        response_body(b'{"usage": {"prompt_tokens": 2}}'),
    ],
    # a subset hint, then the conformance header
    [request_headers(POST, end_of_stream=True, metadata={SUBSET_NAMESPACE: {SUBSET_KEY: [C]}})],
    [request_headers({**POST, "test-epp-endpoint-selection": "10.0.0.2"}, end_of_stream=True)],
    # refusals: a subset nobody matches (503), a body over the cap (413)
    [request_headers(POST, end_of_stream=True, metadata={SUBSET_NAMESPACE: {SUBSET_KEY: []}})],
    [request_headers(POST), request_body(b"x" * 64)],
]


def without_decision(serialised: bytes) -> bytes:
    """A reply with the ``x-switchyard-decision`` header taken out, serialised again."""
    reply = ProcessingResponse.FromString(serialised)
    if reply.WhichOneof("response") != "response_headers":
        return serialised
    mutation = reply.response_headers.response.header_mutation
    kept = [h for h in mutation.set_headers if h.header.key != DECISION_HEADER]
    del mutation.set_headers[:]
    mutation.set_headers.extend(kept)
    if not kept:  # the decision was all it said: the core's "go on unchanged"
        reply.response_headers.response.ClearField("header_mutation")
    return bytes(reply.SerializeToString())


async def exchanges(handler: Handler, rounds: int = 3) -> list[bytes]:
    """Every reply to every scenario, ``rounds`` times over (the counter moves on), serialised."""
    replies: list[bytes] = []
    async with serving(handler) as (client, _):
        for _ in range(rounds):
            for scenario in SCENARIOS:
                replies += [r.SerializeToString() for r in await client.exchange(scenario)]
    return replies


@pytest.mark.parametrize(
    "make",
    [
        lambda: Pipeline(),
        lambda: Pipeline([MaxScorePicker("best")], explain="off"),
        lambda: Pipeline(explain="all", decisions=DecisionLog(0)),
    ],
    ids=["pipeline", "named-picker-explain-off", "explain-all"],
)
def test_with_no_scorers_the_replies_are_the_cores_byte_for_byte(
    make: Callable[[], Pipeline],
) -> None:
    """No scorers configured: every ext_proc reply, serialised, equals plain round-robin's.

    With ``explain="all"`` only the response headers differ (they carry the
    decision), so that variant is compared with the decision header taken out.
    """

    async def scenario() -> None:
        expected = await exchanges(service(RoundRobin(), 48))
        assert len(expected) > 3 * len(SCENARIOS)
        pipeline = make()
        got = await exchanges(service(pipeline, 48))
        if pipeline.explain == "all":
            got = [without_decision(reply) for reply in got]
        assert got == expected

    run(scenario)


# --- explaining ------------------------------------------------------------------------


def test_an_explained_request_gets_the_decision_in_a_response_header() -> None:
    """``x-switchyard-explain: 1`` → ``x-switchyard-decision``: scores, weights, totals, pick."""
    decisions = DecisionLog(size=2)
    pipeline = Pipeline(
        [FakeFilter("no-a", [A]), FakeScorer("queue", {C: 1.0, B: 0.5})],
        weights={"queue": 2.0},
        decisions=decisions,
        explain="header",
    )

    async def scenario() -> None:
        async with serving(service(pipeline), json_routes=pipeline.debug_pages()) as (
            client,
            metrics_port,
        ):
            asked = {**POST, EXPLAIN_HEADER: "1"}
            replies = await client.exchange(
                [
                    request_headers(asked, end_of_stream=True),
                    response_headers({":status": "200"}, metadata=SERVED),
                ]
            )
            assert destination(replies[0]) == C
            decision = json.loads(added_headers(replies)[DECISION_HEADER])
            assert decision["filters"] == [{"filter": "no-a", "removed": [A]}]
            assert decision["weights"] == {"queue": 2.0}
            assert [(s["endpoint"], s["total"]) for s in decision["scores"]] == [
                (C, 2.0),
                (B, 1.0),
                (B2, 0.0),
            ]
            assert decision["picked"] == [C]
            unasked = await client.exchange(
                [
                    request_headers(POST, end_of_stream=True),
                    response_headers({":status": "200"}, metadata=SERVED),
                ]
            )
            assert DECISION_HEADER not in added_headers(unasked)
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{metrics_port}/debug/decisions") as page,
            ):
                kept = await page.json()
            assert [d["picked"] for d in kept] == [[C]]  # only the explained one

    run(scenario)


def test_when_filters_leave_nobody_the_503_carries_the_explanation() -> None:
    """No candidate left: 503, and an explained request learns which filter removed whom."""
    picker = service(Pipeline([FakeFilter("nobody", [A, B, B2, C])], explain="header"))

    async def scenario() -> None:
        async with serving(picker) as (client, _):
            (reply,) = await client.exchange(
                [request_headers({**POST, EXPLAIN_HEADER: "true"}, end_of_stream=True)]
            )
            assert reply.immediate_response.status.code == 503
            content_type, header = reply.immediate_response.headers.set_headers
            assert content_type.header.key == "content-type"
            assert header.header.key == DECISION_HEADER
            removed = json.loads(header.header.raw_value)["filters"][0]["removed"]
            assert removed == [A, B, B2, C]

    run(scenario)


# --- hooks on the response -----------------------------------------------------------

JSON_ANSWER = (
    b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, '
    b'"prompt_tokens_details": {"cached_tokens": 4}}}'
)
SSE_ANSWER = (
    b'data: {"choices": [{"text": "hi"}], "usage": null}\n\n'
    b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize(
    ("content_type", "answer", "usage"),
    [
        ("application/json", JSON_ANSWER, Usage(7, 3, 4)),
        ("text/event-stream", SSE_ANSWER, Usage(5, 1, None)),
        ("application/json", b"not json", None),
    ],
    ids=["json", "sse", "no-usage"],
)
def test_response_hooks_hear_headers_chunks_and_completion_with_usage(
    content_type: str, answer: bytes, usage: Usage | None
) -> None:
    """Headers (their additions reach the reply), each chunk, then served endpoint and usage."""
    log: list[tuple[str, str, Any]] = []
    hook = RecordingHook("hook", log, add_headers={"x-session-token": "abc"})
    picker = service(Pipeline([hook]))

    async def scenario() -> None:
        async with serving(picker) as (client, _):
            replies = await client.exchange(
                [
                    request_headers(POST, end_of_stream=True, body_modes=STREAM_RESPONSE),
                    response_headers(
                        {":status": "200", "content-type": content_type}, metadata=SERVED
                    ),
                    response_body(answer[:20], end_of_stream=False),
                    response_body(answer[20:]),
                ]
            )
            assert added_headers(replies)["x-session-token"] == "abc"
            streamed = b"".join(
                r.response_body.response.body_mutation.streamed_response.body
                for r in replies
                if r.WhichOneof("response") == "response_body"
            )
            assert streamed == answer  # the body goes back to Envoy unchanged

    run(scenario)
    assert [stage for _, stage, _ in log] == [
        "prepare",
        "picked",
        "response_headers",
        "response_chunk",
        "response_chunk",
        "response_complete",
    ]
    assert log[2][2] == (C, "200")
    assert log[-1][2] == (C, usage)


def test_without_a_response_body_the_exchange_completes_at_the_headers() -> None:
    """Response body mode NONE (the demo's): completion comes with the headers, no usage."""
    log: list[tuple[str, str, Any]] = []
    picker = service(Pipeline([RecordingHook("hook", log)]))

    async def scenario() -> None:
        async with serving(picker) as (client, _):
            await client.exchange(
                [
                    request_headers(POST, end_of_stream=True),
                    response_headers({":status": "200"}),
                ]
            )

    run(scenario)
    assert [(stage, detail) for _, stage, detail in log][2:] == [
        ("response_headers", (None, "200")),
        ("response_complete", (None, None)),
    ]


def test_a_failing_response_hook_is_skipped_and_counted() -> None:
    """The response goes on: other hooks still run and the served-endpoint report is sent."""
    registry, log = CollectorRegistry(), list[tuple[str, str, Any]]()
    pipeline = Pipeline(
        [RecordingHook("bad", log, fail_at="response_headers"), RecordingHook("ok", log)],
        registry=registry,
    )

    async def scenario() -> None:
        async with serving(service(pipeline, report_served=True)) as (client, _):
            replies = await client.exchange(
                [
                    request_headers(POST, end_of_stream=True),
                    response_headers({":status": "200"}, metadata=SERVED),
                ]
            )
            assert added_headers(replies)["x-conformance-test-served-endpoint"] == C

    run(scenario)
    assert ("ok", "response_complete", (C, None)) in log
    sample = {"plugin": "bad", "stage": "response_headers"}
    assert registry.get_sample_value("llm_d_epp_plugin_errors_total", sample) == 1


# --- failures, the body, fallback lists ----------------------------------------------


def test_a_failing_scorer_still_routes_the_request_round_robin() -> None:
    """The stream never breaks: round-robin answers, the failure is counted and kept for debug."""
    registry = CollectorRegistry()
    decisions = DecisionLog()
    pipeline = Pipeline([FakeScorer("s", fail=True)], registry=registry, decisions=decisions)

    async def scenario() -> None:
        async with serving(service(pipeline)) as (client, _):
            for expected in (B, B2, C):
                (reply,) = await client.exchange([request_headers(POST, end_of_stream=True)])
                assert destination(reply) == expected

    run(scenario)
    sample = {"plugin": "s", "stage": "score"}
    assert registry.get_sample_value("llm_d_epp_plugin_errors_total", sample) == 3
    kept = json.loads(decisions.render())
    assert kept[0] == {"request": "r-1", "picked": [B], "fallback": "score s: Boom: s is broken"}


@pytest.mark.parametrize("needs_body", [False, True], ids=["headers-only", "needs-body"])
def test_the_held_body_reaches_only_plugins_that_need_it(needs_body: bool) -> None:
    """Full duplex: the pick waits for the body; a needs_body plugin sees it parsed, others not."""
    log: list[tuple[str, str, Any]] = []
    picker = service(Pipeline([RecordingHook("h", log, needs_body=needs_body)]))

    async def scenario() -> None:
        async with serving(picker) as (client, _):
            stream = client.open()
            await stream.send(request_headers(POST))
            await stream.send(request_body(BODY[:9], end_of_stream=False))
            await stream.send(request_body(BODY[9:]))
            await stream.close()
            kinds = []
            while (reply := await stream.recv()) is not None:
                kinds.append(reply.WhichOneof("response"))
            assert kinds == ["request_headers", "request_body"]

    run(scenario)
    ((_, stage, parsed),) = [entry for entry in log if entry[1] == "prepare"]
    assert stage == "prepare"
    assert (parsed == {"model": "m", "prompt": "hello"}) is needs_body
    assert (parsed is None) is not needs_body


@pytest.mark.parametrize(
    ("count", "expected"),
    [(1, C), (3, f"{C},{B},{B2}")],
    ids=["one", "with-fallbacks"],
)
def test_several_endpoints_go_out_as_a_fallback_list(count: int, expected: str) -> None:
    """``maxNumOfEndpoints > 1``: ``ip:port,ip:port`` in the header and in envoy.lb metadata."""
    scorer = FakeScorer("s", {C: 1.0, B: 0.6, B2: 0.5})
    picker = MaxScorePicker("m", Params({"maxNumOfEndpoints": count}))

    async def scenario() -> None:
        async with serving(service(Pipeline([scorer, picker]))) as (client, _):
            (reply,) = await client.exchange([request_headers(POST, end_of_stream=True)])
            assert destination(reply) == expected
            metadata = json_format.MessageToDict(reply.dynamic_metadata)
            assert metadata == {LB: {"x-gateway-destination-endpoint": expected}}

    run(scenario)
