"""The two-hop comparison's arithmetic: ratio, bootstrap interval, paired difference, CPU."""

from __future__ import annotations

import random
import statistics

import pytest

from bench import hops


def _samples(
    upstream: list[float], hops_ms: list[float], noops_ms: list[float]
) -> dict[tuple[str, int], hops.Samples]:
    """Both concurrencies alike: the upstream's p50s and each gateway's, in ms."""
    samples = {}
    for n in hops.CONCURRENCY:
        samples[hops.UPSTREAM.key, n] = hops.Samples([u / 1e3 for u in upstream])
        samples[hops.TWO_HOPS.key, n] = hops.Samples([h / 1e3 for h in hops_ms], 0.9, 1000)
        samples[hops.TWO_NOOPS.key, n] = hops.Samples([o / 1e3 for o in noops_ms], 0.6, 1000)
    return samples


def test_interval_of_an_exact_ratio_is_that_ratio() -> None:
    """When every round's ratio is the same, every resample gives it: the interval is a point."""
    base = [1.0, 2.0, 3.0, 4.0, 5.0]
    low, high = hops.interval([1.25 * b for b in base], base, random.Random(0))
    assert low == pytest.approx(1.25)
    assert high == pytest.approx(1.25)


def test_interval_brackets_the_ratio_and_widens_with_scatter() -> None:
    """Scattered rounds give an interval around the medians' ratio, wider the more they scatter."""
    rng = random.Random(1)
    base = [1.0 + rng.random() for _ in range(30)]
    tight = [1.1 * b * (1 + 0.01 * rng.uniform(-1, 1)) for b in base]
    loose = [1.1 * b * (1 + 0.3 * rng.uniform(-1, 1)) for b in base]
    tight_low, tight_high = hops.interval(tight, base, random.Random(0))
    loose_low, loose_high = hops.interval(loose, base, random.Random(0))
    point = statistics.median(loose) / statistics.median(base)
    assert tight_low < 1.1 < tight_high
    assert loose_low < point - 0.01
    assert point + 0.01 < loose_high
    assert loose_high - loose_low > 3 * (tight_high - tight_low)


def test_report_subtracts_the_upstream_and_divides_added_latencies() -> None:
    """Each gateway's added p50 is over the same round's upstream; the ratio is of the medians,
    the paired figure the median of same-round differences, CPU per request from the totals."""
    table = hops.report(_samples([1.0, 1.0, 2.0], [3.2, 3.4, 4.2], [3.0, 3.0, 4.0]), 0)
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert [row[0].strip() for row in rows] == ["1", "8"]
    for row in rows:
        cells = [cell.strip() for cell in row]
        assert cells[1:4] == ["2.200", "2.000", "1.100"]  # medians 2.2 and 2.0 ms added
        assert cells[5] == "0.200"
        assert cells[6] == "900 / 600 (1.500×)"
        low, high = (float(x) for x in cells[4].split("–"))
        assert low <= 1.1 <= high


def test_too_few_rounds_is_refused() -> None:
    """One round has no interval: the command says so instead of starting anything."""
    with pytest.raises(SystemExit):
        hops.main(["--rounds", "1"])
