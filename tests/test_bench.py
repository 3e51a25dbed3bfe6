"""Smoke runs of the benchmarks: they work and their checks hold (no timing is asserted)."""

from __future__ import annotations

from bench import codec, streams


def test_codecs_agree_byte_for_byte() -> None:
    """Both codecs encode the routing reply identically, and the codec benchmark runs."""
    assert codec.edp_build() == codec.xds_build()
    rows = codec.run(budget=0.001)
    assert len(rows) == 2
    assert "envoy-data-plane" in codec.table(rows)


def test_stream_benchmark_drives_each_server() -> None:
    """Every server kind answers every stream of the benchmark client (the measurement
    stops on a stream that fails or ends with no reply)."""
    results = streams.measure(list(streams.KINDS), streams=40, concurrency=4, rounds=1)
    assert [r.kind for r in results] == list(streams.KINDS)
    assert "noop-rw" in streams.table(results)


def test_chat_body_has_the_requested_size() -> None:
    """The benchmark's body is a valid chat request of exactly the stated size."""
    assert len(streams.chat_body(4096)) == 4096
