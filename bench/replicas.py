"""``python -m bench.replicas``: several picker replicas behind one Envoy, in virtual time.

Envoy opens one ext_proc stream per HTTP request and its load balancer hands
each stream to one host of the ext_proc cluster (``ROUND_ROBIN``, Envoy's
default policy); the replica that got the stream picks the engine and hears
that request's response, and no other replica hears of it. ``Replicas`` is
that: N of ``bench.routing``'s pipeline routers, each built from the same
configuration file as one picker would be, the requests dealt to them in
turn, on the same simulated engines and the same virtual clock as the
single-replica runs (``bench.routing.simulate``).

What the replicas share is the question this benchmark answers, signal by
signal (``SHARES``):

=============  ==============================================================
own            each replica its own view: what the llm-d router does today
               active-active (its operations doc advises against it with
               approximate prefix routing)
prefix         the approximate prefix index and the no-hit LRU shared (both are
               learned from picks), the in-flight counts kept per replica
inflight       the in-flight requests and tokens shared, the prefix index kept
shared         all three shared, every write seen by the next pick
synced         the design as ``lwepp.sharing`` runs it (``docs/scale-out.md``):
               each replica keeps its own index, LRU and counts and, every
               ``SYNC_SECONDS``, applies what the others learned up to then
               and reads their counts (``Summed.peers``); between ticks each
               takes its own turns in the no-hit LRU (``NoHitLRUScorer.synced``)
synced+X       ``synced``, but X (``index``, ``lru`` or ``inflight``) shared
               instantly: what that signal's staleness costs
=============  ==============================================================

Shared state is modelled as one object the replicas all read and write, so
a write is visible to the next pick: the freshness of a store one loopback
or same-zone round trip away (well under a millisecond, against requests
arriving tens of milliseconds apart per replica at these rates). Signals the
engines publish (the precise prefix cache's KV events) are rebuilt by every
replica from the events, as each subscribes to every engine: never shared.

Reported, per workload: p90 TTFT and hit rate of 2 and 4 replicas as ratios
to one replica's in the same run (target: within 1.05x with the design).
One run's p90 moves by several percent for a change as small as the order
ties are broken in, so ``--seeds N --step-jitter 0.1`` runs every cell on N
seeds with each engine step's time jittered and judges the mean ratio.
``--trace FILE`` adds a trace as ``bench.replay`` reads it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from bench import replay, workloads
from bench.routing import (
    AZURE_FILE,
    CONFIG_FILES,
    DEFAULT_SCHEDULING,
    FULL,
    MOONCAKE_FILE,
    QUICK,
    TRACES,
    Outcome,
    PipelineRouter,
    Router,
    endpoints,
    profile_for,
    router,
    simulate,
    subscribe,
)
from bench.workloads import Arrival
from lwepp.attributes import AttributeStore
from lwepp.contracts import DataSource
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.prefix import PrecisePrefixCacheScorer
from lwepp.sharing import approximate_indexes
from serving.logs import configure_logging
from simulator.engine import Engine, Request, Scheduling
from simulator.profiles import Profile

SHARES: Final = (
    "own",
    "prefix",
    "inflight",
    "shared",
    "synced",
    "synced+index",
    "synced+lru",
    "synced+inflight",
)
"""What the replicas share (see the module docstring)."""

SYNC_SECONDS: Final = 0.01
"""``lwepp.sharing.SharedView``'s default interval, the ``synced`` share's staleness."""

T = TypeVar("T")

TARGET: Final = 1.05
"""Four replicas' p90 TTFT and hit rate within this factor of one replica's (issue #33)."""


class Replicas:
    """N pipeline routers behind one round-robin load balancer: a ``bench.routing.Router``."""

    def __init__(
        self,
        name: str,
        members: Sequence[PipelineRouter],
        share: str,
        clock: Callable[[], float] = lambda: 0.0,
        every: float = SYNC_SECONDS,
    ) -> None:
        self.name = name
        self.members = tuple(members)
        self.sources: Sequence[DataSource] = tuple(s for m in self.members for s in m.sources)
        self.fallbacks = 0
        """Requests any replica's failing plugin sent round-robin."""
        self.store: AttributeStore | None = None
        self._turn = itertools.cycle(range(len(self.members)))
        base, _, instant = share.partition("+")
        if share in ("prefix", "shared") or instant == "index":
            _share([approximate_indexes(m.pipeline.plugins) for m in self.members], "index")
        if share in ("prefix", "shared") or instant == "lru":
            _share([_plugins(m, NoHitLRUScorer) for m in self.members], "lru")
        if share in ("inflight", "shared") or instant == "inflight":
            inflight = [_plugins(m, InFlightLoadProducer) for m in self.members]
            _share(inflight, "_requests", "_tokens", "load")
        self.synced = _Synced(self.members, clock, every, instant) if base == "synced" else None

    def choose(self, arrival: Arrival, request: Request) -> tuple[int | None, Any]:
        member = self.members[next(self._turn)]
        if self.synced is not None:
            self.synced.tick()
        before = member.fallbacks
        index, handle = member.choose(arrival, request)
        self.fallbacks += member.fallbacks - before
        return index, (member, handle)

    def first_token(self, arrival: Arrival, index: int, handle: Any) -> None:
        member, inner = handle
        member.first_token(arrival, index, inner)

    def complete(self, arrival: Arrival, index: int, handle: Any, request: Request) -> None:
        member, inner = handle
        member.complete(arrival, index, inner, request)


class _Synced:
    """``lwepp.sharing``'s sync in virtual time: every ``SYNC_SECONDS``, each replica applies
    the entries the others learned before that tick and reads their in-flight counts.

    The sync runs at the first pick after a tick (the state a pick reads is the one the
    last tick left); counts are read as they are then, entries by when they were learned.
    """

    def __init__(
        self,
        members: Sequence[PipelineRouter],
        clock: Callable[[], float],
        every: float,
        instant: str = "",
    ) -> None:
        self.clock, self.next, self.every = clock, every, every
        self.log: list[tuple[float, int, str, str, list[int], int]] = []
        self.applied = [0] * len(members)
        # A signal shared instantly (``synced+<signal>``) is left out of the sync.
        none: list[list[Any]] = [[] for _ in members]
        self.indexes = (
            none
            if instant == "index"
            else [approximate_indexes(m.pipeline.plugins) for m in members]
        )
        self.lrus = none if instant == "lru" else [_plugins(m, NoHitLRUScorer) for m in members]
        self.producers = (
            none if instant == "inflight" else [_plugins(m, InFlightLoadProducer) for m in members]
        )
        for i, scorers in enumerate(self.indexes):
            for scorer in scorers:
                scorer.on_learn = functools.partial(self._learned, i)
        for i, lrus in enumerate(self.lrus):
            for lru in lrus:
                lru.on_cold = functools.partial(self._cold, i)

    def _learned(self, member: int, endpoint: str, hashes: list[int], capacity: int) -> None:
        self.log.append((self.clock(), member, "p", endpoint, hashes, capacity))

    def _cold(self, member: int, endpoint: str) -> None:
        self.log.append((self.clock(), member, "c", endpoint, [], 0))

    def tick(self) -> None:
        now = self.clock()
        if now < self.next:
            return
        tick = now - (now - self.next) % self.every
        self.next = tick + self.every
        for i in range(len(self.applied)):
            start = self.applied[i]
            end = start
            while end < len(self.log) and self.log[end][0] <= tick:
                _, origin, kind, endpoint, hashes, capacity = self.log[end]
                end += 1
                if origin == i:
                    continue
                if kind == "p":
                    for scorer in self.indexes[i]:
                        scorer.index.add(endpoint, hashes, capacity)
                else:
                    for lru in self.lrus[i]:
                        lru.touch(endpoint)
            self.applied[i] = end
            for lru in self.lrus[i]:
                lru.synced(i, len(self.applied))
        for i, producers in enumerate(self.producers):
            others = [p for j, ps in enumerate(self.producers) if j != i for p in ps]
            for producer in producers:
                producer.requests.peers = _summed(o.requests.own for o in others)
                producer.tokens.peers = _summed(o.tokens.own for o in others)


def _plugins(member: PipelineRouter, kind: type[T]) -> list[T]:
    return [p for p in member.pipeline.plugins if type(p) is kind]


def _summed(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for mapping in counts:
        for key, value in mapping.items():
            total[key] = total.get(key, 0) + value
    return total


def _share(plugins: Sequence[Sequence[object]], *fields: str) -> None:
    """Each member's plugins (one list a member, in the same order) read and write the first
    member's ``fields``."""
    for others in plugins[1:]:
        for first, other in zip(plugins[0], others, strict=True):
            for name in fields:
                setattr(other, name, getattr(first, name))


def _precise(member: PipelineRouter) -> list[PrecisePrefixCacheProducer]:
    """The member's precise prefix producers (each a subscriber to every engine)."""
    return [
        source if isinstance(source, PrecisePrefixCacheProducer) else source.producer_plugin
        for source in member.pipeline.sources
        if isinstance(source, PrecisePrefixCacheProducer | PrecisePrefixCacheScorer)
    ]


def builder(count: int, share: str, every: float = SYNC_SECONDS) -> Callable[..., Router]:
    """``bench.routing.router``'s replacement for ``count`` replicas sharing ``share``."""

    def build(
        strategy: str,
        engines: Sequence[Engine],
        profile: Profile,
        clock: Callable[[], float],
        *rest: Any,
    ) -> Router:
        members = []
        for _ in range(count):
            member = router(strategy, engines, profile, clock, *rest)
            assert isinstance(member, PipelineRouter)  # the pickers users run
            members.append(member)
        producers = [p for m in members for p in _precise(m)]
        if producers:  # one subscription per engine hands its events to every replica
            subscribe(producers[0], engines, endpoints(len(engines)), *producers[1:])
        return Replicas(f"{strategy} ×{count} {share}", members, share, clock, every)

    return build


@dataclass(frozen=True, slots=True)
class Row:
    """One workload, one strategy, one replica count and share: the outcome and its ratios."""

    workload: str
    strategy: str
    replicas: int
    share: str
    outcome: Outcome
    p90_ratio: float
    """p90 TTFT over one replica's (lower is better)."""
    hit_ratio: float
    """Hit rate over one replica's (higher is better)."""


def workload_set(quick: bool, seed: int) -> dict[str, Sequence[Arrival]]:
    """``bench.routing``'s routing workloads at their target sizes, and the two traces if found."""
    sizes = QUICK if quick else FULL
    found: dict[str, Sequence[Arrival]] = {
        "shared-prefix": workloads.shared_prefix(
            sizes.shared, sizes.target_rate, sizes.shared_count, seed
        ),
        "multi-turn": workloads.multi_turn(sizes.chat, seed),
    }
    mooncake, azure = TRACES / MOONCAKE_FILE, TRACES / AZURE_FILE
    if mooncake.exists():
        records = workloads.read_mooncake(mooncake, sizes.mooncake_start, sizes.mooncake_count)
        found["mooncake"] = workloads.mooncake(
            records, sizes.mooncake_block_tokens, sizes.mooncake_replay
        )
    if azure.exists():
        rows = workloads.read_azure(azure, sizes.azure_start, sizes.azure_count)
        found["azure-code"] = workloads.azure(rows, sizes.azure_replay, seed)
    return found


def measure(
    arrivals_by_workload: dict[str, Sequence[Arrival]],
    strategies: Sequence[str],
    counts: Sequence[int],
    shares: Sequence[str],
    profile: Profile,
    seed: int = 0,
    every: float = SYNC_SECONDS,
    scheduling: Scheduling = DEFAULT_SCHEDULING,
) -> list[Row]:
    """Every workload × strategy × count × share, ratios against one replica of the same run."""
    rows: list[Row] = []
    for workload, arrivals in arrivals_by_workload.items():
        for strategy in strategies:
            one = simulate(workload, arrivals, strategy, profile, seed=seed, scheduling=scheduling)
            rows.append(Row(workload, strategy, 1, "-", one, 1.0, 1.0))
            _print(rows[-1])
            for count in counts:
                for share in shares:
                    outcome = simulate(
                        workload,
                        arrivals,
                        strategy,
                        profile,
                        seed=seed,
                        scheduling=scheduling,
                        build=builder(count, share, every),
                    )
                    rows.append(
                        Row(
                            workload,
                            strategy,
                            count,
                            share,
                            outcome,
                            outcome.ttft_p90 / one.ttft_p90,
                            outcome.hit_rate / one.hit_rate if one.hit_rate else 1.0,
                        )
                    )
                    _print(rows[-1])
    return rows


def _print(row: Row) -> None:
    o = row.outcome
    print(
        f"{row.workload:14} {row.strategy:12} ×{row.replicas} {row.share:9} "
        f"p50 {o.ttft_p50 * 1e3:6.1f} p90 {o.ttft_p90 * 1e3:6.1f} p99 {o.ttft_p99 * 1e3:6.1f} ms "
        f"({row.p90_ratio:5.3f}×)  "
        f"hits {o.hit_rate:.3f} ({row.hit_ratio:5.3f}×)  failed {o.failed}",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print one line per run; exit 1 if a design row misses ``TARGET``."""
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the smoke sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", nargs="+", default=["recommended", "precise"])
    parser.add_argument("--replicas", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--shares", nargs="+", default=list(SHARES), choices=SHARES)
    parser.add_argument(
        "--sync-seconds", type=float, default=SYNC_SECONDS, help="the synced share's interval"
    )
    parser.add_argument("--workloads", nargs="+", help="only these workloads (default: all)")
    parser.add_argument(
        "--trace",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="also replay this trace as bench.replay does (its default slice and scale)",
    )
    parser.add_argument(
        "--step-jitter",
        type=float,
        default=0.0,
        help="each engine step's time × 1 ± this, seeded (0: exactly as modelled)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run every cell with seeds --seed … --seed + N - 1 and judge the mean ratio",
    )
    args = parser.parse_args(argv)
    for strategy in args.strategies:
        if strategy not in CONFIG_FILES:
            parser.error(f"--strategies: {strategy!r} is not a picker ({', '.join(CONFIG_FILES)})")
    profile = profile_for(QUICK if args.quick else FULL)
    found = workload_set(args.quick, args.seed)
    for path in args.trace:  # bench.replay's default slice and scale of the file
        found[path.name] = replay.arrivals(path, 0, 1000, args.seed)[0]
    chosen = {w: a for w, a in found.items() if not args.workloads or w in args.workloads}
    rows: list[Row] = []
    for seed in range(args.seed, args.seed + args.seeds):
        jitter = Scheduling(step_jitter=args.step_jitter)
        rows += measure(
            chosen,
            args.strategies,
            args.replicas,
            args.shares,
            profile,
            seed,
            args.sync_seconds,
            jitter,
        )
    means = summary(rows)
    if args.seeds > 1:
        print(f"mean ratios over {args.seeds} seeds (step jitter ±{args.step_jitter:g}):")
        for (workload, strategy, count, share), (p90, hits, worst) in means.items():
            print(
                f"{workload:14} {strategy:12} ×{count} {share:16} p90 {p90:5.3f}× "
                f"(worst {worst:5.3f}×)  hits {hits:5.3f}×"
            )
    missed = [
        key
        for key, (p90, hits, _) in means.items()
        if key[3] == "synced"
        and key[2] == max(args.replicas)
        and (p90 > TARGET or hits < 1 / TARGET)
    ]
    for workload, strategy, count, _ in missed:
        print(f"missed: {workload} {strategy} ×{count} synced", file=sys.stderr)
    return 1 if missed else 0


def summary(rows: Iterable[Row]) -> dict[tuple[str, str, int, str], tuple[float, float, float]]:
    """Per workload, strategy, count and share: the mean p90 and hit ratios over the seeds run,
    and the worst p90 ratio."""
    cells: dict[tuple[str, str, int, str], list[Row]] = {}
    for row in rows:
        if row.replicas > 1:
            cells.setdefault((row.workload, row.strategy, row.replicas, row.share), []).append(row)
    return {
        key: (
            statistics.fmean(r.p90_ratio for r in found),
            statistics.fmean(r.hit_ratio for r in found),
            max(r.p90_ratio for r in found),
        )
        for key, found in cells.items()
    }


if __name__ == "__main__":
    configure_logging("warning", "console")  # the pickers' problems on stderr; no chatter
    sys.exit(main())
