"""One simulated vLLM engine: continuous batching, chunked prefill, a block KV cache, preemption.

The model follows vLLM V1's scheduler and KV-cache manager closely enough
that a router sees the same signals (queue, batch, KV usage, prefix hits)
and the same consequences (a hit skips prefill, a full cache preempts), and
it is clock-agnostic: the engine never sleeps and never reads a clock. A
driver (``simulator.clocks``) calls ``step(now)`` to schedule a batch, waits
``step.duration`` in its own time (virtual, or real times ``time_scale``),
then calls ``finish(step, now)`` to apply the results and get the events.

**One step** (vLLM V1's ``Scheduler.schedule``, FCFS policy):

1. The running sequences, in admission order, each get their next tokens
   within the step's token budget (``max_num_batched_tokens``): one for a
   decoding sequence, the rest of its prompt (or as much as the budget
   allows: chunked prefill) for one still in prefill. Only the newest
   running sequence can be mid-prefill (a chunk is cut only when the budget
   runs out, and nothing is admitted after it in that step), so decodes come
   first and the prefill chunk last.
2. A running sequence that needs a new block when none is free preempts the
   most recently admitted running sequence (recompute mode): its blocks are
   freed, it goes back to the front of the waiting queue, and it later
   recomputes its prompt and the tokens it had generated, hitting whatever
   of them is still cached. If it is itself the newest, it preempts itself.
3. If nothing was preempted, waiting requests are admitted first come, first
   served while the budget lasts, fewer than ``max_num_seqs`` run and the KV
   cache can hold the request's whole sequence (its prompt, plus what it had
   generated if it was preempted), cached blocks aside: vLLM's
   ``scheduler_reserve_full_isl``, on by default (``Scheduling`` below). A
   request's prefill starts after its longest cached prefix (full blocks
   only, and never the whole sequence: the last token is always computed,
   as vLLM recomputes it to get logits). A request whose adapter would make
   more than ``max_loras`` distinct adapters run at once is skipped (it
   keeps its place) and the next is tried, as vLLM does.

**Step time** is ``Profile.step_time(prefill tokens, decoding sequences,
attended context tokens)``, plus ``lora_load_time`` for each adapter the
batch needs that is not resident (vLLM loads adapters into their GPU slots
before running the batch), times a random factor when
``Scheduling.step_jitter`` is set. Resident adapters are an LRU set of
``max_loras``; adapters of running requests are never evicted.

**Scheduling switches** (``Scheduling``; each defaults to what current vLLM
does, and can be turned off to see what it changes):

- ``full_prompt_admission``: the admission gate above. vLLM's
  ``SchedulerConfig.scheduler_reserve_full_isl`` (default True since
  vllm-project/vllm#37307) makes ``KVCacheManager.allocate_slots`` refuse a
  waiting request unless the blocks for ``request.num_tokens`` (prompt and
  any output so far), less its prefix hits, fit in the free blocks. Off, the
  gate is the first chunk only: long prompts are admitted, grow, and
  preempt each other, and the waiting queue stays short until they do.
- ``async_scheduling``: vLLM's default (vllm-project/vllm#27614). Its
  ``EngineCore.step_with_batch_queue`` keeps two batches in flight
  (``max_concurrent_batches`` is 2): the batch that starts when step *k*
  ends was scheduled while step *k* ran, before the requests that arrived
  during step *k* were read from the input queue. So a request that arrives
  at a busy engine waits one extra step to be admitted. The model keeps
  the scheduling at the step boundary and hides from it the requests that
  arrived after the previous step started; an engine that was idle (no step
  back to back) sees everything, as vLLM's busy loop then schedules at
  once. Blocks and slots freed in step *k* are usable at once here, one step
  earlier than in vLLM.
- ``cache_at_schedule``: vLLM registers a block in the prefix cache when the
  step that will fill it is scheduled (``allocate_slots`` ends with
  ``cache_blocks(request, min(computed + new tokens, request.num_tokens))``),
  so a request admitted later in the same schedule already hits it (each
  layer writes its KV before its attention reads it). Off, blocks are
  registered when the step ends.
- ``step_jitter``: each step's time is multiplied by a factor drawn
  uniformly from ``1 ± step_jitter`` (seeded; mean 1, so capacity is
  unchanged). Real step times vary (CPU scheduling, sampling, kernels); off
  (0), every step takes exactly its modelled time and tails are optimistic
  for every router alike.

**Tokens.** A step that completes a sequence's prefill samples its first
token (time to first token ends there); every later step samples one more.
Output token ``i`` is ``simulator.tokenizer.output_token(i)``, with a known
id, so blocks holding generated tokens are hashed and cached like prompt
blocks. A request ends after exactly ``max_tokens`` tokens (no EOS).

**KV cache**: ``simulator.kvcache``. Blocks are registered in the prefix
cache when the step that fills them is scheduled (``cache_at_schedule``).
``kv_usage`` is blocks in use over ``num_blocks``; cached blocks nobody uses
do not count.

**Look-ahead.** ``fork`` copies the whole state (queues, blocks, the step
in flight, the random state), so a caller can run the copy forward to see
what would happen to a request, without touching the engine itself.

**Faults** (``Faults``): injected errors, a stall mid-stream, dead metrics
(the HTTP layer's) and a crash after N requests.

**Cost.** ``step`` and ``finish`` are O(running + admitted) with no
per-token work for a prefill: a request's block hashes are computed once (a
tuple hash per block) and kept on the request.
"""

