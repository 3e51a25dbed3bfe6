"""One minute of ``make soak``: good, bad and cancelled requests through the demo gateway."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import SERVICES, soak
from tests.reliability import record

pytestmark = pytest.mark.e2e

MINUTES = 1.0


def test_a_minute_of_mixed_traffic_leaves_every_service_as_it_was(tmp_path: Path) -> None:
    """Every good request gets 200 and every bad one its 4xx; after warm-up no service's memory
    grows more than 5%; once idle, none holds more asyncio tasks than before, or more descriptors
    than Envoy's connections to it; no error logged."""
    report = soak(tmp_path, MINUTES)
    print(report.markdown())  # shown with -s, and by make soak at full length
    tally = report.tally
    assert sum(tally.sent.values()) == int(MINUTES * 60 * report.rate)
    assert report.good_not_200 == 0, tally.good_failed
    assert not tally.bad_unexpected, tally.bad_unexpected
    for name in SERVICES:
        assert report.growth(name) <= 0.05, (name, report.warm[name], report.end[name])
        before, after = report.idle_before[name], report.idle_after[name]
        assert after["asyncio_tasks"] <= before["asyncio_tasks"], (name, before, after)
        # Envoy's connections to the service (one per Envoy worker) open with the first
        # requests and stay: a few descriptors more than before any traffic, never one per request.
        assert after["open_fds"] <= before["open_fds"] + 4, (name, before, after)
    assert report.error_lines == {name: [] for name in report.error_lines}
    good = tally.sent["good"] + tally.sent["good, streamed"]
    cancelled = tally.sent["cancelled mid-body"] + tally.sent["cancelled mid-stream"]
    bad = sum(count for kind, count in tally.sent.items() if kind.startswith("bad"))
    record(
        "Soak",
        f"{MINUTES:g} min at {report.rate:g} requests/s through the demo gateway with "
        "`demo/configs/prefix-aware.yaml`",
        f"{good} good (none failed), {bad} bad (each answered as expected), {cancelled} "
        f"cancelled mid-body or mid-stream; {tally.late} sent over a second late",
    )
    for name in (*SERVICES, "envoy", "simulator"):
        growth = f"{report.growth(name):+.1%}"
        line = (
            f"RSS {report.warm[name]['rss_bytes'] / 2**20:.1f} → "
            f"{report.end[name]['rss_bytes'] / 2**20:.1f} MiB after warm-up (**{growth}**)"
        )
        if name in SERVICES:
            before, after = report.idle_before[name], report.idle_after[name]
            line += (
                f"; idle before → after: {before['open_fds']} → {after['open_fds']} descriptors, "
                f"{before['asyncio_tasks']} → {after['asyncio_tasks']} asyncio tasks (peak "
                f"{report.peak[name]['open_fds']} and {report.peak[name]['asyncio_tasks']})"
            )
        line += f"; {len(report.error_lines.get(name, []))} error log lines"
        record("Soak", name, line)
