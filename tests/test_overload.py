"""Flow control through the real Envoy: each of the router's answers, as a client gets it.

The demo's topology (Envoy, BBR, one picker per pool, simulated replicas) with
a flow-control configuration whose pool fills with one request per replica:
two long streamed answers hold pool a, and whatever comes next waits in the
picker. Every row these tests record goes to ``docs/reliability.md``
(``make reliability``).
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from demo.topology import Topology
from tests.conftest import write_pod_file
from tests.reliability import record

MODEL = "model-a"
CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: active-request-scorer}]
flowControl:
  defaultRequestTTL: 3s
  noEndpointRequestTTL: 2s
  saturationDetector: {pluginRef: concurrency-detector}
  priorityBands:
  - {priority: 10}
  - {priority: -1, maxRequests: 2}
"""
STALE_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: utilization-detector
- type: queue-scorer
flowControl:
  defaultRequestTTL: 2s
"""
BATCH = {"x-llm-d-inference-objective": "batch"}
INTERACTIVE = {"x-llm-d-inference-objective": "interactive"}


@dataclass(frozen=True)
class Answer:
    status: int
    code: str
    reason: str | None
    started: float
    first_byte: float
    ended: float

    @property
    def row(self) -> str:
        header = f", `x-llm-d-request-dropped-reason: {self.reason}`" if self.reason else ""
        return f"**{self.status}** `{self.code}`{header}"


def topology(work: Path, config: str, *simulator_args: str) -> Topology:
    pods = write_pod_file(work / "pods.yaml")
    (work / "picker.yaml").write_text(config)
    return Topology(work, pods, picker_config=work / "picker.yaml", simulator_args=simulator_args)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    with topology(tmp_path_factory.mktemp("overload"), CONFIG) as started:
        yield started


async def ask(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str] | None = None,
    max_tokens: int = 4,
    *,
    stream: bool = False,
) -> Answer:
    """One completion through the gateway: its status, error code, dropped reason, times."""
    started = time.monotonic()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers or {}) as answer:
        first = await answer.content.read(1)
        first_byte = time.monotonic()
        rest = first + await answer.read()
        code = orjson.loads(rest)["error"]["code"] if answer.status != 200 else ""
        reason = answer.headers.get("x-llm-d-request-dropped-reason")
        return Answer(answer.status, code, reason, started, first_byte, time.monotonic())


def flow_metric(gateway: Topology, family: str, **labels: str) -> float:
    """The sum of a picker a flow-control series' samples carrying ``labels``."""
    port = gateway.services["lwepp-a"].listening["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(f"llm_d_epp_flow_control_{family}")
        and all(label in line for label in wanted)
    )


async def until(check: Any, what: str) -> None:
    """Poll ``check()`` (another process's state) until it holds; fail after 15 s."""
    deadline = time.monotonic() + 15
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def both_busy(
    gateway: Topology, session: aiohttp.ClientSession, tokens: tuple[int, int]
) -> list[asyncio.Task[Answer]]:
    """Two long streamed answers, one on each replica of pool a: the pool is full."""
    before = flow_metric(gateway, "requests_total", outcome="Dispatched")
    holders = [
        asyncio.create_task(ask(session, gateway.url, max_tokens=n, stream=True)) for n in tokens
    ]
    await until(
        lambda: flow_metric(gateway, "requests_total", outcome="Dispatched") >= before + 2,
        "both held",
    )
    return holders


def run(scenario: Any) -> Any:
    async def main() -> Any:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await scenario(session)

    return asyncio.run(main())


