"""The engine model in virtual time: step timing, chunked prefill, prefix caching, queues,
preemption, LoRA loading and faults. No sleeps: every test runs on a ``VirtualLoop``."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable

import pytest

from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import CRASHED, INJECTED_ERROR, Engine, Event, Faults, Request, Scheduling
from simulator.kvcache import block_hashes
from simulator.profiles import PROFILES, Profile
from simulator.tokenizer import (
    CHARS_PER_TOKEN,
    count_tokens,
    output_token,
    output_token_id,
    text_block,
    token_block,
    tokenize,
)

H100 = PROFILES["llama-3.1-8b-h100"]


class Run:
    """One engine on a virtual loop, recording every event per request."""

    def __init__(
        self,
        profile: Profile = H100,
        faults: Faults | None = None,
        seed: int = 0,
        scheduling: Scheduling | None = None,
    ) -> None:
        faults = faults or Faults()
        scheduling = scheduling or Scheduling()
        self.loop = VirtualLoop()
        self.engine = Engine(profile, faults=faults, seed=seed, scheduling=scheduling)
        self.events: dict[str, list[tuple[str, int, float]]] = defaultdict(list)
        self.driver = VirtualEngine(self.engine, self.loop, self.record)
        self.requests: dict[str, Request] = {}

    def record(self, event: Event) -> None:
        request = event.request
        self.events[request.id].append((event.kind, request.generated, self.loop.now))

    def submit(
        self, rid: str, tokens: list[int], max_tokens: int = 1, adapter: str | None = None
    ) -> Request:
        request = Request(rid, tokens, max_tokens, self.loop.now, adapter)
        self.requests[rid] = request
        self.driver.submit(request)
        return request

    def at(self, when: float, rid: str, tokens: list[int], max_tokens: int = 1) -> None:
        def submit() -> None:
            self.submit(rid, tokens, max_tokens)

        self.loop.at(when, submit)

    def run(self, until: float | None = None) -> None:
        self.loop.run(until)

    def token_times(self, rid: str) -> list[float]:
        return [when for kind, _, when in self.events[rid] if kind == "token"]


def prompt(seed: int, tokens: int) -> list[int]:
    return token_block(seed, tokens)


def fit_line(xs: Iterable[float], ys: Iterable[float]) -> tuple[float, float, float]:
    """Least squares: slope, intercept and the largest residual."""
    x, y = list(xs), list(ys)
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum(
        (a - mx) ** 2 for a in x
    )
    intercept = my - slope * mx
    residual = max(abs(b - (slope * a + intercept)) for a, b in zip(x, y, strict=True))
    return slope, intercept, residual


# --- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_concatenates() -> None:
    """Equal text gives equal ids; blocks concatenate at the token level; counts agree."""
    assert tokenize("Hello, world!") == tokenize("Hello, world!")
    assert count_tokens("Hello, world!") == len(tokenize("Hello, world!")) == 4
    a, b = text_block(1, 40), text_block(2, 25)
    assert tokenize(a + b) == tokenize(a) + tokenize(b)
    assert len(tokenize(a)) == 40
    assert text_block(1, 40) == a
    assert text_block(1, 10) == " ".join(a.split()[:10]) + " "
    assert token_block(1, 40) == tokenize(a)
    assert tokenize("".join(output_token(i) for i in range(12))) == [
        output_token_id(i) for i in range(12)
    ]


def test_workload_text_has_about_four_characters_per_token() -> None:
    """text_block words average 4 characters with their space, as English text does per BPE
    token, so a router that counts characters sees as many engine tokens as with real text."""
    text = text_block(11, 20_000)
    assert len(tokenize(text)) == 20_000
    assert len(text) / 20_000 == pytest.approx(CHARS_PER_TOKEN, abs=0.05)
    assert {len(word) for word in text.split()} == {2, 3, 4}


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_states_where_each_number_comes_from(name: str) -> None:
    """A profile's source names every coefficient and capacity, and says derived or estimate."""
    profile = PROFILES[name]
    assert profile.name == name
    for field in (
        "step_overhead",
        "prefill_per_token",
        "decode_per_seq",
        "decode_per_context_token",
        "num_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_loras",
        "lora_load_time",
    ):
        assert field in profile.source, field
    assert "derived" in profile.source
    assert "estimate" in profile.source


