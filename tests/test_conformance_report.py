"""The conformance reports in GIE's format, the versions they name, and the picker template (no topology)."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conformance import report
from conformance.cases import CASES, GIE_ORDER, NOT_APPLICABLE
from conformance.command import (
    ONE_HOP,
    SWITCHYARD,
    SWITCHYARD_HANDED,
    Discovery,
    PickerCommand,
    TemplateError,
)
from conformance.crds import CRDS, CrdError, Versions, installed_versions
from conformance.run import CaseResult, Result, Suite
from conformance.upstream import NEXT

TYPES: dict[str, Any] = yaml.safe_load(
    (Path(__file__).parent / "data" / "conformance" / "report-types.yaml").read_text()
)
ROOT_TYPE = "GatewayAPIInferenceExtensionConformanceReport"
NAME = re.compile(r"^[^-]+-[a-z0-9]+-(gateway|epp)-report\.yaml$")


def problems(value: Any, kind: str, where: str = "") -> list[str]:
    """Where ``value`` is not of ``kind`` in the report types (an empty list: it is)."""
    if kind.startswith("["):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [
            p for i, item in enumerate(value) for p in problems(item, kind[1:-1], f"{where}[{i}]")
        ]
    if kind == "string":
        return [] if isinstance(value, str) else [f"{where}: expected a string"]
    if kind == "uint32":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32
        return [] if ok else [f"{where}: expected a uint32"]
    spec = TYPES[kind]
    if "enum" in spec:
        return [] if value in spec["enum"] else [f"{where}: {value!r} is not a {kind}"]
    if not isinstance(value, dict):
        return [f"{where}: expected a {kind} object"]
    found = [f"{where}.{key}: not a field of {kind}" for key in value if key not in spec]
    for key, field in spec.items():
        if key not in value:
            if field["required"]:
                found.append(f"{where}.{key}: required in {kind}, missing")
            continue
        found += problems(value[key], field["type"], f"{where}.{key}")
    return found


def result(outcome: str, detail: str = "") -> Result:
    return Result(outcome, detail)  # type: ignore[arg-type]


def suite(gateway: dict[str, str] | None = None, picker: dict[str, str] | None = None) -> Suite:
    """A finished run: every test passed (status-only ones skipped) unless told otherwise."""
    gateway, picker = gateway or {}, picker or {}
    made = Suite(installed_versions())
    status = {case.name: case.status for case in CASES}
    origin = {case.name: case.origin for case in CASES}
    names = [*GIE_ORDER, *(case.name for case in CASES if case.origin != "GIE")]
    for name in names:
        if name in NOT_APPLICABLE:
            skipped = result("skipped", f"not applicable: {NOT_APPLICABLE[name]}")
            made.results.append(CaseResult(name, "GIE", skipped, skipped, status_only=True))
            continue
        made.results.append(
            CaseResult(
                name,
                origin[name],
                result(gateway.get(name, "passed"), "why" if name in gateway else ""),
                result(picker.get(name, "passed"), "why" if name in picker else ""),
                status[name],
            )
        )
    return made


DATE = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)
SWITCHYARD_IMPL = report.Implementation("Switchyard", "switchyard", "", "0.1.0", ("maintainers",))


def written(tmp_path: Path, run: Suite, mode: str = "local") -> dict[str, dict[str, Any]]:
    paths = report.write(run, tmp_path, SWITCHYARD_IMPL, mode, DATE)
    return {p.name: yaml.safe_load(p.read_text()) for p in paths if p.suffix == ".yaml"}


def test_each_profile_is_one_gateway_api_conformance_report_named_as_gie_asks(
    tmp_path: Path,
) -> None:
    """Two files, GIE's <version>-<mode>-<profile>-report.yaml, each one profile and only the
    report types' keys, every required key present."""
    reports = written(tmp_path, suite({"GatewayFollowingEPPRouting": "failed"}))
    assert sorted(reports) == ["0.1.0-local-epp-report.yaml", "0.1.0-local-gateway-report.yaml"]
    for name, document in reports.items():
        assert NAME.match(name)
        assert problems(document, ROOT_TYPE, name) == []
        (profile,) = document["profiles"]
        assert profile["name"].lower() == name.split("-")[-2]
    assert (tmp_path / "README.md").exists()


def test_the_checked_in_reports_have_gies_format() -> None:
    """docs/conformance holds one report per profile, each of the report types."""
    found = sorted(report.default_dir().glob("*-report.yaml"))
    assert [NAME.match(path.name) is not None for path in found] == [True, True]
    for path in found:
        assert problems(yaml.safe_load(path.read_text()), ROOT_TYPE, path.name) == []


