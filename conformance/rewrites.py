"""Model rewrites (InferenceModelRewrite) to a conformance suite's rules: Switchyard's own cases.

GIE's suite has no test for InferenceModelRewrite, now or in its history (the
API moved to the llm-d router, whose tests are unit, hermetic and e2e tests
of its own). These cases are written the way ``conformance.cases`` writes
GIE's: one function each, its request and pass criteria in the open, judged
by the suite's helpers (``compare``, ``eventually``: three passes in a row,
``send_many``), and run twice: against the pool's picker alone (the ext_proc
stream Envoy would open, the model server played by the transport) and
through the gateway (a real Envoy, BBR, the picker and simulated model
servers, ``demo.topology``), so a failure says whose it is.

The world: one pool, ``a``, of two simulated servers of model ``m`` that also
serve LoRA adapters (``ADAPTERS``). Each response says which model the
request body named when it reached the server (``x-sim-served-model``: the
target) and, in its body, the model the client sees (mapped back). The rewrites
live in a file the picker re-reads when it changes (``RewriteTrial.apply``
replaces it and waits, with a marker request, until the picker serves the new
set); the names the rules match are routed to the pool from the start
(``ALIASES``).

``python -m conformance.rewrites`` runs them and prints the table;
``tests/test_rewrite_cases.py`` runs each in ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import openai
import yaml

from conformance.client import (
    Expected,
    Failed,
    Observation,
    Request,
    Timing,
    Transport,
    Unreachable,
    eventually,
    send_many,
)
from conformance.crds import Versions
from conformance.picker import DESTINATION, NotForPicker, sorted_failures
from conformance.run import CaseResult, Result, Suite, details, table
from demo.topology import Process, Topology, free_ports
from pods.file import load_pods
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from wire.extproc import BodyMode

POOL: Final = "a"
MODEL: Final = "m"
ADAPTERS: Final = (
    *("m-canary", "m-exact", "m-generic", "m-older", "m-newer", "m-first", "m-second"),
    *("m-tie-a", "m-tie-b", "m-header", "m-old-header", "marker-0", "marker-1"),
)
"""What pool ``a``'s servers serve besides ``m``: each case's targets, and the markers."""
ALIASES: Final = ("exact-vs-generic", "oldest", "ordered", "tied", "marker")
"""The names only a rewrite makes servable: the gateway routes them to pool ``a``."""
SERVED: Final = "x-sim-served-model"
REWRITE_HEADER: Final = "x-llm-d-model-name-rewrite"
OLD_REWRITE_HEADER: Final = "x-gateway-model-name-rewrite"
Z_999: Final = 3.2905
"""The two-sided 99.9% quantile of the normal law: a binomial count's bound is
``n·p ± Z_999·√(n·p·(1−p))``."""


def rewrite(name: str, *rules: Mapping[str, Any], created: str | None = None) -> dict[str, Any]:
    """An InferenceModelRewrite of pool ``a``."""
    metadata: dict[str, Any] = {"name": name}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {
        "apiVersion": "llm-d.ai/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": metadata,
        "spec": {"poolRef": {"name": POOL}, "rules": list(rules)},
    }


def rule(*models: str, **weights: int | None) -> dict[str, Any]:
    """A rule matching ``models`` exactly (none: every request), to ``weights``' targets
    (keyword names with ``_`` for ``-``; None: no weight)."""
    targets = [
        {"modelRewrite": t.replace("_", "-"), **({} if w is None else {"weight": w})}
        for t, w in weights.items()
    ]
    found: dict[str, Any] = {"targets": targets}
    if models:
        found["matches"] = [{"model": {"type": "Exact", "value": m}} for m in models]
    return found


def completion(model: str | None, **headers: str) -> Request:
    """A completion request naming ``model`` (None: naming none)."""
    body: dict[str, Any] = {"prompt": "Say hello", "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return Request("/v1/completions", None, "POST", headers, json.dumps(body))


def chat(model: str, *, stream: bool) -> Request:
    body = {
        "model": model,
        "max_tokens": 12,
        "stream": stream,
        "messages": [{"role": "user", "content": "Say hello at some length"}],
    }
    return Request("/v1/chat/completions", None, "POST", {}, json.dumps(body))


def served(request: Request, target: str) -> Expected:
    """The request answered 200 by a server that was asked for ``target``."""
    return Expected(request, headers={SERVED: target})


# --- what came back --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer(Observation):
    """An observation with the response body the client got."""

    body: bytes = b""

    def models(self) -> list[str]:
        """Every ``model`` the client was told: the JSON answer's, or each event's."""
        if self.body.startswith(b"data:"):
            events = [line[5:].strip() for line in self.body.split(b"\n") if line[:5] == b"data:"]
            found = [json.loads(e) for e in events if e and e != b"[DONE]"]
        else:
            found = [json.loads(self.body)] if self.body else []
        return [str(item["model"]) for item in found if isinstance(item, dict) and "model" in item]


def names_only(model: str) -> Callable[[Observation], str | None]:
    """``send_many``'s ``accept``: every ``model`` the client sees is ``model``."""

    def accept(seen: Observation) -> str | None:
        told = seen.models() if isinstance(seen, Answer) else []
        if not told or set(told) != {model}:
            return f"the client was told model {sorted(set(told))}, not {model!r}"
        return None

    return accept