from __future__ import annotations

import copy
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from simulator.kv_events import KVEventLog
from simulator.kvcache import BlockPool, extend_hashes
from simulator.profiles import DEFAULT_PROFILE, PROFILES, Profile
from simulator.tokenizer import count_tokens, output_token, output_token_ids

__all__ = [
    "Engine",
    "Event",
    "Faults",
    "Request",
    "Scheduling",
    "Settings",
    "Step",
    "count_tokens",
    "output_token",
]

INJECTED_ERROR: Final = "injected error (fault error_rate)"
CRASHED: Final = "engine crashed (fault crash_after)"


@dataclass(frozen=True, slots=True)
class Faults:
    """Failures a replica can be told to show, to test what a router does about them."""

    error_rate: float = 0.0
    """Fraction of requests answered with an error at once (a seeded random draw per request)."""
    stall_after_tokens: int | None = None
    """Every stream stops producing after this many tokens ..."""
    stall_seconds: float = 0.0
    """... for this long (``math.inf``: forever); the sequence keeps its slot and blocks."""
    dead_metrics: bool = False
    """``/metrics`` answers 503 (the engine itself keeps working)."""
    crash_after: int | None = None
    """The replica serves this many requests; the next one crashes it, cutting off every
    request in flight, and it serves nothing afterwards."""

    def __post_init__(self) -> None:
        if not 0 <= self.error_rate <= 1:
            raise ValueError("error_rate: must be between 0 and 1")
        if self.stall_after_tokens is not None and self.stall_after_tokens < 1:
            raise ValueError("stall_after_tokens: must be at least 1")
        if self.stall_seconds < 0:
            raise ValueError("stall_seconds: must not be negative")
        if self.crash_after is not None and self.crash_after < 0:
            raise ValueError("crash_after: must not be negative")


@dataclass(frozen=True, slots=True)
class Scheduling:
    """Scheduler behaviours that differ between vLLM versions; each defaults to current vLLM.

    The module docstring says what each one models and where vLLM does it.
    """

    full_prompt_admission: bool = True
    """Admit a waiting request only if its whole sequence fits (``scheduler_reserve_full_isl``);
    False: only its first chunk must fit."""
    async_scheduling: bool = True
    """A request that arrives while a step runs is admitted one step later (vLLM's
    ``async_scheduling``); False: at the next step boundary."""
    cache_at_schedule: bool = True
    """Blocks are hittable from the schedule of the step that fills them; False: from its end."""
    step_jitter: float = 0.0
    """Each step's time is multiplied by a uniform draw from ``1 ± step_jitter`` (0: exact)."""

    def __post_init__(self) -> None:
        if not 0 <= self.step_jitter < 1:
            raise ValueError("step_jitter: must be at least 0 and below 1")


