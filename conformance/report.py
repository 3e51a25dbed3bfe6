"""The conformance reports in GIE's format: one ConformanceReport per profile, a README beside them.

GIE's suite writes Gateway API's ``ConformanceReport`` (``conformance/apis/v1``
of the helpers' release) with one key of its own added,
``GatewayAPIInferenceExtensionVersion`` (GIE's ``conformancereport.go``),
through ``sigs.k8s.io/yaml``, which sorts keys. Gateway API's ``Report()``
fills it: ``apiVersion``/``kind``, the date (RFC 3339), the mode, the
implementation, the Gateway API version and channel (here, like the GIE
version, read from the CRDs: ``conformance.crds``), and one entry per
profile with its core result (``failure`` if any test failed, else
``partial`` if any was skipped, else ``success``), statistics, the sorted
names of the skipped and failed tests, and a summary. GIE's reports README
asks for exactly one profile per file, named
``<implementation version>-<mode>-<profile>-report.yaml``. Written here:

- ``<version>-<mode>-gateway-report.yaml``: profile ``Gateway``, GIE's tests
  through the gateway, the one profile GIE defines;
- ``<version>-<mode>-epp-report.yaml``: profile ``EPP``, the same tests at
  the pickers alone. GIE names an EPP profile as future work without
  defining it; this is Switchyard's reading, in the same format;
- ``README.md``, which GIE's submission rules ask for beside the reports (a
  table of them, how to reproduce them), and which says what the reports'
  format cannot: each test both ways, the status conditions not checked,
  the setup checks not reproduced, and Switchyard's own tests, which no
  profile counts.

The departures from GIE's text: each summary adds a sentence saying how the
pickers learnt their endpoints (``Discovery``: from their InferencePools, or
handed them), and the Gateway profile's one saying that its passes were
judged by traffic only, so that a report read alone does not claim more than
was checked.
"""

from __future__ import annotations

import datetime
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import yaml

from conformance.cases import SETUP_CHECKS
from conformance.client import HELPERS
from conformance.command import SWITCHYARD
from conformance.run import CaseResult, Result, Suite, table
from conformance.upstream import RELEASED

GIE_TESTS: Final = "kubernetes-sigs/gateway-api-inference-extension 84436a96"
"""Where the reproduced tests come from (v1.6.0's tests, unchanged on main at that commit)."""

PROFILES: Final[dict[str, Callable[[CaseResult], Result]]] = {
    "Gateway": lambda result: result.gateway,
    "EPP": lambda result: result.picker,
}
"""Each profile, and which of a test's two runs it reports."""

DEFAULT_MODE: Final = "local"
"""GIE's suite says ``default``; this is the local reproduction, not a cluster run, and says so."""


@dataclass(frozen=True, slots=True)
class Implementation:
    """The report's ``implementation``: who and what was tested (Gateway API's field names).

    The gateway here is always Switchyard's Envoy wiring; what varies is the
    picker, so this names the picker under test.
    """

    organization: str
    project: str
    url: str
    version: str
    contact: tuple[str, ...]

    @classmethod
    def switchyard(cls) -> Implementation:
        """Switchyard's, from the installed package's metadata (its first ``Project-URL``, if
        it names one; GIE writes an empty url when none is given)."""
        try:
            meta = metadata.metadata("switchyard")
            version = meta["Version"]
            urls = meta.get_all("Project-URL") or []
        except metadata.PackageNotFoundError:
            version, urls = "unknown", []
        url = urls[0].split(",", 1)[-1].strip() if urls else ""
        return cls("Switchyard", "switchyard", url, version, ("Switchyard maintainers",))

    def empty_fields(self) -> list[str]:
        """The fields Gateway API's ``Implementation.Validate`` would refuse as empty."""
        fields = {
            "organization": self.organization,
            "project": self.project,
            "url": self.url,
            "version": self.version,
        }
        return [name for name, value in fields.items() if not value] + (
            [] if self.contact else ["contact"]
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "organization": self.organization,
            "project": self.project,
            "url": self.url,
            "version": self.version,
            "contact": list(self.contact),
        }


def _gie_tests(suite: Suite) -> list[CaseResult]:
    return [result for result in suite.results if result.origin == "GIE"]


def _summary(result: str, skipped: int, failed: int) -> str:
    """Gateway API's ``buildSummary`` for a profile with core tests only."""
    if result == "success":
        return "Core tests succeeded."
    if result == "partial":
        return f"Core tests partially succeeded with {skipped} test skips."
    return f"Core tests failed with {failed} test failures."


def profile_report(suite: Suite, name: str) -> dict[str, Any]:
    """One ``ProfileReport``: GIE's tests as this profile's run of them found them."""
    pick = PROFILES[name]
    by_outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for result in _gie_tests(suite):
        by_outcome[pick(result).outcome].append(result.name)
    failed, skipped = sorted(by_outcome["failed"]), sorted(by_outcome["skipped"])
    verdict = "failure" if failed else "partial" if skipped else "success"
    core: dict[str, Any] = {
        "result": verdict,
        "statistics": {
            "Passed": len(by_outcome["passed"]),
            "Skipped": len(skipped),
            "Failed": len(failed),
        },
    }
    if skipped:
        core["skippedTests"] = skipped
    if failed:
        core["failedTests"] = failed
    summary = _summary(verdict, len(skipped), len(failed))
    summary += f" Endpoints: {suite.discovery.describe()}."
    if name == "Gateway":
        traffic_only = [
            r.name for r in _gie_tests(suite) if r.status and r.gateway.outcome == "passed"
        ]
        if traffic_only:
            summary += (
                f" Judged by traffic only: the {len(traffic_only)} passed tests' status "
                "conditions, and the suite's setup checks, were not checked (no Gateway "
                "controller; see README.md)."
            )
    else:
        summary += " The tests' requests at each pool's endpoint picker alone (see README.md)."
    return {"name": name, "summary": summary, "core": core}


