"""What the gateway path adds, through a real Envoy: each service against a do-nothing hop.

The same HTTP load goes through one Envoy per case, all configured from
``demo/envoy.py``'s own filters, clusters and processing modes:

======================  ==============================================================
case                    what sits between Envoy and the upstream
======================  ==============================================================
plain                   nothing: Envoy round-robins over the upstream (the baseline)
noop-picker             a do-nothing ext_proc server in the round-robin picker's
                        processing mode (no response headers: a do-nothing picker needs
                        none, as round-robin)
lwepp                   LWEPP (round-robin), routing through the ORIGINAL_DST cluster
lwepp-tls               the same LWEPP hop over TLS (its default, as GIE's lwepp's)
noop-both               two do-nothing servers, in BBR's mode then the picker's
bbr+lwepp               BBR then LWEPP: the demo's request path
noop-bbr                a do-nothing server in BBR's processing mode
bbr                     BBR alone
one-hop                 ``onehop``: BBR's job and LWEPP's pick in one hop
                        (the filter's processing mode is the picker's: ``noop-picker``
                        is its do-nothing hop)
bbr+lwepp-prefix        BBR then LWEPP with the prefix-aware configuration
                        (``demo/configs/prefix-aware.yaml``), its metrics read once at
                        start and never again: the pipeline's work without the scraping
bbr+lwepp-scrape        the same, scraping every replica's ``/metrics`` every 0.1 s (the
                        configuration's default): the demo gateway as it runs
one-hop-scrape          the one hop with the same configuration, scraping likewise
direct                  no proxy at all: the load generator straight at one replica
sglang-router,          the peers (``bench/peers.py``, round_robin) in place of Envoy,
vllm-router             in front of the same replicas; left out when not installed
                        (``make peers``)
======================  ==============================================================

Each picker is sent the response headers only if it says it needs them
(``bench.rig.Rig.response_headers``, decided as the demo decides it): the round-robin
``lwepp`` and ``one-hop`` are not, so each compares with ``noop-picker`` in the
same mode; the prefix-aware pickers are (their prefix index hears the
response), so the prefix-aware row of the breakdown includes that exchange.

**Where the time goes.** A breakdown table reads each piece of the path
off the same rounds as a difference of two cases: first the demo gateway
built up one piece at a time (Envoy: plain − direct; + the BBR hop: bbr −
plain; + the LWEPP hop, round-robin: bbr+lwepp − bbr; + the prefix-aware
pipeline: bbr+lwepp-prefix − bbr+lwepp; + scraping: bbr+lwepp-scrape −
bbr+lwepp-prefix), then a do-nothing hop (noop-picker − plain), each
service's own work (service − its do-nothing hop), the second hop (noop-both
− noop-picker), and each gateway's and peer's whole cost over the upstream
itself (− direct). The floor of any Python ext_proc gateway, Envoy and one
do-nothing hop over the upstream (noop-picker − direct), is set against
sglang-router's added latency in the ratio table.

The scraping pickers run on the Python services' CPU like every picker, so
their scrapes share the core with the picks, as they do in the demo. The
upstream answers ``/metrics`` with a fixed page in vLLM's names
(``METRICS_PAGE``, rendered by the simulator's own ``simulator.metrics``):
the picker parses and stores a real page every interval, whose numbers never
change, so every replica always scores alike.

``python -m bench overhead --engine llamacpp`` (``make bench-overhead
ENGINE=llamacpp``) runs the same path in front of a real llama.cpp engine
instead, measuring time to first token: ``bench/overhead_engine.py``.

The services run plaintext (``--secure-serving=false``) except in
``lwepp-tls``, whose added latency over ``lwepp``'s is what TLS between Envoy
and a picker costs (a second LWEPP process, on the same CPU, with its
self-signed certificate; Envoy dials it as ``demo.envoy.upstream_tls``).

Each service is judged against the do-nothing hop of the *same* processing
mode, measured in the same run and the same rounds: what Envoy's ext_proc
filter and a Python gRPC server cost anyway is the do-nothing hop's; what the
service adds beyond it is the service's own work. Both filters run the
request body FULL_DUPLEX_STREAMED (as GIE's charts do); the picker's filter
also sends the response headers, BBR's does not.

**Placement.** On a machine of two or more CPUs, every Envoy (one worker
thread, ``--concurrency 1``) and the load generator share the first CPU, and
every Python ext_proc server the second, as the measurements this project
started from placed them: the Python process is the ceiling of every
ext_proc case, and it gets a core of its own. The upstream, two "replicas"
served by one more Envoy that answers a fixed chat completion itself, runs on
the first CPU too (see ``bench.rig.upstream_bootstrap`` for why not the simulator).

**Latency.** Closed loop at concurrency 1 and 8 (``bench/loadgen.py``), the
cases interleaved in rounds (``plain, noop-picker, lwepp, ...`` then again),
so a noisy neighbour hits every case alike; each figure is the median over
rounds of that round's p50 or p99, and "added" is a case's latency minus the
plain proxy's *in the same round*.

**Throughput.** An open-loop sweep: every case still standing runs at the
same offered rate, which then rises by a fixed step; a case drops out at the
first rate where any request fails or its p99 exceeds ``P99_BOUND``. The
highest rate passed is what it sustains (within one step).

**Streams per core.** ``bench/streams.py``: whole ext_proc streams straight
at each server pinned to one core, no Envoy, as server CPU per stream.

**Workers.** ``python -m lwepp --workers N``: streams per second at N = 1
and 2 from several client connections (SO_REUSEPORT spreads connections, not
streams, over the workers).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from bench import loadgen, overhead_engine, streams
from bench.report import (
    Options,
    Plot,
    Section,
    Series,
    Table,
    Target,
    median_interval,
    progress,
)
from bench.rig import CASES, ONCE, PAGE_QUEUE, Placement, Rig, pinned
from demo.topology import HOST

P99_BOUND: Final = 0.025
"""Open-loop pass mark: p99 latency at most 25 ms, and no request failed.

