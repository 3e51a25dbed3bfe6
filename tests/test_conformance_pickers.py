"""Any ext_proc picker held to GIE's tests: a broken one fails exactly what it breaks, a configured
LWEPP passes.

Each is one run of the harness with a picker command (``make conformance
PICKER=...``). The broken picker's run waits 1.5 s for consistency, so each
test it fails costs that much twice (at the picker, then through the
gateway); the configured LWEPP's run leaves out the weighted test, whose
warm-up is the slow part of a whole run (``make conformance
CONFORMANCE_ARGS=--picker-arg=--config=...`` runs it).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conformance import report
from conformance.cases import CASES, NOT_APPLICABLE
from conformance.client import Timing
from conformance.command import ONE_HOP, SWITCHYARD, PickerCommand
from conformance.run import run_suite

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BROKEN = (
    f"{{python}} {Path(__file__).with_name('broken_picker.py')} --host {{host}} "
    "--port {grpc_port} --health-port {health_port} --endpoints {endpoints} "
    "--health-service readiness"
)
"""The broken picker, reporting ready on a health service of its own name, as the llm-d router
does: the harness and Envoy's health check must both ask for that one."""

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
    """tests/broken_picker.py ignores the subset hint and never reports the served endpoint: the
    tests that pin requests or read the report fail, at the picker and through the gateway (the
    picker is at fault); every other test passes (so Envoy found it healthy on the health
    service named), and the report says failure."""
    timing = Timing(max_time_to_consistency=1.5, delay_after_failure=0.1)
    broken = PickerCommand.parse(BROKEN)
    suite = asyncio.run(run_suite(tmp_path, timing, picker=broken, health_service="readiness"))
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
    them both ways: the model header it adds changes no pick, no report, no failure mode."""
    only = [c.name for c in CASES if c.name != "GatewayWeightedAcrossTwoInferencePools"]
    timing = Timing(max_time_to_consistency=30.0, delay_after_failure=0.1)
    suite = asyncio.run(run_suite(tmp_path, timing, only, PickerCommand.parse(ONE_HOP)))
    assert [r.name for r in suite.results if not r.status_only] == only
    for r in suite.results:
        assert r.gateway.outcome in ("passed", "skipped"), (r.name, r.gateway.detail)
        assert r.picker.outcome in ("passed", "skipped"), (r.name, r.picker.detail)
    assert "passed" in {r.gateway.outcome for r in suite.results}
