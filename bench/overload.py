"""``python -m bench.overload`` (also part of ``make bench``): an overloaded pool, governed or not.

The routing part's engines (``bench.routing``: simulated vLLM engines of one
profile, in virtual time on one ``VirtualLoop``), driven through the picker's
real code path: the configuration ``bench/configs/overload.yaml`` loaded by
``lwepp.config``, its pipeline choosing every request (``PipelineRouter``, as
the routing part does), and in front of it what the service's admission
control runs (``lwepp.flowcontrol.admission``): each request's priority from
its InferenceObjective (``lwepp.objectives.priority_of``), then either

``flow control``
    the flow controller of the configuration's ``flowControl`` section
    (``lwepp.flowcontrol.controller``), on the virtual clock: a request
    joins its band and flow, refused at once if its band is full; dispatch
    cycles run when a request arrives and when a response ends (as the
    service's dispatcher does), evictions at each queue-wait deadline; or
``gate off``
    the same file without the ``flowControl`` gate: the router's legacy rule,
    a sheddable request (priority < 0) refused while the detector reads 1.0,
    every other request sent at once.

Each case runs in both modes with the same arrivals (same seed). Loads are in
units of the pool's **capacity**, measured first in the same run: the rate
at which the engines complete requests while offered far more (ten requests
a second per engine) with nothing in front of them; the requests are the
benchmark's own (a fresh ``prompt_tokens``-token prompt each, ``max_tokens``
out).

Cases: an interactive tenant (objective ``interactive``, priority 10)
offering 0.3 throughout beside a batch tenant (``batch``, priority -1)
offering 0.4, 0.7, 1.2 and 2.7 (totals 0.7, 1.0, 1.5, 3.0); and two tenants
of equal priority (no objective; fairness ids ``heavy`` and ``light``)
offering 4:1, at totals 1.5 and 3.0. Each tenant's requests are a Poisson
process of its own.

Measured over the requests that arrive after the warm-up (``Sizes.warmup``):
per tenant, time to first token (arrival at the gateway to first token: the
time waiting in flow control included) p50/p90, requests served per second
(completed within the measured window), refused ones and how long after
arrival their answer came, p99; goodput, output tokens per second of the
requests completed in the window; the most each band of flow control held
(requests and bytes, against its limits), and the engines' own longest
waiting queue.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from bench import routing
from bench.report import Options, Section, Table, Target, percentile, progress
from bench.workloads import MODEL, Arrival, derived_seed
from lwepp.attributes import AttributeStore
from lwepp.config import PickerConfig, load_text
from lwepp.flowcontrol.admission import DEFAULT_FAIRNESS, FAIRNESS_HEADERS
from lwepp.flowcontrol.controller import FlowController
from lwepp.flowcontrol.queues import Item, Outcome
from lwepp.objectives import OBJECTIVE_HEADERS, Objective, priority_of
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request
from simulator.profiles import PROFILES, Profile
from simulator.tokenizer import text_block, token_block

CONFIG: Final = routing.CONFIGS / "overload.yaml"
GATE_LINE: Final = "featureGates: [flowControl]\n"
MODES: Final = ("flow control", "gate off")
OBJECTIVES: Final = MappingProxyType(
    {
        "interactive": Objective("interactive", 10, "sim"),
        "batch": Objective("batch", -1, "sim"),
    }
)
"""The two InferenceObjectives of the demo, as the picker would read them."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every size of a run: full, or the smoke size of ``Options.quick``."""

    engines: int
    duration: float
    """Seconds during which requests arrive, in each run."""
    warmup: float
    """Requests arriving before this are left out of every measure."""
    prompt_tokens: int
    max_tokens: int
    pilot_rate: float = 10.0
    """Requests per second per engine offered to measure capacity: far past it."""


FULL: Final = Sizes(
    engines=routing.ENGINES, duration=150.0, warmup=40.0, prompt_tokens=256, max_tokens=64
)
QUICK: Final = Sizes(
    engines=2, duration=16.0, warmup=4.0, prompt_tokens=64, max_tokens=8, pilot_rate=40.0
)


