"""Random ext_proc streams against each service's real gRPC server, as a separate process.

Hypothesis draws message sequences Envoy might send (an exchange in any body
mode, chunked anywhere, with trailers or not) and ones it never would (any
message in any order, no message at all, random bytes, random header and
metadata values, raw header bytes that are no UTF-8), and hangs up on some
streams half-way. For every stream:

- it ends, with gRPC status OK, within a deadline (no crash, no hang);
- every reply is one ext_proc response of a phase that was sent, and an
  ``ImmediateResponse`` comes last if at all;
- every header the service sets is one Envoy accepts (name and value), so no
  input makes Envoy fail the request with a 500;
- for an exchange Envoy could send that was not refused: one headers reply
  per headers message, one reply per body message outside full duplex, and in
  full duplex the body sent back whole and unchanged.

After the run, each service holds no more tasks or descriptors than before
it, and its memory grew by less than ``MEMORY_SLACK``. ``make test`` runs a
few hundred examples, the same ones each time; ``make fuzz`` runs
``FUZZ_EXAMPLES`` (default 3000) per service, new ones each time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import text_format
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lwepp.picking import SUBSET_KEY, SUBSET_NAMESPACE
from wire.exchange import header_value_problem
from wire.extproc import (
    CHUNK_LIMIT,
    BodyMode,
    ProcessingRequest,
    ProcessingResponse,
    SendMode,
    struct,
)
from wire.stream import EXT_PROC_SERVICE

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 120,
    derandomize=not EXAMPLES,  # make test: the same examples every run
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CAP = 64 * 1024
"""``--max-body-bytes`` of the fuzzed services: small, so the 413 path is reached cheaply."""
STREAM_DEADLINE = 15.0
MEMORY_SLACK = 16 * 2**20
"""Resident memory a service may gain over the run: allocator pools and caches, not a leak
(a leak of even one message per stream passes it within a ``make fuzz`` run)."""
Process = Any
"""A synchronous ``Process`` call: ``process(requests, timeout=...)`` (grpcio has no types)."""
HEADER_NAME = re.compile(r":?[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

PODS = """
pods:
- {name: p0, address: 10.0.0.1, ports: [8000]}
- {name: p1, address: 10.0.0.2, ports: [8000, 8002]}
- {name: p2, address: 10.0.0.3, ports: [8000]}
"""
PIPELINE = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {autoTune: false, blockSizeTokens: 2}
- type: session-affinity-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 2}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: session-affinity-scorer
  - pluginRef: max-score-picker
"""


# --- the services, as an operator runs them ------------------------------------------------


@dataclass
class Served:
    """A service process: its ports, log, and a client on its ext_proc port."""

    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int
    log: Path

    def runtime(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.metrics_port}/debug/runtime"
        with urllib.request.urlopen(url, timeout=5) as page:
            state: dict[str, Any] = json.load(page)
        return state