Far above any case's p99 below saturation (a few ms here), so a case fails it
only once a backlog builds, which is what "the highest rate it sustains" means.
"""

RATE_STEP: Final = 1.25
"""Each open-loop step offers 25% more than the last: the sustained rate is known within it."""

LATENCY_BODY_BYTES: Final = 1024
STREAMS_BODY_BYTES: Final = 4096
BREAKDOWN: Final = (
    ("Envoy as a proxy", "plain", "direct"),
    ("+ the BBR hop", "bbr", "plain"),
    ("+ the LWEPP hop, round-robin", "bbr+lwepp", "bbr"),
    ("+ the prefix-aware pipeline (metrics read once)", "bbr+lwepp-prefix", "bbr+lwepp"),
    ("+ scraping /metrics every 0.1 s", "bbr+lwepp-scrape", "bbr+lwepp-prefix"),
    ("one hop prefix-aware, scraping, over Envoy", "one-hop-scrape", "plain"),
    ("one hop: prefix-aware + scraping − round-robin", "one-hop-scrape", "one-hop"),
    ("a do-nothing ext_proc hop (picker's mode)", "noop-picker", "plain"),
    ("a do-nothing ext_proc hop (BBR's mode)", "noop-bbr", "plain"),
    ("the second hop (two do-nothing hops − one)", "noop-both", "noop-picker"),
    ("LWEPP's own work (round-robin)", "lwepp", "noop-picker"),
    ("BBR's own work", "bbr", "noop-bbr"),
    ("the one hop's own work (BBR's chain + the pick)", "one-hop", "noop-picker"),
    ("two-hop gateway (Envoy + BBR + LWEPP), over the upstream", "bbr+lwepp", "direct"),
    ("one-hop gateway (Envoy + one hop), over the upstream", "one-hop", "direct"),
    (
        "demo gateway, prefix-aware + scraping (two hops), over the upstream",
        "bbr+lwepp-scrape",
        "direct",
    ),
    ("one-hop gateway, prefix-aware + scraping, over the upstream", "one-hop-scrape", "direct"),
    ("the floor: Envoy + a do-nothing hop, over the upstream", "noop-picker", "direct"),
    ("sglang-router, over the upstream", "sglang-router", "direct"),
    ("vllm-router, over the upstream", "vllm-router", "direct"),
)
"""(what, case, base case): each piece of the path as the difference of two cases' latency."""