# --- step time and prefill --------------------------------------------------------------------


def test_ttft_is_linear_in_uncached_prompt_tokens() -> None:
    """On an idle engine, TTFT = step_overhead + prefill_per_token * prompt tokens, exactly."""
    lengths = [1, 16, 100, 777, 2048, 8000]
    ttfts = []
    for length in lengths:
        run = Run()
        request = run.submit("r", prompt(length, length))
        run.run()
        assert request.ttft is not None
        ttfts.append(request.ttft)
    slope, intercept, residual = fit_line(lengths, ttfts)
    assert slope == pytest.approx(H100.prefill_per_token, rel=1e-9)
    assert intercept == pytest.approx(H100.step_overhead, rel=1e-9)
    assert residual < 1e-12


def test_a_repeated_long_prompt_costs_about_one_step() -> None:
    """The second time, all full blocks but the one holding the last token hit: TTFT collapses."""
    run = Run()
    tokens = prompt(7, 4000)
    first = run.submit("first", tokens)
    run.run()
    again = run.submit("again", tokens)
    run.run()
    assert first.cached_tokens == 0
    assert again.cached_tokens == (4000 - 1) // 16 * 16 == 3984
    assert again.ttft == pytest.approx(H100.step_time(16, 0, 0))
    assert first.ttft is not None
    assert again.ttft is not None
    assert again.ttft < first.ttft / 10
    assert run.engine.prefix_hits_total == 3984
    assert run.engine.prefix_queries_total == 8000


def test_ttft_counts_only_the_uncached_tokens() -> None:
    """A shared 1024-token prefix then a private tail: TTFT is linear in the tail alone."""
    run = Run()
    shared = prompt(1, 1024)
    run.submit("warm", shared + prompt(2, 50))
    run.run()
    for index, tail in enumerate([10, 200, 1500]):
        request = run.submit(f"r{index}", shared + prompt(100 + index, tail))
        run.run()
        assert request.cached_tokens == 1024
        assert request.ttft == pytest.approx(H100.step_time(tail, 0, 0))


@pytest.mark.parametrize("lagged", [True, False], ids=["async-scheduling", "sync-scheduling"])
def test_long_prompts_are_prefilled_in_chunks_with_decodes_first(lagged: bool) -> None:
    """A prompt over the token budget takes several steps; a decoding stream keeps getting a
    token every one of those steps (decodes are scheduled first, the chunk takes the rest)."""
    profile = H100.replace(max_num_batched_tokens=512)
    run = Run(profile, scheduling=Scheduling(async_scheduling=lagged))
    run.submit("decoder", prompt(1, 10), max_tokens=30)
    run.run(until=0.05)  # decoding by now
    before = len(run.token_times("decoder"))
    long = run.submit("long", prompt(2, 1500), max_tokens=1)
    run.run()
    decoder = run.token_times("decoder")
    assert long.first_token_at is not None
    during = [t for t in decoder[before:] if t <= long.first_token_at]
    # The step in flight when it arrived, with async scheduling the step already decided while
    # that one ran, then 1500 tokens at 511 per step (one budget token goes to the decoder):
    # 3 steps, each with a decoder token.
    assert len(during) == 1 + lagged + 3
    gaps = [b - a for a, b in itertools.pairwise(decoder)]
    assert max(gaps) < H100.step_time(512, 1, 100)  # never blocked for the whole prefill


def test_a_prompt_over_the_budget_pays_one_overhead_per_chunk() -> None:
    """Idle engine, budget 1000: a 2500-token prompt takes three steps, so its TTFT is three
    step overheads plus the per-token cost of all 2500 tokens, exactly."""
    profile = H100.replace(max_num_batched_tokens=1000)
    run = Run(profile)
    request = run.submit("r", prompt(1, 2500))
    run.run()
    expected = 3 * profile.step_overhead + 2500 * profile.prefill_per_token
    assert request.ttft == pytest.approx(expected, rel=1e-12)


