"""``python -m bench routing``: what picking buys, with LWEPP's real pick path, in virtual time.

Eight simulated engines (``simulator.engine.Engine``, one named profile from
``simulator.profiles``) run on one ``VirtualLoop``: no network, no asyncio,
no wall clock, so a run is deterministic for its seed and takes as long as
its Python work, not as long as the traffic it models.

Each strategy is a way to choose one of the eight for every request:

================  ==========================================================
round-robin       ``Pipeline()`` with no plugins: LWEPP's default
random            ``bench/configs/random.yaml`` (random-picker)
least-queue       ``bench/configs/least-queue.yaml`` (metrics-data-source + queue-scorer)
prefix-aware      ``demo/configs/prefix-aware.yaml``, exactly the example users get
oracle            ``bench/oracle.py``: reads every engine's cache and queue directly
================  ==========================================================

The first four are the picker users run: ``lwepp.config.load_config(path)
.pipeline(store=..., clock=...)`` with the virtual clock, each request routed
through the ``Strategy`` seam exactly as the service does it,
``pipeline.pick(PickRequest(headers, body), endpoints)``.
The metrics a configured ``metrics-data-source`` would scrape are what the
simulator's HTTP server would serve: each engine's state rendered as vLLM's
``/metrics`` page (``simulator.metrics.render``), read by that plugin's own
``read`` and written to the pipeline's ``AttributeStore`` stamped with the
virtual clock, every ``refreshIntervalSeconds`` (the plugin's default unless
the file sets it) per endpoint, the endpoints' scrapes staggered across the
interval as independent pollers drift apart. The scrape itself takes no
virtual time (a loopback scrape takes well under a millisecond). The
pick's followup hears what the service would tell it: the response headers
with the served endpoint when the first token comes back, and, when the
stream ends, its last event (the token usage) and its end.

Measured per run (workload × strategy, × rate for the swept workload): time
to first token (arrival to first token) p50/p90/p99; inter-token latency,
the gaps between consecutive tokens of a request, mean and p90 over every
gap; throughput, output tokens and requests per second of the run
(first arrival to last completion); prefix-hit rate, hit tokens over
queried prompt tokens summed over the engines' own prefix-cache counters;
load spread, requests per engine as max/mean and coefficient of variation;
failures, requests answered with an error or refused (no endpoint picked).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import orjson

from bench import workloads
from bench.oracle import Oracle
from bench.report import Options, Plot, Section, Series, Table, Target, percentile, progress
from bench.workloads import Arrival, MultiTurn, Replay, SharedPrefix
from lwepp.attributes import AttributeStore
from lwepp.config import load_config
from lwepp.contracts import DataSource, Measurement
from lwepp.picking import Followup, PickRequest
from lwepp.pipeline import Pipeline
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.pickers import RandomPicker
from pods.model import Endpoint
from protos.exchange import Refusal
from simulator import metrics
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request
from simulator.profiles import PROFILES, Profile

ROOT: Final = Path(__file__).resolve().parent.parent
CONFIGS: Final = Path(__file__).resolve().parent / "configs"
PREFIX_AWARE: Final = ROOT / "demo" / "configs" / "prefix-aware.yaml"
TRACES: Final = Path(os.environ.get("SWITCHYARD_TRACES", Path(__file__).parent / "traces"))
"""Where the trace slices are (``bench/traces/README.md``); ``SWITCHYARD_TRACES`` overrides it."""
MOONCAKE_FILE: Final = "mooncake_synthetic_trace.last1000.jsonl"
MOONCAKE_FIRST: Final = 2993
"""The slice's first record in the whole Mooncake trace (reports name records by it)."""
AZURE_FILE: Final = "azure2023_llm_code.first1500.csv"

ENGINES: Final = 8
PROFILE: Final = "llama-3.1-8b-l4"
STRATEGIES: Final = ("round-robin", "random", "least-queue", "prefix-aware", "oracle")
CONFIG_FILES: Final = {
    "random": CONFIGS / "random.yaml",
    "least-queue": CONFIGS / "least-queue.yaml",
    "prefix-aware": PREFIX_AWARE,
}


# --- routers -------------------------------------------------------------------------


