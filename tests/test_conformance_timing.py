"""The conformance client's waiting rules, those of Gateway API's helpers v1.6.1, on a fake clock;
its connections; and the switch to the upstream changes pending (``conformance.upstream``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from conformance import cases
from conformance.__main__ import build_parser, upstream_and_timing
from conformance.cases import Trial
from conformance.client import (
    NAMESPACE,
    SELECTION_HEADER,
    Echo,
    Expected,
    Failed,
    GatewayTransport,
    Observation,
    Request,
    Timing,
    Unreachable,
    eventually,
    gateway_session,
    send_many,
)
from conformance.topology import EchoPod
from conformance.upstream import NEXT, RELEASED, Upstream

REQUEST = Request("/p", "h.example")
PASS = Observation(200, pod="pod-a-0")
WRONG = Observation(200, pod="pod-b-0")  # passes the status, not the backend
EXPECTED = Expected(REQUEST, backend="pod-a")


class FakeTime:
    """A clock that only moves when slept on (or when a fake request takes time)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Scripted:
    """A transport answering from a script; each answer takes ``takes`` fake seconds."""

    checks_backend = False

    def __init__(self, time: FakeTime, answers: list[Observation | None], takes: float = 0.0):
        self.time, self.takes = time, takes
        self.answers: Iterator[Observation | None] = iter(answers)
        self.sent = 0

    async def send(self, request: Request) -> Observation:
        self.sent += 1
        self.time.now += self.takes
        answer = next(self.answers)
        if answer is None:
            raise Unreachable("unexpected error reading response: not JSON")
        return answer


def run_eventually(time: FakeTime, transport: Scripted, timing: Timing) -> Observation:
    return asyncio.run(eventually(transport, EXPECTED, timing, clock=time.clock, sleep=time.sleep))


def test_eventually_waits_one_second_after_a_failure_and_none_after_a_pass() -> None:
    """AwaitConvergence: 1 s after each failed attempt, straight on after a passing one."""
    time = FakeTime()
    transport = Scripted(time, [WRONG, PASS, None, PASS, PASS, PASS])
    assert run_eventually(time, transport, Timing()) == PASS
    assert time.sleeps == [1.0, 1.0]
    assert transport.sent == 6


def test_an_answer_that_cannot_be_read_is_retried_not_failed() -> None:
    """A round-trip error (an echo that is not JSON) is one more failed attempt, as in Go."""
    time = FakeTime()
    transport = Scripted(time, [None, None, PASS, PASS, PASS])
    assert run_eventually(time, transport, Timing()) == PASS
    assert time.sleeps == [1.0, 1.0]


def test_the_deadline_is_checked_before_every_attempt_even_in_a_streak() -> None:
    """Two passes took the whole budget: the third attempt is not made, the check fails."""
    time = FakeTime()
    transport = Scripted(time, [PASS, PASS, PASS], takes=1.0)
    with pytest.raises(Failed, match=r"not 3 passes in a row within 1.5 s \(2 attempts\)"):
        run_eventually(time, transport, Timing(max_time_to_consistency=1.5))
    assert transport.sent == 2


def test_a_timed_out_check_names_its_latest_failure_even_after_passes() -> None:
    """Wrong, then right by chance until the deadline: the failure says what was wrong."""
    time = FakeTime()
    transport = Scripted(time, [WRONG, PASS, PASS], takes=0.5)
    with pytest.raises(Failed, match=r"\(3 attempts\); last failure: expected a pod named pod-a"):
        run_eventually(
            time, transport, Timing(max_time_to_consistency=1.2, delay_after_failure=0.1)
        )


def test_the_deadline_cuts_the_wait_after_a_failure_short() -> None:
    """The wait after the last failure ends at the deadline, and the check fails there."""
    time = FakeTime()
    transport = Scripted(time, [WRONG] * 10)
    with pytest.raises(Failed, match="last failure: expected a pod named pod-a"):
        run_eventually(time, transport, Timing(max_time_to_consistency=2.5))
    assert time.sleeps == [1.0, 1.0, 0.5]
    assert time.now == 2.5


def test_the_traffic_loop_retries_503_every_half_second_for_two_minutes() -> None:
    """GIE's traffic loop: 404/503 are retried every 500 ms until 2 minutes after the first try."""
    time = FakeTime()
    transport = Scripted(time, [Observation(503)] * 1000)

    async def loop() -> None:
        await send_many(
            transport,
            EXPECTED,
            Timing(),
            total=1,
            concurrency=1,
            accept=lambda _: None,
            clock=time.clock,
            sleep=time.sleep,
        )

    with pytest.raises(Failed, match="failed after retries"):
        asyncio.run(loop())
    assert set(time.sleeps) == {0.5}
    assert time.now == 120.0
    assert transport.sent == 240


@pytest.mark.parametrize(
    ("answer", "problem"),
    [(Observation(500), "expectation failed"), (WRONG, "expectation failed")],
    ids=["500", "wrong-pod"],
)
def test_the_traffic_loop_fails_at_once_on_anything_but_404_or_503(
    answer: Observation, problem: str
) -> None:
    """Any other mismatch is not retried."""
    time = FakeTime()
    transport = Scripted(time, [answer])

    async def loop() -> None:
        await send_many(
            transport,
            EXPECTED,
            Timing(),
            total=1,
            concurrency=1,
            accept=lambda _: None,
            clock=time.clock,
            sleep=time.sleep,
        )

    with pytest.raises(Failed, match=problem):
        asyncio.run(loop())
    assert time.sleeps == []


