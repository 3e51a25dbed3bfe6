"""Where the milliseconds go in front of a real model server: the gateway path before llama.cpp.

``python -m bench overhead --engine llamacpp`` (``make bench-overhead
ENGINE=llamacpp``). ``bench/overhead.py`` measures each piece of the path
against an upstream that answers in microseconds; here the upstream is one
real engine (``python -m demo.llamacpp``: llama.cpp's own server, Gemma 3
270M, one CPU thread, one slot), and what a client sees is time to first
token (TTFT) and the whole streamed request. The routers, each in front of
the same engine, in the same run:

=================  ==================================================================
case               what sits between the client and the engine
=================  ==================================================================
direct             nothing (the baseline every "added" figure is taken against)
plain              Envoy alone
noop-picker        Envoy and one do-nothing ext_proc hop (picker's mode): the floor of
                   any gateway that calls a Python ext_proc service per request
bbr+lwepp-scrape   the demo gateway: Envoy, BBR, LWEPP with ``demo/configs/llamacpp.yaml``
                   (prefix-aware, queue), scraping the engine's ``/metrics`` every 0.1 s
one-hop-scrape     the one-hop gateway (``onehop``) with the same configuration
sglang-router,     the peers (``bench/peers.py``, round_robin: with one engine every
vllm-router        policy picks it), left out when not installed (``make peers``)
=================  ==================================================================

Processes sit where ``bench/overhead.py`` puts them (``bench.rig.Placement``): Envoy,
the client and the engine on the first CPU, the Python services and the
peers on the second.

**Warm requests.** Every request is the same short prompt, streamed
``/v1/completions`` with ``MAX_TOKENS`` tokens (``ignore_eos``, so exactly
that many): the engine's one slot keeps the prompt, and each request
computes only its last prompt token before the first new one. The engine's
own counters over the measured window (``llamacpp:prompt_tokens_cached_total``
over all prompt tokens) show how warm it was. The client is the live
part's (``bench.live``: aiohttp; TTFT is the first ``data:`` chunk that
carries text, the whole request ends at ``data: [DONE]``), one fresh
connection per request for every case: llama.cpp's server closes its
connection after each streamed answer, so a client straight at it cannot
keep one, and the others do the same so that the cases differ only by the
router.

**Pairing.** The requests go in rounds, one request per case each round, one
at a time (concurrency 1), the cases in a fresh seeded random order each
round; a case's added TTFT is the median over rounds of its TTFT minus
direct's *in the same round*, with a distribution-free 95% confidence
interval of that median (the order statistics a sign test puts around it).
Why ``ROUNDS``: the engine's TTFT varies by several ms from request to
request on a shared CPU (one decode step of tens of ms on one thread), so a
1–5 ms difference needs hundreds of pairs before its interval stands clear of
zero; the interval printed beside each figure says whether it did.

**Concurrency 1 only.** With one thread and one slot the engine computes one
request at a time: at 8 in flight, seven wait their turn, and TTFT becomes
the queue (hundreds of ms that vary with the order of arrival), against
which the routers' millisecond differences cannot be read.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import aiohttp
import orjson

from bench import live
from bench.report import Options, Section, Table, Target, median_interval, percentile, progress
from bench.rig import CASES as OVERHEAD_CASES
from bench.rig import Placement, Rig, pinned
from bench.workloads import Arrival
from demo import llamacpp
from demo.topology import HOST

CASE_KEYS: Final = (
    "direct",
    "plain",
    "noop-picker",
    "bbr+lwepp-scrape",
    "one-hop-scrape",
    "sglang-router",
    "vllm-router",
)
CASES: Final = tuple(case for key in CASE_KEYS for case in OVERHEAD_CASES if case.key == key)

PROMPT: Final = "You are a helpful assistant. Answer the user's question in one short sentence."
MAX_TOKENS: Final = 2
"""Tokens per answer: the first (TTFT) and one more, so the whole request spans a decode step."""

ROUNDS: Final = 400
"""Rounds in a full run (each: one request per case). See the module docstring."""
QUICK_ROUNDS: Final = 3
WARMUP: Final = 3
"""Requests per case before the measured rounds: connections, the slot's cache, first calls."""

BREAKDOWN: Final = (
    ("Envoy as a proxy", "plain", "direct"),
    ("a do-nothing ext_proc hop (picker's mode)", "noop-picker", "plain"),
    (
        "the demo gateway's two hops (BBR; LWEPP prefix-aware, scraping)",
        "bbr+lwepp-scrape",
        "plain",
    ),
    ("the one hop (prefix-aware, scraping)", "one-hop-scrape", "plain"),
    ("two hops − one hop", "bbr+lwepp-scrape", "one-hop-scrape"),
    ("demo gateway (two hops), over the engine", "bbr+lwepp-scrape", "direct"),
    ("one-hop gateway, over the engine", "one-hop-scrape", "direct"),
    ("the floor: Envoy + a do-nothing hop, over the engine", "noop-picker", "direct"),
    ("sglang-router, over the engine", "sglang-router", "direct"),
    ("vllm-router, over the engine", "vllm-router", "direct"),
)
"""(what, case, base case): each piece as the paired difference of two cases' TTFT."""

