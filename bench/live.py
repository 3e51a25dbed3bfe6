"""``python -m bench live``: the demo gateway beside peer routers, over HTTP.

Every arm serves the same seeded workload, streamed, open loop, to a fresh
set of model servers (cold caches), through one router. The workloads
(``bench.workloads``):

shared prefix
    ``groups`` system prompts shared by ``users`` users each, a fresh
    question per request, Poisson arrivals, as ``/v1/completions``;
multi-turn chat (simulator only)
    sessions that start at Poisson times and send ``turns`` turns each as
    ``/v1/chat/completions``, every turn resending the conversation so far,
    sent an exponential think time after the turn before (open loop: it does
    not wait for the answer); one system prompt for all sessions.
    A router that follows the longest cached prefix alone sends every new
    session where the system prompt already is, and keeps the session there:
    the load decides the tail.

The servers are one of two engines (``--engine``):

``simulator`` (the default)
    ``python -m simulator``, 8 replicas in one process, the
    ``llama-3.1-8b-l4`` profile, in scaled real time (see below).
``llamacpp``
    real engines: ``python -m demo.llamacpp``, 2 processes of llama.cpp's own
    server with Gemma 3 270M, one CPU thread and one slot each, and a
    host-memory prompt cache of 12 MiB, room for one more prompt: each engine
    keeps 2 prompts, in real time. The workload has more system prompts (4)
    than engines, and more than one engine keeps: placement decides what is
    cached.

The routers:

- Switchyard's demo gateway (``demo.topology`` with ``simulator=False``: a
  real Envoy, BBR, one LWEPP, in front of the servers the arm started) with
  plain round-robin, with its prefix-aware configuration for the engine
  (``demo/configs/prefix-aware.yaml``: prefix-cache affinity 3, queue 2,
  KV-cache use 2; ``demo/configs/llamacpp.yaml``: the same without the
  KV-cache scorer, which llama.cpp cannot feed), and with the recommended
  configuration (``demo/configs/recommended.yaml``: prefix affinity held in
  check by the requests and prompt tokens the picker itself has in flight
  on each replica);
- ``vllm-router`` and ``sglang-router`` (``bench.peers``), each with
  ``round_robin`` and ``cache_aware`` (only ``cache_aware`` on llama.cpp,
  whose run is long).

The client is aiohttp in this process. Per request it measures the time to
the first ``data:`` chunk that carries a token (TTFT, from the moment the
request is sent), the gaps between token chunks (ITL) and the whole stream;
a request is an error unless it answers 200 with exactly ``max_tokens``
tokens (the count the server reports in ``usage``, else the chunks that carry
text) and ``data: [DONE]``. The replicas' own counters, read from every
replica's ``/metrics`` when the measured window opens and after the last
answer, give each arm's hit rate: prompt tokens served from the cache over
prompt tokens asked for (the simulator's ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``; llama.cpp's
``llamacpp:prompt_tokens_cached_total`` / that plus
``llamacpp:prompt_tokens_total``). The ``x-sim-pod`` header of each answer
shows how the router spread the load (llama.cpp names no replica; Switchyard's
own report, ``x-conformance-test-served-endpoint``, stands in for its arms).

The first ``warmup`` share of the arrivals warms the caches: those requests
are sent, and must succeed, but their latencies are left out, so the
percentiles describe the steady state rather than the first sight of each
system prompt (the same for every arm: one arrival schedule, cold start).

Why the numbers mean something on a 2-core machine: the simulator runs its
modelled times slowed down by ``time_scale`` (every modelled second lasts
``time_scale`` wall seconds), so an engine step (67 ms on the L4 profile)
lasts 120 ms of wall time while the Python and Envoy hops add about 10 ms per
request. Arrival rates are given in modelled time and divided by the time
scale. llama.cpp's engines run in real time: one CPU thread prefills a
300-token prompt in seconds, against the same 10 ms of hops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
import orjson

from bench import peers, report
from bench.report import Options, Plot, Section, Series, Table, Target, percentile, progress
from bench.workloads import Arrival, MultiTurn, SharedPrefix, multi_turn, shared_prefix
from demo import llamacpp
from demo.topology import HOST, Process, Topology, free_ports, listening_line, wait_for
from lwepp.plugins.prometheus import parse
from pods.file import dump_pods
from pods.model import Pod
from simulator.profiles import PROFILES

CONFIGS: Final = Path(__file__).resolve().parent.parent / "demo/configs"
PREFIX_AWARE: Final = CONFIGS / "prefix-aware.yaml"
"""The demo's prefix-aware picker configuration, benchmarked as shipped."""
RECOMMENDED: Final = CONFIGS / "recommended.yaml"
"""The recommended picker configuration (prefix affinity and in-flight load), as shipped."""
PREDICTED_LATENCY: Final = Path(__file__).resolve().parent / "configs/predicted-latency.yaml"
"""The routing benchmark's predicted-latency configuration (``lwepp.plugins.predicted_latency``:
each replica's time to first token predicted from the request path)."""

ROUND_ROBIN: Final = "round-robin"
PREFIX_AWARE_POLICY: Final = "prefix-aware"
RECOMMENDED_POLICY: Final = "recommended"
PREDICTED_LATENCY_POLICY: Final = "predicted-latency"
"""Switchyard's arms: no configuration (round-robin), the engine's prefix-aware one, the
recommended one, predicted latency (simulated engines: shared prefix at 20/s, multi-turn)."""

QUERIES: Final = "vllm:prefix_cache_queries_total"
HITS: Final = "vllm:prefix_cache_hits_total"
"""vLLM's prefix-cache counters, in prompt tokens (the simulator exports vLLM's names)."""