def test_a_full_queue_refuses_at_once_and_an_interactive_request_goes_first(
    gateway: Topology,
) -> None:
    """Pool a held by two answers, two batch requests waiting (their band holds two): a third is
    429 rejected-saturated at once; an interactive request that came after the batch ones is
    let go first when a replica frees."""

    async def scenario(session: aiohttp.ClientSession) -> tuple[Answer, Answer, list[Answer]]:
        before = flow_metric(gateway, "requests_total", outcome="Dispatched")
        holders = await both_busy(gateway, session, (150, 400))
        batch = [asyncio.create_task(ask(session, gateway.url, BATCH)) for _ in range(2)]
        await until(lambda: flow_metric(gateway, "queue_size") == 2, "two batch waiting")
        interactive = asyncio.create_task(ask(session, gateway.url, INTERACTIVE))
        await until(lambda: flow_metric(gateway, "queue_size") == 3, "interactive waiting")
        full = await ask(session, gateway.url, BATCH)
        answers = await asyncio.gather(interactive, *batch, *holders)
        assert flow_metric(gateway, "requests_total", outcome="Dispatched") == before + 5
        return full, answers[0], answers[1:3]

    full, interactive, batch = run(scenario)
    assert (full.status, full.code, full.reason) == (
        429,
        "rejected-saturated",
        "rejected-saturated",
    )
    assert full.ended - full.started < 1.0
    assert interactive.status == 200
    assert all(b.status == 200 for b in batch)
    assert interactive.first_byte < min(b.first_byte for b in batch)
    record(
        "Overload",
        "a batch request with its band's queue full (pool a held, 2 batch requests waiting)",
        f"{full.row}, after {1000 * (full.ended - full.started):.0f} ms; an interactive request "
        f"sent after the waiting batch ones was served first "
        f"({interactive.first_byte - interactive.started:.1f} s in all)",
    )


def test_a_request_that_waits_out_its_budget_is_refused_with_its_reason(gateway: Topology) -> None:
    """Pool a held longer than the 3 s queue-wait budget: the waiting request is 429
    rejected-ttl-expired once its budget ran out."""

    async def scenario(session: aiohttp.ClientSession) -> Answer:
        holders = await both_busy(gateway, session, (700, 700))
        waited = await ask(session, gateway.url)
        await asyncio.gather(*holders)
        return waited

    waited = run(scenario)
    assert (waited.status, waited.code, waited.reason) == (
        429,
        "rejected-ttl-expired",
        "rejected-ttl-expired",
    )
    assert 2.9 < waited.ended - waited.started < 10
    record(
        "Overload",
        "a request waiting past `defaultRequestTTL` (3 s) while pool a stays full",
        f"{waited.row}, after {waited.ended - waited.started:.2f} s",
    )


def test_a_client_that_leaves_while_waiting_frees_its_place_at_once(gateway: Topology) -> None:
    """A waiting batch client hangs up: the picker drops its request at once (counted
    EvictedContextCancelled), and the place it held takes the next batch request."""

    async def scenario(session: aiohttp.ClientSession) -> tuple[float, Answer]:
        cancelled = flow_metric(gateway, "requests_total", outcome="EvictedContextCancelled")
        holders = await both_busy(gateway, session, (300, 300))
        leaving = asyncio.create_task(ask(session, gateway.url, BATCH))
        staying = asyncio.create_task(ask(session, gateway.url, BATCH))
        await until(lambda: flow_metric(gateway, "queue_size") == 2, "two batch waiting")
        left = time.monotonic()
        leaving.cancel()
        await until(
            lambda: (
                flow_metric(gateway, "requests_total", outcome="EvictedContextCancelled")
                == cancelled + 1
            ),
            "the place freed",
        )
        freed = time.monotonic() - left
        taken = asyncio.create_task(ask(session, gateway.url, BATCH))
        answers = await asyncio.gather(staying, taken, *holders)
        return freed, answers[1]

    freed, taken = run(scenario)
    assert taken.status == 200  # it waited in the freed place, and was served
    record(
        "Overload",
        "a batch client hanging up while its request waits (its band full)",
        f"its place freed in {1000 * freed:.0f} ms (`EvictedContextCancelled`); the next batch "
        "request took it and was served **200**",
    )


