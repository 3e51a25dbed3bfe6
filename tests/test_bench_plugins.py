"""Smoke run of the plugin benchmark: it works and its checks hold (no timing is asserted)."""

from __future__ import annotations

from collections.abc import Callable

from bench import plugins
from lwepp.plugins.metrics_source import MetricsDataSource
from pods.model import Endpoint


def once(fn: Callable[[], object]) -> float:
    """A stand-in timer: call once, report 1 µs (the smoke test checks wiring, not speed)."""
    fn()
    return 1.0


def test_plugin_benchmark_runs_every_plugin() -> None:
    """Each built-in scorer and filter is measured against the no-op baseline and tabled."""
    rows = plugins.plugin_rows(once)
    names = [row.what for row in rows]
    assert names[0] == "no-op scorer (baseline)"
    for kind in ("queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer"):
        assert kind in names
    assert "× no-op scorer" in plugins.table(rows, 384.0)


def test_hashing_rows_run() -> None:
    """The hashing comparison runs; both chains are timed against the same baseline."""
    rows = plugins.hashing_rows(once, 1.0)
    assert [row.ratio for row in rows] == [1.0, 1.0]


def test_vllm_page_reads_like_the_engine() -> None:
    """The benchmark's page is a valid vLLM page for the metrics source."""
    page = plugins.vllm_page(histograms=2, buckets=3)
    values = MetricsDataSource("m").read(Endpoint("p", "127.0.0.1", 1), page)
    assert values["queue_depth"] == 3.0
    assert values["lora_running"] == frozenset({"sql", "chat"})