class Router(Protocol):
    """One strategy, bound to one cluster: picks an engine and hears how the request went."""

    name: str
    sources: Sequence[DataSource]
    """Data sources to feed (only ``metrics-data-source`` is scraped here)."""
    store: AttributeStore | None
    """Where scraped measurements go (None without sources)."""
    fallbacks: int
    """Requests a failing plugin sent round-robin instead."""

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        """The engine's index (None: refused) and what the response side needs later."""
        ...

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        """The request's first token came back from engine ``index``."""
        ...

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        """The request ended (``request.error`` set if it failed) on engine ``index``."""
        ...


class PipelineRouter:
    """LWEPP's pipeline, exactly as the service drives it (see the module docstring)."""

    def __init__(
        self,
        name: str,
        pipeline: Pipeline,
        sources: Sequence[DataSource],
        endpoints: Sequence[Endpoint],
    ) -> None:
        self.name = name
        self.pipeline = pipeline
        self.sources = sources
        self.store: AttributeStore | None = pipeline.store
        self.endpoints = tuple(endpoints)  # one tuple for every pick: the pipeline caches by it
        self.index = {e.hostport: i for i, e in enumerate(self.endpoints)}
        self.fallbacks = 0

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        pipeline = self.pipeline
        headers = (
            (":method", "POST"),
            (":path", arrival.path),
            ("content-type", "application/json"),
            ("x-request-id", arrival.request_id),
            ("x-gateway-model-name", str(arrival.body.get("model", ""))),
        )
        body = arrival.body_bytes() if pipeline.needs_body else None
        failures = pipeline.plugin_errors
        before = _request_side_failures(failures)
        try:
            pick = pipeline.pick(PickRequest(headers, body), self.endpoints)
        except Refusal:
            return None, None
        finally:
            self.fallbacks += int(_request_side_failures(failures) - before)
        return self.index[pick.endpoints[0].hostport], pick.followup

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        followup: Followup | None = handle
        if followup is not None:
            followup.headers(self.endpoints[index].hostport, _STREAM_HEADERS)

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        followup: Followup | None = handle
        if followup is None:
            return
        if not request.error:  # the stream's last event carries the usage, as vLLM sends it
            usage = {
                "prompt_tokens": len(request.tokens),
                "completion_tokens": request.generated,
                "prompt_tokens_details": {"cached_tokens": request.cached_tokens},
            }
            followup.chunk(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + _DONE)
        followup.end()


_STREAM_HEADERS: Final = {":status": "200", "content-type": "text/event-stream"}
_DONE: Final = b"\n\ndata: [DONE]\n\n"


def _request_side_failures(counter: Any) -> float:
    """Plugin failures at request-side stages so far: each sent one request round-robin."""
    return sum(
        float(sample.value)
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["stage"] not in _AFTER_PICK
    )


_AFTER_PICK: Final = frozenset(
    {"picked", "response_headers", "response_chunk", "response_complete", "source"}
)


class OracleRouter:
    """``bench.oracle.Oracle`` as a router: no pipeline, no scrapes."""

    def __init__(self, engines: Sequence[Engine], profile: Profile) -> None:
        self.name = "oracle"
        self.oracle = Oracle(engines, profile)
        self.sources: Sequence[DataSource] = ()
        self.store: AttributeStore | None = None
        self.fallbacks = 0

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        return self.oracle.choose(request), None

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        self.oracle.prefilled(arrival.request_id)

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        self.oracle.finished(arrival.request_id)


def endpoints(count: int = ENGINES) -> tuple[Endpoint, ...]:
    """The simulated pool: one endpoint per engine, as an InferencePool lists them."""
    return tuple(
        Endpoint(f"sim-{i}", f"10.0.0.{i + 1}", 8000, {"app": "sim"}) for i in range(count)
    )


def router(
    strategy: str,
    engines: Sequence[Engine],
    profile: Profile,
    clock: Callable[[], float],
    seed: int,
    config_file: Path | None = None,
) -> Router:
    """A fresh router for ``strategy`` over ``engines`` (fresh plugin state for every run).

    ``config_file`` replaces the strategy's own (any strategy but the oracle).
    """
    if strategy == "oracle":
        return OracleRouter(engines, profile)
    pool = endpoints(len(engines))
    if strategy == "round-robin" and config_file is None:
        return PipelineRouter(strategy, Pipeline(clock=clock), (), pool)
    config = load_config(config_file or CONFIG_FILES[strategy])
    pipeline = config.pipeline(store=AttributeStore(), clock=clock, explain="off")
    if isinstance(pipeline.picker, RandomPicker):  # weighted-random-picker is one too
        pipeline.picker.rng = random.Random(seed)  # the pickers take an injected rng; seeded here
    return PipelineRouter(strategy, pipeline, pipeline.sources, pool)


