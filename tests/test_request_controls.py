"""Request controls, the picker's second seam (``lwepp.picking.RequestControl``), over real gRPC.

A control admits each whole request before its choice: it may change the body
that goes upstream (the strategy then sees the new one), hold the request
(the answer waits), refuse it (an ``ImmediateResponse``), and hear, and
rewrite, the response through a followup. Hand-written controls below do each
once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry

from lwepp.metrics import PickerMetrics
from lwepp.picking import Admitted, Choice, Pool, RequestControl, RequestInfo, RoundRobin
from lwepp.server import EndpointPickerService
from pods.model import Endpoint
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    response_body,
    response_headers,
    running,
    set_headers,
)
from tests.fakes import StaticPods, pod
from wire.exchange import Refusal
from wire.extproc import BodyMode, ProcessingResponse

POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r-1"}
BODY = b'{"model":"alias","prompt":"hi"}'
STREAMED = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)


class Seeing(RoundRobin):
    """Round-robin that remembers the bodies it was asked to choose for."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes | None] = []

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        self.bodies.append(request.body)
        return super().choose(request, candidates)


class Renaming:
    """Rewrites ``alias`` to ``target`` in the request, and back in the response."""

    hears_response = True
    reads_response_body = True

    async def admit(self, admitted: Admitted) -> Admitted:
        assert admitted.request.body is not None
        body = admitted.request.body.replace(b'"alias"', b'"target"')
        request = RequestInfo(admitted.request.headers, body)
        return Admitted(request, body, (*admitted.followups, Back()))


class Back:
    def headers(self, served: str | None, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        return [("x-renamed", "yes")]

    def chunk(self, chunk: bytes) -> bytes | None:
        return chunk.replace(b'"target"', b'"alias"')

    def end(self) -> None:
        pass


@dataclasses.dataclass
class Holding:
    """Holds every request until ``gate`` opens; refuses one that asks to be refused."""

    gate: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    entered: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    hears_response: bool = False
    reads_response_body: bool = False

    async def admit(self, admitted: Admitted) -> Admitted:
        if dict(admitted.request.headers).get("x-refuse"):
            raise Refusal(429, "queue full", reason="rejected-saturated")
        self.entered.set()
        await self.gate.wait()
        return admitted


def service(strategy: RoundRobin, *controls: RequestControl) -> EndpointPickerService:
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    return EndpointPickerService(
        pool, strategy, PickerMetrics(CollectorRegistry()), controls=controls
    )


def test_a_control_changes_the_body_the_choice_sees_and_upstream_gets() -> None:
    """The renamed body goes upstream, with its length; the strategy chose for it; the
    response's model is mapped back on its way to the client, and the followup's header added."""
    strategy = Seeing()
    picker = service(strategy, Renaming())
    assert picker.hears_response
    assert picker.reads_response_body

    async def go() -> list[ProcessingResponse]:
        async with (
            running("lwepp", picker) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            return await client.exchange(
                [
                    request_headers(POST, body_modes=STREAMED),
                    request_body(BODY),
                    response_headers({":status": "200"}),
                    response_body(b'{"model":"target","choices":[]}'),
                ]
            )

    headers_reply, body_reply, response_reply, response_chunk = asyncio.run(go())
    sent = body_reply.request_body.response.body_mutation.streamed_response.body
    assert sent == BODY.replace(b"alias", b"target")
    assert ("content-length", str(len(sent))) in set_headers(headers_reply)
    assert strategy.bodies == [sent]
    assert ("x-renamed", "yes") in set_headers(response_reply)
    mapped = response_chunk.response_body.response.body_mutation.streamed_response.body
    assert mapped == b'{"model":"alias","choices":[]}'


def test_a_control_holds_the_answer_until_it_admits_and_can_refuse() -> None:
    """While a control holds a request its choice is not sent; a refusal is the request's
    answer, with the control's status."""
    holding = Holding()
    picker = service(RoundRobin(), holding)

    async def go() -> tuple[bool, list[ProcessingResponse], list[ProcessingResponse]]:
        async with (
            running("lwepp", picker) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            held = asyncio.create_task(client.exchange([request_headers(POST, end_of_stream=True)]))
            await holding.entered.wait()  # the request is whole, and held
            await asyncio.sleep(0)
            waited = not held.done()
            refused = await client.exchange(
                [request_headers({**POST, "x-refuse": "1"}, end_of_stream=True)]
            )
            holding.gate.set()
            return waited, await held, refused

    waited, answered, refused = asyncio.run(go())
    assert waited
    assert ("x-gateway-destination-endpoint", "10.0.0.1:3000") in set_headers(answered[0])
    assert refused[0].immediate_response.status.code == 429


def test_without_controls_nothing_waits_and_nothing_is_read_of_the_response() -> None:
    """No control: the service says it needs neither the response headers nor its body."""
    picker = service(RoundRobin())
    assert not picker.hears_response
    assert not picker.reads_response_body


class Retargeting:
    """Sends every request on as model ``target`` (as a model rewrite does)."""

    hears_response = False
    reads_response_body = False

    async def admit(self, admitted: Admitted) -> Admitted:
        headers = [(n, v) for n, v in admitted.request.headers if n != "x-gateway-model-name"]
        headers.append(("x-gateway-model-name", "target"))
        return Admitted(RequestInfo(headers, admitted.request.body))


def test_the_request_counter_names_the_model_sent_the_target_and_the_priority() -> None:
    """``llm_d_epp_request_total``: ``model_name`` the client's, ``target_model_name`` what
    the controls sent it as, ``priority`` its objective's (the router's labels)."""
    registry = CollectorRegistry()
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    metrics = PickerMetrics(registry, "a", priority_of=lambda headers: 10)
    picker = EndpointPickerService(pool, RoundRobin(), metrics, controls=[Retargeting()])

    async def go() -> None:
        async with (
            running("lwepp", picker) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            headers = {**POST, "x-gateway-model-name": "alias"}
            await client.exchange([request_headers(headers, end_of_stream=True)])

    asyncio.run(go())
    labels = {"model_name": "alias", "target_model_name": "target", "priority": "10"}
    value = registry.get_sample_value(
        "llm_d_epp_request_total", {**labels, "fairness_id": "default-flow"}
    )
    assert value == 1.0
