"""Admission through the picker over real gRPC: the objective's priority, flow control's answers.

The picker runs a configuration with flow control on and a concurrency
detector of one request per endpoint, over one endpoint: one request in
flight saturates the pool, and the next ones wait. The flow controller's
clock is the test's, so budgets run out when the test says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import orjson
from prometheus_client import CollectorRegistry

from lwepp.config import load_text
from lwepp.flowcontrol.governance import Governance, govern
from lwepp.metrics import PickerMetrics
from lwepp.objectives import Objective, Objectives
from lwepp.picking import Pool
from lwepp.server import EndpointPickerService
from serving.testing import (
    ClientStream,
    ExtProcClient,
    request_body,
    request_headers,
    response_body,
    response_headers,
    running,
    set_headers,
)
from tests.fakes import StaticPods, pod
from wire.extproc import BodyMode, ProcessingResponse

STREAMED = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
BODY = b'{"model":"m","prompt":"hi"}'
FLOW = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
flowControl:
  defaultRequestTTL: 10s
  saturationDetector: {pluginRef: concurrency-detector}
  priorityBands:
  - {priority: -1, maxRequests: 2}
"""
OBJECTIVES = {
    name: Objective(name, priority, "a") for name, priority in [("interactive", 10), ("batch", -1)]
}


@dataclass
class Objectives_:
    """A fixed set of objectives (``lwepp.objectives.ObjectiveSource``)."""

    objectives: Objectives = field(default_factory=lambda: MappingProxyType(OBJECTIVES))

    async def run(self) -> None:
        return None


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Picker:
    service: EndpointPickerService
    governance: Governance
    clock: Clock
    source: StaticPods
    client: ExtProcClient


@contextlib.asynccontextmanager
async def picker(config: str = FLOW) -> AsyncIterator[Picker]:
    clock = Clock()
    loaded = load_text(config)
    pipeline = loaded.pipeline(clock=clock)
    source = StaticPods(pod("p0", "10.0.0.1", 8000))
    pool = Pool(source, {})
    governance = govern(
        loaded.flow,
        lambda: pipeline.candidates(pool.endpoints).candidates,
        clock,
        Objectives_(),
        CollectorRegistry(),
        "a",
    )
    service = EndpointPickerService(
        pool, pipeline, PickerMetrics(CollectorRegistry()), controls=governance.controls
    )
    async with (
        running("lwepp", service, background=governance.jobs) as ports,
        ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
    ):
        yield Picker(service, governance, clock, source, client)


async def send(client: ExtProcClient, name: str, **headers: str) -> ClientStream:
    """Open a stream and send a whole request (full-duplex body) named ``name``."""
    stream = client.open()
    sent = {":method": "POST", ":path": "/v1/completions", "x-request-id": name, **headers}
    await stream.send(request_headers(sent, body_modes=STREAMED))
    await stream.send(request_body(BODY))
    return stream


async def first(stream: ClientStream) -> ProcessingResponse:
    answer = await stream.recv()
    assert answer is not None
    return answer


async def finish(stream: ClientStream) -> None:
    """The rest of the request's body reply, then the response, to its end."""
    await stream.recv()  # the body, streamed back
    await stream.send(response_headers({":status": "200"}))
    await stream.recv()
    await stream.send(response_body(b"{}", end_of_stream=True))
    await stream.recv()
    await stream.close()


def refused(answer: ProcessingResponse) -> tuple[int, str, Mapping[str, str]]:
    """An ImmediateResponse's status, JSON error code and headers."""
    immediate = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, orjson.loads(immediate.body)["error"]["code"], headers


def waiting(p: Picker) -> int:
    controller = p.governance.controller
    assert controller is not None
    return controller.length


def wake(p: Picker) -> None:
    """Tell the dispatcher something changed (as a response's end does)."""
    assert p.governance.dispatcher is not None
    p.governance.dispatcher.wake()


async def until(check: object, what: str) -> None:
    """Wait for ``check()`` (the picker runs in this loop); fail after 10 s."""
    for _ in range(10_000):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def test_waiting_requests_go_by_priority_when_a_response_ends() -> None:
    """One request in flight fills the pool; the others wait, and when its response ends the
    interactive one goes before the batch and the unnamed ones that came earlier."""

    async def scenario() -> list[str]:
        async with picker() as p:
            order: list[str] = []
            busy = await send(p.client, "busy")
            assert "x-gateway-destination-endpoint" in dict(set_headers(await first(busy)))
            streams = {
                "batch": await send(p.client, "batch", **{"x-llm-d-inference-objective": "batch"}),
                "plain": await send(p.client, "plain"),
                "interactive": await send(
                    p.client, "interactive", **{"x-llm-d-inference-objective": "interactive"}
                ),
            }
            await until(lambda: waiting(p) == 3, "three waiting")

            async def served(name: str) -> None:
                await first(streams[name])
                order.append(name)
                await finish(streams[name])

            tasks = [asyncio.create_task(served(name)) for name in streams]
            await finish(busy)
            await asyncio.gather(*tasks)
            return order

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == ["interactive", "plain", "batch"]