# --- one run -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run of one workload under one strategy measured (seconds, tokens, counts)."""

    workload: str
    strategy: str
    rate: float | None
    requests: int
    completed: int
    failed: int
    fallbacks: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    itl_p90: float
    output_tokens_per_s: float
    requests_per_s: float
    hit_rate: float
    per_engine: tuple[int, ...]
    spread_max_mean: float
    spread_cv: float
    virtual_seconds: float
    wall_seconds: float
    scrapes: int

    def row(self) -> list[object]:
        """The table row: latencies in milliseconds."""
        return [
            *([] if self.rate is None else [self.rate]),
            self.strategy,
            self.ttft_p50 * 1e3,
            self.ttft_p90 * 1e3,
            self.ttft_p99 * 1e3,
            self.itl_mean * 1e3,
            self.itl_p90 * 1e3,
            self.output_tokens_per_s,
            self.requests_per_s,
            self.hit_rate,
            self.spread_max_mean,
            self.spread_cv,
            self.failed,
        ]


COLUMNS: Final = [
    "strategy",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL mean ms",
    "ITL p90 ms",
    "out tok/s",
    "req/s",
    "hit rate",
    "load max/mean",
    "load CV",
    "failed",
]


@dataclass(slots=True)
class _Flight:
    """One request in flight: where it went and what the router wants back."""

    arrival: Arrival
    index: int
    handle: Any
    last_token: float = 0.0


@dataclass(slots=True)
class _Run:
    """The mutable state of one simulation, closed over by the loop's callbacks."""

    arrivals: Sequence[Arrival]
    router: Router
    loop: VirtualLoop
    engines: list[Engine]
    pool: tuple[Endpoint, ...]
    drivers: list[VirtualEngine] = field(default_factory=list)
    flights: dict[str, _Flight] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    gaps: array[float] = field(default_factory=lambda: array("d"))
    remaining: int = 0
    failed: int = 0
    scrapes: int = 0
    last_done: float = 0.0


def simulate(
    workload: str,
    arrivals: Sequence[Arrival],
    strategy: str,
    profile: Profile,
    *,
    engines: int = ENGINES,
    seed: int = 0,
    rate: float | None = None,
    config: Path | None = None,
) -> Outcome:
    """Replay ``arrivals`` on fresh engines routed by ``strategy``; account for every request.

    ``config`` replaces the strategy's configuration file (to try a variant).
    """
    started = time.perf_counter()
    loop = VirtualLoop()
    fleet = [Engine(profile, seed=seed * 1000 + i) for i in range(engines)]
    pool = endpoints(engines)
    chosen = router(strategy, fleet, profile, lambda: loop.now, seed, config)
    run = _Run(arrivals, chosen, loop, fleet, pool)
    run.remaining = len(arrivals)
    run.drivers = [VirtualEngine(engine, loop, _on_event(run)) for engine in fleet]
    for arrival in arrivals:
        loop.at(arrival.at, _arrive(run, arrival))
    for source in run.router.sources:
        if isinstance(source, MetricsDataSource):
            interval = source.interval
            for i in range(engines):
                loop.at(interval * i / engines, _scrape(run, source, i, interval))
    loop.run()
    return _outcome(workload, strategy, rate, run, time.perf_counter() - started)


def _arrive(run: _Run, arrival: Arrival) -> Callable[[], None]:
    def arrive() -> None:
        request = Request(
            arrival.request_id, arrival.prompt_tokens, arrival.max_tokens, run.loop.now
        )
        index, handle = run.router.choose(arrival, request)
        if index is None:
            run.failed += 1
            run.remaining -= 1
            return
        run.flights[arrival.request_id] = _Flight(arrival, index, handle)
        run.drivers[index].submit(request)

    return arrive


def _on_event(run: _Run) -> Callable[[Event], None]:
    loop, flights, gaps, ttfts, router_ = run.loop, run.flights, run.gaps, run.ttfts, run.router

    def on_event(event: Event) -> None:
        request = event.request
        flight = flights[request.id]
        now = loop.now
        if event.kind == "token":
            if request.generated == 1:
                ttfts.append(now - flight.arrival.at)
                router_.first_token(flight.arrival, flight.index, flight.handle)
            else:
                gaps.append(now - flight.last_token)
            flight.last_token = now
            return
        del flights[request.id]
        if event.kind == "error":
            run.failed += 1
        run.remaining -= 1
        run.last_done = now
        router_.complete(flight.arrival, flight.index, flight.handle, request)

    return on_event