PROFILE: Final = "llama-3.1-8b-l4"
"""The simulator's profile: Llama-3.1-8B on one L4 (``simulator/profiles.py`` gives the
sources). Its KV cache holds 32k tokens, fewer than the workload's system prompts
together (32 x 2,048), so a replica that sees every prompt must keep evicting; and its
67 ms engine step dwarfs the hops' Python overhead."""


SHARED_PREFIX: Final = "shared-prefix"
MULTI_TURN: Final = "multi-turn"


@dataclass(frozen=True, slots=True)
class Size:
    """How big a run is: the workload, its rate and length, the replicas and the time scale.

    For a shared-prefix ``shape``, ``rate`` is requests per *modelled* second
    (the wall-clock rate is ``rate / time_scale``) and ``count`` the number of
    requests; a multi-turn shape carries its own session rate, and ``count``
    is its sessions times its turns. ``warmup`` is the share of arrivals left
    out of the latency statistics.
    """

    shape: SharedPrefix | MultiTurn
    rate: float
    count: int
    replicas: int
    time_scale: float
    warmup: float
    name: str = SHARED_PREFIX
    """The key of this size's results (work folders, plots, targets)."""
    policies: tuple[str, ...] = ()
    """Switchyard's arms on this workload; empty: the backend's ``policies``."""
    peer_policies: tuple[str, ...] = ()
    """The peers' arms on this workload; empty: the backend's ``peer_policies``."""

    @property
    def wall_rate(self) -> float:
        return self.rate / self.time_scale

    @property
    def warmup_count(self) -> int:
        return int(self.count * self.warmup)

    @property
    def workload(self) -> str:
        """``shared-prefix`` or ``multi-turn``: the key of this size's results."""
        return MULTI_TURN if isinstance(self.shape, MultiTurn) else SHARED_PREFIX

    def arrivals(self, seed: int) -> list[Arrival]:
        """The workload's requests for ``seed``, in arrival order."""
        if isinstance(self.shape, MultiTurn):
            arrivals = multi_turn(self.shape, seed)
        else:
            arrivals = shared_prefix(self.shape, self.rate, self.count, seed)
        if len(arrivals) != self.count:
            raise ValueError(f"{self.name}: {len(arrivals)} arrivals, size says {self.count}")
        return arrivals


FULL: Final = Size(
    SharedPrefix(groups=32, prefix_tokens=2048, users=16, question_tokens=64, max_tokens=16),
    rate=20.0,
    count=320,
    replicas=8,
    time_scale=2.0,
    warmup=0.3,
)
"""At 20 requests per modelled second, a replica under round-robin gets 2.5 a second, most
of them misses of ~0.7 s of prefill (2 chunked-prefill steps of 2,048 tokens at 270 us
per token, plus the step overhead): more prefill than it can do. Kept on its groups'
replicas, the same request mostly hits and costs one step. The first 30% of the arrivals
(96 requests, about 5 modelled seconds) let nearly every group's prompt reach a cache: with
fewer, the p90 of the prefix-aware arms sits on the knee where the first sight of a
group's prompt (a miss) begins, and swings from run to run with a handful of requests."""
HEAVY: Final = Size(
    FULL.shape,
    rate=30.0,
    count=FULL.count,
    replicas=FULL.replicas,
    time_scale=FULL.time_scale,
    warmup=FULL.warmup,
    name="shared-prefix-heavy",
    policies=(PREFIX_AWARE_POLICY, RECOMMENDED_POLICY),
    peer_policies=("cache_aware",),
)
"""The same workload half as fast again. At 20 a modelled second every prefix-aware router
reaches the engines' own floor (a hit's prefill and the step it waits for), whichever
replica it keeps each group on; at 30, where the groups land decides the tail: the replica
with the most groups runs near its limit. Round-robin does not run here (at 20 it already
queues for seconds)."""
QUICK: Final = Size(
    SharedPrefix(groups=4, prefix_tokens=128, users=2, question_tokens=16, max_tokens=4),
    rate=20.0,
    count=24,
    replicas=8,
    time_scale=1.0,
    warmup=0.0,
)

CHAT_FULL: Final = Size(
    MultiTurn(
        sessions=48,
        turns=6,
        session_rate=2.0,
        system_tokens=256,
        user_tokens=96,
        max_tokens=32,
        think_seconds=4.0,
    ),
    rate=2.0 * 6,
    count=48 * 6,
    replicas=8,
    time_scale=2.0,
    warmup=0.1,
    name=MULTI_TURN,
    policies=(ROUND_ROBIN, RECOMMENDED_POLICY, PREDICTED_LATENCY_POLICY),
    peer_policies=("cache_aware",),
)
"""48 sessions started at 2 a modelled second, six turns each, 4 s of thinking between turns:
about 10 requests a modelled second while most sessions are open, each turn a prompt of
400 to 1,100 tokens (the conversation so far) and 32 tokens of answer. Spread over 8
replicas that is light work, a handful of requests each; piled onto the replica that
holds the shared system prompt it is a queue. ``rate`` here is the nominal request rate
(sessions a second times turns), for the notes only."""
CHAT_QUICK: Final = Size(
    MultiTurn(
        sessions=4, turns=2, session_rate=8.0, system_tokens=64, user_tokens=16, max_tokens=4
    ),
    rate=8.0 * 2,
    count=4 * 2,
    replicas=8,
    time_scale=1.0,
    warmup=0.0,
    name=MULTI_TURN,
)

