"""``python -m bench routing``: what picking buys, with LWEPP's real pick path, in virtual time.

Eight simulated engines (``simulator.engine.Engine``, one named profile from
``simulator.profiles``) run on one ``VirtualLoop``: no network, no asyncio,
no wall clock, so a run is deterministic for its seed and takes as long as
its Python work, not as long as the traffic it models.

Each strategy is a way to choose one of the eight for every request:

=================  =========================================================
round-robin        ``Pipeline()`` with no plugins: LWEPP's default
random             ``bench/configs/random.yaml`` (random-picker)
least-queue        ``bench/configs/least-queue.yaml`` (metrics-data-source + queue-scorer)
prefix-aware       ``demo/configs/prefix-aware.yaml``, exactly the example users get
optimized-baseline llm-d's current default, its optimized-baseline guide's configuration
                   as the guide ships it (``bench.upstream``): prefix-cache-affinity-filter
                   then token-load-scorer
recommended        ``demo/configs/recommended.yaml``: prefix affinity held in check by
                   the requests and prompt tokens the picker has in flight per engine
vllm, sglang,      ``demo/configs/<engine>.yaml``: the same, with the engine's metrics;
llamacpp           the engines' pages rendered in that engine's names (``SERVERS``)
precise            ``bench/configs/precise.yaml``: the same, with the precise prefix
                   cache fed by the engines' KV-cache events (``subscribe``)
oracle-lookahead   ``bench.oracle.Lookahead``: forks every engine's exact state and
                   simulates it forward; the earliest first token wins
oracle-estimate    ``bench.oracle.Oracle``: exact caches and queues, a step-model estimate
offline-partition  ``bench.oracle.partition``: every group on one engine, from the
                   whole workload known in advance (shared-prefix only)
=================  =========================================================

The first ten are the pickers users run: ``lwepp.config.load_config(path)
.pipeline(store=..., clock=...)`` with the virtual clock, each request routed
through the ``Strategy`` seam exactly as the service does it,
``pipeline.choose(RequestInfo(headers, body), endpoints)``.
The metrics a configured ``metrics-data-source`` would scrape are what the
simulator's HTTP server would serve: each engine's state rendered as vLLM's
``/metrics`` page (``simulator.metrics.render``; SGLang's or llama.cpp's for
the configurations written for them, ``SERVERS``, and ``MISMATCHED`` reads
SGLang's names off vLLM's pages), read by that plugin's own ``read`` and
written to the pipeline's ``AttributeStore`` stamped with the virtual clock,
every ``refreshIntervalSeconds`` (the plugin's default unless the file sets
it) per endpoint, the endpoints' scrapes staggered across the interval as
independent pollers drift apart. The scrape itself takes no virtual time (a
loopback scrape takes well under a millisecond). The pick's followup hears
what the service would tell it: the response headers with the served endpoint
and the first event when the first token comes back, and, when the stream
ends, its last event (the token usage) and its end.

Measured per run (workload × strategy, × rate for the swept workload), over
the requests after the warm-up (``WARMUP``): time to first token (arrival to
first token) p50/p90/p99, and its p90 over the run's first half, to tell a
steady run from a saturated one (``Outcome.saturated``); inter-token
latency, the gaps between consecutive tokens of a request, mean and p90; the
prefix-hit rate, prompt tokens found cached when each request was first
scheduled over prompt tokens. Over the whole run: throughput, output tokens
and requests per second (first arrival to last completion); preemptions,
the engines' own counters; load spread, requests per engine as max/mean and
coefficient of variation; failures, requests answered with an error or
refused (no endpoint picked).

Ratios are compared only between steady runs: past saturation a backlog
grows for as long as requests keep coming, so a ratio there measures the
run's length. The shared-prefix targets are taken at ``Sizes.target_rate``,
where round-robin is steady. ``bounds`` checks, run by run, that no picker
beats the oracle envelope (``make bench-routing`` then asserts it on the
results it wrote); ``VARIANTS`` reruns round-robin and prefix-aware with each
engine-model switch of ``simulator.engine.Scheduling`` turned away from
current vLLM, to show what each one changes.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol

import orjson

from bench import workloads
from bench.oracle import Lookahead, Oracle, RequestPathOracle, floor_ttfts, partition
from bench.report import Options, Plot, Section, Series, Table, Target, percentile, progress
from bench.upstream import OPTIMIZED_BASELINE, guide_config
from bench.workloads import Arrival, MultiTurn, Replay, SharedPrefix
from lwepp.attributes import AttributeStore
from lwepp.config import load_config
from lwepp.contracts import DataSource, Measurement
from lwepp.picking import Followup, RequestInfo
from lwepp.pipeline import Pipeline
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.pickers import RandomPicker
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.predicted_latency import PredictedLatencyProducer, SloHeadroomTierFilter
from lwepp.plugins.prefix import PrecisePrefixCacheScorer
from pods.model import Endpoint
from simulator import metrics
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request, Scheduling
from simulator.kv_events import KVEventLog
from simulator.profiles import PROFILES, Profile
from simulator.tokenizer import output_token_ids
from wire.exchange import Refusal

ROOT: Final = Path(__file__).resolve().parent.parent
CONFIGS: Final = Path(__file__).resolve().parent / "configs"
PREFIX_AWARE: Final = ROOT / "demo" / "configs" / "prefix-aware.yaml"
RECOMMENDED: Final = ROOT / "demo" / "configs" / "recommended.yaml"
TRACES: Final = Path(os.environ.get("SWITCHYARD_TRACES", Path(__file__).parent / "traces"))
"""Where the trace slices are (``bench/traces/README.md``); ``SWITCHYARD_TRACES`` overrides it."""
MOONCAKE_FILE: Final = "mooncake_synthetic_trace.last1000.jsonl"
MOONCAKE_FIRST: Final = 2993
"""The slice's first record in the whole Mooncake trace (reports name records by it)."""
AZURE_FILE: Final = "azure2023_llm_code.first1500.csv"

