"""The conformance report, in the shape of GIE's (``conformance/reports/...``).

GIE's suite writes a Gateway API ``ConformanceReport`` with the extension's
version on top: the implementation (organization, project, url, version,
contact), the date, the Gateway API version and channel, the mode, and per
conformance profile a result (``success``, ``partial`` when tests were
skipped, ``failure``), statistics and the names of the skipped and failed
tests. Two profiles here:

- ``Gateway``: GIE's tests through the gateway (a real Envoy calling
  Switchyard's LWEPP), the profile GIE's own reports carry;
- ``EPP``: the same tests against the endpoint picker alone (GIE names an
  EPP profile as future work; this is Switchyard's reading of it).

Two additions GIE's reports do not have, so that one file says everything:
``tests`` lists every test with its result and, for a skipped one, the reason
(for the others, what was and was not reproduced); ``extraTests`` holds
Switchyard's own tests, which are not counted in the statistics. Keys are
sorted, as GIE's YAML writer sorts them.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import yaml

from conformance.run import CaseResult, Result, Suite

GIE_VERSION: Final = "v1.6.0 (main at 84436a96)"
"""The GIE release (and commit) whose conformance tests are reproduced."""
GATEWAY_API_VERSION: Final = "v1.6.1"
"""The Gateway API conformance module that GIE version builds on."""


def _version() -> str:
    try:
        return metadata.version("switchyard")
    except metadata.PackageNotFoundError:
        return "unknown"


def _url() -> str:
    try:
        urls = metadata.metadata("switchyard").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        urls = []
    return urls[0].split(",", 1)[-1].strip() if urls else "unpublished"


def implementation() -> dict[str, Any]:
    return {
        "organization": "Switchyard",
        "project": "switchyard",
        "url": _url(),
        "version": _version(),
        "contact": ["Switchyard maintainers"],
    }


def _profile(name: str, suite: Suite, pick: Callable[[CaseResult], Result]) -> dict[str, Any]:
    ours = [r for r in suite.results if r.origin == "GIE"]
    extra = [r for r in suite.results if r.origin != "GIE"]
    by_outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for result in ours:
        by_outcome[pick(result).outcome].append(result.name)
    failed, skipped = by_outcome["failed"], by_outcome["skipped"]
    if failed:
        verdict, summary = "failure", f"Core tests failed with {len(failed)} test failures."
    elif skipped:
        verdict = "partial"
        summary = f"Core tests partially succeeded with {len(skipped)} test skips."
    else:
        verdict, summary = "success", "Core tests succeeded."
    core: dict[str, Any] = {
        "result": verdict,
        "statistics": {
            "Passed": len(by_outcome["passed"]),
            "Failed": len(failed),
            "Skipped": len(skipped),
        },
    }
    if skipped:
        core["skippedTests"] = skipped
    if failed:
        core["failedTests"] = failed

    def entry(test: CaseResult) -> dict[str, Any]:
        outcome = pick(test)
        item: dict[str, Any] = {"name": test.name, "result": outcome.outcome}
        if outcome.detail:
            item["reason" if outcome.outcome == "skipped" else "note"] = outcome.detail
        return item

    profile: dict[str, Any] = {
        "name": name,
        "summary": summary,
        "core": core,
        "tests": [entry(test) for test in ours],
    }
    if extra:
        profile["extraTests"] = [entry(test) for test in extra]
    return profile


def build(suite: Suite, date: datetime.datetime | None = None) -> dict[str, Any]:
    """The report as plain data."""
    when = (date or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "GatewayAPIInferenceExtensionVersion": GIE_VERSION,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ConformanceReport",
        "date": when,
        "gatewayAPIChannel": "standard",
        "gatewayAPIVersion": GATEWAY_API_VERSION,
        "implementation": implementation(),
        # GIE's reports say "default"; this run is the local reproduction, not the cluster suite.
        "mode": "local",
        "profiles": [
            _profile("Gateway", suite, lambda test: test.gateway),
            _profile("EPP", suite, lambda test: test.picker),
        ],
    }


def write(suite: Suite, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(build(suite), sort_keys=True, width=100, allow_unicode=True)
    path.write_text(text)
    return path


def default_path() -> Path:
    """``docs/conformance/report-<version>.yaml`` in the source tree."""
    return (
        Path(__file__).resolve().parents[1] / "docs" / "conformance" / f"report-{_version()}.yaml"
    )