class GatewayTransport:
    """HTTP/1.1 to the gateway; the pod and the served model from the simulator's stamps."""

    checks_backend: Final = False

    def __init__(self, session: aiohttp.ClientSession, url: str, timing: Timing) -> None:
        self._session, self._url = session, url
        self._timeout = aiohttp.ClientTimeout(total=timing.request_timeout)

    async def send(self, request: Request) -> Answer:
        try:
            async with self._session.request(
                request.method,
                self._url + request.path,
                headers={"content-type": "application/json", **request.headers},
                data=request.body.encode(),
                timeout=self._timeout,
            ) as response:
                body = await response.read()
                headers = {
                    name.lower(): response.headers.getall(name)
                    for name in dict.fromkeys(response.headers.keys())
                }
                pod = response.headers.get("x-sim-pod", "")
                return Answer(response.status, headers, pod, body=body)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise Unreachable(f"{type(error).__name__}: {error}") from None


class PickerTransport:
    """The pool's picker alone, as Envoy drives it, with this transport as the model server.

    The request goes as BBR leaves it (``x-gateway-model-name`` from the body),
    full duplex both ways; the body the picker sends upstream names the
    served model; the "server" answers it in the request's shape (JSON, or
    events for ``"stream": true``) cut in 7-byte chunks, so the mapping back
    must survive a name split across chunks.
    """

    checks_backend: Final = False
    CHUNK: Final = 7

    def __init__(self, target: str, pods: Mapping[str, str]) -> None:
        """``target``: the picker's ext_proc address; ``pods``: ``ip:port`` → pod name."""
        self._client = ExtProcClient(target, tls=True)
        self._pods = pods

    async def send(self, request: Request) -> Answer:
        body = request.body.encode()
        named = json.loads(body).get("model")
        headers = [
            (":authority", "gateway"),
            (":path", request.path),
            (":method", request.method),
            ("content-type", "application/json"),
            ("x-request-id", str(uuid.uuid4())),
            *((n.lower(), v) for n, v in request.headers.items()),
            *((("x-gateway-model-name", named),) if isinstance(named, str) else ()),
        ]
        modes = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
        stream = self._client.open()
        with sorted_failures(stream):
            await stream.send(request_headers(headers, body_modes=modes))
            await stream.send(request_body(body))
            first = await stream.recv()
            if first is None:
                raise Failed("the picker ended the stream without answering the request")
            if first.WhichOneof("response") == "immediate_response":
                return Answer(first.immediate_response.status.code)
            endpoint = dict(set_headers(first)).get(DESTINATION, "")
            if not endpoint:
                raise Failed(f"the picker named no endpoint ({DESTINATION})")
            upstream = b""
            while True:
                reply = await stream.recv()
                if reply is None:
                    raise Failed("the picker ended the stream before sending the body on")
                part = reply.request_body.response.body_mutation.streamed_response
                upstream += part.body
                if part.end_of_stream:
                    break
            model = json.loads(upstream).get("model", "")
            answer = _server_answer(model, json.loads(body).get("stream") is True)
            await stream.send(response_headers([(":status", "200")]))
            pieces = [answer[i : i + self.CHUNK] for i in range(0, len(answer), self.CHUNK)]
            for i, piece in enumerate(pieces):
                await stream.send(response_body(piece, end_of_stream=i == len(pieces) - 1))
            await stream.close()
            back = b""
            while (reply := await stream.recv()) is not None:
                if reply.WhichOneof("response") == "response_body":
                    back += reply.response_body.response.body_mutation.streamed_response.body
        pod = self._pods.get(endpoint, f"<not a pod: {endpoint}>")
        return Answer(200, {SERVED: [model]}, pod, body=back)

    async def close(self) -> None:
        await self._client.close()


