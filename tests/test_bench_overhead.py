"""The gateway-overhead benchmark end to end, at smoke size, through real Envoys."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import loadgen, overhead
from bench.report import Options


@pytest.mark.e2e
def test_overhead_smoke_run_measures_every_case_and_every_request_succeeds(
    tmp_path: Path,
) -> None:
    """A quick run starts every Envoy, service and installed peer, measures each case at
    concurrency 1 and 8 and in the open-loop sweep, streams per core and 1 and 2 workers; its
    section has every table, breakdown row and target, and not one request failed."""
    section = overhead.run(Options(quick=True, out=tmp_path))
    assert section.key == "overhead"
    missing = section.data["missing"]
    assert set(missing) <= {"sglang-router", "vllm-router"}  # only a peer may be left out
    cases = [case for case in overhead.CASES if case.key not in missing]
    pieces = [row for row in overhead.BREAKDOWN if not {row[1], row[2]} & set(missing)]
    assert [len(t.rows) for t in section.tables] == [
        len(cases),
        len(cases),
        len(pieces),
        3 * len(overhead.COMPARISONS) + 4,  # the TLS hop's (two concurrencies, the rate), one hop's
        6,  # three server loops doing nothing, LWEPP, BBR, the one hop
        2,
    ]
    assert [row[0] for row in section.tables[2].rows] == [what for what, _, _ in pieces]
    assert all(math.isfinite(float(str(value))) for value in section.tables[2].rows[0][1:])
    [tls_rows] = [
        [r for r in t.rows if r[0] == overhead.TLS_COMPARISON[2]] for t in section.tables[3:4]
    ]
    assert [row[1] for row in tls_rows] == [1, 8, "sustained rate (TLS / plaintext)"]
    assert all(
        math.isfinite(float(str(row[2]))) for row in tls_rows[:2]
    )  # measured, whatever its value
    peers_here = [peer for _, peer, _ in overhead.ONE_HOP_TARGETS if peer not in missing]
    assert len(section.targets) == 2 * len(overhead.COMPARISONS) + 2 + len(peers_here) + 1
    latency = section.data["latency"]
    assert set(latency) == {case.key for case in cases}
    for key, by_concurrency in latency.items():
        for runs in by_concurrency.values():
            assert runs
            assert all(run["requests"] > 0 and run["failed"] == 0 for run in runs), (key, runs)
    for steps in section.data["sweep"].values():
        assert steps  # every case ran at least the first rate
        assert all(run["failed"] == 0 for _, run in steps)
    assert section.data["generator_ceiling"]["failed"] == 0
    assert [w["workers"] for w in section.data["workers"]] == [1, 2]
    assert len(section.data["workers"][1]["served"]) == 2
    for service in ("lwepp", "onehop"):
        assert not (tmp_path / "overhead-run" / f"{service}.log").read_text().count('"error"')
    assert '"tls": true' in (tmp_path / "overhead-run" / "lwepp-tls.log").read_text()


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        b"HTTP/1.1 503 Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\nserver: envoy\r\n\r\n",
    ],
    ids=["content-length", "chunked", "no-body"],
)
def test_load_generator_takes_a_response_only_once_it_is_whole(response: bytes) -> None:
    """Fed byte by byte, the parser waits until the response is complete, then returns
    its status and removes exactly that response, leaving the next one's bytes."""
    buffer = bytearray()
    statuses = []
    for i in range(len(response)):
        buffer += response[i : i + 1]
        statuses.append(loadgen.take_response(buffer))
    assert statuses[:-1] == [None] * (len(response) - 1)
    assert statuses[-1] == int(response[9:12])
    assert buffer == b""
    buffer += response + b"HTTP/1.1"
    assert loadgen.take_response(buffer) == int(response[9:12])
    assert buffer == b"HTTP/1.1"


def test_percentile_is_nearest_rank() -> None:
    """p50 of 1..10 is 5, p99 is 10, p100 the maximum; no values give NaN."""
    values = [float(v) for v in range(10, 0, -1)]
    assert loadgen.percentile(values, 50) == 5.0
    assert loadgen.percentile(values, 99) == 10.0
    assert loadgen.percentile(values, 100) == 10.0
    assert loadgen.percentile([], 50) != loadgen.percentile([], 50)
