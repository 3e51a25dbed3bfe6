"""What every benchmark part returns, and how a run is written: Markdown, JSON and plots.

A part (``bench.overhead``, ``bench.routing``, ``bench.live``) is a module
with ``run(options) -> Section``. The section holds its tables, plots and
targets, plus the raw numbers as plain JSON data; ``write`` turns a list of
sections into ``results.md``, ``results.json`` and one PNG and one SVG per
plot. Nothing here measures anything: a part decides what its numbers mean,
this module only lays them out the same way for every part.

Targets are how the project states a goal ("LWEPP adds at most 1.15 times
what a do-nothing ext_proc hop adds") and reports it honestly: the measured
value, the limit, and whether it was reached, with the margin either way.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

_STARTED: Final = time.monotonic()


@dataclass(frozen=True, slots=True)
class Options:
    """How a part runs: its random seed, the smoke size, where files go."""

    seed: int = 0
    quick: bool = False
    """Smoke size: seconds, for the test suite. Numbers from a quick run mean nothing."""
    out: Path = Path("bench-results")
    engine: str = "simulator"
    """What serves the live part's model: ``simulator`` or ``llamacpp`` (real llama.cpp)."""
    workloads: tuple[str, ...] = ()
    """The routing part's workloads to run (empty: every one), e.g. one workload over seeds."""


@dataclass(frozen=True, slots=True)
class Table:
    """A Markdown table: floats are shown with three significant digits, the rest as is."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[object]]
    note: str = ""

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append(
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|"
        )
        for row in self.rows:
            lines.append("| " + " | ".join(cell(value) for value in row) + " |")
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)


def cell(value: object) -> str:
    """One table cell: ``1234.5`` → ``1.23e+03`` is unreadable, so three significant digits
    in plain notation (``1,235``, ``12.3``, ``0.0123``); ``None`` → an en dash."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if value == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{digits}f}"


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a plot."""

    label: str
    x: Sequence[float]
    y: Sequence[float]


@dataclass(frozen=True, slots=True)
class Plot:
    """A line plot, written as ``<name>.png`` and ``<name>.svg``."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    logy: bool = False


@dataclass(frozen=True, slots=True)
class Target:
    """A goal and how the run did against it.

    ``at_most`` goals (latency ratios) are reached when ``measured <= limit``;
    the others (throughput ratios, hit rates) when ``measured >= limit``.
    """

    name: str
    measured: float
    limit: float
    at_most: bool = True
    unit: str = "×"

    @property
    def reached(self) -> bool:
        if math.isnan(self.measured):
            return False
        return self.measured <= self.limit if self.at_most else self.measured >= self.limit

    @property
    def margin(self) -> str:
        """How far from the limit, as a share of it: "12% under the limit", "5% short"."""
        if math.isnan(self.measured) or self.limit == 0:
            return "not measured" if math.isnan(self.measured) else ""
        share = abs(self.measured - self.limit) / abs(self.limit)
        shown = f"{share:.1%}" if share < 0.1 else f"{share:.0%}"  # never a bare "0%"
        if self.reached:
            side = "under" if self.at_most else "over"
            return f"{shown} {side} the limit"
        return f"missed by {shown}"

    def row(self) -> list[object]:
        sign = "≤" if self.at_most else "≥"
        return [
            self.name,
            f"{cell(self.measured)}{self.unit}",
            f"{sign} {cell(self.limit)}{self.unit}",
            "reached" if self.reached else "**missed**",
            self.margin,
        ]


@dataclass(frozen=True, slots=True)
class Timed:
    """One micro-benchmark figure beside the baseline timed in the same run (``bench.plugins``,
    ``bench.hooks``): both are read as their ratio, which a busy machine disturbs less."""

    what: str
    us: float
    baseline_us: float

    @property
    def ratio(self) -> float:
        return self.us / self.baseline_us


@dataclass
class Section:
    """One part's results: what ``write`` lays out under one heading."""

    key: str
    title: str
    command: str
    tables: list[Table] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    """Ready-made Markdown (tables the older micro-benchmarks print), shown after ``tables``."""

    def markdown(self, plot_dir: str = ".") -> str:
        parts = [f"## {self.title}", "", f"`{self.command}`"]
        parts += [table.markdown() for table in self.tables]
        parts += self.blocks
        if self.targets:
            parts.append(
                Table(
                    "Targets",
                    ["target", "measured", "limit", "", "margin"],
                    [t.row() for t in self.targets],
                ).markdown()
            )
        parts += [f"![{p.title}]({plot_dir}/{p.name}.svg)" for p in self.plots]
        if self.notes:
            parts.append("\n".join(f"- {note}" for note in self.notes))
        return "\n\n".join(parts)

    def json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "command": self.command,
            "tables": [asdict(t) for t in self.tables],
            "targets": [
                {**asdict(t), "reached": t.reached, "margin": t.margin} for t in self.targets
            ],
            "plots": [p.name for p in self.plots],
            "notes": self.notes,
            "blocks": self.blocks,
            "data": self.data,
        }


def progress(message: str) -> None:
    """One line on stderr, with the seconds since the run began: a long run shows it is alive."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def write(sections: Sequence[Section], out: Path, *, header: str = "") -> list[Path]:
    """Write ``results.md``, ``results.json`` and every plot under ``out``; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for section in sections:
        for plot in section.plots:
            written += draw(plot, out)
    markdown = "\n\n".join([header, *(s.markdown() for s in sections)]).strip() + "\n"
    (out / "results.md").write_text(markdown)
    (out / "results.json").write_bytes(
        orjson.dumps(
            [s.json() for s in sections],
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
            default=_plain,
        )
    )
    return [out / "results.md", out / "results.json", *written]


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def draw(plot: Plot, out: Path) -> list[Path]:
    """Render one plot as PNG and SVG with matplotlib's non-interactive backend."""
    import matplotlib  # imported here: only writing plots needs it, and it is slow to import

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "switchyard"  # stable element ids in the SVG
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.2), layout="constrained")
    try:
        for series in plot.series:
            axes.plot(series.x, series.y, marker="o", markersize=3, label=series.label)
        axes.set_title(plot.title)
        axes.set_xlabel(plot.xlabel)
        axes.set_ylabel(plot.ylabel)
        if plot.logy:
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        if len(plot.series) > 1:
            axes.legend(fontsize="small")
        paths = [out / f"{plot.name}.png", out / f"{plot.name}.svg"]
        for path in paths:
            # A fixed date and no hash salt keep the SVG the same for the same numbers.
            metadata = {"Date": None} if path.suffix == ".svg" else {"Software": None}
            figure.savefig(path, dpi=110, metadata=metadata)
        return paths
    finally:
        pyplot.close(figure)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free ~95% confidence interval for it.

    The interval's ends are the order statistics of ranks ``(n − z√n)/2`` and
    ``(n + z√n)/2`` (the normal approximation of the sign test's binomial):
    whatever the shape of the distribution, the true median lies between them
    about 95% of the time. NaN ends when there are too few values for one.
    """
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    n = len(ordered)
    low = math.floor((n - z * math.sqrt(n)) / 2)
    if low < 0:
        return statistics.median(ordered), math.nan, math.nan
    return statistics.median(ordered), ordered[low], ordered[n - 1 - low]