@dataclass(frozen=True, slots=True)
class Tenant:
    """One source of requests: its name (its fairness id), its share of the load, and the
    objective its requests name (None: none, priority 0)."""

    name: str
    load: float
    objective: str | None = None

    def headers(self) -> tuple[tuple[str, str], ...]:
        objective = ((OBJECTIVE_HEADERS[0], self.objective),) if self.objective else ()
        return ((FAIRNESS_HEADERS[0], self.name), *objective)


def priority_case(batch: float) -> tuple[Tenant, ...]:
    return Tenant("interactive", 0.3, "interactive"), Tenant("batch", batch, "batch")


def fairness_case(total: float) -> tuple[Tenant, ...]:
    return Tenant("heavy", total * 0.8), Tenant("light", total * 0.2)


CASES: Final = (
    *(("priority", round(0.3 + b, 1), priority_case(b)) for b in (0.4, 0.7, 1.2, 2.7)),
    *(("fairness", total, fairness_case(total)) for total in (1.5, 3.0)),
)
"""(case, total load, tenants): what the issue asks for, in that order."""


def arrivals(
    tenants: Sequence[Tenant], capacity: float, sizes: Sizes, seed: int
) -> list[tuple[Arrival, Tenant]]:
    """Each tenant's Poisson arrivals at ``load × capacity`` per second, merged by time."""
    merged: list[tuple[Arrival, Tenant]] = []
    for tenant in tenants:
        rate = tenant.load * capacity
        rng = random.Random(derived_seed("overload", seed, tenant.name, round(rate, 6)))
        at, n = 0.0, 0
        while (at := at + rng.expovariate(rate)) < sizes.duration:
            block = derived_seed("overload", seed, tenant.name, n)
            merged.append(
                (
                    Arrival(
                        at=at,
                        request_id=f"{tenant.name}-{n}",
                        body={
                            "model": MODEL,
                            "prompt": text_block(block, sizes.prompt_tokens),
                            "max_tokens": sizes.max_tokens,
                        },
                        prompt_tokens=tuple(token_block(block, sizes.prompt_tokens)),
                        max_tokens=sizes.max_tokens,
                        group=tenant.name,
                        session=tenant.name,
                    ),
                    tenant,
                )
            )
            n += 1
    merged.sort(key=lambda pair: pair[0].at)
    return merged


# --- one run ---------------------------------------------------------------------------


@dataclass(slots=True)
class TenantRun:
    """What one tenant got in one run (over the measured window)."""

    name: str
    offered: int = 0
    served: int = 0
    """Completed within the measured window."""
    refused: int = 0
    ttfts: list[float] = field(default_factory=list)
    refusal_delays: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BandPeak:
    priority: int
    requests: int
    max_requests: int
    size: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class Run:
    """One case in one mode: each tenant's measures, the goodput, what the queues held."""

    case: str
    total: float
    mode: str
    window: float
    tenants: tuple[TenantRun, ...]
    peaks: tuple[BandPeak, ...]
    engine_waiting_peak: int
    outcomes: Mapping[str, int]
    wall_seconds: float

    @property
    def goodput(self) -> float:
        return sum(t.output_tokens for t in self.tenants) / self.window

    def tenant(self, name: str) -> TenantRun:
        return next(t for t in self.tenants if t.name == name)

    def served_per_s(self, name: str) -> float:
        return self.tenant(name).served / self.window


def configuration(mode: str, text: str) -> PickerConfig:
    """The benchmark's configuration, as the picker loads it; ``gate off``: without the gate."""
    if mode == "gate off":
        text = text.replace(GATE_LINE, "")
    return load_text(text, str(CONFIG))


@dataclass(slots=True)
class _Flight:
    arrival: Arrival
    tenant: TenantRun
    index: int
    handle: Any
    measured: bool


