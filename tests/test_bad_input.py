"""What a client gets for bad input, through the real Envoy, BBR, the pickers and the replicas.

Each test is one row of the bad-input table in ``docs/reliability.md``
(``tests.reliability.record``). Pool a is FailClose and honours GIE's
``test-epp-endpoint-selection`` (the demo's ``--enable-test-selection-header``);
pool b is FailOpen, its picker started with ``--disable-test-selection-header``
after it (the last of the two wins).
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.soak import error_lines
from demo.topology import Topology
from tests.conftest import write_pod_file
from tests.http_clients import Answer, cut_off, http1, http2, read_then_hang_up
from tests.reliability import record
from wire.exchange import HEADER_VALUE_LIMIT, HEADERS_SIZE_LIMIT, MAX_BODY_BYTES

pytestmark = pytest.mark.e2e

PATH = "/v1/completions"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work = tmp_path_factory.mktemp("bad-input")
    pods = write_pod_file(work / "pods.yaml")
    with Topology(
        work,
        pods,
        fail_open=["b"],
        simulator_args=["--time-scale", "0.1"],
        picker_args={"b": ["--disable-test-selection-header"]},
    ) as topology:
        yield topology


def ask(gateway: Topology, body: bytes | list[bytes] | dict[str, Any], **options: Any) -> Answer:
    """POST ``body`` (bytes, a list of chunks, or an object to send as JSON) over HTTP/1.1."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return http1(gateway.port, PATH, data, **options)


