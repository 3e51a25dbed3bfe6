"""``python -m bench.slo``: latency-slo-admitter and the slack ordering, in virtual time.

What each claims, measured on simulated engines (``simulator``: vLLM-like
``llama-3.1-8b-l4`` engines on one ``VirtualLoop``) through the picker's real
plugins: the configuration loaded by ``lwepp.config``, its pipeline choosing
every request with the SLO and objective headers a client sends
(``PipelineRouter`` with the headers added), the engines' KV-cache use
written into the pipeline's store at each arrival (a scrape that is never
late). Each comparison runs its modes on the same arrivals (same seed), and
reports the share of requests that got their first token within their
``x-llm-d-slo-ttft-ms`` (counted from arrival, queueing included; a refused
request did not), as a ratio to the same run's baseline.

**Admitter** (no flow control): two tenants offering half each, an
interactive one (priority 0) and a batch one (objective ``batch``,
priority -1), each request with a 1 s TTFT SLO. Baseline: every request
sent on (``predicted-latency`` routing, no admitter); against it, the same
file with ``latency-slo-admitter``: a batch request no engine is predicted to
serve in time is refused at once, so the engines' queues stay short enough for
the interactive requests to meet theirs.

**Slack ordering** (flow control on, one band, ``concurrency-detector``
holding each engine at 4 requests or 4,000 prompt tokens in flight, a 3 s
queue-wait budget): 60% of the requests with a 500-token prompt, 40% with a
4,000-token one; both with a 2 s SLO, or 1.5 s for the short ones. Baseline:
``slo-deadline-ordering-policy`` as the router's (received + SLO); against
it, with ``predictedLatencyProducerName`` (received + SLO - the request's
own predicted TTFT).

The admitter's loads are requests per second per engine (past 1.5 the
engines' queues outgrow a 1 s SLO); the ordering's are multiples of what the
pool completes per second when offered ten a second per engine, nothing in
front (measured first in the same run)::

    nice -n 19 python -m bench.slo            # about a minute
    nice -n 19 python -m bench.slo --quick    # smoke size
"""

from __future__ import annotations

import argparse
import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from bench import routing
from bench.workloads import MODEL, Arrival, derived_seed
from lwepp.attributes import AttributeStore
from lwepp.config import load_text
from lwepp.contracts import Measurement
from lwepp.flowcontrol.controller import FlowController
from lwepp.flowcontrol.queues import Item, Outcome
from lwepp.objectives import OBJECTIVE_HEADERS, Objective, priority_of
from lwepp.picking import RequestInfo
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request
from simulator.profiles import PROFILES
from simulator.tokenizer import text_block, token_block
from wire.exchange import Refusal

PROFILE: Final = PROFILES["llama-3.1-8b-l4"]
OBJECTIVES: Final = MappingProxyType({"batch": Objective("batch", -1, "sim")})
HEADER: Final = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
ROUTING: Final = """\
plugins:
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- type: latency-scorer
"""
ADMITTER: Final = "- type: latency-slo-admitter\n"
FLOW: Final = """\
featureGates: [flowControl]
plugins:
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- type: latency-scorer
- type: concurrency-detector
  parameters: {concurrencyMode: hybrid, maxConcurrency: 4, maxTokenConcurrency: 4000}
- type: slo-deadline-ordering-policy
  parameters: {%s}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}]
flowControl:
  defaultRequestTTL: 3s
  saturationDetector: {pluginRef: concurrency-detector}
  defaultPriorityBand: {orderingPolicyRef: slo-deadline-ordering-policy}
"""
SLACK: Final = "predictedLatencyProducerName: predicted-latency-producer"


@dataclass(frozen=True, slots=True)
class Sizes:
    engines: int
    duration: float
    warmup: float
    max_tokens: int


FULL: Final = Sizes(engines=4, duration=120.0, warmup=30.0, max_tokens=64)
QUICK: Final = Sizes(engines=2, duration=30.0, warmup=8.0, max_tokens=16)


@dataclass(frozen=True, slots=True)
class Kind:
    """One class of request: its tenant, objective (None: priority 0), prompt and SLO."""

    tenant: str
    objective: str | None
    prompt_tokens: int
    slo_ms: float
    share: float


@dataclass(slots=True)
class Tally:
    offered: int = 0
    met: int = 0
    refused: int = 0
    completed: int = 0
    """Requests of the tenant (any arrival) completed within the measured window."""

    @property
    def attained(self) -> float:
        return self.met / self.offered if self.offered else 0.0