def test_the_report_types_check_catches_an_extra_or_missing_key() -> None:
    """The check itself can fail: a key GIE never writes, or a required one left out."""
    document = report.build(suite(), "Gateway", SWITCHYARD_IMPL, date=DATE)
    assert problems(document, ROOT_TYPE) == []
    assert problems({**document, "tests": []}, ROOT_TYPE) == [".tests: not a field of " + ROOT_TYPE]
    del document["profiles"][0]["core"]["statistics"]["Passed"]
    assert problems(document, ROOT_TYPE) == [
        ".profiles[0].core.statistics.Passed: required in Statistics, missing"
    ]


def test_statistics_count_gies_tests_only_and_list_them_sorted(tmp_path: Path) -> None:
    """Failed and skipped names sorted (Gateway API's Report sorts them); Switchyard's own tests
    are in no profile; the result and summary are buildSummary's."""
    run = suite(  # GIE runs InferencePoolAppProtocol before HTTPRouteMultipleRules...
        {"InferencePoolAppProtocol": "failed", "HTTPRouteMultipleRulesDifferentPools": "failed"},
        {"EppUnAvailableFailClose": "failed"},
    )
    gateway = report.profile_report(run, "Gateway")
    assert gateway["core"]["failedTests"] == [
        "HTTPRouteMultipleRulesDifferentPools",
        "InferencePoolAppProtocol",
    ]
    assert gateway["core"]["skippedTests"] == sorted(NOT_APPLICABLE)
    assert gateway["core"]["statistics"] == {"Passed": 9, "Skipped": 3, "Failed": 2}
    assert gateway["core"]["result"] == "failure"
    assert gateway["summary"].startswith("Core tests failed with 2 test failures.")
    epp = report.profile_report(run, "EPP")  # the own test's failure is not counted
    assert (epp["core"]["result"], epp["core"]["statistics"]["Failed"]) == ("partial", 0)
    assert epp["summary"].startswith("Core tests partially succeeded with 3 test skips.")


def test_the_gateway_summary_says_its_passes_were_judged_by_traffic_only() -> None:
    """Every passed GIE test also has status checks, which are not run: the summary says so."""
    summary = report.profile_report(suite(), "Gateway")["summary"]
    assert "Judged by traffic only: the 11 passed tests' status conditions" in summary


@pytest.mark.parametrize("discovery", list(Discovery))
def test_each_report_says_how_the_pickers_learnt_their_endpoints(
    tmp_path: Path, discovery: Discovery
) -> None:
    """Both profiles' summaries and the README say whether the pickers read their pools or were
    handed the endpoints; the README also says TLS or plaintext, and which upstream ran, and
    its command reproduces the run."""
    run = suite()
    run.discovery, run.tls, run.upstream = discovery, False, NEXT
    run.picker = SWITCHYARD_HANDED
    for profile in report.PROFILES:
        summary = report.profile_report(run, profile)["summary"]
        assert f"Endpoints: {discovery.describe()}." in summary
    report.write(run, tmp_path, SWITCHYARD_IMPL, "local", DATE)
    readme = (tmp_path / "README.md").read_text()
    assert f"- Endpoints: {discovery.describe()}." in readme
    assert "in plaintext (--picker-plaintext)" in readme
    assert "GIE PR #3053" in readme
    assert "CONFORMANCE_ARGS='--picker-plaintext --upstream=next'" in readme