ONE_HOP_TARGETS: Final = (
    ("one-hop", "sglang-router", 1.5),
    ("one-hop", "vllm-router", 1.5),
)
"""(gateway case, peer case, limit): the gateway's added p50 at concurrency 1 over the upstream,
as a multiple of the peer's over the same upstream."""

FLOOR: Final = ("noop-picker", "sglang-router")
"""(the floor case, the peer): the least any Python ext_proc gateway adds over the upstream
(Envoy and one do-nothing hop in the picker's mode), over what the peer adds; reported at
concurrency 1 and 8 beside ``ONE_HOP_TARGETS``, no target: if it is above their limit, no
Python hop can reach it."""

ONE_HOP_RATE: Final = 1.6
"""Requests per Python core-second, the one hop's over the two hops' (BBR's stream and LWEPP's
stream for every request), both read off whole streams on one core (``bench/streams.py``):
the Python process is the ceiling of every ext_proc case, so this is the gateway's rate per
core of Python, measured as CPU time, which a busy machine disturbs less than a rate."""

COMPARISONS: Final = (
    ("lwepp", "noop-picker", 1.15, "LWEPP"),
    ("bbr", "noop-bbr", 1.25, "BBR"),
    ("bbr+lwepp", "noop-both", 1.1, "BBR + LWEPP"),
)
"""(service case, its do-nothing case, the target ratio of added latency, name)."""

TLS_COMPARISON: Final = ("lwepp-tls", "lwepp", "LWEPP: TLS hop vs plaintext hop")
"""(the TLS case, the same service in plaintext, name): reported as a ratio, no target."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How long each measurement runs."""

    rounds: int
    seconds: float
    sweep_seconds: float
    sweep_start: float
    sweep_steps: int
    stream_count: int
    stream_rounds: int

    @classmethod
    def of(cls, options: Options) -> Sizes:
        if options.quick:
            return cls(1, 0.25, 0.25, 40.0, 1, 40, 1)
        return cls(9, 1.5, 1.5, 100.0, 16, 1500, 5)


# --- measuring --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One load run's summary."""

    requests: int
    failed: int
    rate: float
    p50: float
    p99: float

    @classmethod
    def of(cls, result: loadgen.Result) -> Run:
        return cls(
            result.completed + result.errors,
            result.failed,
            result.rate,
            result.percentile(50),
            result.percentile(99),
        )


def closed_run(port: int, body: bytes, concurrency: int, seconds: float) -> Run:
    """``concurrency`` clients posting ``body`` to ``port`` back to back for ``seconds``."""
    request = loadgen.post(HOST, port, "/v1/chat/completions", body)
    return Run.of(
        asyncio.run(
            loadgen.closed_loop(HOST, port, request, concurrency=concurrency, seconds=seconds)
        )
    )


def _open(port: int, body: bytes, rate: float, seconds: float) -> Run:
    request = loadgen.post(HOST, port, "/v1/chat/completions", body)
    return Run.of(asyncio.run(loadgen.open_loop(HOST, port, request, rate=rate, seconds=seconds)))


def latency_rounds(rig: Rig, sizes: Sizes, body: bytes) -> dict[str, dict[int, list[Run]]]:
    """Closed-loop runs at concurrency 1 and 8, every case once per round, in order."""
    runs: dict[str, dict[int, list[Run]]] = {c.key: {1: [], 8: []} for c in rig.cases}
    for number in range(sizes.rounds):
        progress(f"overhead: latency round {number + 1}/{sizes.rounds}")
        for case in rig.cases:
            for concurrency in (1, 8):
                run = closed_run(rig.envoys[case.key], body, concurrency, sizes.seconds)
                runs[case.key][concurrency].append(run)
    return runs


