"""The overload benchmark at smoke size: it runs every case in both modes, and its measures mean
what they say (no figure of a quick run is asserted)."""

from __future__ import annotations

import pytest

from bench import overload
from bench.report import Options


def test_a_quick_run_measures_every_case_in_both_modes() -> None:
    """Capacity first, then six cases × two modes; every target of the issue is reported, and
    flow control never holds more than its limits."""
    section = overload.run(Options(quick=True))
    runs = section.data["runs"]
    assert section.data["capacity"] > 0
    assert [(r["case"], r["total"], r["mode"]) for r in runs] == [
        (case, total, mode) for case, total, _ in overload.CASES for mode in overload.MODES
    ]
    names = [t.name for t in section.targets]
    assert len(names) == 7
    assert any(name.startswith("interactive TTFT p90 at 3") for name in names)
    for run in runs:
        for peak in run["peaks"]:
            assert peak["requests"] <= peak["max_requests"]
        assert (run["mode"] == "gate off") == (not run["outcomes"])  # no flow control there


def test_the_gate_off_mode_is_the_same_file_without_the_gate() -> None:
    """Both modes load the one configuration; the gate decides whether requests queue."""
    text = overload.CONFIG.read_text()
    on, off = overload.configuration("flow control", text), overload.configuration("gate off", text)
    assert on.flow.gate
    assert on.flow.settings is not None
    assert not off.flow.gate
    assert off.flow.settings is None
    assert type(off.flow.detector) is type(on.flow.detector)


@pytest.mark.parametrize(
    ("offered", "served", "shares"),
    [
        ({"heavy": 1.2, "light": 0.3}, 0.9, {"heavy": 0.6, "light": 0.3}),
        ({"heavy": 2.4, "light": 0.6}, 0.9, {"heavy": 0.45, "light": 0.45}),
        ({"a": 0.1, "b": 0.2, "c": 5.0}, 0.9, {"a": 0.1, "b": 0.2, "c": 0.6}),
    ],
    ids=["light-in-full", "equal", "three"],
)
def test_max_min_fair_shares(
    offered: dict[str, float], served: float, shares: dict[str, float]
) -> None:
    """Whoever asks less than an equal share gets what it asks; the rest is split equally."""
    assert overload.fair_shares(offered, served) == pytest.approx(shares)
