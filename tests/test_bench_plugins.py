"""Smoke run of the plugin benchmark: it times what each row names (no timing is asserted)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import orjson

from bench import plugins
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.prefix_index import block_hashes, seed
from pods.model import Endpoint


class Recording:
    """A stand-in timer: calls the function once, keeps its result, and reports the n-th
    call as taking n µs, so each row's ratio shows which measurement it was divided by."""

    def __init__(self) -> None:
        self.results: list[object] = []

    def __call__(self, fn: Callable[[], object]) -> float:
        self.results.append(fn())
        return float(len(self.results))


def test_plugin_benchmark_times_each_plugin_against_the_no_op_baseline() -> None:
    """Every row is its own measurement divided by the no-op scorer's, measured first."""
    measure = Recording()
    rows = plugins.plugin_rows(measure)
    names = [row.what for row in rows]
    assert names[0] == "no-op scorer (baseline)"
    for kind in ("queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer"):
        assert kind in names
    assert len(measure.results) == len(rows)
    assert [row.us for row in rows] == [float(n) for n in range(1, len(rows) + 1)]
    assert [row.ratio for row in rows] == [row.us / 1.0 for row in rows]
    assert "| queue-scorer | 2.00 | 2.0× |" in plugins.table(rows, 384.0)


def test_each_timed_call_runs_the_plugin_its_row_names() -> None:
    """The timed calls score, filter and match for real: the queue scorer prefers the shorter
    queue, the label filter keeps the decode pods, the warm prefix index favours pod-3."""
    measure = Recording()
    rows = plugins.plugin_rows(measure)
    result = dict(zip([row.what for row in rows], measure.results, strict=True))
    assert result["no-op scorer (baseline)"] == [1.0] * plugins.CANDIDATES
    queue = result["queue-scorer"]
    assert isinstance(queue, list)
    depths = [i % 4 for i in range(plugins.CANDIDATES)]  # as bench.plugins.candidates sets them
    for a, b in itertools.permutations(range(plugins.CANDIDATES), 2):
        if depths[a] < depths[b]:
            assert queue[a] > queue[b], (depths, queue)
    kept = result["label-selector-filter (1 label, 1 expression)"]
    assert isinstance(kept, list)
    assert [c.endpoint.pod for c in kept] == ["pod-1", "pod-3", "pod-5", "pod-7"]
    prefix = result["prefix-cache-scorer score (all blocks held)"]
    assert isinstance(prefix, list)
    assert prefix[3] == max(prefix) > 0
    assert [score for i, score in enumerate(prefix) if i != 3] == [0.0] * (plugins.CANDIDATES - 1)


def test_hashing_rows_time_the_two_chains_over_the_same_prompt() -> None:
    """Both rows hash the 4 KB prompt in 64-byte blocks, each against the given baseline."""
    measure = Recording()
    rows = plugins.hashing_rows(measure, 4.0)
    assert [row.ratio for row in rows] == [0.25, 0.5]
    xxhash_chain, blake_last = measure.results
    assert isinstance(xxhash_chain, list)
    assert len(xxhash_chain) == plugins.PROMPT_BYTES // 64
    assert xxhash_chain == block_hashes(
        orjson.dumps(plugins.chat_body()["messages"])[: plugins.PROMPT_BYTES],
        seed("sql"),
        64,
        256,
    )
    assert isinstance(blake_last, int)
    assert blake_last not in xxhash_chain


def test_vllm_page_reads_like_the_engine() -> None:
    """The benchmark's page is a valid vLLM page for the metrics source."""
    page = plugins.vllm_page(histograms=2, buckets=3)
    values = MetricsDataSource("m").read(Endpoint("p", "127.0.0.1", 1), page)
    assert values["queue_depth"] == 3.0
    assert values["lora_running"] == frozenset({"sql", "chat"})