def _server_answer(model: str, stream: bool) -> bytes:
    """What a model server answers for ``model``: a JSON completion, or events and ``[DONE]``."""
    if not stream:
        return json.dumps({"id": "c", "object": "text_completion", "model": model}).encode()
    events = [{"id": "c", "model": model, "choices": [{"delta": {"content": w}}]} for w in "abc"]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


# --- the trial -------------------------------------------------------------------------------


@dataclass(slots=True)
class RewriteTrial:
    """What a case runs with: a transport, the suite's timing, and the rewrite file."""

    transport: Transport
    timing: Timing
    path: Path
    picker_log: Path
    """The picker's log (JSON lines), where it says what it made of the file."""
    gateway: str | None = None
    """The gateway's URL when through it (None: the picker alone)."""

    @property
    def through_gateway(self) -> bool:
        return self.gateway is not None

    async def eventually(self, expected: Expected) -> Observation:
        return await eventually(self.transport, expected, self.timing)

    async def apply(self, rewrites: Sequence[Mapping[str, Any]], *, wait: bool = True) -> None:
        """Replace the rewrite file (whole, at once: a rename) and, with ``wait``, wait until
        the picker serves the new set: a marker rule sends ``marker`` to an adapter that
        differs from the last set's."""
        marker = "marker-1" if "marker-0" in self.path.read_text() else "marker-0"
        documents = [*rewrites, rewrite("marker", rule("marker", **{marker: None}))]
        write_atomically(self.path, yaml.safe_dump_all(documents, sort_keys=False))
        if wait:
            await self.eventually(served(completion("marker"), marker))


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by renaming a full file over it: a reader sees the old file
    or the new one, never half of one."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(temporary, path)


# --- the cases -------------------------------------------------------------------------------

SPLIT_TOTAL: Final = 2000
SPLIT_CONCURRENCY: Final = 20


def binomial_bound(total: int, share: float) -> float:
    """The 99.9% bound on |count − total·share| of a binomial count."""
    return Z_999 * math.sqrt(total * share * (1 - share))


async def weighted_split(t: RewriteTrial) -> str:
    """2,000 requests for ``m`` (20 at a time) under a 90/10 rewrite to ``m`` and
    ``m-canary``: the canary's count within the binomial 99.9% bound of 200, every answer
    naming ``m`` to the client."""
    await t.apply([rewrite("split", rule(MODEL, m=90, m_canary=10))])
    request = completion(MODEL)
    seen = await send_many(
        t.transport,
        Expected(request),
        t.timing,
        total=SPLIT_TOTAL,
        concurrency=SPLIT_CONCURRENCY,
        accept=names_only(MODEL),
    )
    canary = sum(1 for o in seen if o.headers.get(SERVED) == ["m-canary"])
    base = sum(1 for o in seen if o.headers.get(SERVED) == [MODEL])
    if canary + base != len(seen):
        raise Failed(f"{len(seen) - canary - base} answers served by neither target")
    bound = binomial_bound(SPLIT_TOTAL, 0.1)
    if abs(canary - SPLIT_TOTAL * 0.1) > bound:
        raise Failed(f"m-canary served {canary} of {SPLIT_TOTAL}: not within 200 ± {bound:.0f}")
    return f"m-canary served {canary} of {SPLIT_TOTAL} (200 ± {bound:.0f} at 99.9%)"