LLAMACPP_SLOTS: Final = 1
"""Slots per llama.cpp engine: requests it computes at once."""
LLAMACPP_PROMPT_CACHE_MIB: Final = 12
"""llama.cpp's host-memory prompt cache per engine (``--cache-ram``): one saved prompt.

A slot moving on to another prompt saves its own there, and a request whose prompt is
saved is restored from it. One ~300-token prompt of Gemma 3 270M takes between 6 and 12
MiB (measured: a 6 MiB cache kept none, 12 MiB kept exactly one), so an engine keeps two
prompts: its slot's and one saved. Without the cache, two requests of one group that
overlap would take both slots of a two-slot engine and evict its other group's prompt."""
LLAMACPP_FULL: Final = Size(
    SharedPrefix(
        groups=4,
        prefix_tokens=32,
        users=4,
        question_tokens=2,
        max_tokens=4,
        model=llamacpp.MODEL_ALIAS,
    ),
    rate=1.0,
    count=200,
    replicas=2,
    time_scale=1.0,
    warmup=0.2,
)
"""Sizes are in the workload's words, which Gemma's tokenizer cuts into about 9 tokens each:
a system prompt of ~290 tokens, a question of ~18. Four groups on two engines that keep two
prompts each: kept on their engines, every group's prompt stays cached; spread round-robin,
each engine sees all four and keeps the last two it served. On one CPU thread (some 80 to
250 prompt tokens a second) a miss costs seconds of prefill and a hit a few hundred ms, so at
one request a second round-robin falls behind and prefix placement keeps up."""
LLAMACPP_QUICK: Final = Size(
    SharedPrefix(
        groups=3,
        prefix_tokens=4,
        users=1,
        question_tokens=1,
        max_tokens=2,
        model=llamacpp.MODEL_ALIAS,
    ),
    rate=4.0,
    count=6,
    replicas=2,
    time_scale=1.0,
    warmup=0.0,
)


@dataclass(frozen=True, slots=True)
class Backend:
    """What serves the model in a run, and what the run reads of it.

    ``prefix_config``: Switchyard's prefix-aware picker configuration for these
    servers. ``queries``/``hits``: the servers' counters whose sums are the
    prompt tokens asked for / served from the cache. ``prefill``: the counters
    of prompt tokens computed and of the seconds spent on them, whose ratio is
    the prefill rate the engines reached (a shared machine's CPU varies from arm
    to arm; empty when the time is modelled). ``extra_body``: fields every
    request carries. ``policies``: Switchyard's configurations run (see
    ``switchyard``). ``peer_policies``: the peers' policies run on the shared-prefix
    workload (on multi-turn chat only their ``cache_aware`` runs: round-robin is
    round-robin, whoever routes it).
    """

    name: str
    full: tuple[Size, ...]
    quick: tuple[Size, ...]
    policies: tuple[str, ...]
    prefix_config: Path
    queries: tuple[str, ...]
    hits: tuple[str, ...]
    extra_body: Mapping[str, object]
    peer_policies: tuple[str, ...]
    prefill: tuple[str, ...] = ()

    @property
    def counted(self) -> tuple[tuple[str, ...], ...]:
        """The counter groups read from every replica: queries, hits, then prefill's two."""
        return (self.queries, self.hits, *((name,) for name in self.prefill))

    def sizes(self, quick: bool) -> tuple[Size, ...]:
        """The workloads to run, one size each."""
        return self.quick if quick else self.full


SIMULATOR: Final = Backend(
    "simulator",
    (FULL, HEAVY, CHAT_FULL),
    (QUICK, CHAT_QUICK),
    (ROUND_ROBIN, PREFIX_AWARE_POLICY, RECOMMENDED_POLICY, PREDICTED_LATENCY_POLICY),
    PREFIX_AWARE,
    (QUERIES,),
    (HITS,),
    {},
    peers.POLICIES,
)
LLAMACPP: Final = Backend(
    "llamacpp",
    (LLAMACPP_FULL,),
    (LLAMACPP_QUICK,),
    (ROUND_ROBIN, PREFIX_AWARE_POLICY),
    CONFIGS / "llamacpp.yaml",
    ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
    ("llamacpp:prompt_tokens_cached_total",),
    # Exactly max_tokens tokens from a real model: it would otherwise stop at its end token.
    {"ignore_eos": True},
    ("cache_aware",),
    ("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"),
)
BACKENDS: Final = {backend.name: backend for backend in (SIMULATOR, LLAMACPP)}


@dataclass(frozen=True, slots=True)
class Arm:
    """One router under test: who (``switchyard`` or a peer's name) and which policy."""

    router: str
    policy: str

    @property
    def label(self) -> str:
        return f"{self.router} {self.policy}"


LAG_LIMIT: Final = 0.02
"""A client lagging its schedule by more than this (p99, seconds) was starved of CPU."""