def test_the_answers_when_the_queue_is_full_or_the_budget_runs_out() -> None:
    """The batch band holds two: the third is 429 rejected-saturated at once; the two waiting
    are 429 rejected-ttl-expired once their 10 s budget ran out, each with the router's
    header."""

    async def scenario() -> list[tuple[int, str, Mapping[str, str]]]:
        async with picker() as p:
            busy = await send(p.client, "busy")
            await first(busy)
            batch = {"x-llm-d-inference-objective": "batch"}
            held = [await send(p.client, f"b{n}", **batch) for n in range(2)]
            await until(lambda: waiting(p) == 2, "two waiting")
            full = refused(await first(await send(p.client, "b3", **batch)))
            p.clock.now += 10.0
            wake(p)  # the dispatcher looks again, and finds the budgets spent
            expired = [refused(await first(stream)) for stream in held]
            return [full, *expired]

    answers = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert answers[0] == (
        429,
        "rejected-saturated",
        {
            "content-type": "application/json",
            "x-llm-d-request-dropped-reason": "rejected-saturated",
        },
    )
    for status, code, headers in answers[1:]:
        assert (status, code) == (429, "rejected-ttl-expired")
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"


def test_a_client_that_leaves_frees_its_place_at_once() -> None:
    """Cancelled while waiting (Envoy resets the stream when the client goes): the request
    leaves the queue at once, and the band has room for the next one."""

    async def scenario() -> int:
        async with picker() as p:
            await first(await send(p.client, "busy"))
            batch = {"x-llm-d-inference-objective": "batch"}
            leaving = await send(p.client, "leaving", **batch)
            await send(p.client, "staying", **batch)
            await until(lambda: waiting(p) == 2, "two waiting")
            leaving.cancel()
            await until(lambda: waiting(p) == 1, "the place freed")
            await send(p.client, "next", **batch)
            await until(lambda: waiting(p) == 2, "the next one waiting")
            return waiting(p)

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == 2


def test_stopping_answers_every_waiting_request() -> None:
    """The picker stopping (SIGTERM): every waiting request is answered 503
    rejected-shutting-down, and so is one that comes after."""

    async def scenario() -> list[tuple[int, str, Mapping[str, str]]]:
        async with picker() as p:
            await first(await send(p.client, "busy"))
            held = [await send(p.client, f"w{n}") for n in range(3)]
            await until(lambda: waiting(p) == 3, "three waiting")
            for hook in p.governance.stopping:
                hook()
            late = await send(p.client, "late")
            return [refused(await first(stream)) for stream in [*held, late]]

    for status, code, headers in asyncio.run(asyncio.wait_for(scenario(), 20)):
        assert (status, code) == (503, "rejected-shutting-down")
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-shutting-down"


def test_a_request_waits_for_the_pool_to_have_an_endpoint() -> None:
    """A pool without endpoints: the request waits (the router's noEndpointRequestTTL), and
    goes when an endpoint appears; one whose budget runs out first is 503 rejected-no-endpoints."""

    async def scenario() -> tuple[str, tuple[int, str, Mapping[str, str]]]:
        async with picker(FLOW.replace("10s", "10s\n  noEndpointRequestTTL: 5s")) as p:
            p.source.replace()
            waiting_one = await send(p.client, "early")
            await until(lambda: waiting(p) == 1, "waiting for an endpoint")
            p.clock.now += 5.0
            wake(p)
            gone = refused(await first(waiting_one))
            later = await send(p.client, "later")
            await until(lambda: waiting(p) == 1, "waiting again")
            p.source.replace(pod("p1", "10.0.0.2", 8000))
            wake(p)
            routed = dict(set_headers(await first(later)))["x-gateway-destination-endpoint"]
            return routed, gone

    routed, gone = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert routed == "10.0.0.2:8000"
    assert gone[:2] == (503, "rejected-no-endpoints")
    assert gone[2]["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"


def test_with_the_gate_off_only_sheddable_requests_are_refused_when_saturated() -> None:
    """The router's legacy rule: the pool saturated, a batch request (priority -1) is 429 at
    once; an interactive one and one naming no objective go on."""
    legacy = FLOW.replace("featureGates: [flowControl]\n", "") + (
        "schedulingProfiles: [{name: default, plugins: []}]\n"  # the detector filters nothing
    )

    async def scenario() -> list[int]:
        async with picker(legacy) as p:
            await first(await send(p.client, "busy"))
            codes = []
            for name, objective in [("b", "batch"), ("i", "interactive"), ("n", "none")]:
                answer = await first(
                    await send(p.client, name, **{"x-llm-d-inference-objective": objective})
                )
                codes.append(
                    answer.immediate_response.status.code
                    if answer.HasField("immediate_response")
                    else 200
                )
            return codes

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [429, 200, 200]
