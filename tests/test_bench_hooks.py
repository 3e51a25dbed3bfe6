"""Smoke runs of the hook-overhead benchmark: it works and measures what it says (no timing asserted)."""

from __future__ import annotations

from bench import hooks
from bench.server import handler_for
from lwepp.hooked import HookedService


def test_the_pick_benchmark_times_every_variant_against_round_robin() -> None:
    """Round-robin first (ratio 1), then the pipeline with 0, 1 and 5 plugins, and explained."""
    rows = hooks.run(budget=0.001, rounds=1)
    assert [r.what for r in rows] == [
        "round-robin (the core)",
        "pipeline, 0 plugins",
        "pipeline, 1 plugin",
        "pipeline, 5 plugins",
        "pipeline, 5 plugins, explained",
    ]
    assert rows[0].ratio == 1.0
    assert "| pipeline, 5 plugins |" in hooks.table(rows)


def test_the_benchmarked_pipelines_hold_the_plugins_they_claim() -> None:
    """Five plugins: a prepare/picked hook, a filter, three scorers (and the default picker)."""
    five = hooks.pipeline(5)
    assert (len(five.prepare), len(five.filters), len(five.scorers), len(five.picked)) == (
        1,
        1,
        3,
        1,
    )
    assert len(hooks.pipeline(1).scorers) == 1
    assert isinstance(hooks.service(0), HookedService)


def test_the_stream_benchmark_serves_the_hooked_pipelines() -> None:
    """``bench.server`` knows the kinds the stream table measures (driving them is bench.streams')."""
    for kind in hooks.STREAM_KINDS:
        assert handler_for(kind) is not None