@dataclass(slots=True)
class Request:
    """One generation request: the prompt's token ids and how many tokens to produce.

    The engine fills in the fields after ``adapter`` as the request runs.
    The hash chain of the request's full blocks is computed once and kept
    here, so every engine (and a router asking ``cached_prefix``) reuses it.
    """

    id: str
    tokens: Sequence[int] = field(repr=False)
    """Prompt token ids (``simulator.tokenizer.tokenize``)."""
    max_tokens: int
    arrival: float
    """When the request was added, on the engine's clock."""
    adapter: str | None = None
    """LoRA adapter name, or None for the base model."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first scheduled."""
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0
    preemptions: int = 0
    error: str | None = None
    _hashes: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _hash_block_size: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token, once there is one."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def clone(self) -> Request:
        """A copy with the same progress, sharing the prompt and the hash chain (both fixed by
        the prompt), for a look-ahead that must not touch this request."""
        twin = Request(
            self.id,
            self.tokens,
            self.max_tokens,
            self.arrival,
            self.adapter,
            self.cached_tokens,
            self.first_token_at,
            self.finished_at,
            self.generated,
            self.preemptions,
            self.error,
        )
        twin._hashes = self._hashes
        twin._hash_block_size = self._hash_block_size
        return twin

    def sequence(self, start: int, end: int) -> Sequence[int]:
        """Token ids ``start:end`` of the sequence: the prompt, then the output tokens."""
        prompt = self.tokens
        size = len(prompt)
        if end <= size:
            return prompt[start:end]
        if start >= size:
            return output_token_ids(start - size, end - size)
        return [*prompt[start:size], *output_token_ids(0, end - size)]

    def block_hashes(self, blocks: int, block_size: int) -> list[int]:
        """The hash chain of the sequence's first ``blocks`` full blocks (computed once, kept)."""
        if self._hash_block_size != block_size:
            self._hashes = []
            self._hash_block_size = block_size
        if len(self._hashes) < blocks:
            adapter = self.adapter or ""
            extend_hashes(self._hashes, blocks, block_size, adapter, self.tokens, self.sequence)
        return self._hashes


@dataclass(frozen=True, slots=True)
class Event:
    """What happened to a request at the end of a step."""

    request: Request
    kind: Literal["token", "done", "error"]
    """``token``: output token ``request.generated - 1`` was produced; ``done``: the last one
    was; ``error``: the request failed (``request.error`` says why)."""


class _Seq:
    """The engine's bookkeeping for one request it holds."""

    __slots__ = (
        "added",
        "blocks",
        "capacity",
        "computed",
        "hashed",
        "live",
        "prompt_len",
        "request",
        "running",
        "scheduled_before",
        "stall_until",
        "token_event",
        "total",
    )

    def __init__(self, request: Request) -> None:
        self.request = request
        self.added = request.arrival  # when it joined the queue (async scheduling's lag)
        self.prompt_len = len(request.tokens)
        self.total = self.prompt_len + request.generated  # tokens in the sequence so far
        self.blocks: list[int] = []
        self.capacity = 0  # tokens the blocks hold: len(blocks) * block_size
        self.computed = 0  # tokens whose KV is in the cache (vLLM's num_computed_tokens)
        self.hashed = 0  # leading blocks registered in the prefix cache
        self.live = True
        self.running = False
        self.scheduled_before = False
        self.stall_until = -math.inf
        self.token_event = Event(request, "token")  # immutable, so one serves every token

    def copy(self, request: Request) -> _Seq:
        """This bookkeeping for ``request`` (a copy of ``self.request``), for ``Engine.fork``."""
        twin = _Seq(request)
        twin.added = self.added
        twin.prompt_len = self.prompt_len
        twin.total = self.total
        twin.blocks = list(self.blocks)
        twin.capacity = self.capacity
        twin.computed = self.computed
        twin.hashed = self.hashed
        twin.live = self.live
        twin.running = self.running
        twin.scheduled_before = self.scheduled_before
        twin.stall_until = self.stall_until
        return twin