def test_versions_are_read_from_the_crds_of_what_the_harness_applies() -> None:
    """GIE's bundle-version annotation, Gateway API's version and channel annotations."""
    assert installed_versions() == Versions("v1.6.0", "v1.6.1", "standard")
    run = suite()
    run.versions = Versions("v9.9.9", "v8.8.8", "experimental")  # whatever the CRDs said
    document = report.build(run, "Gateway", SWITCHYARD_IMPL, date=DATE)
    assert (
        document["GatewayAPIInferenceExtensionVersion"],
        document["gatewayAPIVersion"],
        document["gatewayAPIChannel"],
    ) == ("v9.9.9", "v8.8.8", "experimental")


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        (
            "inference.networking.k8s.io/bundle-version: v1.6.0",
            "inference.networking.k8s.io/bundle-version: v1.6.0\n    "
            "x: y\n---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
            "metadata:\n  annotations:\n    inference.networking.k8s.io/bundle-version: v1.5.0",
            "multiple gateway api inference extension CRDs versions",
        ),
        (
            "    inference.networking.k8s.io/bundle-version: v1.6.0\n",
            "",
            "no gateway api inference extension CRDs with the proper annotations",
        ),
        (
            "    gateway.networking.k8s.io/channel: standard\n  name: httproutes",
            "  name: httproutes",
            "partial version and channel annotations",
        ),
        ("bundle-version: v1.6.1", "bundle-version: v1.5.1", "different from the suite version"),
        ("kind: InferencePool", "kind: InferencePoolImport", "no CRD serves InferencePool"),
        (
            "  - {name: v1, served: true, storage: true}\n  - {name: v1beta1",
            "  - {name: v1beta1",
            "no CRD serves GatewayClass gateway.networking.k8s.io/v1",
        ),
    ],
    ids=["two-gie-versions", "no-gie-version", "partial", "not-the-helpers", "no-kind", "no-v1"],
)
def test_crds_that_do_not_name_one_version_stop_the_run(
    tmp_path: Path, old: str, new: str, error: str
) -> None:
    """GIE's and Gateway API's rules: one version each, annotated fully, the helpers' release."""
    text = CRDS.read_text()
    assert old in text
    path = tmp_path / "crds.yaml"
    path.write_text(text.replace(old, new, 1 if "served" in old else -1))
    with pytest.raises(CrdError, match=error):
        installed_versions(path)


def test_the_picker_template_fills_each_word_without_a_shell() -> None:
    """Fields are filled per word, after splitting, so a value with spaces stays one argument."""
    command = PickerCommand.parse("run --at '{host}:{grpc_port}' --f={{x}}", ["--pods", "{pods}"])
    argv = command.argv({"host": "127.1.2.3", "grpc_port": "9002", "pods": "/a b/p.yaml"})
    assert argv == ["run", "--at", "127.1.2.3:9002", "--f={x}", "--pods", "/a b/p.yaml"]
    assert command.template == "run --at '{host}:{grpc_port}' --f={{x}} --pods '{pods}'"
    assert PickerCommand.parse(SWITCHYARD).words[1:3] == ("-m", "lwepp")


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("picker --port {port}", r"unknown field \{port\}; known: \{python\}, \{host\}"),
        ("picker {}", r"unknown field \{\}"),
        ("picker --port {grpc_port:d}", r"write \{grpc_port\} without"),
        ("""picker --json '{"a": 1}'""", r'unknown field \{"a"\}'),
        ("picker '--x", "No closing quotation"),
        ("picker }", "literal brace"),
        ("   ", "empty"),
    ],
    ids=["unknown", "positional", "format-spec", "json-braces", "quote", "lone-brace", "empty"],
)
def test_a_bad_picker_template_is_refused_with_the_reason(template: str, error: str) -> None:
    """A picker command template with an unknown field, a format spec, bad quoting or nothing in it is refused, saying why."""
    with pytest.raises(TemplateError, match=error):
        PickerCommand.parse(template)


@pytest.mark.parametrize(
    ("template", "discovery"),
    [
        (SWITCHYARD, Discovery.POOL),
        (SWITCHYARD_HANDED, Discovery.HANDED),
        (ONE_HOP, Discovery.HANDED),
        ("p --kubeconfig {kubeconfig} --pool {pool}", Discovery.POOL),
        ("p --endpoints {endpoints}", Discovery.HANDED),
        ("p --pods {pods} --selector {selector}", Discovery.HANDED),
        ("p --kubeconfig {kubeconfig} --endpoints {endpoints}", "exclude each other"),
        ("p --kubeconfig {kubeconfig} --selector {selector}", "exclude each other"),
        ("p --pool {pool} --selector {selector}", "cannot learn its endpoints"),
    ],
    ids=["switchyard", "switchyard-handed", "one-hop", "kubeconfig", "endpoints", "pods",
         "both", "kubeconfig-and-selector", "neither"],
)  # fmt: skip
def test_the_fields_a_template_names_say_how_its_picker_finds_endpoints(
    template: str, discovery: Discovery | str
) -> None:
    """{kubeconfig}: the picker reads its pool from the API server; {endpoints} or {pods}: it
    is handed them; both, or neither, is refused."""
    if isinstance(discovery, Discovery):
        assert PickerCommand.parse(template).discovery is discovery
    else:
        with pytest.raises(TemplateError, match=discovery):
            PickerCommand.parse(template)