SWITCHYARD: Final = "switchyard"


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request (times in wall seconds)."""

    request_id: str
    group: str
    measured: bool
    """False for a warm-up request: checked for errors, left out of the latencies."""
    sent: float = 0.0
    """When it was sent, seconds after the first request."""
    late: float = 0.0
    """How long after its scheduled time it was sent (the client's own lag)."""
    ttft: float | None = None
    latency: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    replica: str | None = None
    error: str | None = None


@dataclass(slots=True)
class ArmResult:
    """One arm's outcomes, the replicas' counters over the measured window, and notes."""

    arm: Arm
    outcomes: list[Outcome]
    queries: float | None
    hits: float | None
    notes: list[str] = field(default_factory=list)
    prefill_rate: float | None = None
    """Prompt tokens the engines computed per second of prefill, over the window."""

    def measured(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.measured and o.error is None]

    @property
    def errors(self) -> int:
        return sum(1 for o in self.outcomes if o.error is not None)

    @property
    def hit_rate(self) -> float | None:
        if self.queries is None or self.hits is None or self.queries <= 0:
            return None
        return self.hits / self.queries

    def ttfts(self) -> list[float]:
        return [o.ttft for o in self.measured() if o.ttft is not None]

    def gaps(self) -> list[float]:
        return [g for o in self.measured() for g in o.gaps]

    def latencies(self) -> list[float]:
        return [o.latency for o in self.measured() if o.latency is not None]

    def lag(self) -> float:
        """The p99 of how late the client sent requests: high when the CPU was busy elsewhere."""
        return percentile([o.late for o in self.outcomes], 99)

    def token_rate(self) -> float:
        """Output tokens per wall second over the measured window (first send to last answer)."""
        done = [o for o in self.measured() if o.latency is not None]
        if not done:
            return math.nan
        span = max(o.sent + (o.latency or 0.0) for o in done) - min(o.sent for o in done)
        return sum(o.tokens for o in done) / span if span > 0 else math.nan

    def affinity(self) -> float | None:
        """The share of requests served by their group's most used replica (1.0 = sticky)."""
        groups: dict[str, dict[str, int]] = {}
        for outcome in self.measured():
            if outcome.replica is not None:
                replicas = groups.setdefault(outcome.group, {})
                replicas[outcome.replica] = replicas.get(outcome.replica, 0) + 1
        total = sum(sum(replicas.values()) for replicas in groups.values())
        if not total:
            return None
        return sum(max(replicas.values()) for replicas in groups.values()) / total

    def spread(self, replicas: int) -> float | None:
        """Requests on the busiest replica over the mean per replica (1.0 = even; ``replicas``
        at most: a router that leaves some idle gets their share counted as 0)."""
        counts: dict[str, int] = {}
        for outcome in self.measured():
            if outcome.replica is not None:
                counts[outcome.replica] = counts.get(outcome.replica, 0) + 1
        if not counts:
            return None
        return max(counts.values()) / (sum(counts.values()) / max(replicas, len(counts)))


# --- the client ----------------------------------------------------------------------


def _text(choice: Mapping[str, object]) -> object:
    """The text a streamed choice carries: ``text`` (completions) or ``delta.content`` (chat)."""
    delta = choice.get("delta")
    return choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)


async def send_streamed(
    session: aiohttp.ClientSession, url: str, arrival: Arrival, body: bytes, outcome: Outcome
) -> Outcome:
    """POST one streamed request and time its SSE chunks into ``outcome``."""
    sent = time.perf_counter()
    last = sent
    done = False
    reported: int | None = None
    try:
        async with session.post(
            url + arrival.path, data=body, headers={"content-type": "application/json"}
        ) as response:
            outcome.replica = response.headers.get("x-sim-pod") or response.headers.get(
                "x-conformance-test-served-endpoint"
            )
            if response.status != 200:
                text = (await response.read())[:200].decode(errors="replace")
                outcome.error = f"HTTP {response.status}: {text}"
                return outcome
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(payload)
                if isinstance(usage := chunk.get("usage"), dict):
                    reported = usage.get("completion_tokens")
                # A token is a chunk with text (a completion's ``text``, a chat answer's
                # ``delta.content``): llama.cpp's last chunk only says why it stopped, and
                # the usage chunk carries no choice at all.
                if not any(_text(choice) for choice in chunk.get("choices") or ()):
                    continue
                now = time.perf_counter()
                if outcome.ttft is None:
                    outcome.ttft = now - sent
                else:
                    outcome.gaps.append(now - last)
                last = now
                outcome.tokens += 1
        outcome.latency = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    if reported is not None:
        outcome.tokens = reported  # a token split across chunks (or none) is still one
    if not done:
        outcome.error = "the stream ended without data: [DONE]"
    elif outcome.tokens != arrival.max_tokens:
        outcome.error = f"{outcome.tokens} tokens, asked for {arrival.max_tokens}"
    return outcome


async def _counters(
    session: aiohttp.ClientSession, endpoint: str, backend: Backend
) -> tuple[float, ...] | None:
    names = [name for group in backend.counted for name in group]
    async with session.get(f"http://{endpoint}/metrics") as response:
        families = parse(await response.text(), names)
    if any(name not in families for name in names):
        return None
    return tuple(sum(v for name in group for _, v in families[name]) for group in backend.counted)


async def counters(
    session: aiohttp.ClientSession, endpoints: Sequence[str], backend: Backend = SIMULATOR
) -> tuple[float, ...] | None:
    """``backend.counted``'s sums over ``endpoints`` (prompt tokens asked for, served from
    the cache, then the prefill counters); None if any replica lacks one."""
    found = await asyncio.gather(*(_counters(session, e, backend) for e in endpoints))
    if any(f is None for f in found):
        return None
    return tuple(sum(column) for column in zip(*(f for f in found if f), strict=True))


async def drive(
    url: str,
    endpoints: Sequence[str],
    arrivals: Sequence[Arrival],
    size: Size,
    backend: Backend = SIMULATOR,
) -> tuple[list[Outcome], tuple[float, ...] | None]:
    """Send every arrival at its scheduled time (``at * time_scale`` after the start), open loop;
    the outcomes, and the replicas' prefix-cache counters over the measured window.

    Open loop: a request is sent on schedule whatever the earlier answers do,
    so a router that falls behind shows it as latency rather than by slowing
    the client down. Bodies are encoded before the clock starts; the counters
    are read (in a task of their own, so no send waits) when the first
    measured request goes out, and again after the last answer.
    """
    bodies = [orjson.dumps({**a.body, **backend.extra_body, "stream": True}) for a in arrivals]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        count = functools.partial(counters, session, endpoints, backend)
        before = asyncio.create_task(count()) if not size.warmup else None
        start = time.perf_counter()
        for n, (arrival, body) in enumerate(zip(arrivals, bodies, strict=True)):
            due = start + arrival.at * size.time_scale
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            if n == size.warmup_count and before is None:
                before = asyncio.create_task(count())
            now = time.perf_counter()
            outcome = Outcome(
                arrival.request_id,
                # Placement is judged per system prompt, or per conversation in a chat.
                arrival.session if size.workload == MULTI_TURN else arrival.group,
                measured=n >= size.warmup_count,
                sent=now - start,
                late=max(0.0, now - due),
            )
            tasks.append(asyncio.create_task(send_streamed(session, url, arrival, body, outcome)))
        outcomes = list(await asyncio.gather(*tasks))
        after = await count()
        first = await before if before is not None else None
    if first is None or after is None:
        return outcomes, None
    return outcomes, tuple(a - b for a, b in zip(after, first, strict=True))


