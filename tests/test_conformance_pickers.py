"""Any ext_proc picker held to GIE's tests: a broken one fails exactly what it breaks, a configured
LWEPP passes.

Each is one run of the harness with a picker command (``make conformance
PICKER=...``). The broken picker's runs wait 1.5 s for consistency, so each
test it fails costs that much twice (at the picker, then through the
gateway), and run only the tests their point needs but the first; the
configured LWEPP's run leaves out the weighted test, whose warm-up is the
slow part of a whole run (``make conformance
CONFORMANCE_ARGS=--picker-arg=--config=...`` runs it).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conformance import report
from conformance.cases import CASES, NOT_APPLICABLE
from conformance.client import Timing
from conformance.command import ONE_HOP, SWITCHYARD, Discovery, PickerCommand
from conformance.run import Suite, run_suite

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
PICKER = (
    f"{{python}} {Path(__file__).with_name('broken_picker.py')} --host {{host}} "
    "--port {grpc_port} --health-port {health_port} --secure-serving {secure_serving} "
)
HANDED = PICKER + "--endpoints {endpoints} "
"""The broken picker, handed its endpoints."""
READS_POOL = PICKER + "--kubeconfig {kubeconfig} --pool-name {pool} --pool-namespace {namespace} "
"""The broken picker, reading its InferencePool and the pods from the harness's API server."""
BROKEN = HANDED + "--fault ignores-hints --fault no-report"
SHORT = Timing(max_time_to_consistency=1.5, delay_after_failure=0.1)

PINS_OR_REPORTS = {
    "EppUnAvailableFailOpen",
    "GatewayDestinationEndpointServed",
    "GatewayFollowingEPPRouting",
    "GatewayFollowingEPPRoutingWithDataParallelism",
    "GatewayWeightedAcrossTwoInferencePools",
    "InferencePoolAppProtocol",
    "EppUnAvailableFailOpenOwnPicker",
    "EppUnAvailableFailClose",
}
"""The tests that pin requests to pods (the selection header) or read the served report."""


def test_a_broken_picker_fails_exactly_the_tests_that_check_what_it_breaks(tmp_path: Path) -> None:
    """tests/broken_picker.py ignoring the subset hint and never reporting the served endpoint:
    the tests that pin requests or read the report fail, at the picker and through the gateway
    (the picker is at fault); every other test passes (so Envoy found it healthy, and dialled
    it over TLS), and the report says failure."""
    broken = PickerCommand.parse(BROKEN)
    suite = asyncio.run(run_suite(tmp_path, SHORT, picker=broken))
    outcomes = {r.name: (r.gateway.outcome, r.picker.outcome) for r in suite.results}
    for name, (gateway, picker) in outcomes.items():
        if name in PINS_OR_REPORTS:
            assert (gateway, picker) == ("failed", "failed"), name
        elif name in NOT_APPLICABLE:
            assert (gateway, picker) == ("skipped", "skipped"), name
        elif name == "InferencePoolInvalidEPPService":  # the pool has no picker at all
            assert (gateway, picker) == ("passed", "skipped"), name
        else:
            assert (gateway, picker) == ("passed", "passed"), name
    by_name = {r.name: r for r in suite.results}
    served = by_name["GatewayDestinationEndpointServed"]
    assert "x-conformance-test-served-endpoint" in served.picker.detail  # the missing report
    assert "x-conformance-test-served-endpoint" in served.gateway.detail
    pinned = by_name["GatewayFollowingEPPRouting"].gateway.detail
    assert "expected a pod named primary-inference-model-server-deployment-0" in pinned
    gateway = report.profile_report(suite, "Gateway")["core"]
    gie_failures = sorted(PINS_OR_REPORTS & {c.name for c in CASES if c.origin == "GIE"})
    assert (gateway["result"], gateway["failedTests"]) == ("failure", gie_failures)


def test_lwepp_with_the_recommended_config_passes(tmp_path: Path) -> None:
    """LWEPP with demo/configs/prefix-aware.yaml (filters, scorers, a picker, data sources) is
    held to the same tests and passes them both ways."""
    config = str(ROOT / "demo" / "configs" / "prefix-aware.yaml")
    picker = PickerCommand.parse(SWITCHYARD, ["--config", config])
    only = [c.name for c in CASES if c.name != "GatewayWeightedAcrossTwoInferencePools"]
    timing = Timing(max_time_to_consistency=30.0, delay_after_failure=0.1)
    suite = asyncio.run(run_suite(tmp_path, timing, only, picker))
    assert [r.name for r in suite.results if not r.status_only] == only
    for r in suite.results:
        assert r.gateway.outcome in ("passed", "skipped"), (r.name, r.gateway.detail)
        assert r.picker.outcome in ("passed", "skipped"), (r.name, r.picker.detail)