class _Run:
    """The mutable state of one simulation, and the callbacks the loop calls."""

    def __init__(
        self, mode: str, config_text: str, sizes: Sizes, profile: Profile, seed: int
    ) -> None:
        self.loop = VirtualLoop()
        self.sizes = sizes
        self.fleet = [Engine(profile, seed=seed * 1000 + i) for i in range(sizes.engines)]
        pool = routing.endpoints(sizes.engines)
        config = configuration(mode, config_text) if mode != "capacity" else None
        self.config = config
        plain = load_text(config_text.replace(GATE_LINE, ""), str(CONFIG))  # for its pipeline
        clock: Callable[[], float] = lambda: self.loop.now  # noqa: E731
        pipeline = (config or plain).pipeline(store=AttributeStore(), clock=clock, explain="off")
        self.router = routing.PipelineRouter(mode, pipeline, pipeline.sources, pool)
        endpoints = self.router.endpoints

        def candidates() -> Sequence[Any]:
            return pipeline.candidates(endpoints).candidates

        self.candidates = candidates
        flow = config.flow if config is not None else None
        self.detector = flow.detector if flow is not None else None
        self.controller = (
            FlowController(flow.settings, candidates, clock)
            if flow is not None and flow.settings is not None
            else None
        )
        self.drivers = [VirtualEngine(e, self.loop, self.on_event) for e in self.fleet]
        self.flights: dict[str, _Flight] = {}
        self.waiting_peak = 0
        self.expiry_at: float | None = None
        self.outcomes: dict[str, int] = {}

    # --- admission, as lwepp.flowcontrol.admission.Admission does it ---

    def arrive(self, arrival: Arrival, tenant: Tenant, record: TenantRun, measured: bool) -> None:
        now = self.loop.now
        self.waiting_peak = max(self.waiting_peak, max(e.waiting for e in self.fleet))
        if measured:
            record.offered += 1
        priority = priority_of(tenant.headers(), OBJECTIVES)
        controller = self.controller
        if controller is None:
            detector = self.detector
            saturated = detector is not None and detector.saturation(self.candidates(), now) >= 1
            if priority < 0 and saturated:
                self.refused(record, arrival, measured, "RejectedSheddable")
                return
            self.route(arrival, record, measured)
            return

        def decided(item: Item) -> None:
            outcome = item.outcome.value if item.outcome is not None else ""
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if item.outcome is Outcome.DISPATCHED:
                self.route(arrival, record, measured)
            else:
                self.refused(record, arrival, measured, outcome)

        fairness = dict(tenant.headers()).get(FAIRNESS_HEADERS[0], DEFAULT_FAIRNESS)
        controller.submit(
            Item(
                arrival.request_id,
                fairness,
                priority,
                size=len(arrival.body_bytes()),
                received=now,
                model=MODEL,
                on_done=decided,
            )
        )
        self.pump()

    def pump(self) -> None:
        """Dispatch cycles until one lets nothing go, then the next eviction scheduled."""
        controller = self.controller
        if controller is None:
            return
        while controller.dispatch() is not None:
            pass
        deadline = controller.next_expiry()
        if deadline is not None and (self.expiry_at is None or deadline < self.expiry_at):
            self.expiry_at = deadline
            self.loop.at(max(deadline, self.loop.now), self.expire)

    def expire(self) -> None:
        self.expiry_at = None
        if self.controller is not None:
            self.controller.expire()
        self.pump()

    def refused(self, record: TenantRun, arrival: Arrival, measured: bool, outcome: str) -> None:
        if measured:
            record.refused += 1
            record.refusal_delays.append(self.loop.now - arrival.at)

    def route(self, arrival: Arrival, record: TenantRun, measured: bool) -> None:
        now = self.loop.now
        request = Request(arrival.request_id, arrival.prompt_tokens, arrival.max_tokens, now)
        index, handle = self.router.choose(arrival, request)
        if index is None:
            self.refused(record, arrival, measured, "NoPick")
            return
        self.flights[arrival.request_id] = _Flight(arrival, record, index, handle, measured)
        self.drivers[index].submit(request)

    # --- the engines ---

    def on_event(self, event: Event) -> None:
        request = event.request
        flight = self.flights[request.id]
        now = self.loop.now
        if event.kind == "token":
            if request.generated == 1:
                if flight.measured:
                    flight.tenant.ttfts.append(now - flight.arrival.at)
                self.router.first_token(flight.arrival, flight.index, flight.handle)
            return
        del self.flights[request.id]
        self.router.complete(flight.arrival, flight.index, flight.handle, request)
        window = self.sizes.warmup <= now <= self.sizes.duration
        if event.kind == "done" and window:
            flight.tenant.served += 1
            flight.tenant.output_tokens += request.generated
        self.pump()  # a slot freed