ENGINES: Final = 8
DEFAULT_SCHEDULING: Final = Scheduling()
"""The engines' scheduler switches: current vLLM's (``simulator.engine.Scheduling``)."""
PROFILE: Final = "llama-3.1-8b-l4"
BASELINE: Final = "optimized-baseline"
"""llm-d's current default configuration, the peer the drop-in configurations are held to."""
DROP_IN: Final = ("recommended", "vllm", "sglang", "llamacpp")
"""The configurations the README gives users: no worse than round-robin or ``BASELINE`` anywhere."""
PICKERS: Final = (
    "round-robin",
    "random",
    "least-queue",
    "prefix-aware",
    BASELINE,
    *DROP_IN,
    "precise",
    "predicted-latency",
)
"""The strategies users run: the oracle envelope must not be beaten by any of them."""
ORACLES: Final = ("oracle-lookahead", "oracle-estimate")
"""The two online references whose better p90, per run, is the oracle envelope."""
BOUND: Final = "request-path-bound"
"""``bench.oracle.RequestPathOracle``: the envelope's algorithm fed only request-path knowledge,
the measured bound for a picker that sees only the request path."""
OFFLINE: Final = "offline-partition"
"""The offline reference, for workloads whose requests come in groups (shared prefix)."""
STRATEGIES: Final = (*PICKERS, *ORACLES)
"""What every workload runs under."""
MISMATCHED: Final = "sglang on vLLM"
"""``sglang.yaml`` in front of servers that publish vLLM's names: its metrics never match
(run on the system-prompt workload, to show what picking does then)."""
CONFIG_FILES: Final = {
    "random": CONFIGS / "random.yaml",
    "least-queue": CONFIGS / "least-queue.yaml",
    "prefix-aware": PREFIX_AWARE,
    BASELINE: OPTIMIZED_BASELINE,
    "recommended": RECOMMENDED,
    **{engine: ROOT / "demo" / "configs" / f"{engine}.yaml" for engine in DROP_IN[1:]},
    MISMATCHED: ROOT / "demo" / "configs" / "sglang.yaml",
    "precise": CONFIGS / "precise.yaml",
    "predicted-latency": CONFIGS / "predicted-latency.yaml",
}
SERVERS: Final = {"sglang": "sglang", "llamacpp": "llamacpp"}
"""The metrics dialect the simulated servers publish under a strategy (``simulator.metrics``):
the engine its configuration is written for; vLLM's for every other one."""
MIXED: Final = ("llama-3.1-8b-h100",) * (ENGINES // 2) + ("llama-3.1-8b-l4",) * (ENGINES // 2)
"""The mixed pool: half the engines on H100s, half on L4s (``simulator.profiles``), the same
model, so one request costs about nine times longer to prefill on an L4."""


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
            pick = pipeline.choose(RequestInfo(headers, body), self.endpoints)
        except Refusal:
            return None, None
        finally:
            self.fallbacks += int(_request_side_failures(failures) - before)
        return self.index[pick.endpoints[0].hostport], pick.followup

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        followup: Followup | None = handle
        if followup is not None:  # the stream's headers, then its first event, as vLLM sends them
            followup.headers(self.endpoints[index].hostport, _STREAM_HEADERS)
            followup.chunk(_FIRST_EVENT)

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
_FIRST_EVENT: Final = b'data: {"choices":[{"index":0,"delta":{"content":" "}}]}\n\n'


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


class _OwnRouter:
    """A router of this benchmark's own, outside LWEPP's pipeline: no data sources to scrape,
    no plugin to fall back from, and deaf to the response unless it says otherwise."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sources: Sequence[DataSource] = ()
        self.store: AttributeStore | None = None
        self.fallbacks = 0

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        pass

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        pass


class OracleRouter(_OwnRouter):
    """``bench.oracle.Oracle`` (oracle-estimate) as a router: no pipeline, no scrapes."""

    def __init__(self, engines: Sequence[Engine], profile: Profile) -> None:
        super().__init__("oracle-estimate")
        self.oracle = Oracle(engines, profile)

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        return self.oracle.choose(request), None

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        self.oracle.prefilled(arrival.request_id)

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        self.oracle.finished(arrival.request_id)


class LookaheadRouter(_OwnRouter):
    """``bench.oracle.Lookahead`` (oracle-lookahead) as a router: it reads the engines."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        super().__init__("oracle-lookahead")
        self.lookahead = Lookahead(engines)

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        return self.lookahead.choose(request), None


class PartitionRouter(_OwnRouter):
    """``bench.oracle.partition`` (offline-partition): each group to the engine the partition of
    the whole workload gave it."""

    def __init__(self, arrivals: Sequence[Arrival], engines: int) -> None:
        super().__init__(OFFLINE)
        self.placed = partition((a.group for a in arrivals), engines)

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        return self.placed[arrival.group], None


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
    arrivals: Sequence[Arrival] = (),
) -> Router:
    """A fresh router for ``strategy`` over ``engines`` (fresh plugin state for every run).

    ``config_file`` replaces the strategy's own (a picker's); ``arrivals`` is the whole
    workload, which only the offline partition reads.
    """
    if strategy == "oracle-estimate":
        return OracleRouter(engines, profile)
    if strategy == BOUND:
        bound = OracleRouter(engines, profile)
        bound.name, bound.oracle = BOUND, RequestPathOracle(engines, profile)
        return bound
    if strategy == "oracle-lookahead":
        return LookaheadRouter(engines)
    if strategy == OFFLINE:
        return PartitionRouter(arrivals, len(engines))
    pool = endpoints(len(engines))
    if strategy == "round-robin" and config_file is None:
        return PipelineRouter(strategy, Pipeline(clock=clock), (), pool)
    path = config_file or CONFIG_FILES[strategy]
    config = guide_config(path) if path.name.endswith(".values.yaml") else load_config(path)
    pipeline = config.pipeline(store=AttributeStore(), clock=clock, explain="off")
    if isinstance(pipeline.picker, RandomPicker):  # weighted-random-picker is one too
        pipeline.picker.rng = random.Random(seed)  # the pickers take an injected rng; seeded here
    for source in pipeline.sources:
        if isinstance(source, PrecisePrefixCacheProducer | PrecisePrefixCacheScorer):
            producer = (
                source if isinstance(source, PrecisePrefixCacheProducer) else source.producer_plugin
            )
            producer.clock = clock  # speculative entries age in virtual time
            subscribe(producer, engines, pool)
    for hook in pipeline.picked:
        if isinstance(hook, PredictedLatencyProducer):
            hook.clock = clock  # observed latencies in virtual time
    for step in pipeline.filters:
        if isinstance(step, SloHeadroomTierFilter):
            step.rng = random.Random(seed)
    return PipelineRouter(strategy, pipeline, pipeline.sources, pool)


def subscribe(
    producer: PrecisePrefixCacheProducer,
    engines: Sequence[Engine],
    pool: Sequence[Endpoint],
    *others: PrecisePrefixCacheProducer,
) -> None:
    """Each engine's KV-cache events straight into ``producer`` (and ``others``: one per
    picker replica), as each ZMQ subscriber would receive them (``simulator.kv_events``: the
    same payloads and sequence numbers, no socket; delivered at the end of the step that made
    them, no network delay). An engine has one sink: a later call replaces this one."""
    producers = (producer, *others)
    for engine, endpoint in zip(engines, pool, strict=True):
        topic = f"kv@{endpoint.hostport}@{workloads.MODEL}".encode()
        numbers = itertools.count()

        def sink(payload: bytes, topic: bytes = topic, numbers: Any = numbers) -> None:
            sequence = next(numbers).to_bytes(8, "big")
            for each in producers:
                each.ingest(topic, sequence, payload)

        engine.publish_kv_events(KVEventLog(engine.profile.block_size, sink))


# --- one run -------------------------------------------------------------------------