async def renders(endpoint: str, model: str) -> bool:
    """Whether ``endpoint`` answers vLLM's ``POST /v1/completions/render`` with token ids.

    vllm-router's ``cache_aware`` asks a worker to render (tokenize) each
    prompt there and matches token ids; when the answer is not a list of
    objects with ``token_ids`` it routes without the prefix tree.
    """
    body = {"model": model, "prompt": "render probe"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{endpoint}/v1/completions/render", json=body) as response,
    ):
        if response.status != 200:
            return False
        try:
            answer = await response.json(content_type=None)
        except ValueError:
            return False
    return (
        isinstance(answer, list)
        and bool(answer)
        and isinstance(answer[0], dict)
        and isinstance(answer[0].get("token_ids"), list)
    )


# --- the servers -----------------------------------------------------------------------


def write_pods(path: Path, size: Size, model: str) -> list[str]:
    """A pod file of ``size.replicas`` single-port pods on free ports; their ``ip:port``."""
    ports = free_ports(size.replicas)
    labels = {"pool": "live", "model": model}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        dump_pods(Pod(f"sim-{n}", HOST, (port,), labels) for n, port in enumerate(ports))
    )
    return [f"{HOST}:{port}" for port in ports]


def simulator_args(size: Size) -> list[str]:
    """The simulator's flags: the profile, and the time scale."""
    return ["--profile", PROFILE, "--time-scale", f"{size.time_scale:g}"]


@contextlib.contextmanager
def simulators(work_dir: Path, pods: Path, args: Sequence[str]) -> Iterator[Process]:
    """``python -m simulator`` on ``pods`` until the block ends."""
    work_dir.mkdir(parents=True, exist_ok=True)
    service = Process(
        "simulator",
        [sys.executable, "-m", "simulator", "--pods", str(pods), *args],
        work_dir / "simulator.log",
    )
    try:
        wait_for(service, "listening", lambda: listening_line(service), 60)
        yield service
    finally:
        service.stop()


@contextlib.contextmanager
def llamacpp_engines(work_dir: Path, count: int) -> Iterator[list[int]]:
    """``count`` llama.cpp engines (``python -m demo.llamacpp``: one thread, ``LLAMACPP_SLOTS``
    slots, a ``LLAMACPP_PROMPT_CACHE_MIB`` prompt cache) until the block ends; their ports."""
    work_dir.mkdir(parents=True, exist_ok=True)
    model = llamacpp.packaged_model()  # assembled once, before the engines could race to
    argv = [
        *(sys.executable, "-m", "demo.llamacpp", "--model-file", str(model)),
        *("--threads", "1", "--parallel", str(LLAMACPP_SLOTS)),
        *("--ctx-size", str(1024 * LLAMACPP_SLOTS)),
        *("--prompt-cache-mib", str(LLAMACPP_PROMPT_CACHE_MIB)),
    ]
    engines = [Process(f"llamacpp-{n}", argv, work_dir / f"llamacpp-{n}.log") for n in range(count)]
    try:
        ports = []
        for engine in engines:
            line = wait_for(engine, "listening", functools.partial(listening_line, engine), 120)
            ports.append(int(line["port"]))
        yield ports
    finally:
        for engine in engines:
            engine.stop()


@contextlib.contextmanager
def replicas(
    backend: Backend, work_dir: Path, size: Size, model: str
) -> Iterator[tuple[Path, list[str]]]:
    """Fresh model servers (cold caches) until the block ends: their pod file and ``ip:port``s."""
    pods = work_dir / "pods.yaml"
    if backend is SIMULATOR:
        endpoints = write_pods(pods, size, model)
        with simulators(work_dir, pods, simulator_args(size)):
            yield pods, endpoints
        return
    with llamacpp_engines(work_dir, size.replicas) as ports:
        labels = {"pool": "live", "model": model}
        pods.write_text(
            dump_pods(Pod(f"llamacpp-{n}", HOST, (port,), labels) for n, port in enumerate(ports))
        )
        yield pods, [f"{HOST}:{port}" for port in ports]


@contextlib.contextmanager
def switchyard(
    work_dir: Path, pods: Path, policy: str, backend: Backend, notes: list[str]
) -> Iterator[str]:
    """The demo gateway in front of ``pods`` with ``policy`` (round-robin, the backend's
    prefix-aware config, or the recommended one); its URL. A replica its readiness probe
    drops is noted."""

    def changed(pod: Pod, why: str | None) -> None:
        notes.append(f"switchyard {policy}: replica {pod.name} " + (why or "answers again"))

    config = {
        PREFIX_AWARE_POLICY: backend.prefix_config,
        RECOMMENDED_POLICY: RECOMMENDED,
        PREDICTED_LATENCY_POLICY: PREDICTED_LATENCY,
    }.get(policy)
    with Topology(
        work_dir / "gateway",
        pods,
        picker_config=config,
        startup_timeout=60,
        simulator=False,
        on_server_change=changed,
    ) as topology:
        yield topology.url


@contextlib.contextmanager
def peer_router(work_dir: Path, endpoints: Sequence[str], arm: Arm) -> Iterator[str]:
    """``arm``'s peer router in front of ``endpoints``; the router's URL."""
    peer = next(p for p in peers.PEERS if p.name == arm.router)
    router = peers.start(peer, arm.policy, [f"http://{e}" for e in endpoints], work_dir, timeout=60)
    try:
        yield router.url
    finally:
        router.stop()