def engine_state(engine: Engine, now: float, model: str = workloads.MODEL) -> metrics.State:
    """What the simulator's server puts on ``/metrics`` for ``engine``.

    ``simulator.metrics.state_of``, the construction the server itself uses,
    for a replica serving one base model and no adapters.
    """
    return metrics.state_of(engine, model, now)


def _scrape(
    run: _Run, source: MetricsDataSource, index: int, interval: float
) -> Callable[[], None]:
    engine, endpoint, store, loop = run.engines[index], run.pool[index], run.router.store, run.loop
    assert store is not None  # a router with sources has a store

    def scrape() -> None:
        if run.remaining <= 0:
            return  # the run is over: stop polling so the loop can drain
        now = loop.now
        page = metrics.render("vllm", engine_state(engine, now))
        values = source.read(endpoint, page)
        store.write(endpoint.hostport, {k: Measurement(v, now) for k, v in values.items()})
        run.scrapes += 1
        loop.at(now + interval, scrape)

    return scrape


def _outcome(workload: str, strategy: str, rate: float | None, run: _Run, wall: float) -> Outcome:
    arrivals, engines = run.arrivals, run.engines
    requests = len(arrivals)
    completed = requests - run.failed
    first = arrivals[0].at if arrivals else 0.0
    span = max(run.last_done - first, 1e-9)
    ttfts = sorted(run.ttfts)
    gaps = sorted(run.gaps)
    queries = sum(e.prefix_queries_total for e in engines)
    hits = sum(e.prefix_hits_total for e in engines)
    per_engine = tuple(e.requests_total for e in engines)
    mean = statistics.fmean(per_engine) if per_engine else 0.0
    return Outcome(
        workload=workload,
        strategy=strategy,
        rate=rate,
        requests=requests,
        completed=completed,
        failed=run.failed,
        fallbacks=run.router.fallbacks,
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        itl_mean=statistics.fmean(gaps) if gaps else math.nan,
        itl_p90=percentile(gaps, 90),
        output_tokens_per_s=sum(e.generation_tokens_total for e in engines) / span,
        requests_per_s=completed / span,
        hit_rate=hits / queries if queries else 0.0,
        per_engine=per_engine,
        spread_max_mean=max(per_engine) / mean if mean else math.nan,
        spread_cv=statistics.pstdev(per_engine) / mean if mean else math.nan,
        virtual_seconds=run.last_done,
        wall_seconds=wall,
        scrapes=run.scrapes,
    )


# --- the benchmark -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every size of a run: full, or the smoke size of ``Options.quick``."""

    kv_blocks: int | None
    """KV-cache blocks per engine; None keeps the profile's own count."""
    shared: SharedPrefix
    rates: tuple[float, ...]
    shared_count: int
    chat: MultiTurn
    mooncake_start: int
    mooncake_count: int
    mooncake_block_tokens: int
    mooncake_replay: Replay
    azure_start: int
    azure_count: int
    azure_replay: Replay


FULL: Final = Sizes(
    kv_blocks=None,
    shared=SharedPrefix(groups=64, prefix_tokens=2048, users=16, question_tokens=64, max_tokens=32),
    rates=(6.0, 12.0, 18.0, 24.0, 32.0),
    shared_count=2000,
    chat=MultiTurn(
        sessions=300,
        turns=6,
        session_rate=2.0,
        system_tokens=256,
        user_tokens=96,
        max_tokens=64,
        think_seconds=10.0,
    ),
    mooncake_start=0,
    mooncake_count=1000,
    mooncake_block_tokens=32,
    mooncake_replay=Replay(
        length_scale=32 / 512, output_scale=0.25, time_scale=0.5, max_output=128
    ),
    azure_start=0,
    azure_count=1500,
    azure_replay=Replay(length_scale=1 / 16, output_scale=1.0, time_scale=0.1, max_output=256),
)
QUICK: Final = Sizes(
    kv_blocks=256,
    shared=SharedPrefix(groups=8, prefix_tokens=512, users=4, question_tokens=32, max_tokens=8),
    rates=(4.0, 16.0),
    shared_count=60,
    chat=MultiTurn(sessions=8, turns=3, session_rate=4.0, think_seconds=2.0, max_tokens=8),
    mooncake_start=0,
    mooncake_count=40,
    mooncake_block_tokens=16,
    mooncake_replay=Replay(length_scale=16 / 512, output_scale=0.1, time_scale=0.5, max_output=16),
    azure_start=0,
    azure_count=40,
    azure_replay=Replay(length_scale=0.05, output_scale=0.5, time_scale=0.5, max_output=16),
)