WARMUP: Final = 0.15
"""The first 15% of a run's arrivals warm the caches and are left out of its latencies.

A workload's first requests find every cache cold (each shared-prefix group's first
request prefills its whole prompt and holds up its engine for a long step), and their
share of a run falls as the run grows: counted in, they make the percentiles depend on
the run's length. 15% of the run is 30% of its first half, the live benchmark's warm-up,
and more than the ~300 requests that touch all 64 shared-prefix groups at least once."""
SATURATION_GROWTH: Final = 1.4
"""A run whose TTFT p90 over its whole measured window exceeds this multiple of its p90 over
the first half of the run is saturated: its backlog grows with the run (a stationary run
keeps its p90 as the run doubles; a linearly growing backlog doubles it)."""
SATURATION_THROUGHPUT: Final = 0.95
"""A swept run that answers fewer than this share of its offered rate while requests arrive
is saturated too (``Outcome.answered_per_s``)."""
BOUND_SLACK: Final = 0.02
"""How much lower than the oracle envelope's TTFT p90 a picker's may be before the envelope
is said not to bound it."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run of one workload under one strategy measured (seconds, tokens, counts).

    Latencies and the hit rate are over the requests after the warm-up (``WARMUP``);
    throughput, preemptions and the load spread over the whole run.
    """

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
    ttft_p90_half: float
    """TTFT p90 over the measured requests of the run's first half: the run half as long."""
    itl_mean: float
    itl_p90: float
    output_tokens_per_s: float
    requests_per_s: float
    answered_per_s: float
    """First tokens per second while requests kept arriving (first to last arrival): the rate
    the run sustained; below the offered rate when a backlog builds."""
    hit_rate: float
    preemptions: int
    per_engine: tuple[int, ...]
    spread_max_mean: float
    spread_cv: float
    virtual_seconds: float
    wall_seconds: float
    scrapes: int
    floor_p90: float = math.nan
    """The workload's TTFT floor, p90 (``bench.oracle.floor_ttfts``): no placement goes lower."""

    @property
    def growth(self) -> float:
        """TTFT p90 of the whole run over that of its first half (about 1: stationary)."""
        return _ratio(self.ttft_p90, self.ttft_p90_half)

    @property
    def saturated(self) -> bool:
        """The backlog grows with the run: the p90 grows, or the offered rate is not served."""
        if self.growth > SATURATION_GROWTH:
            return True
        return self.rate is not None and self.answered_per_s < SATURATION_THROUGHPUT * self.rate

    def state(self) -> str:
        """``steady``; ``saturated`` and the rate it sustained (a swept rate); or, for a replay
        whose load is the trace's, how much its p90 grew."""
        if not self.saturated:
            return "steady"
        if self.rate is None:
            return f"p90 grows {self.growth:.2g}×"
        return f"saturated at {self.answered_per_s:.3g}/s"

    def row(self) -> list[object]:
        """The table row: latencies in milliseconds."""
        return [
            *([] if self.rate is None else [self.rate]),
            self.strategy,
            self.state(),
            self.ttft_p50 * 1e3,
            self.ttft_p90 * 1e3,
            self.ttft_p99 * 1e3,
            self.growth,
            self.itl_mean * 1e3,
            self.itl_p90 * 1e3,
            self.output_tokens_per_s,
            self.requests_per_s,
            self.hit_rate,
            self.preemptions,
            self.spread_max_mean,
            self.failed,
        ]

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Outcome:
        """An outcome back from its JSON form (``results.json``: NaN was written as null)."""
        values: dict[str, Any] = {
            name: math.nan if value is None else value
            for name, value in data.items()
            if name in cls.__dataclass_fields__
        }
        values["rate"] = data.get("rate")
        values["per_engine"] = tuple(data["per_engine"])
        return cls(**values)


COLUMNS: Final = [
    "strategy",
    "state",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "p90 growth",
    "ITL mean ms",
    "ITL p90 ms",
    "out tok/s",
    "req/s",
    "hit rate",
    "preemptions",
    "load max/mean",
    "failed",
]


@dataclass(slots=True)
class _Flight:
    """One request in flight: where it went and what the router wants back."""

    arrival: Arrival
    order: int
    """Its place in the workload's arrivals."""
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
    warm: int
    """Arrivals before this one only warm the caches (``WARMUP``)."""
    drivers: list[VirtualEngine] = field(default_factory=list)
    flights: dict[str, _Flight] = field(default_factory=dict)
    ttfts: array[float] = field(default_factory=lambda: array("d"))
    """Per arrival, in order: time to first token (NaN: none)."""
    cached: array[int] = field(default_factory=lambda: array("q"))
    """Per arrival: prompt tokens that hit the prefix cache when it was first scheduled."""
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
    scheduling: Scheduling = DEFAULT_SCHEDULING,
    profiles: Sequence[Profile] = (),
    build: Callable[..., Router] | None = None,
) -> Outcome:
    """Replay ``arrivals`` on fresh engines routed by ``strategy``; account for every request.

    ``config`` replaces the strategy's configuration file (to try a variant);
    ``scheduling`` the engines' scheduler switches (current vLLM's by default);
    ``profiles``, one per engine, a mixed pool (``profile`` for every engine otherwise).
    ``build`` replaces ``router`` (same arguments), e.g. by several replicas of it.
    """
    started = time.perf_counter()
    loop = VirtualLoop()
    kinds = list(profiles) or [profile] * engines
    fleet = [Engine(kinds[i], seed=seed * 1000 + i, scheduling=scheduling) for i in range(engines)]
    pool = endpoints(engines)
    chosen = (build or router)(strategy, fleet, profile, lambda: loop.now, seed, config, arrivals)
    run = _Run(arrivals, chosen, loop, fleet, pool, warm=int(len(arrivals) * WARMUP))
    run.remaining = len(arrivals)
    run.ttfts = array("d", [math.nan]) * len(arrivals)
    run.cached = array("q", [0]) * len(arrivals)
    run.drivers = [VirtualEngine(engine, loop, _on_event(run)) for engine in fleet]
    for order, arrival in enumerate(arrivals):
        loop.at(arrival.at, _arrive(run, arrival, order))
    for source in run.router.sources:
        if isinstance(source, MetricsDataSource):
            interval = source.interval
            for i in range(engines):
                scrape = _scrape(run, source, i, interval, SERVERS.get(strategy, "vllm"))
                loop.at(interval * i / engines, scrape)
    loop.run()
    return _outcome(workload, strategy, rate, run, time.perf_counter() - started)


def _arrive(run: _Run, arrival: Arrival, order: int) -> Callable[[], None]:
    def arrive() -> None:
        request = Request(
            arrival.request_id, arrival.prompt_tokens, arrival.max_tokens, run.loop.now
        )
        index, handle = run.router.choose(arrival, request)
        if index is None:
            run.failed += 1
            run.remaining -= 1
            return
        run.flights[arrival.request_id] = _Flight(arrival, order, index, handle)
        run.drivers[index].submit(request)

    return arrive


def _on_event(run: _Run) -> Callable[[Event], None]:
    loop, flights, gaps, ttfts, router_ = run.loop, run.flights, run.gaps, run.ttfts, run.router
    warm = run.warm

    def on_event(event: Event) -> None:
        request = event.request
        flight = flights[request.id]
        now = loop.now
        if event.kind == "token":
            if request.generated == 1:
                ttfts[flight.order] = now - flight.arrival.at
                run.cached[flight.order] = request.cached_tokens
                router_.first_token(flight.arrival, flight.index, flight.handle)
            elif flight.order >= warm:
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
    run: _Run, source: MetricsDataSource, index: int, interval: float, dialect: str
) -> Callable[[], None]:
    engine, endpoint, store, loop = run.engines[index], run.pool[index], run.router.store, run.loop
    assert store is not None  # a router with sources has a store

    def scrape() -> None:
        if run.remaining <= 0:
            return  # the run is over: stop polling so the loop can drain
        now = loop.now
        page = metrics.render(dialect, engine_state(engine, now))
        values = source.read(endpoint, page)
        store.write(endpoint.hostport, {k: Measurement(v, now) for k, v in values.items()})
        run.scrapes += 1
        loop.at(now + interval, scrape)

    return scrape