def simulate(
    case: str,
    total: float,
    tenants: Sequence[Tenant],
    mode: str,
    capacity: float,
    sizes: Sizes,
    profile: Profile,
    seed: int,
    config_text: str,
) -> Run:
    """One case in one mode (``flow control``, ``gate off``, or ``capacity``: nothing in
    front of the pipeline), on fresh engines."""
    started = time.perf_counter()
    run = _Run(mode, config_text, sizes, profile, seed)
    records = {t.name: TenantRun(t.name) for t in tenants}
    for arrival, tenant in arrivals(tenants, capacity, sizes, seed):
        measured = arrival.at >= sizes.warmup

        def arrive(a: Arrival = arrival, t: Tenant = tenant, m: bool = measured) -> None:
            run.arrive(a, t, records[t.name], m)

        run.loop.at(arrival.at, arrive)
    run.loop.run()
    controller = run.controller
    peaks = (
        tuple(
            BandPeak(b.priority, b.peak_length, b.max_requests, b.peak_size, b.max_bytes)
            for b in (controller.bands[p] for p in controller.order)
        )
        if controller is not None
        else ()
    )
    return Run(
        case,
        total,
        mode,
        sizes.duration - sizes.warmup,
        tuple(records.values()),
        peaks,
        run.waiting_peak,
        dict(sorted(run.outcomes.items())),
        time.perf_counter() - started,
    )


def measure_capacity(sizes: Sizes, profile: Profile, seed: int, config_text: str) -> Run:
    """The pool offered ``pilot_rate`` requests a second per engine, nothing in front."""
    offered = sizes.pilot_rate * sizes.engines
    return simulate(
        "capacity", math.nan, (Tenant("all", 1.0),), "capacity", offered, sizes, profile, seed,
        config_text,
    )  # fmt: skip


# --- the report ------------------------------------------------------------------------


def fair_shares(offered: Mapping[str, float], served: float) -> dict[str, float]:
    """Max-min fair shares of ``served`` among tenants asking ``offered``: whoever asks less
    than an equal share gets all it asks; the rest is shared equally."""
    shares: dict[str, float] = {}
    left, asking = served, dict(offered)
    while asking:
        equal = left / len(asking)
        small = {name: want for name, want in asking.items() if want <= equal}
        if not small:
            shares.update(dict.fromkeys(asking, equal))
            break
        for name, want in small.items():
            shares[name] = want
            left -= want
            del asking[name]
    return shares


def run(options: Options) -> Section:
    """Capacity, then every case in both modes; the section ``python -m bench overload`` writes."""
    started = time.perf_counter()
    sizes = QUICK if options.quick else FULL
    profile = PROFILES[routing.PROFILE]
    config_text = CONFIG.read_text()
    pilot = measure_capacity(sizes, profile, options.seed, config_text)
    capacity = pilot.served_per_s("all")
    progress(f"overload: capacity {capacity:.3g} requests/s ({sizes.engines} engines)")
    runs: list[Run] = []
    for case, total, tenants in CASES:
        for mode in MODES:
            done = simulate(
                case, total, tenants, mode, capacity, sizes, profile, options.seed, config_text
            )
            runs.append(done)
            progress(
                f"overload: {case} at {total:g}, {mode}: goodput {done.goodput:.0f} tokens/s, "
                f"{done.wall_seconds:.1f} s"
            )
    return section(runs, pilot, capacity, sizes, profile, options, time.perf_counter() - started)


def _find(runs: Sequence[Run], case: str, total: float, mode: str) -> Run | None:
    return next(
        (r for r in runs if r.case == case and math.isclose(r.total, total) and r.mode == mode),
        None,
    )


def _ms(values: Sequence[float], q: float) -> float:
    return percentile(values, q) * 1e3