def profile_for(sizes: Sizes) -> Profile:
    """The engines' profile: ``PROFILE`` as published (its KV cache cut for a smoke run)."""
    profile = PROFILES[PROFILE]
    return profile if sizes.kv_blocks is None else profile.replace(num_blocks=sizes.kv_blocks)


def run(options: Options) -> Section:
    """Every workload under every strategy; the section ``python -m bench routing`` writes."""
    sizes = QUICK if options.quick else FULL
    profile = profile_for(sizes)
    seed = options.seed
    outcomes: list[Outcome] = []

    def measure(workload: str, arrivals: Sequence[Arrival], rate: float | None = None) -> None:
        for strategy in STRATEGIES:
            outcome = simulate(workload, arrivals, strategy, profile, seed=seed, rate=rate)
            outcomes.append(outcome)
            progress(
                f"routing: {workload}{'' if rate is None else f' at {rate:g}/s'} {strategy}: "
                f"TTFT p90 {outcome.ttft_p90 * 1e3:.1f} ms, hit rate {outcome.hit_rate:.2f}, "
                f"{outcome.requests} requests in {outcome.wall_seconds:.1f} s"
            )

    for rate in sizes.rates:
        measure(
            "shared-prefix",
            workloads.shared_prefix(sizes.shared, rate, sizes.shared_count, seed),
            rate,
        )
    measure("multi-turn", workloads.multi_turn(sizes.chat, seed))
    traces = TRACES / MOONCAKE_FILE, TRACES / AZURE_FILE
    if all(path.exists() for path in traces):
        records = workloads.read_mooncake(traces[0], sizes.mooncake_start, sizes.mooncake_count)
        measure(
            "mooncake",
            workloads.mooncake(records, sizes.mooncake_block_tokens, sizes.mooncake_replay),
        )
        rows = workloads.read_azure(traces[1], sizes.azure_start, sizes.azure_count)
        measure("azure-code", workloads.azure(rows, sizes.azure_replay, seed))
    return section(outcomes, sizes, profile, options, traces_found=all(p.exists() for p in traces))


def section(
    outcomes: Sequence[Outcome],
    sizes: Sizes,
    profile: Profile,
    options: Options,
    *,
    traces_found: bool,
) -> Section:
    """Tables, plots, targets, notes and data of a finished run."""
    by_workload: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_workload.setdefault(outcome.workload, []).append(outcome)
    notes = notes_for(sizes, profile, traces_found, by_workload.get("shared-prefix", []))
    tables = []
    for workload, rows in by_workload.items():
        swept = rows[0].rate is not None
        tables.append(
            Table(
                f"Routing: {workload}" + (" (rate swept, requests/s)" if swept else ""),
                (["rate/s"] if swept else []) + COLUMNS,
                [o.row() for o in rows],
                workload_notes(sizes).get(workload, ""),
            )
        )
    shared = by_workload.get("shared-prefix", [])
    tables.append(ratio_table(shared))
    tables.append(workload_table(by_workload))
    plots = [
        Plot(
            "routing-shared-prefix-ttft-p90",
            "Shared prefix: TTFT p90 by arrival rate",
            "arrival rate (requests/s)",
            "TTFT p90 (ms)",
            [
                Series(
                    s,
                    [o.rate or 0.0 for o in shared if o.strategy == s],
                    [o.ttft_p90 * 1e3 for o in shared if o.strategy == s],
                )
                for s in STRATEGIES
            ],
            logy=True,
        ),
        Plot(
            "routing-shared-prefix-hit-rate",
            "Shared prefix: prefix-cache hit rate by arrival rate",
            "arrival rate (requests/s)",
            "hit tokens / prompt tokens",
            [
                Series(
                    s,
                    [o.rate or 0.0 for o in shared if o.strategy == s],
                    [o.hit_rate for o in shared if o.strategy == s],
                )
                for s in STRATEGIES
            ],
        ),
    ]
    return Section(
        key="routing",
        title="Routing quality in virtual time (LWEPP's pick path, 8 simulated engines)",
        command="python -m bench routing",
        tables=tables,
        plots=plots,
        targets=targets(shared),
        data={
            "profile": asdict(profile),
            "sizes": asdict(sizes),
            "engines": ENGINES,
            "seed": options.seed,
            "quick": options.quick,
            "runs": [asdict(o) for o in outcomes],
        },
        notes=notes,
    )