def test_virtual_time_is_deterministic() -> None:
    """The same workload gives the same times, hits and preemptions on every run."""

    def outcome() -> list[tuple[float | None, float | None, int, int]]:
        run = Run(H100.replace(num_blocks=40, max_num_seqs=8))
        for index in range(30):
            tokens = prompt(index % 4, 100) + prompt(100 + index, 30)
            run.at(index * 0.01, f"r{index}", tokens, max_tokens=40)
        run.run()
        return [
            (r.first_token_at, r.finished_at, r.cached_tokens, r.preemptions)
            for r in run.requests.values()
        ]

    first = outcome()
    assert first == outcome()
    assert any(preemptions for *_, preemptions in first)


# --- prefix caching ---------------------------------------------------------------------------


def shared_prefix_workload(
    run: Run, groups: int, users: int, prefix: int, question: int, gap: float = 1.0
) -> None:
    """``groups`` system prompts of ``prefix`` tokens, each followed by ``users`` different
    questions of ``question`` tokens; requests arrive ``gap`` seconds apart, round-robin over
    the groups, so each has finished before the next arrives."""
    when = 0.0
    for user in range(users):
        for group in range(groups):
            tokens = prompt(group, prefix) + prompt(1000 + group * users + user, question)
            run.at(when, f"g{group}u{user}", tokens, max_tokens=8)
            when += gap
    run.run()


def test_hit_rate_matches_the_workload_structure_with_an_unbounded_cache() -> None:
    """Every request after the first of its group hits the prefix's full blocks, no more."""
    groups, users, prefix, question = 5, 6, 200, 37
    run = Run(H100)
    shared_prefix_workload(run, groups, users, prefix, question)
    hits_each = prefix // 16 * 16  # the block holding the prefix's end also holds the question
    assert run.engine.prefix_hits_total == groups * (users - 1) * hits_each
    assert run.engine.prefix_queries_total == groups * users * (prefix + question)
    assert all(len(run.events[rid]) == 9 for rid in run.requests)  # 8 tokens and done


def test_hit_rate_falls_as_the_cache_shrinks() -> None:
    """With fewer blocks, prefixes are evicted between reuses: hits fall, monotonically."""
    hits = []
    for blocks in (100_000, 120, 80, 50, 30):
        run = Run(H100.replace(num_blocks=blocks))
        shared_prefix_workload(run, groups=6, users=5, prefix=160, question=40)
        hits.append(run.engine.prefix_hits_total)
    assert hits[0] == 6 * 4 * 160
    assert all(a >= b for a, b in itertools.pairwise(hits)), hits
    assert hits[-1] < hits[0] / 2, hits


def test_cached_prefix_reports_without_side_effects() -> None:
    """``cached_prefix`` tells what would hit, leaves the cache as it was, and agrees with
    what the engine then finds."""
    run = Run(H100.replace(num_blocks=64))
    shared = prompt(3, 320)
    run.submit("a", shared + prompt(4, 30))
    run.run()
    probe = shared + prompt(5, 9)
    free_before = run.engine.used_blocks
    assert run.engine.cached_prefix(probe) == 320
    assert run.engine.cached_prefix(probe, adapter="other") == 0  # adapters never share KV
    assert run.engine.used_blocks == free_before
    request = Request("b", probe, 1, run.loop.now)
    assert run.engine.cached_prefix(request) == 320
    run.driver.submit(request)
    run.run()
    assert request.cached_tokens == 320


def test_block_hashes_chain_on_the_parent() -> None:
    """Equal blocks after different prefixes hash differently; only full blocks are hashed."""
    a = block_hashes([1] * 16 + [2] * 16 + [3] * 5)
    b = block_hashes([9] * 16 + [2] * 16)
    assert len(a) == 2
    assert len(b) == 2
    assert a[1] != b[1]
    assert block_hashes([1] * 16 + [2] * 16) == a


def test_kv_usage_counts_blocks_in_use_not_cached_blocks() -> None:
    """While a request runs its blocks are used; afterwards they stay cached but count as free."""
    run = Run(H100.replace(num_blocks=10))
    run.submit("r", prompt(1, 40), max_tokens=3)
    run.loop.run(until=0.0)  # the first step is scheduled, not finished
    assert run.engine.kv_usage == pytest.approx(3 / 10)
    run.run()
    assert run.engine.kv_usage == 0
    assert run.engine.cached_prefix(prompt(1, 40)) == 32