def run_arm(
    arm: Arm,
    size: Size,
    arrivals: Sequence[Arrival],
    work_dir: Path,
    backend: Backend = SIMULATOR,
) -> ArmResult:
    """Fresh replicas, ``arm``'s router in front, the workload through it; then stop all."""
    model = str(arrivals[0].body["model"])
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        pods, endpoints = stack.enter_context(replicas(backend, work_dir, size, model))
        if arm.router == SWITCHYARD:
            routed = switchyard(work_dir, pods, arm.policy, backend, notes)
        else:
            routed = peer_router(work_dir, endpoints, arm)
        url = stack.enter_context(routed)
        needs_render = arm == Arm(peers.VLLM_ROUTER.name, "cache_aware")
        if needs_render and not asyncio.run(renders(endpoints[0], model)):
            notes.append(
                f"{arm.label}: {'llama.cpp' if backend is LLAMACPP else 'the simulator'} does "
                "not answer POST /v1/completions/render "
                'with [{"token_ids": [...]}], which this router\'s cache_aware uses to '
                "tokenize prompts; without it the router picks by load alone."
            )
        progress(f"live: {arm.label}: {len(arrivals)} requests through {url}")
        outcomes, delta = asyncio.run(drive(url, endpoints, arrivals, size, backend))
    if delta is None:
        return ArmResult(arm, outcomes, None, None, notes)
    rate = delta[2] / delta[3] if len(delta) == 4 and delta[3] > 0 else None
    return ArmResult(arm, outcomes, delta[0], delta[1], notes, rate)


# --- the report ----------------------------------------------------------------------


def arms(
    quick: bool, backend: Backend = SIMULATOR, size: Size = FULL
) -> tuple[list[Arm], list[str]]:
    """The arms to run on ``size``'s workload, and a note for each peer that cannot run here
    (and why).

    Quick: Switchyard's recommended configuration and the first installed peer's
    cache_aware. Otherwise the size's own policies, else the backend's.
    """
    policies = (RECOMMENDED_POLICY,) if quick else size.policies or backend.policies
    chosen = [Arm(SWITCHYARD, p) for p in policies]
    notes = []
    runnable = []
    for peer in peers.PEERS:
        if (reason := peer.unavailable()) is not None:
            notes.append(f"{peer.name} skipped: {reason}.")
        else:
            runnable.append(peer)
    if quick and len(runnable) > 1:
        notes.append(f"Quick size: only {runnable[0].name} of the installed peers runs.")
        runnable = runnable[:1]
    peer_policies = ("cache_aware",) if quick else size.peer_policies or backend.peer_policies
    for peer in runnable:
        chosen += [Arm(peer.name, policy) for policy in peer_policies]
    return chosen, notes


def _ms(seconds: float) -> float:
    return seconds * 1000


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _row(result: ArmResult, size: Size, real: bool = False) -> list[object]:
    time_scale, replicas = size.time_scale, size.replicas
    ttft, gaps = result.ttfts(), result.gaps()
    spread = result.spread(replicas)
    rate = [math.nan if result.prefill_rate is None else result.prefill_rate] if real else []
    return [
        result.arm.label,
        _ms(percentile(ttft, 50)),
        _ms(percentile(ttft, 90)),
        _ms(percentile(ttft, 99)),
        _ms(percentile(gaps, 50)),
        _ms(percentile(result.latencies(), 90)),
        result.token_rate() * time_scale,
        _share(result.hit_rate),
        _share(result.affinity()),
        math.nan if spread is None else spread,
        f"{sum(1 for o in result.outcomes if o.error is None)}/{len(result.outcomes)}",
        result.errors,
        _ms(result.lag()),
        *rate,
    ]


def _quantiles(values: Sequence[float], points: int = 51) -> tuple[list[float], list[float]]:
    """The share of requests (0 to 1) against the TTFT (ms) that share stays under."""
    if not values:
        return [], []
    shares = [i / (points - 1) for i in range(points)]
    return shares, [_ms(percentile(values, 100 * s)) for s in shares]


def _p90(result: ArmResult) -> float:
    return _ms(percentile(result.ttfts(), 90))


def _p50(result: ArmResult) -> float:
    return _ms(percentile(result.ttfts(), 50))


def _hit_rate(result: ArmResult) -> float:
    return math.nan if result.hit_rate is None else 100 * result.hit_rate


def llamacpp_targets(by_label: Mapping[str, ArmResult]) -> list[Target]:
    """On real engines: prefix placement's median TTFT against round-robin's, and its hit
    rate against the best peer's (a prefix-aware router should not cache less)."""
    ours = by_label.get(f"{SWITCHYARD} prefix-aware")
    if ours is None:
        return []
    targets = []
    if (baseline := by_label.get(f"{SWITCHYARD} round-robin")) is not None:
        targets.append(
            Target(
                "Switchyard prefix-aware TTFT p50 ≤ 0.2 × Switchyard round-robin's",
                _p50(ours) / _p50(baseline),
                0.2,
            )
        )
    rated = [r for r in by_label.values() if r.arm.router != SWITCHYARD and r.hit_rate is not None]
    if rated:
        best = max(rated, key=_hit_rate)
        targets.append(
            Target(
                f"Switchyard prefix-aware hit rate ≥ 0.9 × the best peer's ({best.arm.label})",
                _hit_rate(ours),
                0.9 * _hit_rate(best),
                at_most=False,
                unit="%",
            )
        )
    return targets


def _servers(backend: Backend) -> str:
    if backend is LLAMACPP:
        return (
            f"llama.cpp, Gemma 3 270M, 1 CPU thread, {LLAMACPP_SLOTS} slot and a "
            f"{LLAMACPP_PROMPT_CACHE_MIB} MiB prompt cache each"
        )
    return PROFILE


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _size_data(size: Size) -> dict[str, object]:
    data: dict[str, object] = {**asdict(size), "shape": asdict(size.shape)}
    return data