def good(model: str = "model-a", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello there", "max_tokens": 2, **extra}


def cell(answer: Answer) -> str:
    if answer.status == 0:
        return f"no answer: {answer.reset}"
    return f"**{answer.status}** `{answer.excerpt(240)}`" if answer.body else f"**{answer.status}**"


def served_by(gateway: Topology, answer: Answer, pool: str) -> bool:
    """The answer came from a replica of ``pool``, at the endpoint its picker named."""
    (members,) = [p.endpoints for p in gateway.pools if p.name == pool]
    endpoint = answer.headers.get("x-sim-endpoint")
    picked = answer.headers.get("x-sim-received-x-gateway-destination-endpoint")
    return answer.status == 200 and endpoint in members and picked == endpoint


def access_log_lines(
    gateway: Topology, match: Callable[[dict[str, Any]], bool], count: int = 2
) -> list[dict[str, Any]]:
    """The access log lines that ``match``, once ``count`` of them are there (Envoy flushes
    every 500 ms), polled with a deadline."""
    log = gateway.work_dir / "envoy-access.log"
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        found = [line for line in lines if match(line)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def runtime(gateway: Topology, service: str) -> dict[str, Any]:
    port = gateway.services[service].listening["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/runtime", timeout=5) as page:
        state: dict[str, Any] = json.load(page)
    return state


def counter(gateway: Topology, service: str, name: str) -> float:
    """A counter's value on a service's ``/metrics``, summed over its label values."""
    port = gateway.services[service].listening["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    samples = [line for line in lines if line.startswith((name + " ", name + "{"))]
    if not samples and f"# TYPE {name} counter" not in lines:
        raise AssertionError(f"{name} not on {service}'s /metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def tasks(before: dict[str, int], after: dict[str, int]) -> str:
    """``asyncio tasks: bbr 11 → 11, lwepp-a 12 → 12``, for the table."""
    return "asyncio tasks " + ", ".join(f"{n} {before[n]} → {after[n]}" for n in before)


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def settles(gateway: Topology, baseline: dict[str, int], timeout: float = 10.0) -> dict[str, int]:
    """Each service's asyncio tasks, once back at or under ``baseline`` (polled, with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        now = {name: runtime(gateway, name)["asyncio_tasks"] for name in baseline}
        if all(now[name] <= baseline[name] for name in baseline) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


# --- bodies --------------------------------------------------------------------------------

BODIES = [
    ("truncated JSON", b'{"model": "model-a", "prompt": ', 400, "failed to parse request body"),
    ("an empty body", b"", 404, "model"),
    ("a JSON array", b'[{"model": "model-a"}]', 400, "an array, not a JSON object"),
    ("a JSON string, not an object", b'"model-a"', 400, "a scalar, not a JSON object"),
    ("`model` a number (`7`)", b'{"model": 7, "prompt": "hi"}', 404, "'7'"),
    ("`model` null", b'{"model": null, "prompt": "hi"}', 404, "'<nil>'"),
    (
        "`model` an object",
        b'{"model": {"name": "model-a"}, "prompt": "hi"}',
        404,
        "'map[name:model-a]'",
    ),
    ("`model` a list", b'{"model": ["model-a"]}', 404, "'[model-a]'"),
    (
        "`model` with CR/LF (`model-a\\r\\nx: y`)",
        b'{"model": "model-a\\r\\nx: y", "prompt": "hi"}',
        400,
        "body field 'model': the value for header X-Gateway-Model-Name contains the control",
    ),
    (
        "`model` of 70 KB",
        json.dumps({"model": "m" * 70_000}).encode(),
        400,
        f"over the {HEADER_VALUE_LIMIT}-byte limit of a header value",
    ),
    (
        "`model` one byte over the 4,096-byte cap",
        json.dumps({"model": "m" * (HEADER_VALUE_LIMIT + 1)}).encode(),
        400,
        f"is {HEADER_VALUE_LIMIT + 1} bytes long",
    ),
    ("invalid UTF-8 (`\\xff` in a string)", b'{"model": "model-a\xff"}', 400, "not valid UTF-8"),
    ("a lone surrogate (`\\ud800`)", b'{"model": "\\ud800"}', 400, "surrogate"),
    (
        "nesting 5,000 deep",
        b'{"model": "model-a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "depth limit exceeded",
    ),
]


@pytest.mark.parametrize(("what", "body", "status", "says"), BODIES, ids=[row[0] for row in BODIES])
def test_a_bad_body_gets_a_clear_client_error(
    gateway: Topology, what: str, body: bytes, status: int, says: str
) -> None:
    """Never a 5xx for a malformed body: a 400 saying what is wrong, or Envoy's 404 naming the
    model as BBR rendered it (Go's ``%v``, as GIE's BBR)."""
    answer = ask(gateway, body)
    assert answer.status == status, answer
    assert says in answer.body.decode("utf-8", "replace")
    assert "x-sim-pod" not in answer.headers  # no replica saw it
    record("Bad input", what, cell(answer))


def test_a_compressed_body_is_named_as_such(gateway: Topology) -> None:
    """A gzip body (``Content-Encoding: gzip``) is a 415 naming the encoding, not a puzzling
    "not valid UTF-8" 400; one that says ``identity`` is read as any other."""
    body = json.dumps(good()).encode()
    answer = ask(gateway, gzip.compress(body), headers={"content-encoding": "gzip"})
    assert answer.status == 415, answer
    error = json.loads(answer.body)["error"]
    assert error["code"] == "UnsupportedMediaType"
    assert "content-encoding: gzip" in error["message"]
    assert "x-sim-pod" not in answer.headers
    assert ask(gateway, body, headers={"content-encoding": "identity"}).status == 200
    record("Bad input", "a gzip-compressed body (`Content-Encoding: gzip`)", cell(answer))


def test_a_model_at_the_cap_reaches_routing(gateway: Topology) -> None:
    """A 4,096-byte model is a legal header: Envoy matches no route and answers 404."""
    answer = ask(gateway, {"model": "m" * HEADER_VALUE_LIMIT})
    assert answer.status == 404
    assert "m" * HEADER_VALUE_LIMIT in answer.body.decode()
    record(
        "Bad input",
        "`model` of exactly 4,096 bytes",
        "**404** from Envoy's route naming it: a legal header, and no pool serves that model",
    )


def test_duplicate_keys_take_the_last_value(gateway: Topology) -> None:
    """``{"model": "model-b", "model": "model-a"}`` routes to model-a's pool, as Python and Go
    parsers read it (the replica's parser must agree; vLLM's does)."""
    answer = ask(
        gateway, b'{"model": "model-b", "model": "model-a", "prompt": "hi", "max_tokens": 2}'
    )
    assert served_by(gateway, answer, "a"), answer
    assert answer.headers["x-sim-received-x-gateway-model-name"] == "model-a"
    record(
        "Bad input",
        'duplicate keys `{"model": "model-b", "model": "model-a"}`',
        "**200** from pool a: the last value wins, as in Python's and Go's JSON parsers",
    )


def test_a_body_at_the_cap_passes_and_one_byte_more_is_413(gateway: Topology) -> None:
    """Exactly ``--max-body-bytes`` (10 MiB) is served; one byte over is 413 naming the limit."""
    small = json.dumps(good()).encode()
    at_cap = small + b" " * (MAX_BODY_BYTES - len(small))
    answer = ask(gateway, at_cap)
    assert served_by(gateway, answer, "a"), answer
    record("Bad input", "a body of exactly 10 MiB (10,485,760 bytes)", "**200**, served")
    over = ask(gateway, at_cap + b" ")
    assert over.status == 413
    assert f"exceeds the {MAX_BODY_BYTES}-byte limit" in over.body.decode()
    assert "x-sim-pod" not in over.headers
    record("Bad input", "one byte over 10 MiB", cell(over))


# --- headers --------------------------------------------------------------------------------


def test_headers_over_envoys_limit_are_cut_off_by_envoy(gateway: Topology) -> None:
    """61 KiB of headers, or 101 of them: Envoy closes the connection (its access log says 431)."""
    big = ask(gateway, good(), raw_headers=b"x-big: " + b"a" * (61 * 1024) + b"\r\n")
    many = ask(gateway, good(), raw_headers=b"".join(b"x-h%d: v\r\n" % i for i in range(101)))
    for answer in (big, many):
        assert answer.status == 0, answer
    logged = access_log_lines(gateway, lambda line: line["status"] == 431 and not line["path"])
    assert [line["details"] for line in logged] == [
        "http1.headers_too_large",
        "http1.too_many_headers",
    ]
    record(
        "Bad input",
        "61 KiB of headers",
        "the connection closed, no answer (Envoy's access log: 431)",
    )
    record("Bad input", "101 headers", "the connection closed, no answer (Envoy's access log: 431)")


def test_headers_that_fit_only_until_routed_get_431(gateway: Topology) -> None:
    """Headers Envoy accepted, with no room left for the model header: 431 from BBR, not a 500."""
    body = json.dumps(good("m" * 2000)).encode()
    near = ask(gateway, body, headers={"x-big": "a" * (HEADERS_SIZE_LIMIT - 1500)})
    assert near.status == 431, near
    assert "X-Gateway-Model-Name" in near.body.decode()
    record("Bad input", "59 KiB of headers and a 2,000-byte `model`", cell(near))
    counted = ask(gateway, good(), headers={f"x-h{i}": "v" for i in range(92)})
    assert counted.status == 431, counted
    record("Bad input", "92 headers (100 once Envoy and BBR add theirs)", cell(counted))


# --- how the body arrives ------------------------------------------------------------------


def test_a_chunked_body_is_served(gateway: Topology) -> None:
    """``Transfer-Encoding: chunked`` (no length): BBR states the length, the replica gets it all."""
    data = json.dumps(good(prompt="one two three four")).encode()
    answer = ask(gateway, [data[:10], data[10:30], data[30:]])
    assert served_by(gateway, answer, "a"), answer
    assert json.loads(answer.body)["usage"]["prompt_tokens"] == 4
    record(
        "Bad input",
        "a chunked body (no Content-Length), 3 chunks",
        "**200**, the whole body served",
    )


def test_a_body_that_trickles_in_is_served(gateway: Topology) -> None:
    """Chunks 2.5 s apart, longer than Envoy's 2 s message timeout: nothing times out."""
    data = json.dumps(good()).encode()
    started = time.monotonic()
    answer = ask(gateway, [data[:5], data[5:15], data[15:]], gap=2.5)
    took = time.monotonic() - started
    assert served_by(gateway, answer, "a"), answer
    record(
        "Bad input",
        "a body trickling in: 3 chunks 2.5 s apart",
        f"**200** after {took:.1f} s (a full-duplex body is not timed by Envoy)",
    )


def test_http1_and_http2_get_the_same_answers(gateway: Topology) -> None:
    """HTTP/2 with prior knowledge is served, and refused, exactly as HTTP/1.1."""
    ok1, ok2 = ask(gateway, good()), http2(gateway.port, PATH, json.dumps(good()).encode())
    assert served_by(gateway, ok1, "a"), ok1
    assert served_by(gateway, ok2, "a"), ok2
    bad = json.dumps({"model": "model-a\r\nx: y"}).encode()
    bad1, bad2 = ask(gateway, bad), http2(gateway.port, PATH, bad)
    assert bad1.status == bad2.status == 400
    assert bad1.body == bad2.body
    record("Bad input", "a good request over HTTP/1.1, then over HTTP/2 (h2c)", "**200** both")
    record("Bad input", "CR/LF in `model` over HTTP/1.1, then HTTP/2", "**400** both, same body")


# --- clients that go away ---------------------------------------------------------------------


def test_a_client_that_hangs_up_mid_request_leaves_nothing_behind(gateway: Topology) -> None:
    """Half a body, then the connection closes: no stream or task is left, the next request is
    served, nothing is logged as an error."""
    names = ["bbr", "lwepp-a"]
    baseline = {name: runtime(gateway, name)["asyncio_tasks"] for name in names}
    streams = counter(gateway, "bbr", "bbr_requests_total")
    for i in range(20):
        with cut_off(gateway.port, PATH, b'{"model": "model-a", "prompt": "', declared=1000):
            # Hang up only once BBR holds the stream, so each cut reaches it.
            until(lambda: counter(gateway, "bbr", "bbr_requests_total") - streams > i)  # noqa: B023
    after = settles(gateway, baseline)
    assert all(after[n] <= baseline[n] for n in names), (baseline, after)
    assert served_by(gateway, ask(gateway, good()), "a")
    record(
        "Bad input",
        "20 clients hanging up half-way through the body",
        f"nothing left: {tasks(baseline, after)}; the next request **200**",
    )


def test_a_client_that_hangs_up_mid_stream_leaves_nothing_behind(gateway: Topology) -> None:
    """A streamed completion, closed after its first event: nothing left, the next is served."""
    names = ["bbr", "lwepp-a"]
    baseline = {name: runtime(gateway, name)["asyncio_tasks"] for name in names}
    body = json.dumps(good(max_tokens=400, stream=True)).encode()
    streams = counter(gateway, "lwepp-a", "llm_d_epp_request_total")
    for _ in range(10):
        read_then_hang_up(gateway.port, PATH, body)
    after = settles(gateway, baseline)
    assert counter(gateway, "lwepp-a", "llm_d_epp_request_total") - streams == 10
    assert all(after[n] <= baseline[n] for n in names), (baseline, after)
    assert served_by(gateway, ask(gateway, good()), "a")
    record(
        "Bad input",
        "10 clients hanging up after the first event of a streamed completion",
        f"nothing left: {tasks(baseline, after)}; the next request **200**",
    )


# --- routing headers a client sends itself -------------------------------------------------------


def test_the_test_selection_header_pins_a_replica_unless_turned_off(gateway: Topology) -> None:
    """Honoured (pool a, enabled as GIE's lwepp and the demo do): a client chooses its replica
    within the pool, never outside it. With --disable-test-selection-header (pool b) it changes
    nothing."""
    a, b = gateway.pools
    chosen = a.endpoints[1]
    pinned = [
        ask(gateway, good(), headers={"test-epp-endpoint-selection": chosen}) for _ in range(4)
    ]
    assert {answer.headers.get("x-sim-endpoint") for answer in pinned} == {chosen}
    outside = ask(gateway, good(), headers={"test-epp-endpoint-selection": b.endpoints[0]})
    assert outside.status == 503
    assert "x-sim-pod" not in outside.headers
    ignored = [
        ask(gateway, good("model-b"), headers={"test-epp-endpoint-selection": b.endpoints[1]})
        for _ in range(4)
    ]
    assert {answer.headers.get("x-sim-endpoint") for answer in ignored} == set(b.endpoints)
    record(
        "Bad input",
        "`test-epp-endpoint-selection: <replica 2 of pool a>` (`--enable-test-selection-header`)",
        "**200** ×4, all from that replica: a client can choose its replica within the pool",
    )
    record(
        "Bad input",
        "`test-epp-endpoint-selection: <a replica of pool b>` to pool a",
        f"{cell(outside)}: never outside the pool",
    )
    record(
        "Bad input",
        "the same header to pool b, whose picker runs `--disable-test-selection-header`",
        "**200** ×4, round-robin over both replicas: the header is ignored",
    )


def test_no_service_logged_an_error(gateway: Topology) -> None:
    """All of the above are answered, not failures: no service logged an error line."""
    for name in ("bbr", "lwepp-a"):
        assert error_lines(gateway.services[name].log) == [], name


def test_a_clients_destination_header_is_dropped(gateway: Topology) -> None:
    """``x-gateway-destination-endpoint`` from a client never routes: Envoy strips it, the picker
    chooses; with pool b's picker down (FailOpen) Envoy's round-robin chooses, not the client."""
    b = gateway.pools[1]
    foreign = b.endpoints[0]
    answers = [
        ask(gateway, good(), headers={"x-gateway-destination-endpoint": foreign}) for _ in range(4)
    ]
    assert all(served_by(gateway, answer, "a") for answer in answers), answers
    gateway.stop("lwepp-b")  # the last test of the module: it may stop a picker
    elsewhere = "127.0.0.1:9"  # discard: nothing listens there
    fallback = [
        ask(gateway, good("model-b"), headers={"x-gateway-destination-endpoint": elsewhere})
        for _ in range(4)
    ]
    assert all(answer.status == 200 for answer in fallback), fallback
    assert {answer.headers["x-sim-endpoint"] for answer in fallback} == set(b.endpoints)
    record(
        "Bad input",
        "`x-gateway-destination-endpoint: <a replica of pool b>` to pool a",
        "**200** ×4 from pool a, where its picker sent them: the header is stripped at the edge",
    )
    record(
        "Bad input",
        "`x-gateway-destination-endpoint: 127.0.0.1:9` to pool b with its picker down (FailOpen)",
        "**200** ×4, Envoy's round-robin over pool b: the client's address is never used",
    )