def start(log: Path, module: str, *args: str) -> Served:
    """``python -m module`` on free ports, its log in a file (a pipe could fill and block it)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", module, *args),
                *("--grpc-port=0", "--grpc-health-port=0", "--metrics-port=0"),
                *("--grace=2", f"--max-body-bytes={CAP}", "--secure-serving=false"),
                "--enable-debug-pages",  # /debug/runtime: what the run leaves behind
            ],
            stderr=out,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if '"listening"' in line:
                event = json.loads(line)
                return Served(process, event["grpc_port"], event["metrics_port"], log)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"{module} did not start: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module", params=["bbr", "lwepp", "lwepp-pipeline"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, Process, dict[str, Any]]]:
    """Each service in turn, a gRPC client for it, and its state after a warm-up."""
    work = tmp_path_factory.mktemp(request.param)
    args: list[str] = []
    if request.param.startswith("lwepp"):
        (work / "pods.yaml").write_text(PODS)
        args = ["--pods", str(work / "pods.yaml")]
        if request.param == "lwepp-pipeline":
            (work / "config.yaml").write_text(PIPELINE)
            args += ["--config", str(work / "config.yaml"), "--explain", "all"]
    service = start(work / "service.log", request.param.split("-")[0], *args)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            process: Process = channel.stream_stream(
                f"/{EXT_PROC_SERVICE}/Process",
                request_serializer=ProcessingRequest.SerializeToString,
                response_deserializer=ProcessingResponse.FromString,
            )
            # Warm up (imports, caches, allocator pools) before the baseline is taken.
            for messages in warm_up():
                assert play(process, Plan(messages, True, None))[1] == "OK"
            yield service, process, service.runtime()
    finally:
        service.process.kill()
        service.process.wait()


def warm_up() -> list[list[ProcessingRequest]]:
    headers = header_map([(":method", "POST"), (":path", "/v1/completions")])
    body = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()
    modes = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
    exchange = [
        make("request_headers", headers=headers, modes=modes),
        make("request_body", body=body, end_of_stream=True),
        make("response_headers", headers=header_map([(":status", "200")]), end_of_stream=True),
    ]
    return [exchange] * 200


# --- building messages -------------------------------------------------------------------


def header_map(pairs: Sequence[tuple[str, str | bytes]]) -> Any:
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v if isinstance(v, bytes) else v.encode())
            for k, v in pairs
        ]
    )


def make(
    kind: str,
    *,
    headers: Any = None,
    body: bytes = b"",
    end_of_stream: bool = False,
    modes: tuple[int, int] | None = None,
    metadata: dict[str, dict[str, Any]] | None = None,
) -> ProcessingRequest:
    """One ``ProcessingRequest`` of ``kind`` (``"none"``: no phase set at all)."""
    message = ProcessingRequest()
    if kind.endswith("_headers"):
        getattr(message, kind).CopyFrom(
            pb.HttpHeaders(headers=headers, end_of_stream=end_of_stream)
        )
    elif kind.endswith("_body"):
        getattr(message, kind).CopyFrom(pb.HttpBody(body=body, end_of_stream=end_of_stream))
    elif kind.endswith("_trailers"):
        getattr(message, kind).CopyFrom(pb.HttpTrailers())
    if modes is not None:
        message.protocol_config.request_body_mode = SendMode(modes[0])
        message.protocol_config.response_body_mode = SendMode(modes[1])
    for namespace, values in (metadata or {}).items():
        message.metadata_context.filter_metadata[namespace].CopyFrom(struct(values))
    return message


# --- what to draw ---------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
"""Any text protobuf can carry (a ``string`` field must be UTF-8: no lone surrogates)."""

NAMES = st.sampled_from(
    [
        ":method",
        ":path",
        ":status",
        "content-type",
        "content-length",
        "x-request-id",
        "test-epp-endpoint-selection",
        "x-gateway-model-name",
        "x-switchyard-explain",
        "x-session-token",
        "x-gateway-destination-endpoint",
    ]
) | TEXT.filter(bool)
VALUES = (
    TEXT
    | st.binary(max_size=40)
    | st.sampled_from(
        [
            "10.0.0.1",
            "10.0.0.2:8002,10.0.0.9",
            "1",
            "cDE=",
            "[::1]:80",
            "",
            "v" * 5000,
            "v" * 70_000,
        ]
    )
)
HEADERS = st.lists(st.tuples(NAMES, VALUES), max_size=8).map(header_map)
MODES = st.sampled_from(
    [BodyMode.NONE, BodyMode.STREAMED, BodyMode.BUFFERED, BodyMode.FULL_DUPLEX_STREAMED]
)
ANY_MODE = MODES | st.integers(0, 7)

JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
METADATA = st.dictionaries(
    st.sampled_from(["envoy.lb", SUBSET_NAMESPACE]) | TEXT,
    st.dictionaries(
        st.sampled_from([SUBSET_KEY, "x-gateway-destination-endpoint-served"]) | TEXT,
        JSON | st.lists(st.sampled_from(["10.0.0.1", "10.0.0.2:8002", "x"]), max_size=3),
        max_size=2,
    ),
    max_size=2,
)

MODELS = TEXT | st.integers() | st.none() | st.lists(TEXT, max_size=2) | st.just("m\r\nx: y")
BODIES = (
    st.binary(max_size=300)
    | st.builds(
        lambda model, prompt: json.dumps({"model": model, "prompt": prompt}).encode(),
        MODELS,
        TEXT,
    )
    | st.integers(CHUNK_LIMIT - 100, CAP + 100).map(
        lambda n: b'{"model": "m", "prompt": "' + b"x" * n + b'"}'
    )
)

KINDS = [
    "request_headers",
    "request_body",
    "request_trailers",
    "response_headers",
    "response_body",
    "response_trailers",
    "none",
]


@st.composite
def any_message(draw: st.DrawFn) -> ProcessingRequest:
    """Any message at all, fields drawn at random."""
    kind = draw(st.sampled_from(KINDS))
    return make(
        kind,
        headers=draw(HEADERS),
        body=draw(BODIES),
        end_of_stream=draw(st.booleans()),
        modes=draw(st.none() | st.tuples(ANY_MODE, ANY_MODE)),
        metadata=draw(METADATA),
    )


def split(draw: st.DrawFn, body: bytes) -> list[bytes]:
    """``body`` cut at up to three random places."""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    edges = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


@st.composite
def exchange(draw: st.DrawFn) -> list[ProcessingRequest]:
    """An exchange Envoy could send: request, then maybe a response, in the body modes drawn."""
    modes = draw(st.tuples(MODES, MODES))
    messages: list[ProcessingRequest] = []
    for phase, mode in zip(("request", "response"), modes, strict=True):
        if phase == "response" and not draw(st.booleans()):
            break
        has_body = mode != BodyMode.NONE and draw(st.integers(0, 4)) > 0  # mostly
        body = draw(BODIES) if has_body else None
        trailers = (
            body is not None and mode == BodyMode.FULL_DUPLEX_STREAMED and draw(st.booleans())
        )
        messages.append(
            make(
                f"{phase}_headers",
                headers=draw(HEADERS),
                end_of_stream=body is None,
                modes=modes if phase == "request" else None,
                metadata=draw(METADATA),
            )
        )
        if body is None:
            continue
        pieces = [body] if mode == BodyMode.BUFFERED else split(draw, body)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            messages.append(make(f"{phase}_body", body=piece, end_of_stream=last and not trailers))
        if trailers:
            messages.append(make(f"{phase}_trailers"))
    return messages


@dataclass(frozen=True)
class Plan:
    messages: list[ProcessingRequest]
    well_formed: bool
    hang_up_after: int | None

    def __repr__(self) -> str:
        """Short enough for a failure report: each message in text format, long values cut."""
        shown = []
        for message in self.messages:
            text = text_format.MessageToString(message, as_one_line=True, as_utf8=True)
            shown.append(text if len(text) < 400 else text[:400] + f"... ({len(text)} chars)")
        return (
            f"Plan(well_formed={self.well_formed}, hang_up_after={self.hang_up_after}, "
            f"messages=[\n  " + ",\n  ".join(shown) + "])"
        )

    def _repr_pretty_(self, printer: Any, _cycle: bool) -> None:
        printer.text(repr(self))  # Hypothesis' printer would otherwise show every field whole


@st.composite
def mangled(draw: st.DrawFn) -> list[ProcessingRequest]:
    """An exchange with messages dropped, repeated and reordered (a confused or hostile peer)."""
    messages = draw(exchange())
    order = draw(st.lists(st.integers(0, len(messages) - 1), max_size=len(messages) + 2))
    return [messages[i] for i in order]


EXCHANGES = st.builds(Plan, messages=exchange(), well_formed=st.just(True), hang_up_after=st.none())
PLANS = (
    EXCHANGES
    | EXCHANGES
    | st.builds(
        Plan,
        messages=mangled(),
        well_formed=st.just(False),
        hang_up_after=st.none() | st.integers(0, 8),
    )
    | st.builds(
        Plan,
        messages=st.lists(any_message(), max_size=8),
        well_formed=st.just(False),
        hang_up_after=st.none() | st.integers(0, 8),
    )
)


# --- the stream and its checks ----------------------------------------------------------------


def play(process: Process, plan: Plan) -> tuple[list[ProcessingResponse], str]:
    """Send the plan's messages (hanging up where it says), read every reply; return them
    and the stream's gRPC status name.

    The synchronous client sends as Envoy does: whatever the service does not
    read once it has ended the stream (after an ``ImmediateResponse``) is
    dropped, and the status is the service's.
    """
    started = threading.Event()
    calls: list[Any] = []

    def requests() -> Iterator[ProcessingRequest]:
        started.wait()
        for i, message in enumerate(plan.messages):
            if plan.hang_up_after == i:
                calls[0].cancel()  # the client goes away
                return
            yield message

    call = process(requests(), timeout=STREAM_DEADLINE)
    calls.append(call)
    started.set()
    replies = []
    with contextlib.suppress(grpc.RpcError):
        replies.extend(call)
    return replies, str(call.code().name)


def phase_of(reply: ProcessingResponse) -> str:
    kind = reply.WhichOneof("response")
    assert kind is not None, "a reply with no phase"
    return str(kind)


def check_mutation(reply: ProcessingResponse) -> None:
    """Every header set is one Envoy accepts; ``raw_value`` only (never both fields)."""
    kind = phase_of(reply)
    if kind == "immediate_response":
        mutation = reply.immediate_response.headers
    elif kind.endswith("_trailers"):
        mutation = getattr(reply, kind).header_mutation
    else:
        mutation = getattr(reply, kind).response.header_mutation
    for option in mutation.set_headers:
        name, raw = option.header.key, option.header.raw_value
        assert HEADER_NAME.fullmatch(name), f"header name {name!r}"
        assert not option.header.value, f"{name}: value and raw_value both set"
        assert header_value_problem(raw.decode()) is None, f"{name}: {raw[:80]!r}"
    for name in mutation.remove_headers:
        assert HEADER_NAME.fullmatch(name), f"removed header name {name!r}"


def check(plan: Plan, replies: list[ProcessingResponse]) -> None:
    sent = [m.WhichOneof("request") for m in plan.messages]
    phases = [phase_of(reply) for reply in replies]
    if "immediate_response" in phases:
        assert phases.index("immediate_response") == len(phases) - 1, phases
        assert 200 <= replies[-1].immediate_response.status.code <= 599
    for reply in replies:
        check_mutation(reply)
    for phase in set(phases) - {"immediate_response"}:
        assert phase in sent, f"a {phase} reply to {sent}"
        if not phase.endswith("_body"):
            assert phases.count(phase) <= sent.count(phase), (phases, sent)
    if "immediate_response" in phases:
        event(f"refused with {replies[-1].immediate_response.status.code}")
    elif plan.well_formed:
        check_exchange(plan, replies, sent, phases)


def check_exchange(
    plan: Plan, replies: list[ProcessingResponse], sent: list[Any], phases: list[str]
) -> None:
    """An exchange Envoy could send, not refused: each message answered, bodies intact.

    Headers and trailers get one reply each. Outside full duplex each body
    message gets one reply; in full duplex Envoy forwards only what comes back,
    so the body sent back (in chunks of the service's choosing) must be the
    body sent, byte for byte (no plugin here changes it), its end announced
    on its last chunk only, and not at all when trailers end it.
    """
    config = plan.messages[0].protocol_config
    for phase, mode in (
        ("request", config.request_body_mode),
        ("response", config.response_body_mode),
    ):
        for part in ("headers", "trailers"):
            kind = f"{phase}_{part}"
            assert phases.count(kind) == sent.count(kind), (kind, phases, sent)
        kind = f"{phase}_body"
        trailers = f"{phase}_trailers" in sent
        event(f"exchange checked: {phase} {BodyMode(mode).name}{', trailers' if trailers else ''}")
        bodies = [getattr(m, kind).body for m in plan.messages if m.WhichOneof("request") == kind]
        answers = [getattr(r, kind).response for r in replies if phase_of(r) == kind]
        if BodyMode(mode) == BodyMode.FULL_DUPLEX_STREAMED:
            chunks = [a.body_mutation.streamed_response for a in answers]
            assert b"".join(c.body for c in chunks) == b"".join(bodies), f"the {phase} body changed"
            # The body's end is announced once, on its last chunk, unless trailers end it.
            ends = [c.end_of_stream for c in chunks]
            if bodies:
                expected = [False] * (len(ends) - 1) + [not trailers]
                assert ends == expected or (trailers and not ends), (phase, ends)
        else:
            assert len(answers) == len(bodies), (kind, phases, sent)


def fuzz(served: tuple[Served, Process, dict[str, Any]], plan: Plan) -> None:
    _service, process, _baseline = served
    replies, status = play(process, plan)
    if plan.hang_up_after is not None and plan.hang_up_after < len(plan.messages):
        # OK: the service had ended the stream (an ImmediateResponse) before we hung up.
        assert status in ("CANCELLED", "OK"), status
        return  # the run's last test checks that nothing was left behind
    assert status == "OK", status  # DEADLINE_EXCEEDED: the service hung
    check(plan, replies)


@FUZZ
@given(plan=PLANS)
def test_any_stream_ends_cleanly_with_valid_replies(
    served: tuple[Served, Process, dict[str, Any]], plan: Plan
) -> None:
    """Random streams: no crash, no hang, replies Envoy accepts, full-duplex bodies intact."""
    fuzz(served, plan)


def test_the_run_leaves_nothing_behind(served: tuple[Served, Process, dict[str, Any]]) -> None:
    """After every example: no more tasks or descriptors than before, memory within the slack."""
    service, _process, baseline = served
    deadline = time.monotonic() + 10
    while True:
        now = service.runtime()
        settled = now["asyncio_tasks"] <= baseline["asyncio_tasks"]
        if (settled and now["open_fds"] <= baseline["open_fds"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert service.process.poll() is None, "the service died"
    assert now["asyncio_tasks"] <= baseline["asyncio_tasks"], (baseline, now)
    assert now["open_fds"] <= baseline["open_fds"], (baseline, now)
    assert now["rss_bytes"] - baseline["rss_bytes"] <= MEMORY_SLACK, (baseline, now)