def sweep(rig: Rig, sizes: Sizes, body: bytes) -> dict[str, list[tuple[float, Run]]]:
    """Rising open-loop rates, every case still passing at each; a case stops at its first miss."""
    steps: dict[str, list[tuple[float, Run]]] = {c.key: [] for c in rig.cases}
    alive = [c.key for c in rig.cases]
    rate = sizes.sweep_start
    for _ in range(sizes.sweep_steps):
        if not alive:
            break
        progress(f"overhead: open loop at {rate:,.0f} req/s ({len(alive)} cases)")
        for key in list(alive):
            run = _open(rig.envoys[key], body, rate, sizes.sweep_seconds)
            steps[key].append((rate, run))
            if not passes(run):
                alive.remove(key)
        rate *= RATE_STEP
    return steps


def passes(run: Run) -> bool:
    """No request failed, and p99 stayed within the bound."""
    return run.failed == 0 and run.p99 <= P99_BOUND


def sustained(steps: Sequence[tuple[float, Run]]) -> float:
    """The highest offered rate passed before the first miss (0 if the first one missed)."""
    best = 0.0
    for rate, run in steps:
        if not passes(run):
            break
        best = rate
    return best


def generator_ceiling(rig: Rig, sizes: Sizes) -> Run:
    """The load generator against Envoy answering by itself: its own limit, on its own CPU.

    A GET: Envoy answers ``/direct`` as soon as it has the headers, and it
    closes an HTTP/1.1 connection it answers before the request's body is in.
    """
    request = loadgen.request(HOST, rig.envoys["plain"], "GET", "/direct")
    result = asyncio.run(
        loadgen.closed_loop(
            HOST, rig.envoys["plain"], request, concurrency=8, seconds=sizes.seconds
        )
    )
    return Run.of(result)


# --- the section ------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ms(seconds: float) -> float:
    return seconds * 1e3


def run(options: Options) -> Section:
    """Start every process, measure latency, the sweep, streams per core and workers (with
    ``options.engine`` ``llamacpp``: the breakdown in front of a real engine instead)."""
    if options.engine == "llamacpp":
        return overhead_engine.run(options)
    sizes = Sizes.of(options)
    placement = Placement.detect()
    work_dir = options.out / "overhead-run"
    chat = streams.chat_body(LATENCY_BODY_BYTES)
    started = time.monotonic()
    rig = Rig(work_dir, placement)
    try:
        progress("overhead: starting the ext_proc servers, an Envoy per case and the peers")
        rig.start()
        with pinned(placement.gateway):
            for case in rig.cases:  # warm up: connections, first-stream costs
                closed_run(rig.envoys[case.key], chat, 8, min(0.5, sizes.seconds / 2))
            ceiling = generator_ceiling(rig, sizes)
            latency = latency_rounds(rig, sizes, chat)
            steps = sweep(rig, sizes, chat)
        queues = rig.pool_queue()
    finally:
        rig.close()
    progress("overhead: streams per core")
    per_core = streams.measure(
        ["noop-rw", "noop-gen", "noop-sync", "lwepp", "bbr", "onehop"],
        streams=sizes.stream_count,
        rounds=sizes.stream_rounds,
    )
    progress("overhead: workers")
    scaling = streams.measure_workers(
        (1, 2), streams=sizes.stream_count, rounds=sizes.stream_rounds
    )
    return section(
        latency,
        steps,
        ceiling,
        per_core,
        scaling,
        placement,
        time.monotonic() - started,
        rig.missing,
        queues,
    )


def _added(
    latency: dict[str, dict[int, list[Run]]], key: str, c: int, q: str, base: str = "plain"
) -> float:
    """Median over rounds of (case − ``base``, the plain proxy by default) for percentile ``q``
    ("p50"/"p99"), seconds."""
    if key not in latency or base not in latency:
        return float("nan")
    pairs = zip(latency[key][c], latency[base][c], strict=True)
    return _median([getattr(run, q) - getattr(base, q) for run, base in pairs])


def _interval(latency: dict[str, dict[int, list[Run]]], key: str, base: str, c: int) -> str:
    """The distribution-free 95% interval of the median over rounds of (case − base)'s p50,
    in ms ("–" with too few rounds for one)."""
    pairs = zip(latency[key][c], latency[base][c], strict=True)
    _, low, high = median_interval([run.p50 - other.p50 for run, other in pairs])
    return "–" if math.isnan(low) else f"{_ms(low):.2f} … {_ms(high):.2f}"