@dataclass(slots=True)
class Sent:
    arrival: Arrival
    kind: Kind
    measured: bool
    index: int = -1
    handle: Any = None


@dataclass(slots=True)
class Result:
    tallies: dict[str, Tally] = field(default_factory=dict)

    def share(self, tenant: str | None = None) -> float:
        chosen = [t for n, t in self.tallies.items() if tenant is None or n == tenant]
        offered = sum(t.offered for t in chosen)
        return sum(t.met for t in chosen) / offered if offered else 0.0


def arrivals(kinds: Sequence[Kind], rate: float, sizes: Sizes, seed: int) -> list[Sent]:
    """Poisson arrivals at ``rate`` per second, each of a kind drawn by its share."""
    rng = random.Random(derived_seed("slo", seed, round(rate, 6)))
    out, at, n = [], 0.0, 0
    while (at := at + rng.expovariate(rate)) < sizes.duration:
        kind = rng.choices(kinds, [k.share for k in kinds])[0]
        block = derived_seed("slo", seed, n)
        body = {
            "model": MODEL,
            "prompt": text_block(block, kind.prompt_tokens),
            "max_tokens": sizes.max_tokens,
            "stream": True,
        }
        tokens = tuple(token_block(block, kind.prompt_tokens))
        arrival = Arrival(at, f"r{n}", body, tokens, sizes.max_tokens, kind.tenant, kind.tenant)
        out.append(Sent(arrival, kind, at >= sizes.warmup))
        n += 1
    return out


class _Router(routing.PipelineRouter):
    """``PipelineRouter`` with the request's SLO and objective headers, as a client sends them."""

    def __init__(self, *args: Any, extra: Mapping[str, tuple[tuple[str, str], ...]]) -> None:
        super().__init__(*args)
        self.extra = extra

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        headers = (
            ("x-request-id", arrival.request_id),
            ("x-gateway-model-name", MODEL),
            *self.extra[arrival.request_id],
        )
        body = arrival.body_bytes() if self.pipeline.needs_body else None
        try:
            pick = self.pipeline.choose(RequestInfo(headers, body), self.endpoints)
        except Refusal:  # the admitter's answer (or no endpoint)
            return None, None
        return self.index[pick.endpoints[0].hostport], pick.followup


def headers_of(kind: Kind) -> tuple[tuple[str, str], ...]:
    objective = ((OBJECTIVE_HEADERS[0], kind.objective),) if kind.objective else ()
    return (("x-llm-d-slo-ttft-ms", str(int(kind.slo_ms))), *objective)


def simulate(text: str, sent: Sequence[Sent], sizes: Sizes, seed: int) -> Result:
    """One run of configuration ``text`` over ``sent`` on fresh engines."""
    loop = VirtualLoop()
    clock: Callable[[], float] = lambda: loop.now  # noqa: E731
    config = load_text(HEADER + text, "bench/slo.py")
    pipeline = config.pipeline(store=AttributeStore(), clock=clock, explain="off")
    pipeline.priority = lambda headers: priority_of(headers, OBJECTIVES)
    for plugin in pipeline.plugins:  # observed latencies, in-flight entries: in virtual time
        if hasattr(plugin, "clock"):
            plugin.clock = clock
    pool = routing.endpoints(sizes.engines)
    extra = {s.arrival.request_id: headers_of(s.kind) for s in sent}
    router = _Router(text, pipeline, pipeline.sources, pool, extra=extra)
    fleet = [Engine(PROFILE, seed=seed * 1000 + i) for i in range(sizes.engines)]
    result = Result({k.tenant: Tally() for k in {s.kind for s in sent}})
    flights: dict[str, Sent] = {}
    settings = config.flow.settings
    controller = (
        FlowController(settings, lambda: pipeline.candidates(router.endpoints).candidates, clock)
        if settings is not None
        else None
    )

    def scrape() -> None:
        for engine, endpoint in zip(fleet, router.endpoints, strict=True):
            usage = {"kv_cache_usage": Measurement(engine.kv_usage, loop.now)}
            pipeline.store.write(endpoint.hostport, usage)

    def route(s: Sent) -> None:
        arrival = s.arrival
        request = Request(arrival.request_id, arrival.prompt_tokens, arrival.max_tokens, loop.now)
        index, handle = router.choose(arrival, request)
        if index is None:
            if s.measured:
                result.tallies[s.kind.tenant].refused += 1
            return
        s.index, s.handle = index, handle
        flights[arrival.request_id] = s
        drivers[index].submit(request)

    def pump() -> None:
        if controller is not None:
            while controller.dispatch() is not None:
                pass

    def arrive(s: Sent) -> None:
        scrape()
        if s.measured:
            result.tallies[s.kind.tenant].offered += 1
        if controller is None:
            route(s)
            return

        def decided(item: Item) -> None:
            if item.outcome is Outcome.DISPATCHED:
                route(s)
            elif s.measured:
                result.tallies[s.kind.tenant].refused += 1

        body = s.arrival.body_bytes()
        controller.submit(
            Item(s.arrival.request_id, "default-flow", priority_of(headers_of(s.kind), OBJECTIVES),
                 size=len(body), received=loop.now, slo_ms=s.kind.slo_ms, on_done=decided)
        )  # fmt: skip
        pump()

    def on_event(event: Event) -> None:
        request = event.request
        s = flights[request.id]
        if event.kind == "token":
            if request.generated == 1:
                ttft = loop.now - s.arrival.at
                if s.measured and ttft <= s.kind.slo_ms / 1000:
                    result.tallies[s.kind.tenant].met += 1
                router.first_token(s.arrival, s.index, s.handle)
            return
        del flights[request.id]
        if event.kind == "done" and sizes.warmup <= loop.now <= sizes.duration:
            result.tallies[s.kind.tenant].completed += 1
        router.complete(s.arrival, s.index, s.handle, request)
        pump()

    drivers = [VirtualEngine(e, loop, on_event) for e in fleet]
    for s in sent:
        loop.at(s.arrival.at, functools.partial(arrive, s))
    loop.run()
    return result