def run_rows(runs: Sequence[Run], capacity: float) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in runs:
        for t in r.tenants:
            rows.append(
                [
                    f"{r.case} {r.total:g}",
                    r.mode,
                    t.name,
                    t.offered / r.window / capacity,
                    t.served / r.window / capacity,
                    t.refused,
                    _ms(t.refusal_delays, 99) if t.refusal_delays else None,
                    _ms(t.ttfts, 50),
                    _ms(t.ttfts, 90),
                ]
            )
        rows.append(
            [
                f"{r.case} {r.total:g}",
                r.mode,
                "(all)",
                sum(t.offered for t in r.tenants) / r.window / capacity,
                sum(t.served for t in r.tenants) / r.window / capacity,
                sum(t.refused for t in r.tenants),
                None,
                r.goodput,
                r.engine_waiting_peak,
            ]
        )
    return rows


def targets(runs: Sequence[Run], capacity: float) -> list[Target]:
    """The issue's five goals, on the flow-control runs."""
    fc = "flow control"
    out: list[Target] = []
    base = _find(runs, "priority", 0.7, fc)
    base_p90 = percentile(base.tenant("interactive").ttfts, 90) if base else math.nan
    for total in (1.5, 3.0):
        r = _find(runs, "priority", total, fc)
        p90 = percentile(r.tenant("interactive").ttfts, 90) if r else math.nan
        out.append(
            Target(f"interactive TTFT p90 at {total:g} / its p90 at 0.7", p90 / base_p90, 1.25)
        )
    priority = [r for r in runs if r.case == "priority" and r.mode == fc]
    out.append(
        Target(
            "interactive requests refused, any load",
            float(sum(r.tenant("interactive").refused for r in priority)),
            0.0,
            unit="",
        )
    )
    delays = [d for r in priority for d in r.tenant("batch").refusal_delays]
    out.append(
        Target(
            "refused batch request answered after (p99)",
            percentile(delays, 99) * 1e3,
            50.0,
            unit=" ms",
        )
    )
    at_one, at_three = _find(runs, "priority", 1.0, fc), _find(runs, "priority", 3.0, fc)
    if at_one is not None and at_three is not None:
        out.append(
            Target(
                "goodput at 3.0 / goodput at 1.0",
                at_three.goodput / at_one.goodput,
                0.95,
                at_most=False,
            )
        )
    worst = 0.0
    for total in (1.5, 3.0):
        r = _find(runs, "fairness", total, fc)
        if r is None:
            worst = math.nan
            continue
        offered = {t.name: t.offered / r.window for t in r.tenants}
        served = {t.name: t.served / r.window for t in r.tenants}
        shares = fair_shares(offered, sum(served.values()))
        for name, share in shares.items():
            worst = max(worst, abs(served[name] - share) / share)
    out.append(
        Target(
            "4:1 tenants' served throughput off its max-min fair share (worst)",
            worst * 100,
            10.0,
            unit="%",
        )
    )
    over = 0.0
    for r in runs:
        for peak in r.peaks:
            over = max(over, peak.requests / peak.max_requests, peak.size / peak.max_bytes)
    out.append(Target("peak queued requests or bytes / the band's limit", over, 1.0))
    return out