TARGET: Final = ("one-hop-scrape", "sglang-router", 1.5)
"""(gateway, peer, limit): the gateway's added TTFT over the engine, over the peer's."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's times (seconds), or its error."""

    ttft: float
    latency: float
    error: str | None = None


async def _one(session: aiohttp.ClientSession, port: int, arrival: Arrival, body: bytes) -> Sample:
    """One streamed request to ``port``, timed and checked by the live part's client."""
    outcome = live.Outcome(arrival.request_id, arrival.group, measured=True)
    await live.send_streamed(session, f"http://{HOST}:{port}", arrival, body, outcome)
    if outcome.error is not None or outcome.ttft is None or outcome.latency is None:
        return Sample(math.nan, math.nan, outcome.error or "no token arrived")
    return Sample(outcome.ttft, outcome.latency)


async def measure(
    ports: dict[str, int], engine: str, rounds: int, seed: int
) -> tuple[dict[str, list[Sample]], tuple[float, ...] | None]:
    """``WARMUP`` requests per case, then ``rounds`` rounds of one request per case in a
    seeded random order; every case's samples in round order, and the engine's counters
    (``live.LLAMACPP.counted``) over the measured rounds."""
    body_fields = {"model": llamacpp.MODEL_ALIAS, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    body = orjson.dumps({**body_fields, **live.LLAMACPP.extra_body, "stream": True})
    arrival = Arrival(0.0, "overhead", body_fields, (), MAX_TOKENS, "same", "same")
    order = list(ports)
    rng = random.Random(seed)
    samples: dict[str, list[Sample]] = {key: [] for key in order}
    connector = aiohttp.TCPConnector(force_close=True)  # see "Warm requests" above
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for key in order:
            for _ in range(WARMUP):
                warm = await _one(session, ports[key], arrival, body)
                if warm.error is not None:
                    raise RuntimeError(f"{key}: a warm-up request failed: {warm.error}")
        before = await live.counters(session, [engine], live.LLAMACPP)
        for number in range(rounds):
            if number % 50 == 0:
                progress(f"overhead (llamacpp): round {number + 1}/{rounds}")
            rng.shuffle(order)
            for key in order:
                samples[key].append(await _one(session, ports[key], arrival, body))
        after = await live.counters(session, [engine], live.LLAMACPP)
    if before is None or after is None:
        return samples, None
    return samples, tuple(a - b for a, b in zip(after, before, strict=True))


def paired(
    samples: dict[str, list[Sample]], key: str, base: str, what: str = "ttft"
) -> list[float]:
    """``key``'s time minus ``base``'s in each round where both succeeded (seconds)."""
    pairs = zip(samples[key], samples[base], strict=True)
    return [
        getattr(a, what) - getattr(b, what) for a, b in pairs if a.error is None and b.error is None
    ]


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _good(runs: Sequence[Sample], what: str) -> list[float]:
    return [getattr(s, what) for s in runs if s.error is None]


def run(options: Options) -> Section:
    """Start one engine, every router in front of it; measure the rounds; lay them out."""
    placement = Placement.detect()
    work_dir = options.out / "overhead-llamacpp-run"
    rounds = QUICK_ROUNDS if options.quick else ROUNDS
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        progress("overhead (llamacpp): starting the engine")
        with pinned(placement.gateway):
            (port,) = stack.enter_context(live.llamacpp_engines(work_dir / "engine", 1))
        rig = Rig(
            work_dir,
            placement,
            cases=CASES,
            config=live.LLAMACPP.prefix_config,
            upstream_ports=[port],
        )
        stack.callback(rig.close)
        progress("overhead (llamacpp): starting the gateways and the peers")
        rig.start()
        ports = {case.key: rig.envoys[case.key] for case in rig.cases}
        with pinned(placement.gateway):
            samples, counters = asyncio.run(measure(ports, f"{HOST}:{port}", rounds, options.seed))
        queues = rig.pool_queue()
        missing = dict(rig.missing)
    return section(
        samples, counters, placement, rounds, time.monotonic() - started, missing, queues
    )


def section(
    samples: dict[str, list[Sample]],
    counters: tuple[float, ...] | None,
    placement: Placement,
    rounds: int,
    seconds: float,
    missing: dict[str, str],
    queues: dict[str, float | None],
) -> Section:
    """The tables (per case; the breakdown), the target, notes and raw data."""
    cases = [case for case in CASES if case.key in samples]
    peer = TARGET[1]
    peer_added = (
        statistics.median(paired(samples, peer, "direct") or [math.nan])
        if peer in samples
        else math.nan
    )
    direct_ttft = statistics.median(_good(samples["direct"], "ttft") or [math.nan])
    rows: list[list[object]] = []
    for case in cases:
        runs = samples[case.key]
        ttfts = _good(runs, "ttft")
        latencies = _good(runs, "latency")
        row: list[object] = [
            case.label,
            len(ttfts),
            sum(s.error is not None for s in runs),
            _ms(statistics.median(ttfts)) if ttfts else math.nan,
            _ms(percentile(ttfts, 90)),
            _ms(statistics.median(latencies)) if latencies else math.nan,
        ]
        if case.key == "direct":
            row += [None, None, None, None, 1.0]
        else:
            added, low, high = median_interval(paired(samples, case.key, "direct"))
            whole = statistics.median(paired(samples, case.key, "direct", "latency") or [math.nan])
            row += [
                _ms(added),
                f"{_ms(low):.2f} … {_ms(high):.2f}",
                _ms(whole),
                added / peer_added,
                (direct_ttft + added) / direct_ttft,
            ]
        rows.append(row)
    breakdown: list[list[object]] = []
    for what, key, base in BREAKDOWN:
        if key not in samples or base not in samples:
            continue
        added, low, high = median_interval(paired(samples, key, base))
        whole = statistics.median(paired(samples, key, base, "latency") or [math.nan])
        breakdown.append([what, _ms(added), f"{_ms(low):.2f} … {_ms(high):.2f}", _ms(whole)])
    targets = []
    gateway, _, limit = TARGET
    if peer in samples:
        ratio = statistics.median(paired(samples, gateway, "direct") or [math.nan]) / peer_added
        targets.append(
            Target(
                f"one-hop gateway added TTFT over a llama.cpp engine vs {peer}'s, concurrency 1",
                ratio,
                limit,
            )
        )
    cached = None
    if counters is not None and counters[0] > 0:
        cached = counters[1] / counters[0]
    notes = [
        f"Placement: CPUs {sorted(placement.gateway)}: every Envoy (--concurrency 1), the client "
        f"and the engine (one thread, one slot); CPUs {sorted(placement.python)}: every Python "
        "ext_proc server and the peers.",
        f"Requests: the same {len(PROMPT)}-character prompt, streamed /v1/completions, "
        f"{MAX_TOKENS} tokens each, concurrency 1, a new connection per request; {WARMUP} "
        f"warm-up requests per case, then {rounds} rounds of one request per case in a "
        "seeded random order.",
        "Added: the median over rounds of the case's time minus direct's in the same round, "
        "with a distribution-free 95% interval of that median; 'vs sglang-router' divides "
        "added TTFTs; 'vs no proxy' is the case's TTFT (direct's median + added) over direct's.",
        "Warm: of the prompt tokens the measured requests asked for, the engine served "
        + (
            f"{cached:.1%} from its cache"
            if cached is not None
            else "an unknown share (no counters)"
        )
        + ".",
        "Scraping: at the end, the scraping pickers' pool queue gauge read "
        + ", ".join(f"{kind} {value}" for kind, value in queues.items())
        + " (their scrapes of the engine's /metrics arrived and parsed).",
        *(f"Left out: {key}: {why}." for key, why in missing.items()),
        f"Whole run: {seconds:.0f} s.",
    ]
    data = {
        "placement": placement.describe(),
        "engine": "llamacpp",
        "rounds": rounds,
        "max_tokens": MAX_TOKENS,
        "samples": {
            key: [[s.ttft, s.latency, s.error] for s in runs] for key, runs in samples.items()
        },
        "counters": counters,
        "cached_share": cached,
        "pool_queue": queues,
        "missing": missing,
        "seconds": seconds,
    }
    return Section(
        key="overhead-llamacpp",
        title="Gateway overhead in front of a real llama.cpp engine: time to first token",
        command="make bench-overhead ENGINE=llamacpp",
        tables=[
            Table(
                "TTFT and whole request through each router (concurrency 1; ms)",
                [
                    "case",
                    "requests",
                    "failed",
                    "TTFT p50",
                    "TTFT p90",
                    "whole p50",
                    "added TTFT p50",
                    "95% interval",
                    "added whole p50",
                    "added TTFT vs sglang-router's",
                    "TTFT vs no proxy",
                ],
                rows,
            ),
            Table(
                "Where the time goes before the first token (ms; paired differences)",
                ["piece", "added TTFT p50", "95% interval", "added whole p50"],
                breakdown,
            ),
        ],
        plots=[],
        targets=targets,
        data=data,
        notes=notes,
    )