def _find(outcomes: Sequence[Outcome], strategy: str, rate: float | None) -> Outcome | None:
    return next((o for o in outcomes if o.strategy == strategy and o.rate == rate), None)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def ratio_table(shared: Sequence[Outcome]) -> Table:
    """Prefix-aware against round-robin and the oracle, at each rate of the sweep."""
    rows: list[list[object]] = []
    for rate in sorted({o.rate for o in shared if o.rate is not None}):
        pa, rr, oracle = (_find(shared, s, rate) for s in ("prefix-aware", "round-robin", "oracle"))
        if pa is None or rr is None or oracle is None:
            continue
        rows.append(
            [
                rate,
                _ratio(pa.ttft_p90, rr.ttft_p90),
                _ratio(pa.ttft_p90, oracle.ttft_p90),
                _ratio(pa.hit_rate, oracle.hit_rate),
                _ratio(rr.ttft_p90, oracle.ttft_p90),
            ]
        )
    return Table(
        "Shared prefix: prefix-aware against round-robin and the oracle",
        [
            "rate/s",
            "prefix-aware / round-robin TTFT p90",
            "prefix-aware / oracle TTFT p90",
            "prefix-aware / oracle hit rate",
            "round-robin / oracle TTFT p90",
        ],
        rows,
        "Targets apply at the highest rate: ≤ 0.1, ≤ 1.25 and ≥ 0.9.",
    )


def workload_table(by_workload: Mapping[str, Sequence[Outcome]]) -> Table:
    """prefix-aware beside round-robin and the oracle on every workload (the top swept rate)."""
    rows: list[list[object]] = []
    for workload, outcomes in by_workload.items():
        rate = max((o.rate for o in outcomes if o.rate is not None), default=None)
        pa, rr, oracle = (
            _find(outcomes, s, rate) for s in ("prefix-aware", "round-robin", "oracle")
        )
        if pa is None or rr is None or oracle is None:
            continue
        rows.append(
            [
                workload if rate is None else f"{workload} at {rate:g}/s",
                _ratio(pa.ttft_p50, rr.ttft_p50),
                _ratio(pa.ttft_p90, rr.ttft_p90),
                _ratio(pa.ttft_p90, oracle.ttft_p90),
                _ratio(pa.itl_p90, rr.itl_p90),
                pa.hit_rate,
                oracle.hit_rate,
                rr.hit_rate,
                sum(1 for n in pa.per_engine if n),
                pa.spread_max_mean,
            ]
        )
    return Table(
        "Every workload: prefix-aware beside round-robin and the oracle",
        [
            "workload",
            "TTFT p50 / RR",
            "TTFT p90 / RR",
            "TTFT p90 / oracle",
            "ITL p90 / RR",
            "hit rate",
            "oracle hit rate",
            "RR hit rate",
            "engines used",
            "load max/mean",
        ],
        rows,
        "Ratios below 1 favour prefix-aware. 'engines used': engines that served at least one "
        f"request, of {ENGINES}.",
    )


def targets(shared: Sequence[Outcome]) -> list[Target]:
    """The three goals, at the highest swept rate (where placement matters most)."""
    rates = [o.rate for o in shared if o.rate is not None]
    if not rates:
        return []
    top = max(rates)
    pa, rr, oracle = (_find(shared, s, top) for s in ("prefix-aware", "round-robin", "oracle"))
    if pa is None or rr is None or oracle is None:
        return []
    at = f"shared prefix at {top:g} requests/s"
    return [
        Target(
            f"prefix-aware TTFT p90 / round-robin's, {at}", _ratio(pa.ttft_p90, rr.ttft_p90), 0.1
        ),
        Target(
            f"prefix-aware TTFT p90 / oracle's, {at}", _ratio(pa.ttft_p90, oracle.ttft_p90), 1.25
        ),
        Target(
            f"prefix-aware hit rate / oracle's, {at}",
            _ratio(pa.hit_rate, oracle.hit_rate),
            0.9,
            at_most=False,
        ),
    ]