def section(
    runs: Sequence[Run],
    pilot: Run,
    capacity: float,
    sizes: Sizes,
    profile: Profile,
    options: Options,
    wall: float,
) -> Section:
    """Tables, targets, notes and data of a finished run."""
    fairness_rows: list[list[object]] = []
    for total in (1.5, 3.0):
        for mode in MODES:
            r = _find(runs, "fairness", total, mode)
            if r is None:
                continue
            offered = {t.name: t.offered / r.window for t in r.tenants}
            served = {t.name: t.served / r.window for t in r.tenants}
            shares = fair_shares(offered, sum(served.values()))
            for t in r.tenants:
                fairness_rows.append(
                    [total, mode, t.name, offered[t.name] / capacity, served[t.name] / capacity,
                     shares[t.name] / capacity, served[t.name] / shares[t.name]]
                )  # fmt: skip
    peak_rows = [
        [f"{r.case} {r.total:g}", p.priority, p.requests, p.max_requests, p.size, p.max_bytes]
        for r in runs
        for p in r.peaks
        if p.requests
    ]
    tables = [
        Table(
            "Overload: each tenant, with flow control and with the gate off (loads in units of "
            "capacity)",
            [
                "case",
                "mode",
                "tenant",
                "offered",
                "served",
                "refused",
                "refusal p99 ms",
                "TTFT p50 ms",
                "TTFT p90 ms",
            ],
            run_rows(runs, capacity),
            "'(all)' rows: offered and served summed, refused summed, then goodput (output "
            "tokens/s of the requests completed in the window) in the TTFT p50 column and the "
            "engines' longest waiting queue in the TTFT p90 column.",
        ),
        Table(
            "Two tenants of equal priority, 4:1 (round-robin fairness with flow control)",
            [
                "total",
                "mode",
                "tenant",
                "offered",
                "served",
                "max-min fair share",
                "served / share",
            ],
            fairness_rows,
        ),
        Table(
            "What flow control's bands held at most",
            ["case", "band", "requests", "limit", "bytes", "limit"],
            peak_rows,
        ),
    ]
    served = {
        mode: (r.tenant("interactive").served + r.tenant("batch").served) / r.window / capacity
        for mode in MODES
        if (r := _find(runs, "priority", 3.0, mode)) is not None
    }
    notes = [
        f"{sizes.engines} simulated engines, profile {profile.name}: {profile.summary}.",
        "The detector's limits in the configuration were chosen for these engines by trying "
        "several: per engine, 96 requests and 800 prompt tokens waiting to be prefilled keep "
        "an interactive request's TTFT near its value at 0.7 of capacity; a higher token "
        "limit admits more of the batch tenant (more goodput) and lets TTFT grow with it. "
        "The price, at a total load of 3.0: the pool served "
        + ", ".join(f"{share:.2f} of its capacity with {mode}" for mode, share in served.items())
        + ".",
        f"Capacity: {capacity:.3g} requests/s ({capacity / sizes.engines:.3g} per engine), "
        f"measured offering {sizes.pilot_rate:g} requests/s per engine; each request a fresh "
        f"{sizes.prompt_tokens}-token prompt and {sizes.max_tokens} tokens out.",
        f"Each run: arrivals for {sizes.duration:g} s, measured after {sizes.warmup:g} s; "
        f"configuration {routing._shown(CONFIG)}; seed {options.seed}. Wall time {wall:.0f} s.",
    ]
    return Section(
        key="overload",
        title="Overload in virtual time: flow control against the gate off",
        command="python -m bench.overload",
        tables=tables,
        targets=targets(runs, capacity),
        data={
            "capacity": capacity,
            "sizes": asdict(sizes),
            "profile": profile.name,
            "seed": options.seed,
            "quick": options.quick,
            "runs": [
                {
                    "case": r.case,
                    "total": r.total,
                    "mode": r.mode,
                    "goodput": r.goodput,
                    "engine_waiting_peak": r.engine_waiting_peak,
                    "outcomes": dict(r.outcomes),
                    "peaks": [asdict(p) for p in r.peaks],
                    "tenants": [
                        {
                            "name": t.name,
                            "offered": t.offered,
                            "served": t.served,
                            "refused": t.refused,
                            "ttft_p50": percentile(t.ttfts, 50),
                            "ttft_p90": percentile(t.ttfts, 90),
                            "refusal_p99": percentile(t.refusal_delays, 99),
                        }
                        for t in r.tenants
                    ],
                }
                for r in runs
            ],
        },
        notes=notes,
    )


def main() -> None:
    """``python -m bench.overload [--quick] [--seed N] [--out DIR]``."""
    import argparse

    from bench.report import write

    parser = argparse.ArgumentParser(
        prog="python -m bench.overload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="smoke size: seconds, numbers meaningless"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/overload"))
    args = parser.parse_args()
    done = run(Options(seed=args.seed, quick=args.quick, out=args.out))
    paths = write([done], args.out, header="# Switchyard benchmarks: overload")
    print(paths[0].read_text(), flush=True)


if __name__ == "__main__":
    main()
