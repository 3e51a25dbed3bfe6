"""The gateway-overhead benchmark end to end, at smoke size, through real Envoys."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from bench import loadgen, overhead, overhead_engine, report, rig
from bench.report import Options
from lwepp.plugins.prometheus import parse


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
    cases = [case for case in rig.CASES if case.key not in missing]
    pieces = [row for row in overhead.BREAKDOWN if not {row[1], row[2]} & set(missing)]
    assert [len(t.rows) for t in section.tables] == [
        len(cases),
        len(cases),
        len(pieces),
        3 * len(overhead.COMPARISONS)
        + 4  # the TLS hop's (two concurrencies, the rate), one hop's
        + (2 if overhead.FLOOR[1] not in missing else 0),  # the floor, at 1 and 8
        6,  # three server loops doing nothing, LWEPP, BBR, the one hop
        2,
    ]
    assert [row[0] for row in section.tables[2].rows] == [what for what, _, _ in pieces]
    assert all(math.isfinite(float(str(value))) for value in section.tables[2].rows[0][1:5])
    assert section.tables[2].rows[0][5:] == ["–", "–"]  # one round: too few for an interval
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
    # The scraping pickers read the upstream's metrics page, and kept reading it to the end.
    assert section.data["pool_queue"] == {
        "lwepp-scrape": rig.PAGE_QUEUE,
        "onehop-scrape": rig.PAGE_QUEUE,
    }


def test_scraping_config_sets_the_interval_of_every_metrics_source(tmp_path: Path) -> None:
    """The benchmark's prefix-aware pickers run the given config with only the metrics
    source's refreshIntervalSeconds changed (or none: its own); a config without a metrics
    source (llamacpp.yaml: llama.cpp has no KV gauge) runs as it is."""
    once = rig.scraping_config(rig.PREFIX_CONFIG, tmp_path / "once.yaml", 3600.0)
    base = yaml.safe_load(rig.PREFIX_CONFIG.read_text())
    written = yaml.safe_load(once.read_text())
    [source] = [p for p in written["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"] == {"refreshIntervalSeconds": 3600.0}
    assert written["schedulingProfiles"] == base["schedulingProfiles"]
    as_is = rig.scraping_config(rig.PREFIX_CONFIG, tmp_path / "as-is.yaml", None)
    assert yaml.safe_load(as_is.read_text()) == base
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"plugins": [{"type": "queue-scorer"}]}))
    out = rig.scraping_config(bare, tmp_path / "out.yaml", 1.0)
    assert yaml.safe_load(out.read_text()) == {"plugins": [{"type": "queue-scorer"}]}


def test_metrics_page_speaks_vllm_for_the_scraping_pickers() -> None:
    """The fast upstream's fixed /metrics page carries what a vLLM-reading picker scrapes:
    the queue it reports, the running batch, KV-cache use and the cache geometry."""
    families = parse(
        rig.METRICS_PAGE,
        [
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
        ],
    )
    assert families["vllm:num_requests_waiting"][0][1] == rig.PAGE_QUEUE
    assert len(families) == 4


def test_median_interval_brackets_the_median_by_sign_test_ranks() -> None:
    """The median of paired differences comes with the order statistics at ranks
    (n ± 1.96·√n)/2 as its 95% interval; too few values give no interval."""
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unordered
    assert report.median_interval(values) == (50.5, 41.0, 60.0)
    median, low, high = report.median_interval([3.0, 1.0, 2.0])
    assert median == 2.0
    assert math.isnan(low)
    assert math.isnan(high)
    assert all(math.isnan(v) for v in report.median_interval([]))


def test_paired_differences_skip_rounds_where_either_request_failed() -> None:
    """A round counts only if both cases' requests succeeded: a failed request's time
    must not pass for a fast one."""
    ok = overhead_engine.Sample
    samples = {
        "direct": [ok(0.040, 0.07), ok(0.041, 0.08), ok(math.nan, math.nan, "HTTP 503")],
        "plain": [ok(0.042, 0.07), ok(math.nan, math.nan, "reset"), ok(0.050, 0.09)],
    }
    assert overhead_engine.paired(samples, "plain", "direct") == pytest.approx([0.002])


@pytest.mark.e2e
def test_engine_smoke_run_measures_every_router_in_front_of_a_real_llamacpp_engine(
    tmp_path: Path,
) -> None:
    """`--engine llamacpp`: one real engine, every router in front of it, a few paired rounds;
    every request gets its tokens, the engine served the repeated prompt from its cache, and
    the scraping pickers read the engine's /metrics."""
    section = overhead.run(Options(quick=True, out=tmp_path, engine="llamacpp"))
    assert section.key == "overhead-llamacpp"
    missing = section.data["missing"]
    assert set(missing) <= {"sglang-router", "vllm-router"}
    keys = [key for key in overhead_engine.CASE_KEYS if key not in missing]
    samples = section.data["samples"]
    assert list(samples) == keys
    for key, runs in samples.items():
        assert len(runs) == overhead_engine.QUICK_ROUNDS, key
        assert all(error is None and 0 < ttft < latency for ttft, latency, error in runs), key
    assert section.data["cached_share"] > 0.5  # all but the last prompt token, every time
    assert set(section.data["pool_queue"]) == {"lwepp-scrape", "onehop-scrape"}
    assert all(value is not None for value in section.data["pool_queue"].values())
    assert [row[0] for row in section.tables[0].rows] == [
        case.label for case in overhead_engine.CASES if case.key in keys
    ]


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
