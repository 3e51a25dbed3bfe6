"""The benchmark report: cells, targets and the files a run writes."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest

from bench.__main__ import parse
from bench.report import Options, Plot, Section, Series, Table, Target, cell, percentile, write


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (1234.5, "1,234"),
        (12.345, "12.3"),
        (0.012345, "0.0123"),
        (0.0, "0"),
        (None, "–"),
        (7, "7"),
        (math.nan, "n/a"),
        ("x", "x"),
    ],
    ids=["thousands", "tens", "small", "zero", "none", "int", "nan", "text"],
)
def test_cells_show_three_significant_digits(value: object, shown: str) -> None:
    """Floats get three significant digits in plain notation; other values print as they are."""
    assert cell(value) == shown


def test_targets_say_reached_or_missed_with_the_margin() -> None:
    """An at-most target is reached at or under its limit, an at-least one at or over it."""
    under = Target("latency", measured=1.0, limit=1.15)
    assert under.reached
    assert under.margin == "13% under the limit"
    over = Target("latency", measured=1.3, limit=1.15)
    assert not over.reached
    assert over.margin == "missed by 13%"
    floor = Target("throughput", measured=0.72, limit=0.8, at_most=False)
    assert not floor.reached
    assert floor.margin == "missed by 10%"
    assert Target("throughput", 0.9, 0.8, at_most=False).margin == "12% over the limit"
    assert not Target("nothing", math.nan, 1.0).reached
    assert Target("edge", 1.1504, 1.15).margin == "missed by 0.0%"


def test_percentile_interpolates() -> None:
    """Percentiles interpolate between ranks, as numpy's default does."""
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_write_lays_out_markdown_json_and_plots(tmp_path: Path) -> None:
    """A section becomes Markdown with its command, tables and targets, JSON, and PNG + SVG."""
    section = Section(
        key="demo",
        title="A part",
        command="make bench-demo",
        tables=[Table("Numbers", ["case", "p50 ms"], [["plain", 0.38]], note="one core")],
        plots=[Plot("demo-p50", "p50", "rate", "ms", [Series("plain", [1, 2], [0.3, 0.4])])],
        targets=[Target("ratio", 1.1, 1.15)],
        data={"rates": (1, 2)},
        notes=["scaled 1:8"],
    )
    paths = write([section], tmp_path, header="# Run")
    markdown = (tmp_path / "results.md").read_text()
    assert "`make bench-demo`" in markdown
    assert "| plain | 0.380 |" in markdown
    assert "| ratio | 1.10× | ≤ 1.15× | reached |" in markdown
    assert "![p50](./demo-p50.svg)" in markdown
    assert "- scaled 1:8" in markdown
    data = orjson.loads((tmp_path / "results.json").read_bytes())
    assert data[0]["targets"][0]["reached"] is True
    assert data[0]["data"]["rates"] == [1, 2]
    assert (tmp_path / "demo-p50.png").read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in (tmp_path / "demo-p50.svg").read_bytes()
    assert set(paths) >= {tmp_path / "demo-p50.png", tmp_path / "demo-p50.svg"}


def test_command_line_names_parts_and_options() -> None:
    """No part named means every part; unknown parts and routing workloads are refused by name."""
    parts, options = parse(["routing", "--seed", "3", "--quick", "--out", "x"])
    assert parts == ["routing"]
    assert options == Options(seed=3, quick=True, out=Path("x"))
    assert parse([])[0] == ["micro", "overhead", "routing", "overload", "live"]
    with pytest.raises(SystemExit):
        parse(["nonsense"])
    assert parse(["--workloads", "shared-prefix, mooncake"])[1].workloads == (
        "shared-prefix",
        "mooncake",
    )
    with pytest.raises(SystemExit):
        parse(["--workloads", "shared"])