def capacity(sizes: Sizes, kinds: Sequence[Kind], seed: int) -> float:
    """Requests the pool completes per second when offered ten a second per engine."""
    sent = arrivals(kinds, 10.0 * sizes.engines, sizes, seed)
    loose = [Sent(s.arrival, Kind(s.kind.tenant, None, s.kind.prompt_tokens, 1e9, 1), s.measured)
             for s in sent]  # fmt: skip
    result = simulate(ROUTING, loose, sizes, seed)
    return sum(t.completed for t in result.tallies.values()) / (sizes.duration - sizes.warmup)


ADMISSION_KINDS: Final = (
    Kind("interactive", None, 1000, 1000.0, 0.5),
    Kind("batch", "batch", 1000, 1000.0, 0.5),
)
ORDERING_MIXES: Final = {
    "one SLO (2 s)": (Kind("short", None, 500, 2000.0, 0.6), Kind("long", None, 4000, 2000.0, 0.4)),
    "1.5 s short, 2 s long": (
        Kind("short", None, 500, 1500.0, 0.6),
        Kind("long", None, 4000, 2000.0, 0.4),
    ),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes, seed = (QUICK if args.quick else FULL), args.seed
    print("admitter (no flow control): share of requests with TTFT within their SLO")
    for per_engine in (1.5, 2.0, 2.5):
        sent = arrivals(ADMISSION_KINDS, per_engine * sizes.engines, sizes, seed)
        base = simulate(ROUTING, sent, sizes, seed)
        gated = simulate(ROUTING + ADMITTER, sent, sizes, seed)
        refused = gated.tallies["batch"].refused / max(1, gated.tallies["batch"].offered)
        print(
            f"  {per_engine:.1f} requests/s per engine: interactive "
            f"{base.share('interactive'):.3f} -> "
            f"{gated.share('interactive'):.3f} ({_ratio(gated, base, 'interactive')}), "
            f"all {base.share():.3f} -> {gated.share():.3f} ({_ratio(gated, base)}); "
            f"batch refused {refused:.0%}"
        )
    print("slack ordering (flow control): share of requests with TTFT within their SLO")
    for mix, kinds in ORDERING_MIXES.items():
        cap = capacity(sizes, kinds, seed)
        print(f"  {mix}: capacity {cap:.2f} requests/s ({sizes.engines} engines)")
        for load in (1.0, 1.2):
            sent = arrivals(kinds, load * cap, sizes, seed)
            base = simulate(FLOW % "", sent, sizes, seed)
            slack = simulate(FLOW % SLACK, sent, sizes, seed)
            parts = ", ".join(
                f"{k.tenant} {base.share(k.tenant):.3f} -> {slack.share(k.tenant):.3f}"
                for k in kinds
            )
            print(
                f"    load {load:.1f}: all {base.share():.3f} -> {slack.share():.3f} "
                f"({_ratio(slack, base)}); {parts}"
            )


def _ratio(a: Result, b: Result, tenant: str | None = None) -> str:
    base = b.share(tenant)
    return f"{a.share(tenant) / base:.2f}x" if base else "n/a"


if __name__ == "__main__":
    main()