def _described(size: Size, backend: Backend) -> tuple[str, str]:
    """A workload's table title and the note saying what it was."""
    real = backend is LLAMACPP
    servers = f"{size.replicas} replicas ({_servers(backend)})"
    window = (
        f" over the last {size.count - size.warmup_count} requests (the first "
        f"{size.warmup_count} warm the caches). Hit rate: prompt tokens served from the "
        "replicas' caches / prompt tokens asked for, over the same window."
    )
    scale = (
        "Latencies are wall milliseconds"
        if real
        else f"Latencies are wall milliseconds at time scale {size.time_scale:g} (divide by "
        f"{size.time_scale:g} for modelled time)"
    )
    shape = size.shape
    if isinstance(shape, MultiTurn):
        title = (
            f"Multi-turn chat over HTTP: {servers}, {shape.sessions} sessions of "
            f"{shape.turns} turns, {shape.session_rate:g} sessions/s modelled"
        )
        note = (
            f"Workload: one {shape.system_tokens}-token system prompt shared by every "
            f"session, {shape.user_tokens}-token user turns, {shape.max_tokens}-token "
            f"answers resent with the next turn, {shape.think_seconds:g} s mean think time "
            "(modelled), streamed /v1/chat/completions. " + scale + window
        )
        return title, note
    rate = f"{size.rate:g}/s" if real else f"{size.rate:g}/s modelled ({size.wall_rate:g}/s wall)"
    title = f"Shared prefix over HTTP: {servers}, {size.count} streamed requests at {rate}"
    if real:
        note = (
            f"Workload: {shape.groups} system prompts of {shape.prefix_tokens} words "
            f"(about {9 * shape.prefix_tokens} of Gemma's tokens), {shape.users} users "
            f"each, {shape.question_tokens}-word questions, {shape.max_tokens} output "
            "tokens, Poisson arrivals. "
        )
    else:
        note = (
            f"Workload: {shape.groups} system prompts of {shape.prefix_tokens} "
            f"tokens, {shape.users} users each, {shape.question_tokens}-token questions, "
            f"{shape.max_tokens} output tokens, Poisson arrivals. "
        )
    return title, note + scale + window


def workload_targets(
    by_label: Mapping[str, ArmResult], workload: str, real: bool = False
) -> list[Target]:
    """On simulated engines: the recommended and predicted-latency configurations' p90 TTFT at
    least 10% under the best peer cache_aware's and under round-robin's; the prefix-aware
    one's against the best peer (where it ran). On real engines, ``llamacpp_targets``."""
    if real:
        return llamacpp_targets(by_label)
    peer_best = sorted(
        (
            r
            for r in by_label.values()
            if r.arm.router != SWITCHYARD and r.arm.policy == "cache_aware"
        ),
        key=_p90,
    )
    baseline = by_label.get(f"{SWITCHYARD} {ROUND_ROBIN}")
    targets = []
    shares = (
        (RECOMMENDED_POLICY, 0.9),
        (PREDICTED_LATENCY_POLICY, 0.9),
        (PREFIX_AWARE_POLICY, 1.0),
    )
    for policy, share in shares:
        if (ours := by_label.get(f"{SWITCHYARD} {policy}")) is None:
            continue
        if peer_best:
            best = peer_best[0]
            times = f"{share:g} × " if share != 1.0 else ""
            targets.append(
                Target(
                    f"{workload}: Switchyard {policy} TTFT p90 ≤ {times}the best peer "
                    f"cache_aware's ({best.arm.label})",
                    _p90(ours),
                    share * _p90(best),
                    unit=" ms",
                )
            )
        if baseline is not None:
            targets.append(
                Target(
                    f"{workload}: Switchyard {policy} TTFT p90 ≤ Switchyard round-robin's",
                    _p90(ours),
                    _p90(baseline),
                    unit=" ms",
                )
            )
    return targets


