"""Smoke runs of the hook-overhead benchmark: it measures what it says (no timing asserted)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from bench import hooks, instructions
from bench.server import handler_for
from lwepp.pipeline import Pipeline
from serving.testing import ExtProcClient, request_headers, set_headers
from wire.extproc import ProcessingRequest, ProcessingResponse

ADDRESSES = {f"{pod.address}:{pod.ports[0]}" for pod in hooks.PODS}


def test_the_pick_benchmark_reports_each_variant_against_round_robin() -> None:
    """Round-robin first, then the pipelines; every ratio is against round-robin's time."""
    rows = hooks.run(budget=0.001, rounds=1)
    assert [r.what for r in rows] == [
        "round-robin (the core)",
        "pipeline, 0 plugins",
        "pipeline, 1 plugin",
        "pipeline, 5 plugins",
        "pipeline, 5 plugins, explained",
    ]
    for row in rows:
        assert row.baseline_us == rows[0].us
        assert row.ratio == pytest.approx(row.us / rows[0].us)
    assert "| pipeline, 5 plugins |" in hooks.table(rows)


def test_each_timed_call_is_a_whole_pick_through_its_plugins() -> None:
    """What is timed routes the request, and runs every plugin the row names.

    The explained variant's record shows the filter, the three scorers and
    the picker at work in the very call the benchmark times.
    """
    for variant in hooks.variants():
        reply = variant.route()()
        assert dict(set_headers(reply))["x-gateway-destination-endpoint"] in ADDRESSES
    explained = hooks.variants()[-1]
    explained.route()()
    pipeline = explained.service.strategy
    assert isinstance(pipeline, Pipeline)
    (record,) = json.loads(pipeline.decisions.render())
    assert record["filters"] == [{"filter": "keep-all", "removed": []}]
    assert record["weights"] == {"s0": 1.0, "s1": 1.0, "s2": 1.0}
    assert [row["total"] for row in record["scores"]] == [3.0] * len(ADDRESSES)
    assert record["picked"][0] in ADDRESSES


def test_the_benchmarked_pipelines_hold_the_plugins_they_claim() -> None:
    """Five plugins: a prepare/picked hook, a filter, three scorers (and the default picker)."""
    five = hooks.pipeline(5)
    assert (len(five.prepare), len(five.filters), len(five.scorers), len(five.picked)) == (
        1,
        1,
        3,
        1,
    )
    assert len(hooks.pipeline(1).scorers) == 1
    assert hooks.pipeline(0).plugins == ()


@pytest.mark.parametrize("kind", hooks.STREAM_KINDS)
def test_the_stream_benchmark_serves_each_picker_it_measures(kind: str) -> None:
    """Each ``bench.server`` kind the stream table measures answers a stream with an endpoint."""

    async def scenario() -> str:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler_for(kind),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with ExtProcClient(f"127.0.0.1:{port}") as client:
                (reply,) = await client.exchange([request_headers({}, end_of_stream=True)])
        finally:
            await server.stop(0)
        return dict(set_headers(reply))["x-gateway-destination-endpoint"]

    assert asyncio.run(scenario()) in ADDRESSES


def test_an_unknown_server_kind_is_refused() -> None:
    """A kind the benchmark does not know stops the server with its name."""
    with pytest.raises(SystemExit, match="unknown server kind 'lwepp-hooks-x'"):
        handler_for("lwepp-hooks-x")


@pytest.mark.parametrize("kind", instructions.STREAM_KINDS)
def test_the_counted_stream_is_a_whole_stream(kind: str) -> None:
    """What ``bench.instructions`` counts per stream: headers answered after the body, with
    the endpoint (pickers) or the model header (BBR), and the body sent back whole."""

    class Recording(instructions.WireStream):
        __slots__ = ("replies",)

        def __init__(self) -> None:
            super().__init__()
            self.replies: list[ProcessingResponse] = []

        async def send(self, reply: ProcessingResponse) -> None:
            self.replies.append(reply)

    stream = Recording()
    asyncio.run(instructions._handler(kind)(stream))
    headers, *body = stream.replies
    added = dict(set_headers(headers))
    if kind == "bbr":
        assert added["X-Gateway-Model-Name"] == "m"
    else:
        assert added["x-gateway-destination-endpoint"] in ADDRESSES
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in body)
    assert sent == request_body_of(instructions.WIRE[1])


def request_body_of(wire: bytes) -> bytes:
    return bytes(ProcessingRequest.FromString(wire).request_body.body)