@dataclass(frozen=True, slots=True)
class Step:
    """One scheduled batch: how long it takes, and what ``finish`` applies."""

    duration: float
    """Seconds this batch takes on the modelled hardware."""
    start: float
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    """KV tokens attended by the decoding sequences."""
    lora_loads: tuple[str, ...]
    """Adapters loaded before the batch ran."""
    preempted: int
    """Sequences preempted while scheduling this batch."""
    batch: tuple[tuple[_Seq, int], ...] = field(repr=False)


class Engine:
    """The state of one engine; ``step``/``finish`` advance it (see the module docstring)."""

    __slots__ = (
        "_in_flight",
        "_jitter",
        "_last_now",
        "_loaded",
        "_outbox",
        "_pending",
        "_pool",
        "_prev_end",
        "_prev_start",
        "_rng",
        "_running",
        "_seqs",
        "_waiting",
        "all_tokens",
        "crashed",
        "errors_total",
        "faults",
        "generation_tokens_total",
        "kv_events",
        "preemptions_total",
        "prefix_hits_total",
        "prefix_queries_total",
        "profile",
        "prompt_tokens_total",
        "requests_total",
        "running_adapters",
        "scheduling",
        "waiting_adapters",
    )

    def __init__(
        self,
        profile: Profile,
        *,
        faults: Faults = Faults(),
        seed: int = 0,
        all_tokens: bool = True,
        scheduling: Scheduling = Scheduling(),
    ) -> None:
        """``all_tokens=False`` reports only the first token and ``done`` of each request (a
        benchmark that needs only time to first token and completion saves one event per token)."""
        self.profile = profile
        self.faults = faults
        self.all_tokens = all_tokens
        self.scheduling = scheduling
        self._rng = random.Random(seed)
        # Its own stream, so turning jitter on leaves the fault draws as they were.
        self._jitter = random.Random(f"step-jitter-{seed}")
        self._in_flight: Step | None = None
        self._prev_start = self._prev_end = -math.inf
        self._pool = BlockPool(profile.num_blocks)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}
        self._outbox: list[Event] = []
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._pending = 0
        self._last_now = -math.inf
        self.crashed = False
        self.running_adapters: Counter[str] = Counter()
        self.waiting_adapters: Counter[str] = Counter()
        self.requests_total = 0
        self.errors_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self.preemptions_total = 0
        self.kv_events: KVEventLog | None = None
        """Where the block-cache events go, when published (``publish_kv_events``)."""

    def publish_kv_events(self, log: KVEventLog) -> None:
        """Report every block entering and leaving the prefix cache to ``log``, a batch a step,
        as vLLM does with ``--kv-events-config`` (``simulator.kv_events``)."""
        self.kv_events = log
        self._pool.on_evict = log.removed

    # --- state ---------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Sequences in the running batch (vLLM's ``num_requests_running``)."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests waiting to be scheduled, preempted ones included."""
        return len(self._waiting)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def used_blocks(self) -> int:
        return self._pool.used

    @property
    def kv_usage(self) -> float:
        """Blocks in use over all blocks, 0-1 (cached blocks nobody holds do not count)."""
        return self._pool.used / self._pool.num_blocks

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        """Resident LoRA adapters, least recently used first."""
        return tuple(self._loaded)

    @property
    def in_flight(self) -> Step | None:
        """The step scheduled and not yet finished, if any."""
        return self._in_flight

    @property
    def idle(self) -> bool:
        """Nothing to run and nothing to report."""
        return not (self._running or self._waiting or self._outbox)

    @property
    def wake_at(self) -> float | None:
        """When a stalled sequence resumes, if the engine has nothing else to do until then."""
        ends = [s.stall_until for s in self._running if s.stall_until > self._last_now]
        soonest = min(ends, default=math.inf)
        return None if math.isinf(soonest) else soonest

    def cached_prefix(self, tokens: Sequence[int] | Request, adapter: str | None = None) -> int:
        """Leading prompt tokens that would hit the prefix cache now; no side effects.

        Full blocks only, and at most all tokens but the last, as in scheduling.
        Given a ``Request``, its kept hash chain is used (and its adapter).
        """
        size = self.profile.block_size
        if isinstance(tokens, Request):
            count = len(tokens.tokens)
            hashes = tokens.block_hashes(count // size, size)
        else:
            count = len(tokens)
            probe = Request("", tokens, 1, 0.0, adapter)
            hashes = probe.block_hashes(count // size, size)
        return self._pool.hit_length(hashes, (count - 1) // size) * size

    def pending_tokens(self) -> int:
        """Tokens still to run through the model for every request held: the rest of each
        prompt (after what hit the cache) plus each remaining output token; for a queue
        estimate. Kept as a running total, so reading it is O(1)."""
        return self._pending

    def validate(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why the engine would refuse a request of this size, or None if it would run it.

        vLLM refuses an empty prompt, and a sequence longer than the KV cache
        can hold (it could never run, not even alone).
        """
        if prompt_tokens < 1:
            return "the prompt must have at least one token"
        if max_tokens < 1:
            return "max_tokens must be at least 1"
        size = self.profile.block_size
        blocks = -(-(prompt_tokens + max_tokens - 1) // size)
        if blocks > self._pool.num_blocks:
            return (
                f"{prompt_tokens} prompt tokens and {max_tokens} output tokens need {blocks} "
                f"KV blocks of {size} tokens; the cache has {self._pool.num_blocks}"
            )
        return None

    # --- requests ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Put a request at the back of the waiting queue.

        A request that cannot run, an injected error and a crash are reported
        as an ``error`` event by the next ``finish`` (the next ``step`` is
        then never None), with ``request.error`` set at once.
        """
        if request.id in self._seqs:
            raise ValueError(f"request {request.id!r} is already in the engine")
        earlier = self.requests_total
        self.requests_total += 1
        crash_after = self.faults.crash_after
        if not self.crashed and crash_after is not None and earlier >= crash_after:
            self._crash(request.arrival)
        if self.crashed:
            self._fail(request, CRASHED, request.arrival)
            return
        problem = self.validate(len(request.tokens), request.max_tokens)
        if problem is not None:
            self._fail(request, problem, request.arrival)
            return
        if self.faults.error_rate and self._rng.random() < self.faults.error_rate:
            self._fail(request, INJECTED_ERROR, request.arrival)
            return
        seq = _Seq(request)
        self._seqs[request.id] = seq
        self._waiting.append(seq)
        self._pending += seq.prompt_len + request.max_tokens - 1
        if request.adapter:
            self.waiting_adapters[request.adapter] += 1

    def abort(self, request_id: str) -> None:
        """The client went away: drop the request wherever it is and free its blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.running:
            self._running.remove(seq)
            self._leave_running(seq)
        else:
            self._waiting.remove(seq)
            self._leave_waiting(seq)
        self._drop(seq)

    # --- stepping ------------------------------------------------------------------------

    def step(self, now: float) -> Step | None:
        """Schedule one batch at ``now``; None when there is nothing to run or report."""
        self._last_now = now
        profile = self.profile
        size = profile.block_size
        pool = self._pool
        running = self._running
        budget = profile.max_num_batched_tokens
        at_schedule = self.scheduling.cache_at_schedule
        batch: list[tuple[_Seq, int]] = []
        prefill = decodes = context = preempted = 0

        append = batch.append
        # Popping victims off the end while iterating is safe: a list iterator checks the
        # length at every step, so the loop simply ends before the preempted ones.
        for seq in running:
            if budget == 0:
                break
            if seq.stall_until > now:
                continue
            computed = seq.computed
            remaining = seq.total - computed
            count = remaining if remaining < budget else budget
            end = computed + count
            if end > seq.capacity:  # the step's tokens need another block
                need = (end - seq.capacity + size - 1) // size
                new = pool.allocate(need)
                while new is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq:
                        break
                    new = pool.allocate(need)
                if new is None:
                    break  # ``seq`` was the newest and preempted itself
                seq.blocks += new
                seq.capacity += need * size
            append((seq, count))
            budget -= count
            if at_schedule and end >= (seq.hashed + 1) * size:
                self._register(seq, end)
            if remaining == 1 and seq.total > seq.prompt_len:
                decodes += 1
                context += end
            else:
                prefill += count

        loads: list[str] = []
        if not preempted and self._waiting:
            # Async scheduling: back to back, this batch was decided while the previous one
            # ran, before the requests that came since it started were read.
            lagged = self.scheduling.async_scheduling and self._prev_end == now
            cutoff = self._prev_start if lagged else now
            budget, admitted = self._admit(batch, budget, cutoff, loads)
            if lagged and not batch:
                # vLLM would have run an empty batch and scheduled again at once.
                budget, admitted = self._admit(batch, budget, now, loads)
            for seq, count in admitted:
                if count == 1 and seq.request.generated:
                    decodes += 1
                    context += seq.computed + 1
                else:
                    prefill += count

        if not batch and not self._outbox:
            return None
        duration = 0.0
        if batch:
            duration = profile.step_time(prefill, decodes, context)
            duration += profile.lora_load_time * len(loads)
            jitter = self.scheduling.step_jitter
            if jitter:
                duration *= 1.0 + jitter * (2.0 * self._jitter.random() - 1.0)
        step = Step(duration, now, prefill, decodes, context, tuple(loads), preempted, tuple(batch))
        self._in_flight = step
        return step

    def _admit(
        self, batch: list[tuple[_Seq, int]], budget: int, cutoff: float, loads: list[str]
    ) -> tuple[int, list[tuple[_Seq, int]]]:
        """Admit waiting requests that joined by ``cutoff`` into ``batch``, first come first
        served (module docstring, rule 3); the budget left and what was admitted."""
        profile = self.profile
        size = profile.block_size
        pool = self._pool
        running = self._running
        waiting = self._waiting
        full = self.scheduling.full_prompt_admission
        at_schedule = self.scheduling.cache_at_schedule
        admitted: list[tuple[_Seq, int]] = []
        skipped: list[_Seq] = []
        loras = self.running_adapters
        while waiting and budget > 0 and len(running) < profile.max_num_seqs:
            seq = waiting[0]
            if seq.added > cutoff:
                break  # not read yet; everyone behind it came later still
            request = seq.request
            adapter = request.adapter
            if adapter and adapter not in loras and len(loras) >= profile.max_loras:
                skipped.append(waiting.popleft())
                continue
            total = seq.total
            hashes = request.block_hashes(total // size, size)
            hits = pool.hits(hashes, (total - 1) // size)
            computed = len(hits) * size
            count = min(total - computed, budget)
            need = (computed + count + size - 1) // size - len(hits)
            # The gate: the whole sequence's blocks, or this step's chunk's.
            gate = (total + size - 1) // size - len(hits) if full else need
            if gate > pool.free - pool.evictable(hits):
                break  # the head waits for blocks; FCFS does not look past it
            pool.touch(hits)
            new = pool.allocate(need)
            assert new is not None
            seq.blocks = hits + new
            seq.capacity = len(seq.blocks) * size
            seq.computed = computed
            seq.hashed = len(hits)
            self._pending -= computed
            if not seq.scheduled_before:
                seq.scheduled_before = True
                request.cached_tokens = computed
                self.prefix_queries_total += seq.prompt_len
                self.prefix_hits_total += computed
            waiting.popleft()
            self._leave_waiting(seq)
            running.append(seq)
            seq.running = True
            if adapter:
                loras[adapter] += 1
                if adapter in self._loaded:
                    self._loaded.move_to_end(adapter)
                else:
                    loads.append(adapter)
                    self._load(adapter)
            if at_schedule and computed + count >= (seq.hashed + 1) * size:
                self._register(seq, computed + count)
            batch.append((seq, count))
            admitted.append((seq, count))
            budget -= count
        if skipped:
            waiting.extendleft(reversed(skipped))
        return budget, admitted

    def finish(self, step: Step, now: float) -> list[Event]:
        """Apply a batch's results at ``now`` (its end) and return what happened, in order."""
        events = self._outbox
        self._outbox = []
        if step is self._in_flight:
            self._in_flight = None
            self._prev_start, self._prev_end = step.start, now
        size = self.profile.block_size
        at_end = not self.scheduling.cache_at_schedule
        faults = self.faults
        all_tokens = self.all_tokens
        done = False
        fed = generated_now = 0
        stall_after, stall_seconds = faults.stall_after_tokens, faults.stall_seconds
        for seq, count in step.batch:
            if not seq.live:
                continue  # aborted while the step ran
            computed = seq.computed + count
            seq.computed = computed
            fed += count
            if at_end and computed >= (seq.hashed + 1) * size:  # blocks filled
                self._register(seq, computed)
            if computed < seq.total:
                continue  # a prefill chunk: no token yet
            request = seq.request
            seq.total += 1
            generated = request.generated + 1
            request.generated = generated
            generated_now += 1
            if generated == 1:
                request.first_token_at = now
                self.prompt_tokens_total += seq.prompt_len
                events.append(seq.token_event)
            elif all_tokens:
                events.append(seq.token_event)
            if generated >= request.max_tokens:
                request.finished_at = now
                events.append(Event(request, "done"))
                seq.live = False
                del self._seqs[request.id]
                self._leave_running(seq)
                self._pool.release(seq.blocks)
                seq.blocks = []
                seq.capacity = 0
                done = True
            elif generated == stall_after and stall_seconds:
                seq.stall_until = now + stall_seconds
        self._pending -= fed
        self.generation_tokens_total += generated_now
        if done:
            self._running = [seq for seq in self._running if seq.live]
        if self.kv_events is not None:
            self.kv_events.flush(now)
        return events

    def fork(self) -> Engine:
        """An independent copy of this engine, to run forward without touching this one.

        Everything that decides what happens next is copied: the queues, every
        request's progress (on copies of the requests, sharing their prompt and
        hash chain), the KV blocks and prefix cache, the step in flight (finish
        the copy's ``in_flight`` first), the resident adapters and the random
        state. Events waiting to be reported are not (they concern requests
        that are already decided), and the copy reports only first tokens and
        completions (``all_tokens=False``). Cost: O(blocks + requests held).
        """
        twin = copy.copy(
            self
        )  # settings, counters, clock marks: immutable; the rest replaced below
        twin.all_tokens = False
        twin._rng = random.Random()
        twin._rng.setstate(self._rng.getstate())
        twin._jitter = random.Random()
        twin._jitter.setstate(self._jitter.getstate())
        twin._pool = self._pool.copy()
        twin.kv_events = None
        seqs: dict[int, _Seq] = {}
        for seq in self._seqs.values():
            seqs[id(seq)] = seq.copy(seq.request.clone())
        twin._seqs = {seq.request.id: seq for seq in seqs.values()}
        twin._running = [seqs[id(seq)] for seq in self._running]
        twin._waiting = deque(seqs[id(seq)] for seq in self._waiting)
        step = self._in_flight
        twin._in_flight = None
        if step is not None:
            batch = tuple((seqs[id(seq)], count) for seq, count in step.batch if id(seq) in seqs)
            twin._in_flight = replace(step, batch=batch)
        twin._outbox = []
        twin._loaded = OrderedDict(self._loaded)
        twin.running_adapters = Counter(self.running_adapters)
        twin.waiting_adapters = Counter(self.waiting_adapters)
        return twin

    # --- internals -----------------------------------------------------------------------

    def _register(self, seq: _Seq, tokens: int) -> None:
        """Put the sequence's full blocks up to ``tokens`` into the prefix cache."""
        size = self.profile.block_size
        full = tokens // size
        hashes = seq.request.block_hashes(full, size)
        blocks = seq.blocks
        register = self._pool.register
        log = self.kv_events
        if log is None:
            for index in range(seq.hashed, full):
                register(blocks[index], hashes[index])
        else:  # report each run of blocks that became the cached copy as one BlockStored
            request, run = seq.request, seq.hashed
            for index in range(seq.hashed, full):
                if not register(blocks[index], hashes[index]):
                    log.stored(hashes, run, index, request.sequence, request.adapter or "")
                    run = index + 1
            log.stored(hashes, run, full, request.sequence, request.adapter or "")
        seq.hashed = full

    def _preempt(self, seq: _Seq) -> None:
        """Recompute-mode preemption: free the blocks, back to the front of the queue."""
        self._pool.release(seq.blocks)
        seq.blocks = []
        seq.capacity = 0
        self._pending += seq.computed
        seq.computed = 0
        seq.hashed = 0
        seq.request.preemptions += 1
        self.preemptions_total += 1
        self._leave_running(seq)
        self._waiting.appendleft(seq)
        if seq.request.adapter:
            self.waiting_adapters[seq.request.adapter] += 1

    def _leave_running(self, seq: _Seq) -> None:
        seq.running = False
        adapter = seq.request.adapter
        if adapter:
            _decrement(self.running_adapters, adapter)
            if adapter in self._loaded:
                self._loaded.move_to_end(adapter)

    def _leave_waiting(self, seq: _Seq) -> None:
        if seq.request.adapter:
            _decrement(self.waiting_adapters, seq.request.adapter)

    def _drop(self, seq: _Seq) -> None:
        """Forget a request that leaves before finishing: free its blocks and pending work."""
        seq.live = False
        self._pool.release(seq.blocks)
        seq.blocks = []
        seq.capacity = 0
        self._pending -= seq.prompt_len + seq.request.max_tokens - 1 - seq.computed

    def _load(self, adapter: str) -> None:
        """Make ``adapter`` resident, evicting the least recently used idle one if full."""
        self._loaded[adapter] = None
        if len(self._loaded) > self.profile.max_loras:
            for name in self._loaded:
                if name not in self.running_adapters:
                    del self._loaded[name]
                    break

    def _fail(self, request: Request, reason: str, now: float) -> None:
        request.error = reason
        request.finished_at = now
        self.errors_total += 1
        self._outbox.append(Event(request, "error"))

    def _crash(self, now: float) -> None:
        """The replica dies: every request it holds fails, and it takes no more."""
        self.crashed = True
        for seq in [*self._running, *self._waiting]:
            self._drop(seq)
            self._fail(seq.request, CRASHED, now)
        self._running.clear()
        self._waiting.clear()
        self._seqs.clear()
        self.running_adapters.clear()
        self.waiting_adapters.clear()


def _decrement(counter: Counter[str], key: str) -> None:
    """Count one less, deleting the key at zero (so ``len`` counts only present keys)."""
    if counter[key] <= 1:
        counter.pop(key, None)
    else:
        counter[key] -= 1


@dataclass(frozen=True, slots=True)
class Settings:
    """How a served replica is built: a profile, scheduler switches, the driver's time scale,
    faults, a seed.

    ``max_running`` and ``kv_capacity`` override the profile's
    ``max_num_seqs`` and KV-cache size (in tokens; the cache gets
    ``ceil(kv_capacity / block_size)`` blocks), for small, easily filled
    replicas in tests and demos.
    """

    profile: str | Profile = DEFAULT_PROFILE
    """A name in ``simulator.profiles.PROFILES``, or a ``Profile``."""
    time_scale: float = 1.0
    """Multiplies every delay of the real-time driver; 0 means no delay at all."""
    max_running: int | None = None
    """Overrides the profile's ``max_num_seqs``."""
    kv_capacity: int | None = None
    """Overrides the profile's KV-cache size, in tokens."""
    faults: Faults = Faults()
    seed: int = 0
    """Seeds the fault draws and the step jitter; replica ``i`` of a process uses ``seed + i``."""
    scheduling: Scheduling = Scheduling()
    """The scheduler's switches (current vLLM by default)."""

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError("time_scale: must not be negative")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError("max_running: must be at least 1")
        if self.kv_capacity is not None and self.kv_capacity < 1:
            raise ValueError("kv_capacity: must be at least 1")
        if isinstance(self.profile, str) and self.profile not in PROFILES:
            known = ", ".join(PROFILES)
            raise ValueError(f"profile: {self.profile!r} is not one of {known}")

    def engine_profile(self) -> Profile:
        """The profile with this replica's overrides applied."""
        profile = PROFILES[self.profile] if isinstance(self.profile, str) else self.profile
        changes: dict[str, int] = {}
        if self.max_running is not None:
            changes["max_num_seqs"] = self.max_running
        if self.kv_capacity is not None:
            changes["num_blocks"] = -(-self.kv_capacity // profile.block_size)
        return profile.replace(**changes) if changes else profile

    def engine(self, index: int = 0) -> Engine:
        """A fresh engine for replica ``index``."""
        return Engine(
            self.engine_profile(),
            faults=self.faults,
            seed=self.seed + index,
            scheduling=self.scheduling,
        )