# --- queues and preemption --------------------------------------------------------------------


def test_requests_beyond_max_num_seqs_wait() -> None:
    """Twelve requests at once with room for four: eight wait, and TTFT grows in steps of a
    batch's service time, first come first served."""
    run = Run(H100.replace(max_num_seqs=4))
    for index in range(12):
        run.submit(f"r{index}", prompt(index, 100), max_tokens=20)
    run.loop.run(until=0.0)
    assert (run.engine.running, run.engine.waiting) == (4, 8)
    run.run()
    ttfts = [run.requests[f"r{index}"].ttft or 0.0 for index in range(12)]
    assert ttfts[0] == ttfts[3] < ttfts[4] == ttfts[7] < ttfts[8] == ttfts[11]


@pytest.mark.parametrize("gap", [0.2, 0.03], ids=["under-capacity", "over-capacity"])
def test_arrivals_above_token_throughput_build_a_queue(gap: float) -> None:
    """2000-token prompts: an engine prefills ~33k tokens/s, so one every 30 ms is too many
    (the queue and TTFT grow without bound) while one every 200 ms is not (TTFT stays flat)."""
    run = Run()
    waiting: list[int] = []
    for index in range(40):
        run.at(index * gap, f"r{index}", prompt(index, 2000), max_tokens=2)
        run.loop.at((index + 0.5) * gap, lambda: waiting.append(run.engine.waiting))
    run.run()
    ttfts = [run.requests[f"r{index}"].ttft or 0.0 for index in range(40)]
    if gap > 0.1:
        assert max(ttfts) == pytest.approx(min(ttfts))
        assert max(waiting) == 0
    else:
        assert ttfts[-1] > 10 * ttfts[0]
        assert waiting[-1] > waiting[len(waiting) // 2] > 0


def test_preemption_frees_the_newest_and_recomputes_it_correctly() -> None:
    """Three long generations in a 20-block cache: the most recently admitted is preempted,
    requeued at the front, recomputed (hitting its own cached blocks), and every stream still
    gets exactly its tokens, in order, once each."""
    profile = H100.replace(num_blocks=20)
    run = Run(profile)
    engine = run.engine
    requests = [Request(f"r{i}", prompt(i, 64), 150, 0.0) for i in range(3)]
    for request in requests:
        engine.add(request)
    events: list[Event] = []
    prefill = 0
    now = 0.0
    indices: dict[str, list[int]] = defaultdict(list)
    while (step := engine.step(now)) is not None:
        prefill += step.prefill_tokens
        now += step.duration
        for event in engine.finish(step, now):
            events.append(event)
            if event.kind == "token":
                indices[event.request.id].append(event.request.generated - 1)
    first, _, newest = requests
    assert engine.preemptions_total > 0
    assert first.preemptions == 0
    assert newest.preemptions > 0
    for request in requests:
        assert indices[request.id] == list(range(150))
        assert [e.kind for e in events if e.request is request][-1] == "done"
    # Recomputation costs less than everything again: some of the victims' blocks still hit.
    assert 3 * 64 < prefill < 3 * 64 + sum(r.preemptions * (64 + 150) for r in requests)
    assert engine.kv_usage == 0
    assert engine.pending_tokens() == 0


def test_a_request_too_large_for_the_cache_is_refused() -> None:
    """A sequence that could never fit, even alone, is an error at once (vLLM refuses it too)."""
    run = Run(H100.replace(num_blocks=4))
    request = run.submit("big", prompt(1, 60), max_tokens=10)
    run.run()
    assert request.error is not None
    assert "KV blocks" in request.error
    assert run.events["big"] == [("error", 0, 0.0)]


# --- LoRA -------------------------------------------------------------------------------------


def test_an_adapter_that_is_not_resident_costs_a_load() -> None:
    """The first request for an adapter waits lora_load_time more; while it stays resident
    later ones do not; with max_loras 2 the least recently used idle adapter is evicted."""
    profile = H100.replace(max_loras=2, lora_load_time=0.05)
    run = Run(profile)
    base = profile.step_time(100, 0, 0)
    ttft: dict[str, float] = {}
    for index, adapter in enumerate(["a", "a", "b", "a", "c", "b", "a"]):
        request = run.submit(f"r{index}", prompt(index, 100), adapter=adapter)
        run.run()
        assert request.ttft is not None
        ttft[f"{index}{adapter}"] = request.ttft - base
    assert ttft == pytest.approx(
        {"0a": 0.05, "1a": 0, "2b": 0.05, "3a": 0, "4c": 0.05, "5b": 0.05, "6a": 0.05}
    )
    assert run.engine.loaded_adapters == ("b", "a")


def test_max_loras_limits_distinct_adapters_in_a_batch() -> None:
    """With max_loras 1, a request for a second adapter waits while the first runs, without
    blocking a base-model request behind it."""
    run = Run(H100.replace(max_loras=1))
    first = run.submit("a", prompt(1, 50), max_tokens=5, adapter="a")
    other = run.submit("b", prompt(2, 50), max_tokens=5, adapter="b")
    base = run.submit("base", prompt(3, 50), max_tokens=5)
    run.loop.run(until=0.0)
    assert (run.engine.running, run.engine.waiting) == (2, 1)
    assert dict(run.engine.running_adapters) == {"a": 1}
    assert dict(run.engine.waiting_adapters) == {"b": 1}
    run.run()
    assert first.finished_at is not None
    assert other.first_token_at is not None
    assert other.first_token_at > first.finished_at
    assert base.ttft == first.ttft


# --- scheduling switches (each defaults to current vLLM) --------------------------------------


@pytest.mark.parametrize("full", [True, False], ids=["full-prompt-gate", "first-chunk-gate"])
def test_admission_gate_on_the_whole_prompt_queues_instead_of_preempting(full: bool) -> None:
    """Two 200-token prompts, a 24-block cache (13 blocks each): with vLLM's full-prompt gate the
    second waits in the queue and nothing is preempted; gated on its first chunk only, it is
    admitted, the queue reads empty, and the two preempt each other."""
    profile = H100.replace(num_blocks=24, max_num_batched_tokens=64)
    run = Run(profile, scheduling=Scheduling(full_prompt_admission=full))
    first = run.submit("first", prompt(1, 200), max_tokens=20)
    second = run.submit("second", prompt(2, 200), max_tokens=20)
    seen: list[tuple[int, int]] = []
    run.loop.at(0.03, lambda: seen.append((run.engine.running, run.engine.waiting)))
    run.run()
    assert first.finished_at is not None
    assert second.first_token_at is not None
    if full:
        assert seen == [(1, 1)]
        assert run.engine.preemptions_total == 0
        assert second.first_token_at > first.finished_at
    else:
        assert seen == [(2, 0)]
        assert run.engine.preemptions_total > 0
        assert second.preemptions > 0


def test_async_scheduling_admits_a_request_one_step_late_on_a_busy_engine() -> None:
    """An idle engine schedules a new request at once either way; while a step runs, the next
    batch is already decided, so with async scheduling the request waits one more step (one
    decode step of the running stream here)."""

    def ttfts(lagged: bool) -> tuple[float, float]:
        run = Run(scheduling=Scheduling(async_scheduling=lagged))
        idle = run.submit("idle", prompt(5, 100))
        run.run()
        run.submit("decoder", prompt(1, 10), max_tokens=50)
        run.run(until=run.loop.now + 0.05)
        late = run.submit("late", prompt(2, 100))
        run.run()
        assert idle.ttft is not None
        assert late.ttft is not None
        return idle.ttft, late.ttft

    (idle_async, late_async), (idle_sync, late_sync) = ttfts(True), ttfts(False)
    assert idle_async == idle_sync == pytest.approx(H100.step_time(100, 0, 0))
    lag = late_async - late_sync
    assert H100.step_overhead < lag < 1.1 * H100.step_overhead


def test_async_scheduling_adds_no_lag_when_the_decided_batch_is_empty() -> None:
    """A request that arrives during the last step of the only stream: the batch decided
    meanwhile is empty, and vLLM then schedules again at once, so the request starts when
    that step ends."""
    run = Run()
    last = run.submit("last", prompt(1, 10), max_tokens=2)
    run.run(until=H100.step_time(10, 0, 0) + 0.003)  # the stream's second (last) step runs
    new = run.submit("new", prompt(2, 100))
    run.run()
    assert last.finished_at is not None
    assert new.first_token_at == pytest.approx(last.finished_at + H100.step_time(100, 0, 0))


@pytest.mark.parametrize("at_schedule", [True, False], ids=["at-schedule", "at-step-end"])
def test_blocks_scheduled_in_a_step_are_hit_by_a_request_admitted_after_them(
    at_schedule: bool,
) -> None:
    """Two equal 320-token prompts admitted in one step: vLLM caches the first one's blocks when
    it schedules them, so the second hits 304 tokens (all full blocks but the last token's);
    registered only at the step's end, the second computes everything."""
    run = Run(scheduling=Scheduling(cache_at_schedule=at_schedule))
    first = run.submit("a", prompt(5, 320))
    second = run.submit("b", prompt(5, 320))
    run.run()
    assert first.cached_tokens == 0
    assert second.cached_tokens == (304 if at_schedule else 0)
    assert run.engine.prefix_hits_total == second.cached_tokens
    assert second.ttft == pytest.approx(H100.step_time(320 + 320 - second.cached_tokens, 0, 0))


def test_step_jitter_varies_step_times_within_its_bounds_reproducibly() -> None:
    """Jitter 0.2 multiplies each step by a seeded draw in [0.8, 1.2] with mean about 1; the
    same seed gives the same times, another seed others, and the fault draws are unchanged."""

    def factors(jitter: float, seed: int) -> list[float]:
        run = Run(seed=seed, scheduling=Scheduling(step_jitter=jitter))
        out = []
        for index in range(200):
            request = run.submit(f"r{index}", prompt(index, 100))
            run.run()
            assert request.ttft is not None
            out.append(request.ttft / H100.step_time(100, 0, 0))
        return out

    jittered = factors(0.2, seed=1)
    assert 0.8 <= min(jittered) < 0.85
    assert 1.15 < max(jittered) <= 1.2
    assert sum(jittered) / len(jittered) == pytest.approx(1.0, abs=0.03)
    assert factors(0.2, seed=1) == jittered
    assert factors(0.2, seed=2) != jittered
    assert factors(0.0, seed=1) == pytest.approx([1.0] * 200)

    def failures(jitter: float) -> list[str]:
        run = Run(faults=Faults(error_rate=0.3), seed=4, scheduling=Scheduling(step_jitter=jitter))
        for index in range(50):  # steps (and jitter draws) between the requests' fault draws
            run.submit(f"r{index}", prompt(index, 20), max_tokens=3)
            run.run(until=run.loop.now + 0.004)
        run.run()
        return [rid for rid, events in run.events.items() if events[-1][0] == "error"]

    assert failures(0.5) == failures(0.0)


def test_scheduling_rejects_a_jitter_outside_zero_to_one() -> None:
    """A step jitter of 1 or more (a step could take no time) is refused, naming the field."""
    for jitter in (-0.1, 1.0):
        with pytest.raises(ValueError, match="step_jitter"):
            Scheduling(step_jitter=jitter)


def test_a_fork_runs_forward_exactly_as_the_engine_would_and_leaves_it_untouched() -> None:
    """Fork mid-step (running, waiting and cached requests, a step in flight, jitter on): run
    forward, the fork gives every request the first-token and finish times the engine itself
    then gives them, and running the fork changes nothing in the engine."""
    profile = H100.replace(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=256)
    run = Run(profile, seed=3, scheduling=Scheduling(step_jitter=0.3))
    for index in range(12):
        run.at(index * 0.004, f"r{index}", prompt(index % 3, 100) + prompt(100 + index, 30), 40)
    run.run(until=0.05)
    engine = run.engine
    step = engine.in_flight
    assert step is not None
    assert engine.running
    assert engine.waiting

    def state() -> tuple[object, ...]:
        return (
            engine.running,
            engine.waiting,
            engine.used_blocks,
            engine.pending_tokens(),
            engine.preemptions_total,
            engine.prefix_hits_total,
            engine.cached_prefix(prompt(1, 100) + prompt(7, 40)),
            [(r.generated, r.first_token_at) for r in run.requests.values()],
        )

    before = state()
    twin = engine.fork()
    seen: dict[str, tuple[float | None, float | None]] = {}
    now = step.start + step.duration
    events = twin.finish(twin.in_flight or step, now)
    while True:
        for event in events:
            if event.kind == "done":
                seen[event.request.id] = (event.request.first_token_at, event.request.finished_at)
        following = twin.step(now)
        if following is None:
            break
        now += following.duration
        events = twin.finish(following, now)
    assert state() == before
    assert twin.preemptions_total > engine.preemptions_total  # the fork did work
    run.run()
    assert seen == {rid: (r.first_token_at, r.finished_at) for rid, r in run.requests.items()}


# --- faults -----------------------------------------------------------------------------------


def test_error_rate_fails_that_fraction_of_requests_reproducibly() -> None:
    """error_rate 0.3: a seeded draw per request; the same seed fails the same requests."""

    def failed(seed: int) -> list[str]:
        run = Run(faults=Faults(error_rate=0.3), seed=seed)
        for index in range(200):
            run.submit(f"r{index}", prompt(index, 20))
        run.run()
        return [rid for rid, events in run.events.items() if events[-1][0] == "error"]

    once = failed(1)
    assert 40 < len(once) < 80
    assert failed(1) == once
    assert failed(2) != once
    run = Run(faults=Faults(error_rate=1.0))
    request = run.submit("r", prompt(1, 20))
    run.run()
    assert request.error == INJECTED_ERROR
    assert run.events["r"] == [("error", 0, 0.0)]


def test_stall_stops_a_stream_mid_way_for_the_stall_time() -> None:
    """After stall_after_tokens tokens a stream pauses for stall_seconds, then finishes."""
    run = Run(faults=Faults(stall_after_tokens=3, stall_seconds=2.0))
    run.submit("r", prompt(1, 20), max_tokens=6)
    run.run()
    times = run.token_times("r")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 6
    assert gaps[2] >= 2.0
    assert max(gaps[:2] + gaps[3:]) < 0.1


def test_a_stall_forever_holds_the_slot_until_aborted() -> None:
    """stall_seconds inf: the stream never resumes; aborting it frees its blocks."""
    run = Run(faults=Faults(stall_after_tokens=1, stall_seconds=math.inf))
    run.submit("r", prompt(1, 40), max_tokens=5)
    run.run()
    assert len(run.token_times("r")) == 1
    assert run.engine.running == 1
    assert run.engine.kv_usage > 0
    run.driver.abort("r")
    run.run()
    assert run.engine.running == 0
    assert run.engine.kv_usage == 0


def test_crash_after_n_requests_fails_everything_after() -> None:
    """crash_after 2: two requests run; the third crashes the engine, failing those in flight,
    and every later request fails too."""
    run = Run(faults=Faults(crash_after=2))
    run.submit("a", prompt(1, 20), max_tokens=100)
    run.submit("b", prompt(2, 20), max_tokens=100)
    run.run(until=0.1)
    run.submit("c", prompt(3, 20))
    run.run()
    run.submit("d", prompt(4, 20))
    run.run()
    for rid in "abcd":
        assert run.events[rid][-1][0] == "error"
        assert run.requests[rid].error == CRASHED
    assert 0 < len(run.token_times("a")) < 100
    assert run.engine.crashed
    assert run.engine.kv_usage == 0


# --- the virtual loop -------------------------------------------------------------------------


def test_virtual_loop_runs_callbacks_in_time_then_insertion_order() -> None:
    """Events run in time order; equal times keep the order they were added in."""
    loop = VirtualLoop()
    seen: list[str] = []
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    loop.run(until=1.5)
    assert (seen, loop.now) == (["a", "b"], 1.5)
    loop.run()
    assert (seen, loop.now) == (["a", "b", "c"], 2.0)
    with pytest.raises(ValueError, match="before now"):
        loop.at(1.0, lambda: None)