async def exact_before_generic(t: RewriteTrial) -> str:
    """A rule naming the model exactly wins over a generic rule, even an older one; a model
    no rule names goes by the generic rule."""
    await t.apply(
        [
            rewrite("generic", rule(m_generic=None), created="2020-01-01T00:00:00Z"),
            rewrite(
                "exact", rule("exact-vs-generic", m_exact=None), created="2026-01-01T00:00:00Z"
            ),
        ]
    )
    await t.eventually(served(completion("exact-vs-generic"), "m-exact"))
    await t.eventually(served(completion(MODEL), "m-generic"))
    return ""


async def oldest_resource_first(t: RewriteTrial) -> str:
    """Two rewrites naming the same model: the older one's rule decides, whatever the order
    the source lists them in."""
    await t.apply(
        [
            rewrite("newer", rule("oldest", m_newer=None), created="2025-06-01T00:00:00Z"),
            rewrite("older", rule("oldest", m_older=None), created="2025-01-01T00:00:00Z"),
        ]
    )
    await t.eventually(served(completion("oldest"), "m-older"))
    return ""


async def list_order_within_one(t: RewriteTrial) -> str:
    """Two rules of one rewrite naming the same model: the first in the list decides."""
    await t.apply(
        [rewrite("ordered", rule("ordered", m_first=None), rule("ordered", m_second=None))]
    )
    await t.eventually(served(completion("ordered"), "m-first"))
    return ""


async def ties_in_source_order(t: RewriteTrial) -> str:
    """Created in the same second, which the router leaves to an unstable sort: here the
    order the source gives decides (a file's order; the API's: by name), every time."""
    same = "2025-02-01T00:00:00Z"
    await t.apply(
        [
            rewrite("tie-b", rule("tied", m_tie_b=None), created=same),
            rewrite("tie-a", rule("tied", m_tie_a=None), created=same),
        ]
    )
    await t.eventually(served(completion("tied"), "m-tie-b"))
    return "Switchyard's rule: the router promises no order here"


async def header_target(t: RewriteTrial) -> str:
    """``x-llm-d-model-name-rewrite`` (and the older ``x-gateway-model-name-rewrite``) names
    the target when no rule matches the body's model; a rule that matches overrides it. The
    client is told its own model either way."""
    await t.apply([rewrite("canary", rule("exact-vs-generic", m_canary=None))])
    header = completion(MODEL, **{REWRITE_HEADER: "m-header"})
    old = completion(MODEL, **{OLD_REWRITE_HEADER: "m-old-header"})
    overridden = completion("exact-vs-generic", **{REWRITE_HEADER: "m-header"})
    for request, target, client in (
        (header, "m-header", MODEL),
        (old, "m-old-header", MODEL),
        (overridden, "m-canary", "exact-vs-generic"),
    ):
        seen = await t.eventually(served(request, target))
        if problem := names_only(client)(seen):
            raise Failed(f"{request.headers}: {problem}")
    return ""


async def response_mapped_back(t: RewriteTrial) -> str:
    """A buffered answer and a streamed one (every event) name the model the client sent,
    though a server of the target answered."""
    await t.apply([rewrite("canary", rule(MODEL, m_canary=None))])
    for request in (completion(MODEL), chat(MODEL, stream=False), chat(MODEL, stream=True)):
        seen = await t.eventually(served(request, "m-canary"))
        if problem := names_only(MODEL)(seen):
            raise Failed(f"{request.path}: {problem}")
    return ""


async def no_model(t: RewriteTrial) -> str:
    """A body naming no model, with no generic rule: 400 naming the field (the router's
    answer); with a generic rule, its target serves it."""
    if t.through_gateway:
        raise NotForPicker("the gateway answers a request naming no model itself (404)")
    await t.apply([rewrite("canary", rule(MODEL, m_canary=None))])
    refused = await t.transport.send(completion(None))
    if refused.status != 400:
        raise Failed(f"a body naming no model: expected 400, got {refused.status}")
    await t.apply([rewrite("default", rule(m_generic=None))])
    await t.eventually(served(completion(None), "m-generic"))
    return ""


async def openai_sdk(t: RewriteTrial) -> str:
    """The official OpenAI SDK, sent to ``m-canary`` by a rewrite, sees the model it asked
    for: a completion, a chat and every chunk of a streamed chat."""
    if t.gateway is None:
        raise NotForPicker("the SDK speaks HTTP to a gateway")
    await t.apply([rewrite("canary", rule(MODEL, m_canary=None))])
    return await asyncio.to_thread(_sdk_calls, t.gateway)


