"""The oracle router: what picking could reach if the router saw inside every engine.

It is no pipeline and no plugin: it reads the simulated engines directly.
For each request it estimates, on every engine, the time to its first token,
and picks by that estimate and the work the choice adds (below)::

    hit       = max(engine.cached_prefix(request),
                    the prefix it shares with prompts sent there and not yet prefilled)
    own       = len(prompt) - hit                       tokens this request must prefill
    ahead     = uncached prompt tokens of the requests sent there and not yet prefilled
    seqs      = requests sent there and not finished
    context   = their prompt tokens (what their decoding attends to)
    steps     = ceil((ahead + own) / (max_num_batched_tokens - seqs))
    estimate  = (ahead + own) * prefill_per_token
              + steps * (step_overhead + seqs * decode_per_seq
                         + context * decode_per_context_token)

That is the engine's own step-time model (``Profile.step_time``) applied to
an FCFS queue with chunked prefill: every prefill token ahead is computed
first, and every step also advances every sequence already decoding (one
token each, out of the step's token budget).

``cached_prefix`` alone would miss what is about to be cached: two requests
of a new group arriving close together would find the prefix nowhere and
could go to two engines, paying its prefill twice. So the oracle also
remembers, per engine, the prompts it sent there that have no first token
yet (their KV blocks are being computed), by the engine's own block hashes,
and counts a match there as a hit, as it will be when the new request's turn
comes (eviction aside). ``ahead`` is counted the same way: what each waiting
prompt will really have to prefill, which the engine's ``pending_tokens``
cannot know before the prompt is scheduled.

**The choice** is not the smallest estimate alone but the smallest
``estimate + WORK_WEIGHT * own * prefill_per_token``: each choice is also
charged, twice, the engine time its own uncached prefill takes from every
request that comes after it there. A pure time-to-first-token greedy is a
poor reference under load: whenever a group's engine is busy for a moment,
an idle engine without the prefix looks as fast, so the group spreads, its
prefix is prefilled again and evicts other groups' prefixes, and later
requests pay for it. On this benchmark's shared-prefix workload at 24 and
32 requests/s (L4 profile) the greedy rule (weight 0) had a TTFT p90 of
1.6 s and 3.8 s where the charged one had 0.2 s and 0.26 s. The weight 2
is the smallest tried that stops the spreading (2, 4 and 8 made the same
picks); the oracle is a strong heuristic with perfect information, not a
proven optimum.

Ties (equal costs, as when every engine is idle and holds nothing) go to
the engine with the fewest requests so far, then the lowest index: a
deterministic spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from simulator.engine import Engine, Request
from simulator.profiles import Profile

WORK_WEIGHT: Final = 2.0
"""How many times a choice's own uncached prefill time is added to its estimate (docstring)."""


class Oracle:
    """Picks the engine with the smallest estimated time to first token (module docstring)."""

    def __init__(
        self, engines: Sequence[Engine], profile: Profile, work_weight: float = WORK_WEIGHT
    ) -> None:
        self.engines = engines
        self.profile = profile
        self.work_weight = work_weight
        self.sent = [0] * len(engines)
        self.ahead = [0] * len(engines)
        """Per engine: uncached prompt tokens of the requests sent there, not yet prefilled."""
        self.seqs = [0] * len(engines)
        """Per engine: requests sent there and not finished."""
        self.context = [0] * len(engines)
        """Per engine: prompt tokens of those requests."""
        # Per engine: block hash -> how many prompts not yet prefilled there contain it.
        self._pending: list[dict[int, int]] = [{} for _ in engines]
        self._sent: dict[str, tuple[int, list[int], int]] = {}
        self._running: dict[str, tuple[int, int]] = {}

    def hit(self, index: int, request: Request, hashes: Sequence[int]) -> int:
        """Prompt tokens of ``request`` that will be cached on engine ``index`` at its turn."""
        size = self.profile.block_size
        pending = self._pending[index]
        blocks = 0
        for block in hashes:
            if block not in pending:
                break
            blocks += 1
        return max(self.engines[index].cached_prefix(request), blocks * size)

    def estimate(self, index: int, own: int) -> float:
        """Seconds until a prompt with ``own`` tokens to prefill gets a first token there."""
        profile = self.profile
        work = self.ahead[index] + own
        seqs = self.seqs[index]
        budget = max(1, profile.max_num_batched_tokens - seqs)
        steps = max(1, -(-work // budget))
        per_step = (
            profile.step_overhead
            + seqs * profile.decode_per_seq
            + self.context[index] * profile.decode_per_context_token
        )
        return work * profile.prefill_per_token + steps * per_step

    def cost(self, index: int, own: int) -> float:
        """The estimate plus the prefill this choice adds there (module docstring)."""
        return self.estimate(index, own) + self.work_weight * own * self.profile.prefill_per_token

    def choose(self, request: Request) -> int:
        """The engine for ``request``; its prompt counts as pending there until ``prefilled``."""
        size = self.profile.block_size
        length = len(request.tokens)
        # Full blocks, all but the last token: what the engine itself can hit.
        blocks = (length - 1) // size
        hashes = request.block_hashes(blocks, size)[:blocks]
        best, best_key, best_own = 0, (float("inf"), 0, 0), length
        for index in range(len(self.engines)):
            own = length - self.hit(index, request, hashes)
            key = (self.cost(index, own), self.sent[index], index)
            if key < best_key:
                best, best_key, best_own = index, key, own
        self.sent[best] += 1
        self.ahead[best] += best_own
        self.seqs[best] += 1
        self.context[best] += length
        self._running[request.id] = (best, length)
        pending = self._pending[best]
        for block in hashes:
            pending[block] = pending.get(block, 0) + 1
        self._sent[request.id] = (best, list(hashes), best_own)
        return best

    def prefilled(self, request_id: str) -> None:
        """The request's first token came (or it failed): its blocks are the engine's now."""
        entry = self._sent.pop(request_id, None)
        if entry is None:
            return
        index, hashes, own = entry
        self.ahead[index] -= own
        pending = self._pending[index]
        for block in hashes:
            left = pending[block] - 1
            if left:
                pending[block] = left
            else:
                del pending[block]

    def finished(self, request_id: str) -> None:
        """The request is over (done or failed): it no longer decodes there."""
        self.prefilled(request_id)
        entry = self._running.pop(request_id, None)
        if entry is not None:
            index, length = entry
            self.seqs[index] -= 1
            self.context[index] -= length