ECHO = {
    "path": "/p",
    "host": "h.example",
    "method": "GET",
    "headers": {},
    "namespace": "inference-conformance-app-backend",
    "pod": "pod-a-0",
}


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1]", b'{"path": 7}', b'{"headers": {"X": "not-a-list"}}'],
    ids=["not-json", "not-an-object", "path-not-string", "headers-not-lists"],
)
def test_the_gateway_transport_reports_an_unreadable_echo_as_a_round_trip_error(
    body: bytes,
) -> None:
    """An answer that says application/json but is not the echo's JSON raises Unreachable (which
    the checks retry); a good echo after it is read normally."""

    async def test() -> None:
        answers = iter([body, web.json_response(ECHO).body])

        async def handler(_request: web.Request) -> web.Response:
            return web.Response(body=next(answers), content_type="application/json")

        app = web.Application()
        app.router.add_get("/p", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                transport = GatewayTransport(
                    session, {"conformance-primary": f"127.0.0.1:{port}"}, Timing()
                )
                with pytest.raises(Unreachable, match="unexpected error reading response"):
                    await transport.send(REQUEST)
                seen = await transport.send(REQUEST)
                assert (seen.status, seen.pod) == (200, "pod-a-0")
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(test(), 10))


def test_the_gateway_transport_opens_a_connection_per_request() -> None:
    """As the helpers' round tripper (a new transport with keep-alives off for each request):
    every request comes on a connection of its own, which it asks to be closed."""

    async def test() -> None:
        seen: list[tuple[object, str | None]] = []

        async def handler(request: web.Request) -> web.Response:
            assert request.transport is not None
            seen.append(
                (request.transport.get_extra_info("peername"), request.headers.get("Connection"))
            )
            return web.json_response(ECHO)

        app = web.Application()
        app.router.add_get("/p", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            async with gateway_session() as session:
                gateway = {"conformance-primary": f"127.0.0.1:{port}"}
                transport = GatewayTransport(session, gateway, Timing())
                for _ in range(3):
                    await transport.send(REQUEST)
        finally:
            await runner.cleanup()
        assert len({peer for peer, _ in seen}) == 3
        assert {connection for _, connection in seen} == {"close"}

    asyncio.run(asyncio.wait_for(test(), 10))


class WeightedGateway:
    """A gateway that splits 7/3 across the pools and honours a pin to one pod."""

    checks_backend = True

    def __init__(self, pods: dict[str, tuple[EchoPod, ...]]) -> None:
        self.pods, self.sent, self.pinned = pods, 0, 0

    async def send(self, request: Request) -> Observation:
        self.sent += 1
        selection = request.headers[SELECTION_HEADER]
        if "," not in selection:  # the warm-up: pinned to one pod's ip:3000
            self.pinned += 1
            ip = selection.rpartition(":")[0]
            pod = next(p for pods in self.pods.values() for p in pods if p.ip == ip)
        else:
            app = cases.PRIMARY if self.sent % 10 < 7 else cases.SECONDARY
            pod = self.pods[app][self.sent % 3]
        echo = Echo(
            request.path,
            request.host or "",
            request.method,
            {k.lower(): [v] for k, v in request.headers.items()},
            NAMESPACE,
        )
        return Observation(200, {}, pod.name, "3000", echo)


@pytest.mark.parametrize(
    ("upstream", "pinned"), [(RELEASED, 18), (NEXT, 0)], ids=["released", "next"]
)
def test_the_weighted_warm_up_runs_only_as_released(upstream: Upstream, pinned: int) -> None:
    """GIE v1.6.0 warms each of the six pods up (three passes in a row each); with GIE PR
    #3053 (--upstream next) the warm-up is gone and the rest of the test is the same."""
    pods = {
        app: tuple(
            EchoPod(f"{app}-deployment-{i}", f"10.0.{k}.{i}", app, (3000,)) for i in range(3)
        )
        for k, app in enumerate((cases.PRIMARY, cases.SECONDARY))
    }
    gateway = WeightedGateway(pods)
    trial = Trial(gateway, pods, Timing(), cast(Any, object()), upstream)
    note = asyncio.run(cases.gateway_weighted_across_two_pools(trial))
    assert gateway.pinned == pinned
    assert gateway.sent == pinned + 3 + 200
    assert note.startswith("primary share 0.70")


@pytest.mark.parametrize(
    ("argv", "delay", "upstream"),
    [
        ([], 1.0, RELEASED),
        (["--upstream", "next"], 0.1, NEXT),
        (["--upstream", "next", "--delay-after-failure", "2"], 2.0, NEXT),
    ],
    ids=["released", "next", "next-with-a-delay"],
)
def test_the_upstream_switch_sets_the_wait_after_a_failure(
    argv: list[str], delay: float, upstream: Upstream
) -> None:
    """Gateway API main waits 100 ms after a failed attempt where v1.6.1 waits 1 s;
    --delay-after-failure still decides when given."""
    found, timing = upstream_and_timing(build_parser().parse_args(argv))
    assert (found, timing.delay_after_failure) == (upstream, delay)