def test_a_pool_without_endpoints_answers_503_rejected_no_endpoints(gateway: Topology) -> None:
    """Pool a's pods turn not ready: a request waits `noEndpointRequestTTL` (2 s) for one to
    appear, then is 503 rejected-no-endpoints; once they are back, requests are served."""
    pods = gateway.pod_file
    original = pods.read_text()

    async def scenario(session: aiohttp.ClientSession) -> tuple[Answer, Answer]:
        lines = original.replace("labels: {pool: a,", "ready: false\n  labels: {pool: a,")
        pods.write_text(lines)
        try:
            await asyncio.sleep(1.5)  # the pod file is checked every second
            gone = await ask(session, gateway.url)
        finally:
            pods.write_text(original)
        await asyncio.sleep(1.5)
        back = await ask(session, gateway.url)
        return gone, back

    gone, back = run(scenario)
    assert (gone.status, gone.code, gone.reason) == (
        503,
        "rejected-no-endpoints",
        "rejected-no-endpoints",
    )
    assert gone.ended - gone.started > 1.9
    assert back.status == 200
    record(
        "Overload",
        "pool a with no ready endpoint (its pods not ready), flow control on",
        f"{gone.row} after waiting {gone.ended - gone.started:.2f} s (`noEndpointRequestTTL`, "
        "2 s) for an endpoint; **200** once the pods were ready again",
    )


def test_sigterm_answers_every_waiting_request_before_the_picker_exits(tmp_path: Path) -> None:
    """SIGTERM to pool a's picker with three requests waiting: each is 503
    rejected-shutting-down, before the process exits."""
    with topology(tmp_path, CONFIG.replace("3s", "30s")) as gateway:

        async def scenario(
            session: aiohttp.ClientSession,
        ) -> tuple[list[Answer], float, float]:
            holders = await both_busy(gateway, session, (600, 600))
            waiting = [asyncio.create_task(ask(session, gateway.url)) for _ in range(3)]
            await until(lambda: flow_metric(gateway, "queue_size") == 3, "three waiting")
            picker = gateway.services["lwepp-a"]
            signalled = time.monotonic()
            picker.process.send_signal(signal.SIGTERM)
            answers = await asyncio.gather(*waiting)
            await asyncio.to_thread(picker.process.wait, 30)
            exited = time.monotonic() - signalled
            await asyncio.gather(*holders, return_exceptions=True)
            return [*answers], max(a.ended for a in answers) - signalled, exited

        answers, answered, exited = run(scenario)
    for answer in answers:
        assert (answer.status, answer.code, answer.reason) == (
            503,
            "rejected-shutting-down",
            "rejected-shutting-down",
        )
    assert answered < exited
    record(
        "Overload",
        "SIGTERM to pool a's picker with 3 requests waiting (and 2 streaming)",
        f"all 3 {answers[0].row}, the last {1000 * answered:.0f} ms after the signal; the picker "
        f"exited {exited:.1f} s after it, once the streaming answers were done",
    )


def test_stale_metrics_count_as_saturated(tmp_path: Path) -> None:
    """Every replica's /metrics answering 503 (utilization detector, flow control on): the pool
    reads saturated, fail-closed, so requests wait and are refused when their budget runs out;
    the stale-endpoints gauge says why."""
    with topology(tmp_path, STALE_CONFIG, "--dead-metrics") as gateway:

        async def scenario(session: aiohttp.ClientSession) -> Answer:
            return await ask(session, gateway.url)

        waited = run(scenario)
        stale = flow_metric(gateway, "stale_endpoints")
        saturation = flow_metric(gateway, "pool_saturation", stage="effective")
    assert (waited.status, waited.reason) == (429, "rejected-ttl-expired")
    assert stale == 2
    assert saturation == 1.0
    record(
        "Overload",
        "every replica's `/metrics` answering 503 (utilization detector, flow control on)",
        f"fail-closed: {waited.row} after {waited.ended - waited.started:.2f} s "
        f"(`defaultRequestTTL` 2 s); `llm_d_epp_flow_control_stale_endpoints` {stale:g}, "
        f'`pool_saturation{{stage="effective"}}` {saturation:g}',
    )