def workload_notes(sizes: Sizes) -> dict[str, str]:
    """Each workload table's note: its shape and every scaling factor."""
    sp, chat, mc, az = sizes.shared, sizes.chat, sizes.mooncake_replay, sizes.azure_replay
    return {
        "shared-prefix": (
            f"{sp.groups} groups × {sp.prefix_tokens}-token system prompt, {sp.users} users each, "
            f"{sp.question_tokens}-token questions, {sp.max_tokens} output tokens; "
            f"{sizes.shared_count} requests per rate, Poisson arrivals."
        ),
        "multi-turn": (
            f"{chat.sessions} sessions × {chat.turns} turns, sessions start at "
            f"{chat.session_rate:g}/s (Poisson), think time {chat.think_seconds:g} s mean "
            f"(exponential, open-loop); shared {chat.system_tokens}-token system prompt, "
            f"{chat.user_tokens}-token user messages, {chat.max_tokens}-token answers resent."
        ),
        "mooncake": (
            f"Mooncake synthetic trace, records {MOONCAKE_FIRST + sizes.mooncake_start}–"
            f"{MOONCAKE_FIRST + sizes.mooncake_start + sizes.mooncake_count - 1}: "
            "512-token blocks → "
            f"{sizes.mooncake_block_tokens} tokens (lengths × {mc.length_scale:g}), outputs × "
            f"{mc.output_scale:g} (at most {mc.max_output}), time × {mc.time_scale:g}."
        ),
        "azure-code": (
            f"Azure LLM inference trace (code), rows {sizes.azure_start}–"
            f"{sizes.azure_start + sizes.azure_count - 1}: prompts × {az.length_scale:g}, "
            f"outputs × {az.output_scale:g} (at most {az.max_output}), time × {az.time_scale:g}; "
            "nothing shared (control)."
        ),
    }


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (reports name no home folders)."""
    root = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def notes_for(
    sizes: Sizes, profile: Profile, traces_found: bool, shared: Sequence[Outcome] = ()
) -> list[str]:
    """The assumptions of the run, stated plainly (with round-robin's measured hit rate)."""
    sp = sizes.shared
    prefix_blocks = -(-sp.prefix_tokens // profile.block_size)
    per_engine = profile.num_blocks // prefix_blocks
    kv = (
        "as published"
        if sizes.kv_blocks is None
        else f"with its KV cache cut to {profile.num_blocks} blocks (smoke size)"
    )
    blind = [o.hit_rate for o in shared if o.strategy == "round-robin"]
    hit = statistics.fmean(blind) if blind else 0.0
    uncached = (1 - hit) * sp.prompt_tokens * profile.prefill_per_token
    notes = [
        f"Engines: {ENGINES} simulated vLLM engines (simulator.engine), profile "
        f"{profile.name!r} {kv}: {profile.summary}; {profile.num_blocks:,} KV blocks of "
        f"{profile.block_size} tokens ({profile.kv_tokens:,} tokens), prefill "
        f"{profile.prefill_per_token * 1e6:g} µs/token, step overhead "
        f"{profile.step_overhead * 1e3:g} ms, max_num_seqs {profile.max_num_seqs}, "
        f"max_num_batched_tokens {profile.max_num_batched_tokens}. Virtual time: "
        "no network, no asyncio; every number is deterministic for the seed.",
        "Strategies: round-robin is Pipeline() with no plugins (LWEPP's default); random is "
        "bench/configs/random.yaml (random-picker, seeded); least-queue is "
        "bench/configs/least-queue.yaml (metrics-data-source + queue-scorer); prefix-aware is "
        "demo/configs/prefix-aware.yaml unchanged; oracle is bench/oracle.py (exact caches and "
        "queues, least estimated time to first token plus the prefill work the choice adds).",
        "Metrics: each engine's state rendered as vLLM's /metrics page (simulator.metrics) and "
        "read by metrics-data-source's own parser into the pipeline's attribute store, every "
        "refreshIntervalSeconds per endpoint (LWEPP's default, 0.1 s; GIE's EPP refreshes "
        "every 50 ms), endpoints staggered across the interval; a scrape takes no virtual "
        "time, so data is at most one interval old. Response hooks hear response_headers at "
        "the first token and response_complete (served endpoint, usage) at the end.",
        f"Shared-prefix sizing: {sp.groups} groups × {sp.prefix_tokens}-token prefixes = "
        f"{prefix_blocks} KV blocks each; one engine's {profile.num_blocks:,} blocks hold at "
        f"most {per_engine} of them ({per_engine / sp.groups:.0%} of the groups, fewer while "
        f"running requests hold blocks), the {ENGINES} engines together "
        f"{per_engine * ENGINES} (all {sp.groups}). Best possible hit rate: "
        f"{sp.shared_fraction:.2f} of prompt tokens less each group's first (cold) request.",
        f"Shared-prefix rates: engines that see every group (round-robin measured a hit rate of "
        f"{hit:.2f}) prefill {1 - hit:.0%} of each {sp.prompt_tokens}-token prompt, "
        f"{uncached:.2f} s of engine time, so the {ENGINES} engines saturate below "
        f"{ENGINES / uncached:.0f} requests/s (less once decoding takes its share of each "
        f"step); placement by prefix leaves about {sp.question_tokens} uncached tokens "
        f"({sp.question_tokens * profile.prefill_per_token * 1e3:.0f} ms). The sweep "
        f"({', '.join(f'{r:g}' for r in sizes.rates)} requests/s) takes cache-blind "
        "strategies from below saturation to far beyond it while placement by prefix stays "
        "below it: the regime where placement matters. The targets are taken at the "
        "highest rate.",
        "TTFT: arrival to first token (routing takes no virtual time). Past saturation a "
        "backlog builds for as long as requests keep coming, so there TTFT grows with the "
        "number of requests: it shows that a strategy is saturated, not by how much. ITL: "
        "every gap between consecutive tokens of a request, mean and p90. Throughput: "
        "output tokens and completed requests per second from the first arrival to the last "
        "completion. Hit rate: the engines' prefix-cache counters, hit tokens / queried "
        "prompt tokens. Load "
        "spread: requests per engine, max/mean and coefficient of variation.",
        "Prompt text is simulator.tokenizer text: one pseudo-random word of about ten "
        "characters per token. prefix-aware.yaml hashes 16-character blocks (blockSizeTokens 4, "
        "4 characters per token) and matches at most 256 of them: the first ~4,096 characters, "
        "about 370 of these tokens.",
    ]
    notes.append(
        "Reading prefix-aware.yaml's arithmetic (prefix ×3, queue ×2, KV use ×2): "
        "queue-scorer reads waiting requests, which stay 0 until an engine is saturated (it "
        "admits up to max_num_seqs while KV blocks last), so while no engine queues only the "
        "KV term, worth at most 2, can move a pick. A prefix every request shares (the "
        "multi-turn workload's system prompt, about 70% of a first turn's hashed text) gives "
        "the engines that already served it about 3 × 0.7 = 2.1 more, so new sessions keep "
        "to the engines that served first until those queue: see 'engines used' in the "
        "per-workload table."
    )
    if traces_found:
        mc, az = sizes.mooncake_replay, sizes.azure_replay
        notes.append(
            f"Traces ({_shown(TRACES)}): Mooncake synthetic trace (kvcache-ai/Mooncake, "
            "Apache-2.0; "
            "Qin et al., FAST 2025) and Azure LLM inference trace, code (Azure/"
            "AzurePublicDataset, CC-BY-4.0; Patel et al., ISCA 2024). Mooncake records "
            f"{MOONCAKE_FIRST + sizes.mooncake_start}–"
            f"{MOONCAKE_FIRST + sizes.mooncake_start + sizes.mooncake_count - 1}: each "
            f"512-token hash block becomes text_block(hash_id, {sizes.mooncake_block_tokens}), "
            f"so prompt lengths × {mc.length_scale:g}; output lengths × {mc.output_scale:g} "
            f"(at most {mc.max_output}); arrival gaps × {mc.time_scale:g}. Azure rows "
            f"{sizes.azure_start}–{sizes.azure_start + sizes.azure_count - 1}: prompt lengths "
            f"× {az.length_scale:g} (fresh text each), output lengths × {az.output_scale:g} "
            f"(at most {az.max_output}); arrival gaps × {az.time_scale:g}. Lengths are rounded "
            "up, at least 1. Slices: Mooncake's last 1,000 records (its last ~240 s, where "
            "requests share the most with each other), Azure's first 1,500 rows (~10 minutes); "
            "the gaps are compressed so that round-robin runs the engines busy but not "
            "saturated, and the whole benchmark takes a few minutes."
        )
    else:
        notes.append(f"The trace workloads were skipped: no traces under {TRACES}.")
    return notes