def _sdk_calls(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
    messages: Any = [{"role": "user", "content": "hi"}]
    chatted = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
    )
    told = {raw.parse().model, chatted.model, *(chunk.model for chunk in chunks)}
    if told != {MODEL} or raw.headers.get(SERVED) != "m-canary":
        raise Failed(f"the SDK was told {sorted(told)}, served {raw.headers.get(SERVED)!r}")
    return f"completion, chat and {len(chunks)} streamed chunks all name {MODEL!r}"


RELOAD_TARGETS: Final = ("m-canary", "m-exact", "m-canary", "m-exact")


async def reload_under_load(t: RewriteTrial) -> str:
    """The rewrite file replaced four times (and broken once) while requests flow, 8 at a
    time: none is lost or answered with a wrong name, each replacement is followed, the
    broken one leaves the last good set in force."""
    await t.apply([rewrite("moving", rule(MODEL, m_canary=None))])
    answers: list[Observation] = []
    stop = asyncio.Event()

    async def flow() -> None:
        while not stop.is_set():
            answers.append(await t.transport.send(completion(MODEL)))

    async def followed(target: str, since: int) -> None:
        deadline = time.monotonic() + t.timing.max_time_to_consistency
        while not any(o.headers.get(SERVED) == [target] for o in answers[since:]):
            if time.monotonic() > deadline:
                raise Failed(f"the change to {target} was never followed")
            await asyncio.sleep(0.01)

    flows = [asyncio.create_task(flow()) for _ in range(8)]
    try:
        for target in RELOAD_TARGETS:
            since = len(answers)
            await t.apply([rewrite("moving", rule(MODEL, **{target: None}))], wait=False)
            await followed(target, since)
        rejected = _rejections(t.picker_log)
        write_atomically(t.path, "kind: [not, a, rewrite\n")  # broken: the last set stays
        await _until(lambda: _rejections(t.picker_log) > rejected, t.timing, "the broken edit")
        since = len(answers) + 8  # what was in flight may have been decided before
        await followed(RELOAD_TARGETS[-1], since)
    finally:
        stop.set()
        await asyncio.gather(*flows)
    wrong = [o for o in answers if o.status != 200 or names_only(MODEL)(o) is not None]
    if wrong:
        raise Failed(f"{len(wrong)} of {len(answers)} requests lost or misnamed: {wrong[0]}")
    late = {tuple(o.headers.get(SERVED) or ()) for o in answers[since:]}
    if late != {(RELOAD_TARGETS[-1],)}:
        raise Failed(f"after the broken edit, served {late}")
    return f"{len(answers)} requests, 4 replacements and a broken edit, none lost"


def _rejections(log: Path) -> int:
    """How many times the picker has said it rejected the rewrite file."""
    return log.read_text(errors="replace").count('"model rewrite file rejected')


async def _until(check: Callable[[], bool], timing: Timing, what: str) -> None:
    """Poll ``check`` (state in another process, with no event of its own) until it holds."""
    deadline = time.monotonic() + timing.max_time_to_consistency
    while not check():
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not seen within {timing.max_time_to_consistency:g} s")
        await asyncio.sleep(0.02)


@dataclass(frozen=True, slots=True)
class RewriteCase:
    """A case: its name and what it runs (``Trial`` → a note)."""

    name: str
    run: Callable[[RewriteTrial], Awaitable[str]]
    origin: str = "Switchyard"


CASES: Final = (
    RewriteCase("ModelRewriteWeightedSplit", weighted_split),
    RewriteCase("ModelRewriteExactBeforeGeneric", exact_before_generic),
    RewriteCase("ModelRewriteOldestResourceFirst", oldest_resource_first),
    RewriteCase("ModelRewriteListOrder", list_order_within_one),
    RewriteCase("ModelRewriteTiesInSourceOrder", ties_in_source_order),
    RewriteCase("ModelRewriteHeaderTarget", header_target),
    RewriteCase("ModelRewriteResponseMappedBack", response_mapped_back),
    RewriteCase("ModelRewriteNoModel", no_model),
    RewriteCase("ModelRewriteOpenAISDK", openai_sdk),
    RewriteCase("ModelRewriteReloadUnderLoad", reload_under_load),
)