def _outcome(workload: str, strategy: str, rate: float | None, run: _Run, wall: float) -> Outcome:
    arrivals, engines, warm = run.arrivals, run.engines, run.warm
    requests = len(arrivals)
    completed = requests - run.failed
    first = arrivals[0].at if arrivals else 0.0
    last = arrivals[-1].at if arrivals else 0.0
    span = max(run.last_done - first, 1e-9)
    # First tokens by the last arrival: ttft + arrival time <= last.
    answered = sum(
        1
        for a, t in zip(arrivals, run.ttfts, strict=True)
        if not math.isnan(t) and a.at + t <= last
    )
    measured = [t for t in run.ttfts[warm:] if not math.isnan(t)]
    half = [t for t in run.ttfts[warm : requests // 2] if not math.isnan(t)]
    gaps = sorted(run.gaps)
    prompts = sum(len(a.prompt_tokens) for a in arrivals[warm:])
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
        ttft_p50=percentile(measured, 50),
        ttft_p90=percentile(measured, 90),
        ttft_p99=percentile(measured, 99),
        ttft_p90_half=percentile(half, 90),
        itl_mean=statistics.fmean(gaps) if gaps else math.nan,
        itl_p90=percentile(gaps, 90),
        output_tokens_per_s=sum(e.generation_tokens_total for e in engines) / span,
        requests_per_s=completed / span,
        answered_per_s=answered / max(last - first, 1e-9),
        hit_rate=sum(run.cached[warm:]) / prompts if prompts else 0.0,
        preemptions=sum(e.preemptions_total for e in engines),
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
    target_rate: float
    """The shared-prefix rate the targets are taken at: one where round-robin is steady."""
    shared_count: int
    chat: MultiTurn
    system: MultiTurn
    """The system-prompt workload: one long system prompt every session starts with, then a
    few divergent turns (the shape that makes prefix affinity herd)."""
    mooncake_start: int
    mooncake_count: int
    mooncake_block_tokens: int
    mooncake_replay: Replay
    azure_start: int
    azure_count: int
    azure_replay: Replay
    mixed: MultiTurn
    """The mixed pool's workload (``MIXED``): multi-turn chat, busier."""


_FULL = Sizes(
    kv_blocks=None,
    shared=SharedPrefix(groups=64, prefix_tokens=2048, users=16, question_tokens=64, max_tokens=32),
    rates=(4.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0),
    target_rate=10.0,
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
    system=MultiTurn(
        sessions=600,
        turns=3,
        session_rate=4.0,
        system_tokens=512,
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
    mixed=MultiTurn(),  # the chat workload, twice as busy: set below
)
FULL: Final = replace(_FULL, mixed=replace(_FULL.chat, session_rate=2 * _FULL.chat.session_rate))
"""The full sizes; the mixed pool's chat twice as busy as the multi-turn workload's."""
QUICK: Final = Sizes(
    kv_blocks=256,
    shared=SharedPrefix(groups=8, prefix_tokens=512, users=4, question_tokens=32, max_tokens=8),
    rates=(4.0, 16.0),
    target_rate=4.0,
    shared_count=60,
    chat=MultiTurn(sessions=8, turns=3, session_rate=4.0, think_seconds=2.0, max_tokens=8),
    system=MultiTurn(
        sessions=12, turns=3, session_rate=4.0, system_tokens=128, think_seconds=2.0, max_tokens=8
    ),
    mooncake_start=0,
    mooncake_count=40,
    mooncake_block_tokens=16,
    mooncake_replay=Replay(length_scale=16 / 512, output_scale=0.1, time_scale=0.5, max_output=16),
    azure_start=0,
    azure_count=40,
    azure_replay=Replay(length_scale=0.05, output_scale=0.5, time_scale=0.5, max_output=16),
    mixed=MultiTurn(sessions=8, turns=3, session_rate=8.0, think_seconds=2.0, max_tokens=8),
)

VARIANTS: Final = (
    ("current vLLM (the default)", DEFAULT_SCHEDULING),
    ("admission on the first chunk", Scheduling(full_prompt_admission=False)),
    ("no async scheduling", Scheduling(async_scheduling=False)),
    ("blocks cached at step end", Scheduling(cache_at_schedule=False)),
    ("step jitter ±20%", Scheduling(step_jitter=0.2)),
    (
        "the earlier model (first three off)",
        Scheduling(full_prompt_admission=False, async_scheduling=False, cache_at_schedule=False),
    ),
)
"""Engine-model variants the sensitivity table runs round-robin and prefix-aware under."""
VARIANT_STRATEGIES: Final = ("round-robin", "prefix-aware")


def profile_for(sizes: Sizes) -> Profile:
    """The engines' profile: ``PROFILE`` as published (its KV cache cut for a smoke run)."""
    profile = PROFILES[PROFILE]
    return profile if sizes.kv_blocks is None else profile.replace(num_blocks=sizes.kv_blocks)


def mixed_pool(sizes: Sizes) -> list[Profile]:
    """The mixed pool's engines, one profile each (``MIXED``; KV cut as ``profile_for``)."""
    return [
        PROFILES[name]
        if sizes.kv_blocks is None
        else PROFILES[name].replace(num_blocks=sizes.kv_blocks)
        for name in MIXED
    ]


def floor_p90(arrivals: Sequence[Arrival], profile: Profile, scheduling: Scheduling) -> float:
    """The TTFT floor's p90 over the measured requests (``bench.oracle.floor_ttfts``)."""
    floors = floor_ttfts(
        [a.prompt_tokens for a in arrivals],
        [output_token_ids(0, a.max_tokens) for a in arrivals],
        profile,
        1.0 - scheduling.step_jitter,
    )
    return percentile(floors[int(len(arrivals) * WARMUP) :], 90)


@dataclass(frozen=True, slots=True)
class Variant:
    """One run of the sensitivity table: an engine-model variant, a strategy, a rate."""

    variant: str
    outcome: Outcome


def run(options: Options) -> Section:
    """Every workload under every strategy; the section ``python -m bench routing`` writes."""
    started = time.perf_counter()
    sizes = QUICK if options.quick else FULL
    profile = profile_for(sizes)
    seed = options.seed
    outcomes: list[Outcome] = []

    def wanted(workload: str) -> bool:
        return not options.workloads or workload in options.workloads

    def measure(
        workload: str,
        arrivals: Sequence[Arrival],
        rate: float | None = None,
        strategies: Sequence[str] = STRATEGIES,
        profiles: Sequence[Profile] = (),
    ) -> None:
        if not wanted(workload):
            return
        fastest = min(profiles or [profile], key=lambda p: p.prefill_per_token)
        floor = floor_p90(arrivals, fastest, DEFAULT_SCHEDULING)
        for strategy in (*strategies, BOUND):
            outcome = simulate(
                workload, arrivals, strategy, profile, seed=seed, rate=rate, profiles=profiles
            )
            outcomes.append(replace(outcome, floor_p90=floor))
            progress(
                f"routing: {workload}{'' if rate is None else f' at {rate:g}/s'} {strategy}: "
                f"TTFT p90 {outcome.ttft_p90 * 1e3:.1f} ms ({outcome.state()}), hit rate "
                f"{outcome.hit_rate:.2f}, {outcome.requests} requests in "
                f"{outcome.wall_seconds:.1f} s"
            )

    shared = {
        rate: workloads.shared_prefix(sizes.shared, rate, sizes.shared_count, seed)
        for rate in sizes.rates
        if wanted("shared-prefix")
    }
    for rate, arrivals in shared.items():
        measure("shared-prefix", arrivals, rate, (*STRATEGIES, OFFLINE))
    chat = workloads.multi_turn(sizes.chat, seed)
    measure("multi-turn", chat)
    measure(
        "system-prompt", workloads.multi_turn(sizes.system, seed), None, (*STRATEGIES, MISMATCHED)
    )
    traces = TRACES / MOONCAKE_FILE, TRACES / AZURE_FILE
    if all(path.exists() for path in traces):
        records = workloads.read_mooncake(traces[0], sizes.mooncake_start, sizes.mooncake_count)
        measure(
            "mooncake",
            workloads.mooncake(records, sizes.mooncake_block_tokens, sizes.mooncake_replay),
        )
        rows = workloads.read_azure(traces[1], sizes.azure_start, sizes.azure_count)
        measure("azure-code", workloads.azure(rows, sizes.azure_replay, seed))
    measure("mixed-pool", workloads.multi_turn(sizes.mixed, seed), profiles=mixed_pool(sizes))
    variants: list[Variant] = []
    runs: list[tuple[str, float | None, Sequence[Arrival], Sequence[tuple[str, Scheduling]]]]
    runs = [
        ("shared-prefix", rate, shared[rate], VARIANTS[1:])
        for rate in (sizes.target_rate, max(sizes.rates))
        if rate in shared
    ]
    # Multi-turn under the earlier model only: what the engine model did to its ratio.
    if wanted("multi-turn"):
        runs.append(("multi-turn", None, chat, VARIANTS[-1:]))
    for workload, at_rate, inputs, chosen in runs:
        for name, scheduling in chosen:
            for strategy in VARIANT_STRATEGIES:
                outcome = simulate(
                    workload,
                    inputs,
                    strategy,
                    profile,
                    seed=seed,
                    rate=at_rate,
                    scheduling=scheduling,
                )
                variants.append(Variant(name, outcome))
                progress(
                    f"routing: engine model '{name}', {workload}"
                    f"{'' if at_rate is None else f' at {at_rate:g}/s'} {strategy}: "
                    f"TTFT p90 {outcome.ttft_p90 * 1e3:.1f} ms ({outcome.state()})"
                )
    return section(
        outcomes,
        sizes,
        profile,
        options,
        traces_found=all(p.exists() for p in traces),
        variants=variants,
        wall=time.perf_counter() - started,
    )


def section(
    outcomes: Sequence[Outcome],
    sizes: Sizes,
    profile: Profile,
    options: Options,
    *,
    traces_found: bool,
    variants: Sequence[Variant] = (),
    wall: float = math.nan,
) -> Section:
    """Tables, plots, targets, notes and data of a finished run."""
    by_workload: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_workload.setdefault(outcome.workload, []).append(outcome)
    shared = by_workload.get("shared-prefix", [])
    notes = notes_for(sizes, profile, traces_found, shared, wall)
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
    tables.append(ratio_table(shared))
    tables.append(workload_table(by_workload, sizes.target_rate))
    tables.append(workload_table(by_workload, sizes.target_rate, "recommended"))
    tables.append(workload_table(by_workload, sizes.target_rate, "precise"))
    tables.append(drop_in_table(by_workload))
    tables.append(bound_table(outcomes))
    if variants:
        tables.append(variant_table(outcomes, variants))
    lines = (*PICKERS, "oracle envelope", OFFLINE, "TTFT floor")
    steady = [o for o in shared if not o.saturated]
    plots = [
        Plot(
            "routing-shared-prefix-ttft-p90",
            "Shared prefix: TTFT p90 by arrival rate (steady runs only)",
            "arrival rate (requests/s)",
            "TTFT p90 (ms)",
            [Series(name, *_series(steady, name, "ttft_p90", 1e3)) for name in lines],
            logy=True,
        ),
        Plot(
            "routing-shared-prefix-hit-rate",
            "Shared prefix: prefix-cache hit rate by arrival rate",
            "arrival rate (requests/s)",
            "hit tokens / prompt tokens",
            [Series(name, *_series(shared, name, "hit_rate")) for name in lines[:-1]],
        ),
    ]
    return Section(
        key="routing",
        title="Routing quality in virtual time (LWEPP's pick path, 8 simulated engines)",
        command="python -m bench routing",
        tables=tables,
        plots=plots,
        targets=[
            *targets(shared, sizes.target_rate),
            *recommended_targets(by_workload, sizes.target_rate),
            *precise_targets(by_workload, sizes.target_rate),
            *drop_in_targets(by_workload),
            *latency_targets(by_workload, sizes.target_rate),
            bound_target(outcomes),
        ],
        data={
            "profile": asdict(profile),
            "scheduling": asdict(DEFAULT_SCHEDULING),
            "sizes": asdict(sizes),
            "engines": ENGINES,
            "seed": options.seed,
            "quick": options.quick,
            "wall_seconds": wall,
            "runs": [asdict(o) for o in outcomes],
            "bounds": [asdict(b) | {"ratio": b.ratio, "holds": b.holds} for b in bounds(outcomes)],
            "variants": [{"variant": v.variant, **asdict(v.outcome)} for v in variants],
        },
        notes=notes,
    )


def _series(
    outcomes: Sequence[Outcome], name: str, field_name: str, scale: float = 1.0
) -> tuple[list[float], list[float]]:
    """One plot line: a strategy, the oracle envelope or the floor, by rate."""
    xs: list[float] = []
    ys: list[float] = []
    for rate in sorted({o.rate for o in outcomes if o.rate is not None}):
        if name == "TTFT floor":
            found = next((o for o in outcomes if o.rate == rate), None)
            value = None if found is None else found.floor_p90
        else:
            chosen = (
                envelope(outcomes, "shared-prefix", rate)
                if name == "oracle envelope"
                else _find(outcomes, name, rate)
            )
            value = None if chosen is None else getattr(chosen, field_name)
        if value is not None and not math.isnan(value):
            xs.append(rate)
            ys.append(value * scale)
    return xs, ys


def _find(outcomes: Sequence[Outcome], strategy: str, rate: float | None) -> Outcome | None:
    return next((o for o in outcomes if o.strategy == strategy and o.rate == rate), None)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def envelope(outcomes: Sequence[Outcome], workload: str, rate: float | None) -> Outcome | None:
    """The oracle envelope of one run: the online oracle with the lower TTFT p90."""
    runs = [
        o for o in outcomes if o.workload == workload and o.rate == rate and o.strategy in ORACLES
    ]
    return min(runs, key=lambda o: (o.ttft_p90, ORACLES.index(o.strategy)), default=None)


def versus(a: Outcome | None, b: Outcome | None, value: Callable[[Outcome], float]) -> object:
    """``value(a) / value(b)``, or which of the two is saturated (a ratio of backlogs means
    nothing) with the rate it served."""
    if a is None or b is None:
        return None
    for run in (a, b):
        if run.saturated:
            if run.rate is None:
                return f"{run.strategy} not steady"
            return f"{run.strategy} saturated ({run.answered_per_s:.3g}/s)"
    return _ratio(value(a), value(b))


def _p90(o: Outcome) -> float:
    return o.ttft_p90


def _hits(o: Outcome) -> float:
    return o.hit_rate


def ratio_table(shared: Sequence[Outcome]) -> Table:
    """Prefix-aware against round-robin and the oracle envelope, at each rate of the sweep."""
    rows: list[list[object]] = []
    for rate in sorted({o.rate for o in shared if o.rate is not None}):
        pa, rr = _find(shared, "prefix-aware", rate), _find(shared, "round-robin", rate)
        best, offline = envelope(shared, "shared-prefix", rate), _find(shared, OFFLINE, rate)
        if pa is None or rr is None or best is None:
            continue
        rows.append(
            [
                rate,
                rr.state(),
                versus(pa, rr, _p90),
                versus(pa, best, _p90),
                versus(pa, best, _hits),
                best.strategy,
                versus(best, offline, _p90),
                pa.ttft_p90 * 1e3,
                pa.floor_p90 * 1e3,
            ]
        )
    return Table(
        "Shared prefix: prefix-aware against round-robin and the oracle envelope",
        [
            "rate/s",
            "round-robin",
            "prefix-aware / round-robin TTFT p90",
            "prefix-aware / oracle envelope TTFT p90",
            "prefix-aware / oracle envelope hit rate",
            "envelope from",
            "oracle envelope / offline partition TTFT p90",
            "prefix-aware TTFT p90 ms",
            "TTFT floor p90 ms",
        ],
        rows,
        "A ratio is shown only when both runs are steady; past saturation a backlog grows with "
        "the run, and the cell names the saturated strategy and the rate it served instead. "
        "The targets are taken at the rate named in the notes, where round-robin is steady.",
    )


def workload_table(
    by_workload: Mapping[str, Sequence[Outcome]], target_rate: float, picker: str = "prefix-aware"
) -> Table:
    """prefix-aware beside round-robin and the oracle envelope on every workload (shared
    prefix at the target rate)."""
    rows: list[list[object]] = []
    for workload, outcomes in by_workload.items():
        rate = target_rate if any(o.rate is not None for o in outcomes) else None
        pa, rr = _find(outcomes, picker, rate), _find(outcomes, "round-robin", rate)
        best = envelope(outcomes, workload, rate)
        if pa is None or rr is None or best is None:
            continue
        rows.append(
            [
                workload if rate is None else f"{workload} at {rate:g}/s",
                versus(pa, rr, lambda o: o.ttft_p50),
                versus(pa, rr, _p90),
                versus(pa, best, _p90),
                versus(pa, rr, lambda o: o.itl_p90),
                pa.hit_rate,
                best.hit_rate,
                rr.hit_rate,
                pa.preemptions,
                sum(1 for n in pa.per_engine if n),
                pa.spread_max_mean,
            ]
        )
    return Table(
        f"Every workload: {picker} beside round-robin and the oracle envelope",
        [
            "workload",
            "TTFT p50 / RR",
            "TTFT p90 / RR",
            "TTFT p90 / oracle envelope",
            "ITL p90 / RR",
            "hit rate",
            "envelope hit rate",
            "RR hit rate",
            "preemptions",
            "engines used",
            "load max/mean",
        ],
        rows,
        f"Ratios below 1 favour {picker}. 'engines used': engines that served at least one "
        f"request, of {ENGINES}.",
    )


@dataclass(frozen=True, slots=True)
class Bound:
    """One run: the oracle envelope's TTFT p90 against the best picker's."""

    workload: str
    rate: float | None
    oracle: str
    oracle_p90: float
    picker: str
    picker_p90: float

    @property
    def ratio(self) -> float:
        """The best picker's p90 over the envelope's: at least ``1 - BOUND_SLACK`` when the
        envelope bounds the run."""
        return _ratio(self.picker_p90, self.oracle_p90)

    @property
    def holds(self) -> bool:
        return self.ratio >= 1.0 - BOUND_SLACK - 1e-9  # 1e-9: float noise at the limit


def bounds(outcomes: Sequence[Outcome]) -> list[Bound]:
    """For every run (workload and rate): the envelope against the best of ``PICKERS``."""
    found: list[Bound] = []
    for key in dict.fromkeys((o.workload, o.rate) for o in outcomes):
        workload, rate = key
        best = envelope(outcomes, workload, rate)
        pickers = [o for o in outcomes if (o.workload, o.rate) == key and o.strategy in PICKERS]
        if best is None or not pickers:
            continue
        picker = min(pickers, key=lambda o: (o.ttft_p90, PICKERS.index(o.strategy)))
        found.append(
            Bound(workload, rate, best.strategy, best.ttft_p90, picker.strategy, picker.ttft_p90)
        )
    return found


def bound_table(outcomes: Sequence[Outcome]) -> Table:
    """Does the oracle envelope bound every picker, run by run?"""
    rows: list[list[object]] = [
        [
            b.workload if b.rate is None else f"{b.workload} at {b.rate:g}/s",
            b.oracle,
            b.oracle_p90 * 1e3,
            b.picker,
            b.picker_p90 * 1e3,
            b.ratio,
            "yes" if b.holds else "**no**",
        ]
        for b in bounds(outcomes)
    ]
    return Table(
        "Does the oracle envelope bound every picker? (TTFT p90, run by run)",
        [
            "run",
            "envelope from",
            "envelope p90 ms",
            "best picker",
            "its p90 ms",
            "best picker / envelope",
            "bounded",
        ],
        rows,
        "The envelope is, per run, the better TTFT p90 of oracle-lookahead and oracle-estimate. "
        "It bounds a run when no picker's p90 is more than "
        f"{BOUND_SLACK:.0%} below it (a ratio of at least {1 - BOUND_SLACK:g}).",
    )


def bound_target(outcomes: Sequence[Outcome]) -> Target:
    """The worst run's best-picker / envelope ratio: the envelope bounds every run when it is
    at least ``1 - BOUND_SLACK``."""
    ratios = [b.ratio for b in bounds(outcomes)]
    return Target(
        "best picker's TTFT p90 / oracle envelope's, worst run",
        min(ratios, default=math.nan),
        1.0 - BOUND_SLACK,
        at_most=False,
    )


def variant_table(outcomes: Sequence[Outcome], variants: Sequence[Variant]) -> Table:
    """Each engine-model switch turned away from current vLLM (or jitter on): shared prefix at
    the target rate and the top rate, and multi-turn under the earlier model."""
    rows: list[list[object]] = []
    for key in dict.fromkeys((v.outcome.workload, v.outcome.rate) for v in variants):
        every = [(VARIANTS[0][0], o) for o in outcomes if (o.workload, o.rate) == key]
        every += [
            (v.variant, v.outcome) for v in variants if (v.outcome.workload, v.outcome.rate) == key
        ]
        for name, _ in VARIANTS:
            rr = next((o for n, o in every if n == name and o.strategy == "round-robin"), None)
            pa = next((o for n, o in every if n == name and o.strategy == "prefix-aware"), None)
            if rr is None or pa is None:
                continue
            workload, rate = key
            rows.append(
                [
                    workload if rate is None else f"{workload} at {rate:g}/s",
                    name,
                    rr.state() if rr.saturated else rr.ttft_p90 * 1e3,
                    rr.preemptions,
                    pa.state() if pa.saturated else pa.ttft_p90 * 1e3,
                    pa.ttft_p99 * 1e3,
                    pa.preemptions,
                    pa.hit_rate,
                    versus(pa, rr, _p90),
                ]
            )
    return Table(
        "What each engine-model switch changes (round-robin and prefix-aware)",
        [
            "run",
            "engine model",
            "RR TTFT p90 ms",
            "RR preemptions",
            "PA TTFT p90 ms",
            "PA TTFT p99 ms",
            "PA preemptions",
            "PA hit rate",
            "PA / RR TTFT p90",
        ],
        rows,
        "Each row turns one of simulator.engine.Scheduling's switches away from current vLLM "
        "(or adds jitter); 'the earlier model' is the engine model before these switches "
        "existed (the workload text is today's in every row).",
    )


def targets(shared: Sequence[Outcome], rate: float) -> list[Target]:
    """The three goals, at ``rate``: below round-robin's saturation, where ratios mean
    something (a ratio with a saturated run is not measured, and so not reached)."""
    pa, rr = _find(shared, "prefix-aware", rate), _find(shared, "round-robin", rate)
    best = envelope(shared, "shared-prefix", rate)
    if pa is None or rr is None or best is None:
        return []

    def measured(value: object) -> float:
        return value if isinstance(value, float) else math.nan

    at = f"shared prefix at {rate:g} requests/s"
    return [
        Target(f"prefix-aware TTFT p90 / round-robin's, {at}", measured(versus(pa, rr, _p90)), 0.1),
        Target(
            f"prefix-aware TTFT p90 / oracle envelope's, {at}",
            measured(versus(pa, best, _p90)),
            1.25,
        ),
        Target(
            f"prefix-aware hit rate / oracle envelope's, {at}",
            measured(versus(pa, best, _hits)),
            0.9,
            at_most=False,
        ),
    ]


RECOMMENDED_LIMITS: Final = (
    ("multi-turn", "ITL p90", lambda o: o.itl_p90, 1.0),
    ("multi-turn", "TTFT p90", _p90, 1.0),
    ("azure-code", "TTFT p50", lambda o: o.ttft_p50, 1.0),
    ("azure-code", "TTFT p90", _p90, 1.0),
    ("mooncake", "TTFT p90", _p90, 1.0),
    ("shared-prefix", "TTFT p90", _p90, 0.1),
)
"""The recommended configuration against round-robin: never worse on any workload (real
traces included), and a tenth of its p90 where prompts share long prefixes."""


def recommended_targets(by_workload: Mapping[str, Sequence[Outcome]], rate: float) -> list[Target]:
    """``RECOMMENDED_LIMITS``, each on the workloads this run has (shared prefix at ``rate``)."""
    found = []
    for workload, what, value, limit in RECOMMENDED_LIMITS:
        outcomes = by_workload.get(workload, [])
        at = rate if any(o.rate is not None for o in outcomes) else None
        rec, rr = _find(outcomes, "recommended", at), _find(outcomes, "round-robin", at)
        if rec is None or rr is None:
            continue
        ratio = versus(rec, rr, value)
        where = workload if at is None else f"{workload} at {at:g} requests/s"
        found.append(
            Target(
                f"recommended {what} / round-robin's, {where}",
                ratio if isinstance(ratio, float) else math.nan,
                limit,
            )
        )
    return found


def precise_targets(by_workload: Mapping[str, Sequence[Outcome]], rate: float) -> list[Target]:
    """The precise prefix cache against the oracle envelope, on shared prefix (at ``rate``)
    and the Mooncake trace: its hit rate at least 0.98× the envelope's, its TTFT p90 at most
    1.05× the envelope's."""
    found = []
    for workload in ("shared-prefix", "mooncake"):
        outcomes = by_workload.get(workload, [])
        at = rate if any(o.rate is not None for o in outcomes) else None
        precise, best = _find(outcomes, "precise", at), envelope(outcomes, workload, at)
        if precise is None or best is None:
            continue
        where = workload if at is None else f"{workload} at {at:g} requests/s"
        hits, p90 = versus(precise, best, _hits), versus(precise, best, _p90)
        found += [
            Target(
                f"precise hit rate / oracle envelope's, {where}",
                hits if isinstance(hits, float) else math.nan,
                0.98,
                at_most=False,
            ),
            Target(
                f"precise TTFT p90 / oracle envelope's, {where}",
                p90 if isinstance(p90, float) else math.nan,
                1.05,
            ),
        ]
    return found


def _runs(
    by_workload: Mapping[str, Sequence[Outcome]],
) -> list[tuple[str, Sequence[Outcome], float | None]]:
    """Every run of the part: (workload, its outcomes, rate), swept rates one by one."""
    return [
        (workload, outcomes, rate)
        for workload, outcomes in by_workload.items()
        for rate in dict.fromkeys(o.rate for o in outcomes)
    ]


def _worse(a: Outcome | None, b: Outcome | None) -> float:
    """``a``'s TTFT p90 over ``b``'s; infinite when ``a`` alone is saturated; NaN when there is
    nothing to compare (a run missing, or both saturated)."""
    if a is None or b is None or (a.saturated and b.saturated):
        return math.nan
    if a.saturated or b.saturated:
        return math.inf if a.saturated else 0.0
    return _ratio(a.ttft_p90, b.ttft_p90)


def drop_in_table(by_workload: Mapping[str, Sequence[Outcome]]) -> Table:
    """``DROP_IN`` and llm-d's default against round-robin, and ``DROP_IN`` against llm-d's
    default, run by run."""
    rows: list[list[object]] = []
    for workload, outcomes, rate in _runs(by_workload):
        rr, baseline = _find(outcomes, "round-robin", rate), _find(outcomes, BASELINE, rate)
        if rr is None or baseline is None:
            continue
        row: list[object] = [workload if rate is None else f"{workload} at {rate:g}/s"]
        row.append(versus(baseline, rr, _p90))
        for name in DROP_IN:
            mine = _find(outcomes, name, rate)
            row += [versus(mine, rr, _p90), versus(mine, baseline, _p90)]
        rows.append(row)
    columns = ["run", f"{BASELINE} / RR"]
    for name in DROP_IN:
        columns += [f"{name} / RR", f"{name} / {BASELINE}"]
    return Table(
        f"The drop-in configurations beside round-robin and llm-d's default ({BASELINE})",
        columns,
        rows,
        "TTFT p90 ratios, every run (each swept rate of shared prefix too); below 1 favours the "
        f"first named. {BASELINE} is llm-d's optimized-baseline guide's configuration, unchanged.",
    )


def drop_in_targets(by_workload: Mapping[str, Sequence[Outcome]]) -> list[Target]:
    """Each of ``DROP_IN``: its worst TTFT p90 against round-robin's and against ``BASELINE``'s,
    over every run (a run where it alone is saturated counts as infinitely worse)."""
    found = []
    for name in DROP_IN:
        for reference in ("round-robin", BASELINE):
            worst, where = math.nan, "no run"
            for workload, outcomes, rate in _runs(by_workload):
                ratio = _worse(_find(outcomes, name, rate), _find(outcomes, reference, rate))
                if not math.isnan(ratio) and not ratio <= worst:
                    worst, where = ratio, workload if rate is None else f"{workload} at {rate:g}/s"
            if where != "no run":
                found.append(
                    Target(f"{name} TTFT p90 / {reference}'s, worst run ({where})", worst, 1.0)
                )
    return found


def latency_targets(by_workload: Mapping[str, Sequence[Outcome]], rate: float) -> list[Target]:
    """Issue 34's targets for ``predicted-latency`` on every workload (shared prefix at
    ``rate``): TTFT p90 at most 1.06× the oracle envelope's and the request-path bound's
    (``BOUND``, what any picker that sees only the request path reached), never above
    round-robin's; nothing-shared traffic (azure-code) at most 0.95× round-robin's; the mixed
    pool at most 0.8× the recommended configuration's."""
    found = []

    def add(what: str, a: Outcome | None, b: Outcome | None, limit: float) -> None:
        ratio = versus(a, b, _p90)
        if a is not None and b is not None:
            found.append(Target(what, ratio if isinstance(ratio, float) else math.nan, limit))

    for workload, outcomes in by_workload.items():
        at = rate if any(o.rate is not None for o in outcomes) else None
        where = workload if at is None else f"{workload} at {at:g} requests/s"
        mine = _find(outcomes, "predicted-latency", at)
        rr = _find(outcomes, "round-robin", at)
        add(f"predicted-latency TTFT p90 / oracle envelope's, {where}", mine,
            envelope(outcomes, workload, at), 1.06)  # fmt: skip
        add(f"predicted-latency TTFT p90 / request-path bound's, {where}", mine,
            _find(outcomes, BOUND, at), 1.06)  # fmt: skip
        add(f"predicted-latency TTFT p90 / round-robin's, {where}", mine, rr, 1.0)
        if workload == "azure-code":
            add(f"predicted-latency TTFT p90 / round-robin's, {where}", mine, rr, 0.95)
        if workload == "mixed-pool":
            rec = _find(outcomes, "recommended", at)
            add(f"predicted-latency TTFT p90 / recommended's, {where}", mine, rec, 0.8)
    return found


def workload_notes(sizes: Sizes) -> dict[str, str]:
    """Each workload table's note: its shape and every scaling factor."""
    sp, chat, mc, az = sizes.shared, sizes.chat, sizes.mooncake_replay, sizes.azure_replay
    system = sizes.system
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
        "system-prompt": (
            f"{system.sessions} sessions × {system.turns} turns, sessions start at "
            f"{system.session_rate:g}/s (Poisson), think time {system.think_seconds:g} s mean; "
            f"every session starts with the same {system.system_tokens}-token system prompt, "
            f"then {system.user_tokens}-token user messages and {system.max_tokens}-token "
            f"answers resent. '{MISMATCHED}' is sglang.yaml in front of servers publishing "
            "vLLM's metric names."
        ),
        "mooncake": (
            f"Mooncake synthetic trace, records {MOONCAKE_FIRST + sizes.mooncake_start}–"
            f"{MOONCAKE_FIRST + sizes.mooncake_start + sizes.mooncake_count - 1}: "
            "512-token blocks → "
            f"{sizes.mooncake_block_tokens} tokens (lengths × {mc.length_scale:g}), outputs × "
            f"{mc.output_scale:g} (at most {mc.max_output}), time × {mc.time_scale:g}."
        ),
        "mixed-pool": (
            f"Mixed pool ({ENGINES // 2} engines on H100s, {ENGINES // 2} on L4s, one model): "
            f"multi-turn chat, {sizes.mixed.sessions} sessions × {sizes.mixed.turns} turns "
            f"starting at {sizes.mixed.session_rate:g}/s, otherwise as multi-turn."
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
    sizes: Sizes,
    profile: Profile,
    traces_found: bool,
    shared: Sequence[Outcome] = (),
    wall: float = math.nan,
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
    rr = _find(shared, "round-robin", sizes.target_rate)
    steady_rr = [o.rate for o in shared if o.strategy == "round-robin" and not o.saturated]
    saturated_rr = [o.rate for o in shared if o.strategy == "round-robin" and o.saturated]
    sample = workloads.shared_prefix(sp, 1.0, 20, 0)
    chars = sum(len(a.body["prompt"]) for a in sample) / sum(len(a.prompt_tokens) for a in sample)
    switches = ", ".join(f"{k} {v}" for k, v in asdict(DEFAULT_SCHEDULING).items())
    notes = [
        f"Engines: {ENGINES} simulated vLLM engines (simulator.engine), profile "
        f"{profile.name!r} {kv}: {profile.summary}; {profile.num_blocks:,} KV blocks of "
        f"{profile.block_size} tokens ({profile.kv_tokens:,} tokens), prefill "
        f"{profile.prefill_per_token * 1e6:g} µs/token, step overhead "
        f"{profile.step_overhead * 1e3:g} ms, max_num_seqs {profile.max_num_seqs}, "
        f"max_num_batched_tokens {profile.max_num_batched_tokens}. Scheduler switches as "
        f"current vLLM ({switches}): whole-prompt admission, a request arriving at a busy "
        "engine admitted one step later (async scheduling), blocks hittable once scheduled, "
        "exact step times. Virtual time: no network, no asyncio; every number is "
        "deterministic for the seed.",
        "Strategies: round-robin is Pipeline() with no plugins (LWEPP's default); random is "
        "bench/configs/random.yaml (random-picker, seeded); least-queue is "
        "bench/configs/least-queue.yaml (metrics-data-source + queue-scorer); prefix-aware is "
        "demo/configs/prefix-aware.yaml unchanged. References (bench/oracle.py): "
        "oracle-lookahead forks every engine's exact state (blocks, queues, the step in "
        "flight, admission) and simulates it forward with the request and no later arrival, "
        "and picks the earliest first token; oracle-estimate (the earlier oracle) picks by a "
        "step-model estimate plus twice the prefill the choice adds; the oracle envelope is, "
        "per run, the one of the two with the lower TTFT p90; offline-partition (shared "
        "prefix only) puts every group on one engine, groups spread to even out requests "
        "with the whole workload known in advance; the TTFT floor is each request alone on "
        "an idle engine that holds every earlier prompt, a bound no placement can beat.",
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
        f"{per_engine * ENGINES} (all {sp.groups}). Best possible hit rate once warm: "
        f"{sp.shared_fraction:.2f} of prompt tokens.",
        f"Shared-prefix rates: engines that see every group (round-robin measured a hit rate of "
        f"{hit:.2f}) prefill {1 - hit:.0%} of each {sp.prompt_tokens}-token prompt, "
        f"{uncached:.2f} s of engine time, so the {ENGINES} engines saturate below "
        f"{ENGINES / uncached:.0f} requests/s (less once decoding takes its share of each "
        f"step); placement by prefix leaves about {sp.question_tokens} uncached tokens "
        f"({sp.question_tokens * profile.prefill_per_token * 1e3:.0f} ms). Round-robin was "
        f"steady at {_rates(steady_rr)} and saturated at {_rates(saturated_rr)} requests/s. "
        f"The targets are taken at {sizes.target_rate:g} requests/s, below its saturation "
        f"(there: {'not measured' if rr is None else rr.state()}, TTFT p90 growth "
        f"{'n/a' if rr is None else f'{rr.growth:.2f}'} as the run doubles).",
        f"Each run: the first {WARMUP:.0%} of arrivals warm the caches and are left out of "
        "latencies and hit rates (their share would otherwise shrink as the run grows). TTFT: "
        "arrival to first token (routing takes no virtual time). Steady or saturated: a run is "
        f"saturated when its TTFT p90 is more than {SATURATION_GROWTH:g}× its p90 over the "
        f"first half of the run ('p90 growth': a backlog that grows with the run doubles it, "
        f"a stationary one keeps it), or when it answered less than "
        f"{SATURATION_THROUGHPUT:.0%} of the offered rate while requests kept arriving; "
        "ratios involving a saturated run are not shown, since they measure the run's length, "
        "not placement (a trace replay, whose load is the trace's, is marked by how much its "
        "p90 grew instead). ITL: every gap "
        "between consecutive tokens of a measured request, mean and p90. Throughput: output "
        "tokens and completed requests per second from the first arrival to the last "
        "completion. Hit rate: prompt tokens found in the prefix cache when each request was "
        "first scheduled / prompt tokens. Preemptions: the engines' own counters, whole run. "
        "Load spread: requests per engine, max/mean.",
        f"Prompt text is simulator.tokenizer text: {chars:.1f} characters per token with the "
        "spaces, as English under a BPE tokenizer. prefix-aware.yaml hashes 16-character "
        "blocks (blockSizeTokens 4, 4 characters per token) and matches at most 256 of them: "
        f"the first 4,096 characters, about {4096 / chars:,.0f} of these tokens.",
    ]
    notes.append(
        "Reading prefix-aware.yaml's arithmetic (prefix ×3, queue ×2, KV use ×2): "
        "queue-scorer reads waiting requests, which stay 0 while an engine admits everything "
        "that arrives (up to max_num_seqs, while the whole prompt fits in free KV blocks), so "
        "below saturation only the KV term, worth at most 2, can move a pick. A prefix every "
        "request shares (the multi-turn workload's system prompt) gives the engines that "
        "already served it up to 3 more, so new sessions keep to the engines that served "
        "first until those queue: see 'engines used' in the per-workload table."
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
    if not math.isnan(wall):
        notes.append(f"Whole routing part: {wall:.0f} s of wall time.")
    return notes


def _rates(rates: Sequence[float | None]) -> str:
    return ", ".join(f"{r:g}" for r in rates if r is not None) or "none of the swept rates"
