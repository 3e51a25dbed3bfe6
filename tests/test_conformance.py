"""GIE's conformance tests, reproduced locally (``make conformance``), as part of every test run.

One run of the whole suite (echo pods, five LWEPPs, a real Envoy) is shared
by the module: each GIE test is then one pytest test, passing when it passed
through the gateway and at the picker alone. The requests, counts and
tolerances are the originals'; only the waiting is shorter: 30 s to
consistency instead of GIE's 300 s (a conformant gateway passes in its first
tries), and 0.1 s after a failed attempt instead of the helpers' 1 s (the
weighted test's warm-up fails most attempts by design, and would take minutes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from conformance import report
from conformance.cases import CASES, GIE_ORDER, NOT_APPLICABLE
from conformance.client import Timing
from conformance.run import CaseResult, Suite, run_suite, table

pytestmark = pytest.mark.e2e

TIMING = Timing(max_time_to_consistency=30.0, delay_after_failure=0.1)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Suite:
    """One run of the whole suite; the topology is stopped before the first test reads it."""
    return asyncio.run(run_suite(tmp_path_factory.mktemp("conformance"), TIMING))


def result_of(suite: Suite, name: str) -> CaseResult:
    (found,) = [result for result in suite.results if result.name == name]
    return found


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_applicable_test_passes_through_the_gateway_and_at_the_picker(
    suite: Suite, name: str
) -> None:
    """Each reproduced test passes both ways (or is skipped at the picker with a reason)."""
    result = result_of(suite, name)
    assert result.gateway.outcome == "passed", result.gateway.detail
    assert result.picker.outcome in ("passed", "skipped"), result.picker.detail
    if result.picker.outcome == "skipped":
        assert result.picker.detail


@pytest.mark.parametrize("name", list(NOT_APPLICABLE))
def test_status_only_tests_are_skipped_with_their_reason(suite: Suite, name: str) -> None:
    """The three tests that send no request are skipped both ways, saying why."""
    result = result_of(suite, name)
    assert (result.gateway.outcome, result.picker.outcome) == ("skipped", "skipped")
    assert result.status_only
    assert "status" in result.gateway.detail


def test_every_gie_test_is_accounted_for_and_its_status_half_named(suite: Suite) -> None:
    """All of GIE's tests appear, in GIE's order, then Switchyard's own; each reproduced GIE test
    says its status conditions were not checked, and which they are."""
    names = [result.name for result in suite.results]
    assert names[: len(GIE_ORDER)] == list(GIE_ORDER)
    assert names[len(GIE_ORDER) :] == [c.name for c in CASES if c.origin != "GIE"]
    rows = table(suite).splitlines()
    for result in suite.results:
        if result.origin == "GIE" and not result.status_only:
            assert result.status, result.name
            assert any(
                row.startswith(f"| {result.name} |") and "not checked (traffic only)" in row
                for row in rows
            )
    readme = (report.default_dir() / "README.md").read_text()
    assert "InferencePool pool-with-invalid-epp: ResolvedRefs=False" in readme


def normalised(document: dict[str, Any]) -> dict[str, Any]:
    """A report without what changes from run to run (the date)."""
    return {**document, "date": None}


def test_reports_have_gies_shape_and_match_the_ones_checked_in(
    suite: Suite, tmp_path: Path
) -> None:
    """The harness writes one report per profile and a README; docs/conformance holds this
    version's, unchanged (rerun `make conformance` when they should change)."""
    paths = report.write(suite, tmp_path, report.Implementation.switchyard())
    gateway = yaml.safe_load(paths[0].read_text())
    (profile,) = gateway["profiles"]
    assert profile["name"] == "Gateway"
    assert profile["core"]["result"] == "partial"  # the status-only tests are skipped
    assert profile["core"]["statistics"] == {
        "Passed": len(GIE_ORDER) - len(NOT_APPLICABLE),
        "Failed": 0,
        "Skipped": len(NOT_APPLICABLE),
    }
    checked_in = sorted(path.name for path in report.default_dir().iterdir())
    assert checked_in == sorted(path.name for path in paths), "run `make conformance`"
    for path in paths:
        kept = report.default_dir() / path.name
        if path.suffix == ".yaml":
            assert normalised(yaml.safe_load(kept.read_text())) == normalised(
                yaml.safe_load(path.read_text())
            )
        else:
            assert kept.read_text() == path.read_text()