# --- the world, and a run --------------------------------------------------------------------


def pod_file(path: Path) -> Path:
    """Pool ``a``: two servers of ``m`` and its adapters, on ports the OS chooses."""
    adapters = ",".join(ADAPTERS)
    lines = ["pods:"]
    for index, port in enumerate(free_ports(2)):
        lines += [
            f"- name: {POOL}-{index}",
            "  address: 127.0.0.1",
            f"  ports: [{port}]",
            f"  labels: {{pool: {POOL}, model: {MODEL}, adapters: '{adapters}'}}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def rewrite_world(work_dir: Path, *, one_hop: bool = False) -> Iterator[tuple[Topology, Path]]:
    """The gateway of pool ``a`` with its rewrite file (every alias routed), running."""
    work_dir.mkdir(parents=True, exist_ok=True)
    rewrites = work_dir / "rewrites.yaml"
    routed = rewrite("aliases", rule(*ALIASES, m=None))
    write_atomically(rewrites, yaml.safe_dump(routed, sort_keys=False))
    topology = Topology(
        work_dir,
        pod_file(work_dir / "pods.yaml"),
        simulator_args=["--time-scale", "0"],
        demo_flags=False,
        one_hop=one_hop,
        model_rewrites=rewrites,
    )
    with topology:
        yield topology, rewrites


def picker_service(topology: Topology) -> Process:
    """The process that picks for pool ``a``: its picker, or the one hop."""
    return topology.services.get("onehop") or topology.services[f"lwepp-{POOL}"]


def picker_address(topology: Topology) -> str:
    return f"127.0.0.1:{picker_service(topology).listening['grpc_port']}"


def pods_by_endpoint(topology: Topology) -> dict[str, str]:
    return {f"{p.address}:{port}": p.name for p in load_pods(topology.pod_file) for port in p.ports}


async def run_case(
    case: RewriteCase, topology: Topology, rewrites: Path, timing: Timing
) -> CaseResult:
    """The case at the picker alone, then through the gateway (``conformance.run``'s order)."""
    results: dict[str, Result] = {}
    picker = PickerTransport(picker_address(topology), pods_by_endpoint(topology))
    log = picker_service(topology).log
    try:
        async with aiohttp.ClientSession() as session:
            gateway = GatewayTransport(session, topology.url, timing)
            for mode, transport, url in (
                ("picker", picker, None),
                ("gateway", gateway, topology.url),
            ):
                trial = RewriteTrial(transport, timing, rewrites, log, url)
                results[mode] = await _run_one(case, trial)
    finally:
        await picker.close()
    return CaseResult(case.name, case.origin, results["gateway"], results["picker"])


async def _run_one(case: RewriteCase, trial: RewriteTrial) -> Result:
    start = time.monotonic()
    try:
        note = await case.run(trial)
    except NotForPicker as why:
        return Result("skipped", str(why), time.monotonic() - start)
    except Failed as failure:
        return Result("failed", str(failure), time.monotonic() - start)
    return Result("passed", note, time.monotonic() - start)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m conformance.rewrites [--work-dir DIR] [--one-hop]``: every case, a table."""
    parser = argparse.ArgumentParser(prog="python -m conformance.rewrites", description=__doc__)
    parser.add_argument("--work-dir", type=Path, help="logs and the rewrite file (default: temp)")
    parser.add_argument("--one-hop", action="store_true", help="the one hop instead of two")
    args = parser.parse_args(argv)
    timing = Timing(max_time_to_consistency=30, delay_after_failure=0.1)
    with tempfile.TemporaryDirectory(prefix="rewrites-") as scratch:
        work = args.work_dir or Path(scratch)
        began = time.monotonic()
        with rewrite_world(work, one_hop=args.one_hop) as (topology, rewrites):
            suite = Suite(Versions("", "", ""))
            for case in CASES:
                suite.results.append(asyncio.run(run_case(case, topology, rewrites, timing)))
        suite.seconds = time.monotonic() - began
    print(table(suite))
    print()
    print(details(suite))
    print(f"\nWhole run {suite.seconds:.1f} s.")
    if not suite.passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