def build(
    suite: Suite,
    profile: str,
    implementation: Implementation,
    mode: str = DEFAULT_MODE,
    date: datetime.datetime | None = None,
) -> dict[str, Any]:
    """One profile's report as plain data, with GIE's keys and no others."""
    when = (date or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "GatewayAPIInferenceExtensionVersion": suite.versions.inference_extension,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ConformanceReport",
        "date": when,
        "gatewayAPIChannel": suite.versions.gateway_api_channel,
        "gatewayAPIVersion": suite.versions.gateway_api,
        "implementation": implementation.as_dict(),
        "mode": mode,
        "profiles": [profile_report(suite, profile)],
    }


def file_name(implementation: Implementation, mode: str, profile: str) -> str:
    """GIE's ``<Implementation Version>-<Mode>-<Profile>-report.yaml``."""
    return f"{implementation.version or 'unversioned'}-{mode}-{profile.lower()}-report.yaml"


def readme(suite: Suite, implementation: Implementation, mode: str, files: Sequence[str]) -> str:
    """The README beside the reports: GIE's table of contents and reproduce section, then what
    the reports cannot say. No times or measured figures, so that a rerun that found the same
    writes the same file."""
    who = implementation.project or "the picker under test"
    lines = [
        f"# GIE conformance: {who} {implementation.version}".rstrip(),
        "",
        f"GIE's conformance tests ({GIE_TESTS}, on the Gateway API conformance helpers "
        f"{HELPERS}), reproduced on one machine by Switchyard's harness: echo pods on "
        "loopback addresses, one endpoint picker per InferencePool, a real Envoy as the "
        "gateway. Every test runs twice: through the gateway, and against each pool's picker "
        "alone. See Switchyard's `docs/conformance.md` for what a pass does and does not prove.",
        "",
        "| Extension Version Tested | Profile Tested | Implementation Version | Mode | Report |",
        "|---|---|---|---|---|",
    ]
    for profile, name in zip(PROFILES, files, strict=True):
        lines.append(
            f"| {suite.versions.inference_extension} | {profile} | "
            f"{implementation.version} | {mode} | [{profile} report](./{name}) |"
        )
    command = "make conformance"
    if suite.picker != SWITCHYARD:
        command += f" PICKER={shlex.quote(suite.picker)}"
    arguments = ["--picker-plaintext"] if not suite.tls else []
    if suite.upstream is not RELEASED:
        arguments.append(f"--upstream={suite.upstream.name}")
    if arguments:
        command += f" CONFORMANCE_ARGS={shlex.quote(' '.join(arguments))}"
    lines += [
        "",
        "## Reproduce",
        "",
        "From a Switchyard checkout (the Makefile installs what it needs):",
        "",
        "```sh",
        command,
        "```",
        "",
        "## Results",
        "",
        *(f"- {line}" for line in suite.conditions()),
        "",
        table(suite, times=False),
        "",
        "## Not checked here",
        "",
        "There is no Kubernetes API server and no Gateway controller, so no status condition "
        "is written or read. GIE's suite checks, before any test:",
        "",
        *(f"- {check}" for check in SETUP_CHECKS),
        "",
        "and, in each test, besides its traffic:",
        "",
    ]
    for result in _gie_tests(suite):
        if result.status_only:
            lines.append(f"- **{result.name}** (nothing else): {result.gateway.detail}")
        elif result.status:
            lines.append(f"- **{result.name}**: " + "; ".join(result.status))
    reasons = [
        f"- **{result.name}** ({mode_name}): {outcome.detail}"
        for result in suite.results
        if not result.status_only
        for mode_name, outcome in (("gateway", result.gateway), ("picker alone", result.picker))
        if outcome.outcome == "skipped"
    ]
    if reasons:
        lines += ["", "Skipped otherwise:", "", *reasons]
    lines.append("")
    return "\n".join(lines)


def write(
    suite: Suite,
    out_dir: Path,
    implementation: Implementation,
    mode: str = DEFAULT_MODE,
    date: datetime.datetime | None = None,
) -> list[Path]:
    """Write both profiles' reports and the README into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for profile in PROFILES:
        path = out_dir / file_name(implementation, mode, profile)
        document = build(suite, profile, implementation, mode, date)
        path.write_text(yaml.safe_dump(document, sort_keys=True, width=100, allow_unicode=True))
        paths.append(path)
    notes = out_dir / "README.md"
    notes.write_text(readme(suite, implementation, mode, [path.name for path in paths]))
    return [*paths, notes]


def default_dir() -> Path:
    """``docs/conformance`` in the source tree: where Switchyard's own reports are kept."""
    return Path(__file__).resolve().parents[1] / "docs" / "conformance"