def test_the_one_hop_service_as_each_pools_picker_passes(tmp_path: Path) -> None:
    """onehop (BBR's chain, then the pick, in one stream) held to the same tests passes
    them both ways: the model header it adds changes no pick, no report, no failure mode.
    In plaintext (--picker-plaintext), which the gateway and the picker-alone runs both dial."""
    only = [c.name for c in CASES if c.name != "GatewayWeightedAcrossTwoInferencePools"]
    timing = Timing(max_time_to_consistency=30.0, delay_after_failure=0.1)
    one_hop = PickerCommand.parse(ONE_HOP)
    suite = asyncio.run(run_suite(tmp_path, timing, only, one_hop, plaintext=True))
    assert not suite.tls
    assert [r.name for r in suite.results if not r.status_only] == only
    for r in suite.results:
        assert r.gateway.outcome in ("passed", "skipped"), (r.name, r.gateway.detail)
        assert r.picker.outcome in ("passed", "skipped"), (r.name, r.picker.detail)
    assert "passed" in {r.gateway.outcome for r in suite.results}


def outcomes(suite: Suite) -> dict[str, tuple[str, str]]:
    return {r.name: (r.gateway.outcome, r.picker.outcome) for r in suite.results}


def test_a_picker_that_reads_its_pool_has_its_target_ports_tested(tmp_path: Path) -> None:
    """A picker that takes each pod's first container port for the pool's target port passes
    InferencePoolAppProtocol when the harness hands it its endpoints, and fails it, both ways,
    when it reads its InferencePool itself (the h2c pool's target port is 3001, the
    appprotocol pods' first container port 3000). GIE's data-parallel test does not catch it:
    every allowed set there holds a bare IP, which port 3000 satisfies."""
    fault = "--fault container-port"
    tests = ["InferencePoolAppProtocol", "GatewayFollowingEPPRoutingWithDataParallelism"]
    reads = PickerCommand.parse(READS_POOL + fault)
    suite = asyncio.run(run_suite(tmp_path / "pool", SHORT, tests, reads))
    assert suite.discovery is Discovery.POOL
    assert outcomes(suite) == {
        "InferencePoolAppProtocol": ("failed", "failed"),
        "GatewayFollowingEPPRoutingWithDataParallelism": ("passed", "passed"),
    }
    handed = PickerCommand.parse(HANDED + fault)
    suite = asyncio.run(run_suite(tmp_path / "handed", SHORT, tests[:1], handed))
    assert suite.discovery is Discovery.HANDED
    assert outcomes(suite) == {"InferencePoolAppProtocol": ("passed", "passed")}


def test_the_gateway_fails_a_picker_that_names_the_endpoint_only_in_the_header(
    tmp_path: Path,
) -> None:
    """Without envoy.lb metadata (which this gateway, like Istio's, routes on), the gateway's
    check answers 500 saying so: the Gateway profile fails the picker even in a test whose
    requests any pod may serve, as the EPP profile does."""
    picker = PickerCommand.parse(READS_POOL + "--fault header-only")
    tests = ["GatewayDestinationEndpointServed", "HTTPRouteMultipleRulesDifferentPools"]
    suite = asyncio.run(run_suite(tmp_path, SHORT, tests, picker))
    assert outcomes(suite) == dict.fromkeys(tests, ("failed", "failed"))
    for result in suite.results:
        assert "got 500 (endpoint picker protocol" in result.gateway.detail, result.gateway.detail
        assert "envoy.lb metadata None differ" in result.picker.detail
    gateway = report.profile_report(suite, "Gateway")["core"]
    assert gateway["failedTests"] == sorted(tests)


def test_a_fallback_list_is_followed_through_the_gateway(tmp_path: Path) -> None:
    """A picker that names up to three allowed endpoints (``ip:port,ip:port``) passes the tests
    that pin pods and ports, both ways: Envoy serves the first, and reports it."""
    picker = PickerCommand.parse(READS_POOL + "--fallbacks 3")
    tests = [
        "GatewayDestinationEndpointServed",
        "GatewayFollowingEPPRouting",
        "GatewayFollowingEPPRoutingWithDataParallelism",
    ]
    suite = asyncio.run(run_suite(tmp_path, SHORT, tests, picker))
    assert outcomes(suite) == dict.fromkeys(tests, ("passed", "passed"))
    access = (tmp_path / "access-conformance-primary.log").read_text().splitlines()
    picked = [json.loads(line)["picked"] for line in access]
    assert any("," in value for value in picked)  # lists were sent, and followed