def section(
    latency: dict[str, dict[int, list[Run]]],
    steps: dict[str, list[tuple[float, Run]]],
    ceiling: Run,
    per_core: list[streams.Result],
    scaling: list[streams.WorkersResult],
    placement: Placement,
    seconds: float,
    missing: dict[str, str] | None = None,
    queues: dict[str, float | None] | None = None,
) -> Section:
    """Lay the measurements out: tables, targets, plots, raw data."""
    missing = missing or {}
    queues = queues or {}
    cases = [case for case in CASES if case.key not in missing]
    latency_rows: list[list[object]] = []
    rate_rows: list[list[object]] = []
    for case in cases:
        row: list[object] = [case.label]
        over_envoy = case.envoy and case.key != "plain"
        for c in (1, 8):
            runs = latency[case.key][c]
            row += [
                _ms(_median([r.p50 for r in runs])),
                _ms(_median([r.p99 for r in runs])),
                _ms(_added(latency, case.key, c, "p50")) if over_envoy else None,
                _ms(_added(latency, case.key, c, "p99")) if over_envoy else None,
            ]
        latency_rows.append(row)
        rate_rows.append(
            [
                case.label,
                *(_median([r.rate for r in latency[case.key][c]]) for c in (1, 8)),
                sustained(steps[case.key]),
                sum(r.failed for c in (1, 8) for r in latency[case.key][c]),
            ]
        )
    latency_columns = [
        "case",
        *(
            f"{what} (c={c})"
            for c in (1, 8)
            for what in ("p50 ms", "p99 ms", "added p50 ms", "added p99 ms")
        ),
    ]
    rate_columns = [
        "case",
        "req/s (c=1)",
        "req/s (c=8)",
        f"sustained req/s (open loop, p99 ≤ {P99_BOUND * 1e3:.0f} ms)",
        "failed requests (closed loop)",
    ]
    targets: list[Target] = []
    ratio_rows: list[list[object]] = []
    for service, noop, limit, name in COMPARISONS:
        for c in (1, 8):
            p50 = _added(latency, service, c, "p50") / _added(latency, noop, c, "p50")
            p99 = _added(latency, service, c, "p99") / _added(latency, noop, c, "p99")
            ratio_rows.append([name, c, p50, p99, limit])
            targets.append(
                Target(
                    f"{name} added p50 latency vs {_noop_name(noop)}, concurrency {c}",
                    p50,
                    limit,
                )
            )
        base_rate = sustained(steps[noop])
        rate = sustained(steps[service]) / base_rate if base_rate else float("nan")
        ratio_rows.append([name, "sustained rate (service / do-nothing)", rate, None, None])
    tls_case, plain_case, tls_name = TLS_COMPARISON
    for c in (1, 8):
        p50 = _added(latency, tls_case, c, "p50") / _added(latency, plain_case, c, "p50")
        p99 = _added(latency, tls_case, c, "p99") / _added(latency, plain_case, c, "p99")
        ratio_rows.append([tls_name, c, p50, p99, None])
    base_rate = sustained(steps[plain_case])
    rate = sustained(steps[tls_case]) / base_rate if base_rate else float("nan")
    ratio_rows.append([tls_name, "sustained rate (TLS / plaintext)", rate, None, None])
    breakdown_rows = [
        [
            what,
            *(_ms(_added(latency, key, c, q, base)) for q in ("p50", "p99") for c in (1, 8)),
            *(_interval(latency, key, base, c) for c in (1, 8)),
        ]
        for what, key, base in BREAKDOWN
        if key in latency and base in latency
    ]
    for gateway, peer, limit in ONE_HOP_TARGETS:
        if peer not in latency:
            continue
        ratio = _added(latency, gateway, 1, "p50", "direct") / _added(
            latency, peer, 1, "p50", "direct"
        )
        targets.append(
            Target(
                f"one-hop gateway added p50 over the upstream vs {peer}'s, concurrency 1",
                ratio,
                limit,
            )
        )
    floor, floor_peer = FLOOR
    if floor_peer in latency:
        for c in (1, 8):
            ratio_rows.append(
                [
                    f"the floor (Envoy + a do-nothing hop) over the upstream vs {floor_peer}'s",
                    c,
                    *(
                        _added(latency, floor, c, q, "direct")
                        / _added(latency, floor_peer, c, q, "direct")
                        for q in ("p50", "p99")
                    ),
                    None,
                ]
            )
    base_rate = sustained(steps["bbr+lwepp"])
    rate = sustained(steps["one-hop"]) / base_rate if base_rate else float("nan")
    ratio_rows.append(["one hop vs BBR + LWEPP", "sustained rate", rate, None, None])
    by_kind = {r.kind: r for r in per_core}
    base = by_kind["noop-rw"]
    stream_rows = [
        [
            r.kind,
            r.per_second,
            r.cpu_us_per_stream,
            1e6 / r.cpu_us_per_stream,
            base.cpu_us_per_stream / r.cpu_us_per_stream,
        ]
        for r in per_core
    ]
    two_hops = by_kind["lwepp"].cpu_us_per_stream + by_kind["bbr"].cpu_us_per_stream
    targets.append(
        Target(
            "one-hop requests per Python core-second vs two hops' (BBR's + LWEPP's stream)",
            two_hops / by_kind["onehop"].cpu_us_per_stream,
            ONE_HOP_RATE,
            at_most=False,
        )
    )
    for kind, limit, name in (("lwepp", 0.8, "LWEPP"), ("bbr", 0.7, "BBR")):
        targets.append(
            Target(
                f"{name} streams per core-second vs a do-nothing server (4 KB bodies)",
                base.cpu_us_per_stream / by_kind[kind].cpu_us_per_stream,
                limit,
                at_most=False,
            )
        )
    one = scaling[0]
    worker_rows = [
        [w.workers, w.per_second, w.per_second / one.per_second, " / ".join(map(str, w.served))]
        for w in scaling
    ]
    rates = [rate for case_steps in steps.values() for rate, _ in case_steps]
    offered = [min(rates), max(rates)]
    plots = [
        Plot(
            "overhead-open-loop-p99",
            "Open loop: p99 latency at each offered rate",
            "offered rate (requests/s)",
            "p99 latency (ms)",
            [
                Series(
                    case.label,
                    [rate for rate, _ in steps[case.key]],
                    [_ms(r.p99) for _, r in steps[case.key]],
                )
                for case in cases
            ]
            + [Series(f"pass mark: p99 {P99_BOUND * 1e3:.0f} ms", offered, [P99_BOUND * 1e3] * 2)],
            logy=True,
        )
    ]
    notes = [
        f"Placement: {placement.describe()}.",
        "Upstream: two replicas served by one Envoy answering a fixed non-streamed chat "
        "completion (direct_response), the same for every case; requests are 1 KB "
        "chat-completions POSTs.",
        f"Load generator (`bench/loadgen.py`) against Envoy answering itself: "
        f"{ceiling.rate:,.0f} req/s at concurrency 8, p50 {_ms(ceiling.p50):.2f} ms — "
        "its ceiling, shared with Envoy's CPU.",
        "Latency: closed loop, the cases interleaved in rounds; each figure is the median over "
        "rounds; 'added' is the case minus the plain proxy in the same round. Ratios are each "
        "service's added latency over the do-nothing hop's of the same processing mode; the TLS "
        "row is LWEPP over TLS (its default, a self-signed certificate) over the same LWEPP in "
        "plaintext, which every other case uses.",
        f"Sustained: open loop, rates rising by {RATE_STEP - 1:.0%} a step; a case stops at its "
        f"first step with a failed request or p99 over {P99_BOUND * 1e3:.0f} ms (a case "
        "still passing at the last step sustains at least that rate; 0: it missed the first).",
        "Streams per core: `bench/streams.py`, each server pinned to one CPU, headers + 4 KB "
        "body full-duplex; the ratio is server CPU per stream, the do-nothing server's over the "
        "service's. The server loops, each doing nothing: noop-rw is grpc.aio with "
        "context.read/write (what serving.server runs), noop-gen grpc.aio with an async "
        "generator, noop-sync grpc's synchronous server (a thread per stream).",
        "Workers: `python -m lwepp --workers N`, streams/s from 8 client connections; with two "
        "CPUs the client shares them with the workers, so 2 workers cannot double it here.",
        "Where the time goes: each row is the difference of two cases' latency (median over "
        "rounds of the paired difference, with a distribution-free 95% interval of that "
        "median: a row whose interval spans 0 is below this run's resolution); 'over the "
        "upstream' is against the load generator straight at one replica. The peers run "
        "round_robin on the Python services' CPU.",
        "Prefix-aware: the pickers run demo/configs/prefix-aware.yaml; the -prefix picker "
        f"reads the replicas' /metrics once (refreshIntervalSeconds {ONCE:.0f}), the -scrape "
        "ones every 0.1 s (its default), on the Python services' CPU; the replicas answer "
        "a fixed vLLM-style page. At the end, the scraping pickers' pool queue gauge read "
        + ", ".join(f"{kind} {value}" for kind, value in queues.items())
        + f" (the page says {PAGE_QUEUE}): their scrapes arrived and parsed.",
        *(f"Left out: {key}: {why}." for key, why in missing.items()),
        f"Whole run: {seconds:.0f} s.",
    ]
    data = {
        "placement": placement.describe(),
        "latency": {
            key: {str(c): [run_data(r) for r in runs] for c, runs in by_c.items()}
            for key, by_c in latency.items()
        },
        "sweep": {key: [[rate, run_data(r)] for rate, r in s] for key, s in steps.items()},
        "generator_ceiling": run_data(ceiling),
        "streams": [
            {"kind": r.kind, "streams": r.streams, "seconds": r.seconds, "cpu": r.server_cpu}
            for r in per_core
        ],
        "workers": [
            {"workers": w.workers, "streams": w.streams, "seconds": w.seconds, "served": w.served}
            for w in scaling
        ],
        "seconds": seconds,
        "missing": missing,
        "pool_queue": queues,
    }
    return Section(
        key="overhead",
        title="Gateway overhead: what each ext_proc service adds through a real Envoy",
        command="make bench-overhead",
        tables=[
            Table(
                "Latency through Envoy (closed loop; added = minus the plain proxy, same round)",
                latency_columns,
                latency_rows,
            ),
            Table("Throughput through Envoy", rate_columns, rate_rows),
            Table(
                "Where the time goes: added latency of each piece (ms; paired differences)",
                [
                    "piece",
                    "p50 (c=1)",
                    "p50 (c=8)",
                    "p99 (c=1)",
                    "p99 (c=8)",
                    "p50 (c=1) 95% interval",
                    "p50 (c=8) 95% interval",
                ],
                breakdown_rows,
            ),
            Table(
                "Added latency: each service over the do-nothing hop of its processing mode",
                ["service", "concurrency", "p50 ratio", "p99 ratio", "target (p50)"],
                ratio_rows,
            ),
            Table(
                "Whole ext_proc streams on one core (headers + 4 KB body, no Envoy)",
                [
                    "server",
                    "streams/s",
                    "server CPU µs/stream",
                    "streams per core-second",
                    "vs do-nothing",
                ],
                stream_rows,
            ),
            Table(
                "LWEPP workers (SO_REUSEPORT)",
                ["workers", "streams/s", "vs 1 worker", "streams each worker served"],
                worker_rows,
            ),
        ],
        plots=plots,
        targets=targets,
        data=data,
        notes=notes,
    )


def _noop_name(key: str) -> str:
    return {
        "noop-picker": "a do-nothing hop in the picker's mode",
        "noop-bbr": "a do-nothing hop in BBR's mode",
        "noop-both": "two do-nothing hops",
    }[key]


def run_data(run: Run) -> dict[str, float]:
    return {
        "requests": run.requests,
        "failed": run.failed,
        "rate": run.rate,
        "p50": run.p50,
        "p99": run.p99,
    }


if __name__ == "__main__":
    sys.exit("run it as: python -m bench overhead")