def section(
    runs: Sequence[tuple[Size, Sequence[ArmResult]]],
    notes: list[str],
    quick: bool,
    backend: Backend = SIMULATOR,
) -> Section:
    """The report: per workload a table (one row per arm), a TTFT CDF and the targets; the
    raw numbers."""
    real = backend is LLAMACPP
    tables, plots, targets = [], [], []
    for size, results in runs:
        title, note = _described(size, backend)
        tables.append(
            Table(
                title,
                [
                    "router / policy",
                    "TTFT p50 ms",
                    "TTFT p90 ms",
                    "TTFT p99 ms",
                    "ITL p50 ms",
                    "E2E p90 ms",
                    "output tok/s" if real else "output tok/s (modelled)",
                    "prefix-cache hit rate",
                    "on the group's main replica"
                    if size.workload == SHARED_PREFIX
                    else "on the session's main replica",
                    "busiest replica / mean",
                    "answered",
                    "errors",
                    "client lag p99 ms",
                    *(["engine prefill tok/s"] if real else []),
                ],
                [_row(r, size, real) for r in results],
                note=note,
            )
        )
        key = "live-llamacpp" if real else "live"
        plots.append(
            Plot(
                f"{key}-ttft-cdf" if size.name == SHARED_PREFIX else f"{key}-{size.name}-ttft-cdf",
                f"Time to first token, {_lower_first(title.split(':')[0])}"
                + (f" at {size.rate:g}/s" if size.workload == SHARED_PREFIX else "")
                + " (the CDF, axes swapped)",
                "share of requests",
                "TTFT, wall ms (log scale)",
                [Series(r.arm.label, *_quantiles(r.ttfts())) for r in results],
                logy=True,
            )
        )
        targets += workload_targets({r.arm.label: r for r in results}, size.name, real)
    every = [r for _, results in runs for r in results]
    starved = [
        f"{size.name}: {r.arm.label} ({_ms(r.lag()):.0f} ms)"
        for size, results in runs
        for r in results
        if r.lag() > LAG_LIMIT
    ]
    step = PROFILES[PROFILE].step_overhead
    timing = (
        "Real time: each engine computes on one CPU thread; a miss prefills the whole "
        "system prompt (seconds), a hit only the question, against about 10 ms that the "
        "gateway's hops (Python, Envoy) add per request on this 2-core machine, where the "
        "client, the routers and the engines share the CPU."
        if real
        else f"Time scale {runs[0][0].time_scale:g}: every modelled second of the simulator "
        f"lasts {runs[0][0].time_scale:g} wall seconds, so one engine step of the {PROFILE} "
        f"profile ({step * 1000:.0f} ms modelled, at least) lasts "
        f"{step * 1000 * runs[0][0].time_scale:.0f} ms, and a miss on a long prefix far "
        "longer, against a few ms that the gateway's hops (Python, Envoy) add per request "
        "on this 2-core machine, where the client, the routers and the simulators share "
        "the CPU."
    )
    notes = [
        *notes,
        *(note for r in every for note in r.notes),
        timing,
        (
            f"The client fell behind its schedule by more than {_ms(LAG_LIMIT):.0f} ms (p99) "
            f"in {', '.join(starved)}: the CPU was busy elsewhere during those arms, and "
            "their latencies are inflated by it; rerun on a quiet machine."
            if starved
            else f"The client sent 99% of the requests within {_ms(LAG_LIMIT):.0f} ms of their "
            "scheduled times in every arm."
        ),
        f"Each arm starts from fresh {'engine' if real else 'simulator'} processes (cold "
        "prefix caches) and the same arrival schedule; peers run with their defaults (cache "
        "threshold 0.3, balance thresholds 64 and 1.5).",
    ]
    if real:
        notes.append(
            "llama.cpp names no replica in its answers: the placement columns count "
            "Switchyard's own report (x-conformance-test-served-endpoint) and are n/a for "
            "the peers. Engine prefill tok/s: prompt tokens the engines computed per second "
            "they spent computing them (llamacpp:prompt_tokens_total / "
            "llamacpp:prompt_seconds_total over the window). A short computation (a "
            "question after a cached prompt) runs slower per token than a whole prompt, "
            "so compare it between arms of similar hit rates: there it shows how much CPU "
            "each arm had on a shared machine (arms run one after the other)."
        )
    if quick:
        notes.append("Quick (smoke) size: the numbers mean nothing.")
    data = {
        "engine": backend.name,
        "profile": "llamacpp-gemma-3-270m" if real else PROFILE,
        "workloads": [
            {
                "workload": size.name,
                "size": _size_data(size),
                "arms": [
                    {
                        "router": r.arm.router,
                        "policy": r.arm.policy,
                        "queries": r.queries,
                        "hits": r.hits,
                        "prefill_rate": r.prefill_rate,
                        "errors": r.errors,
                        "outcomes": [asdict(o) for o in r.outcomes],
                    }
                    for r in results
                ],
            }
            for size, results in runs
        ],
    }
    return Section(
        key="live-llamacpp" if real else "live",
        title="Live on real llama.cpp engines: the demo gateway beside vLLM's and SGLang's routers"
        if real
        else "Live: the demo gateway beside vLLM's and SGLang's routers",
        command="make bench-live ENGINE=llamacpp" if real else "make bench-live",
        tables=tables,
        plots=plots,
        targets=targets,
        data=data,
        notes=notes,
    )


def run(options: Options, workloads: Sequence[str] = (), only: Sequence[str] = ()) -> Section:
    """Run every arm on each workload (the same arrivals for every arm of a workload) and
    report them side by side; with ``workloads`` (size names) or ``only`` (arm labels, as
    ``switchyard recommended``), those alone."""
    backend = BACKENDS[options.engine]
    notes: list[str] = []
    runs = []
    for size in backend.sizes(options.quick):
        if workloads and size.name not in workloads:
            continue
        arrivals = size.arrivals(options.seed)
        chosen, skipped = arms(options.quick, backend, size)
        chosen = [arm for arm in chosen if not only or arm.label in only]
        notes += [note for note in skipped if note not in notes]
        results = []
        for n, arm in enumerate(chosen):
            work_dir = options.out / "live" / size.name / f"{n}-{arm.router}-{arm.policy}"
            try:
                results.append(run_arm(arm, size, arrivals, work_dir, backend))
            except RuntimeError as error:  # TopologyError, PeerError: a router that did not start
                notes.append(f"{size.name}: {arm.label} did not run: {error}")
                progress(f"live: {size.name}: {arm.label} failed: {error}")
        runs.append((size, results))
    return section(runs, notes, options.quick, backend)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m bench.live``: the live part alone, restricted to some workloads and arms
    (``make bench-live`` runs them all), e.g. predicted latency beside recommended and the
    peers' cache_aware::

        python -m bench.live --workload shared-prefix --workload multi-turn \\
            --arm "switchyard recommended" --arm "switchyard predicted-latency" \\
            --arm "sglang-router cache_aware" --arm "vllm-router cache_aware"
    """
    parser = argparse.ArgumentParser(
        prog="python -m bench.live", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("--workload", action="append", default=[], help="a workload (size) name, repeatable")
    add("--arm", action="append", default=[], help="an arm's label, repeatable")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="smoke size")
    add("--out", type=Path, default=Path("bench-results"))
    add("--engine", choices=sorted(BACKENDS), default=SIMULATOR.name)
    args = parser.parse_args(argv)
    options = Options(seed=args.seed, quick=args.quick, out=args.out, engine=args.engine)
    paths = report.write([run(options, args.workload, args.arm)], options.out, header="# live")
    print(paths[0].read_text(), flush=True)


if __name__ == "__main__":
    main()
