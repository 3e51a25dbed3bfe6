"""Running the suite: bring the topology up, run every test both ways, collect the results.

For each test, as GIE's suite does, the test's HTTPRoutes are applied (and
Envoy is waited for) before it runs and removed after. The test then runs
against the pickers alone first, then through the gateway; a failure in the
first says the picker is at fault, a failure only in the second says the
gateway's wiring is. The pickers are whatever ``PickerCommand`` starts
(Switchyard's LWEPP by default), and the API versions the run reports are
read from the CRDs of what it applies (``conformance.crds``) before anything
starts.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from conformance.cases import CASES, GIE_ORDER, NOT_APPLICABLE, Case, Skipped, Trial
from conformance.client import Failed, GatewayTransport, Timing, Transport, gateway_session
from conformance.command import SWITCHYARD, Discovery, PickerCommand
from conformance.crds import Versions, installed_versions
from conformance.picker import NotForPicker, PickerTransport
from conformance.topology import GATEWAYS, Topology
from conformance.upstream import RELEASED, Upstream

Outcome = Literal["passed", "failed", "skipped"]
MODES: Final = ("gateway", "picker")


@dataclass(frozen=True, slots=True)
class Result:
    """One test run one way: the outcome, and the reason, failure or note that goes with it."""

    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CaseResult:
    """A test's results through the gateway and at the picker.

    ``status``: the test's status half in GIE's suite, which this run does not
    check (``Case.status``); ``status_only``: a GIE test that has nothing else.
    """

    name: str
    origin: str
    gateway: Result
    picker: Result
    status: tuple[str, ...] = ()
    status_only: bool = False

    @property
    def passed(self) -> bool:
        return "failed" not in (self.gateway.outcome, self.picker.outcome)


@dataclass(slots=True)
class Suite:
    """What a run found; ``results`` in GIE's order, then Switchyard's own tests.

    ``picker``: the command template the pickers ran from; ``versions``: what
    the CRDs of the applied objects say (the report's API versions);
    ``discovery``: how the pickers learnt their endpoints; ``tls``: whether
    the gateway dialled them over TLS; ``upstream``: the upstream behaviour
    followed (``conformance.upstream``).
    """

    versions: Versions
    picker: str = SWITCHYARD
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    startup_seconds: float = 0.0
    discovery: Discovery = Discovery.POOL
    tls: bool = True
    upstream: Upstream = RELEASED

    def conditions(self) -> list[str]:
        """What the run was, in sentences, for the reports and the terminal."""
        return [
            f"Endpoints: {self.discovery.describe()}.",
            "The gateway dialled the pickers over TLS, as GIE's gateways dial lwepp."
            if self.tls
            else "The gateway dialled the pickers in plaintext (--picker-plaintext); GIE's "
            "gateways dial TLS.",
            f"Upstream: {self.upstream.summary}.",
        ]

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.results)


async def _run_one(case: Case, trial: Trial) -> Result:
    start = time.monotonic()
    try:
        note = await case.run(trial)
    except Skipped as skipped:
        return Result("skipped", str(skipped), time.monotonic() - start)
    except NotForPicker as why:
        return Result("skipped", f"not the picker's to decide: {why}", time.monotonic() - start)
    except Failed as failure:
        return Result("failed", str(failure), time.monotonic() - start)
    except Exception:  # a broken harness or a crashed service: report it, run the rest
        return Result("failed", traceback.format_exc(limit=3), time.monotonic() - start)
    return Result("passed", note, time.monotonic() - start)


async def run_suite(
    work_dir: Path,
    timing: Timing | None = None,
    only: Collection[str] = (),
    picker: PickerCommand | None = None,
    *,
    plaintext: bool = False,
    upstream: Upstream = RELEASED,
) -> Suite:
    """Start the topology in ``work_dir``, run the tests (all, or those named), stop it.

    ``picker`` starts each pool's picker (Switchyard's LWEPP by default), which
    is ready once its health port reports ``inference-extension`` SERVING;
    ``plaintext``: the gateway and the picker-alone runs dial the pickers
    without TLS; ``upstream``: the upstream behaviour to follow (the timing's
    wait after a failure is the caller's to match).
    """
    timing = timing or Timing()
    picker = picker or PickerCommand.parse(SWITCHYARD)
    cases: Sequence[Case] = [case for case in CASES if not only or case.name in only]
    suite = Suite(
        installed_versions(),
        picker.template,
        discovery=picker.discovery,
        tls=not plaintext,
        upstream=upstream,
    )
    began = time.monotonic()
    with Topology(work_dir, picker=picker, plaintext=plaintext) as topology:
        suite.startup_seconds = time.monotonic() - began
        pods_by_ip = {pod.ip: pod.name for pods in topology.pods.values() for pod in pods}
        pickers = {
            name: f"{pool.picker}:{pool.picker_port}"
            for name, pool in topology.pools.items()
            if name in topology.services
        }
        gateways = {g.name: g for g in GATEWAYS}
        alone = PickerTransport(gateways, pickers, pods_by_ip, tls=not plaintext)
        try:
            async with gateway_session() as session:
                gateway = GatewayTransport(session, topology.gateways, timing)
                for case in cases:
                    await asyncio.to_thread(topology.apply, case.routes)
                    alone.routes = case.routes
                    results = {}
                    for mode, transport, owner in (
                        ("picker", alone, None),
                        ("gateway", gateway, topology),
                    ):
                        via: Transport = transport
                        trial = Trial(via, topology.pods, timing, owner, upstream)
                        results[mode] = await _run_one(case, trial)
                    await alone.close()  # a picker the test restarted has a new certificate
                    suite.results.append(
                        CaseResult(
                            case.name,
                            case.origin,
                            results["gateway"],
                            results["picker"],
                            case.status,
                        )
                    )
                await asyncio.to_thread(topology.apply, ())
        finally:
            await alone.close()
    for name, reason in NOT_APPLICABLE.items():
        if not only or name in only:
            skipped = Result("skipped", f"not applicable: {reason}")
            suite.results.append(CaseResult(name, "GIE", skipped, skipped, status_only=True))
    order = {name: i for i, name in enumerate(GIE_ORDER)}
    suite.results.sort(key=lambda result: order.get(result.name, len(order)))
    suite.seconds = time.monotonic() - began
    return suite


def status_column(result: CaseResult) -> str:
    """What became of the test's status conditions (GIE's tests have some; ours have none)."""
    if result.status_only:
        return "not checked: the whole test"
    return "not checked (traffic only)" if result.status else "none in the test"


def table(suite: Suite, *, times: bool = True) -> str:
    """The results as a Markdown table: one row per test, both ways, the status half, and
    (with ``times``) how long each took."""
    rows = [
        "| test | through the gateway | picker alone | status conditions |"
        + (" time |" if times else ""),
        "|---|---|---|---|" + ("---:|" if times else ""),
    ]
    for result in suite.results:
        name = result.name + (" *" if result.origin != "GIE" else "")
        row = (
            f"| {name} | {result.gateway.outcome} | {result.picker.outcome} "
            f"| {status_column(result)} |"
        )
        if times:
            seconds = result.gateway.seconds + result.picker.seconds
            row += f" {seconds:.1f} s |" if not result.status_only else " |"
        rows.append(row)
    rows.append("")
    rows.append("`*` Switchyard's own test, not in GIE's suite.")
    return "\n".join(rows)


def details(suite: Suite) -> str:
    """Notes, reasons and failures, test by test."""
    lines = []
    for result in suite.results:
        gateway, picker = result.gateway, result.picker
        if gateway.detail and (gateway.outcome, gateway.detail) == (picker.outcome, picker.detail):
            lines.append(f"- {result.name} (both ways, {gateway.outcome}): {gateway.detail}")
            continue
        for mode, outcome in (("gateway", gateway), ("picker", picker)):
            if outcome.detail:
                lines.append(f"- {result.name} ({mode}, {outcome.outcome}): {outcome.detail}")
    return "\n".join(lines)
