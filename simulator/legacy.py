"""One simulated inference engine: a waiting queue, a running batch, KV usage and token timing.

A real engine (vLLM, SGLang) admits up to a fixed number of sequences into its
running batch, makes the rest wait, and slows down as the batch grows. This
module models exactly that much, so an endpoint picker reading ``/metrics``
sees the same signals it would see from vLLM, and a loaded replica really does
answer more slowly. All times are in seconds; ``time_scale`` multiplies every
delay (0 turns the delays into bare event-loop yields, for tests)::

    load(r)   = 1 + load_factor * (r - 1)       r = running requests, this one included
    ttft      = (ttft_base + prefill_per_token * prompt_tokens) * load(r)
    itl       = itl_base * load(r)              before each output token after the first
    total     = queue wait + ttft + (max_tokens - 1) * itl
    kv_usage  = min(1, tokens held by running requests / kv_capacity)

``r`` is read again before every token, so a stream speeds up or slows down as
other requests join or leave the batch. A running request holds its prompt
tokens plus the tokens generated so far. The queue wait is not a formula: it
is however long the request actually spends waiting for one of the
``max_running`` slots, first come, first served.

Tokens are words and punctuation marks (``count_tokens``), not a real
tokenizer's sub-words; the output is a fixed word cycle (``output_token``), so
equal requests get equal answers on every replica.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Final

Sleep = Callable[[float], Awaitable[None]]
"""How the engine waits; ``asyncio.sleep`` in production, a recorder or a gate in tests."""

_TOKEN: Final = re.compile(r"\w+|[^\w\s]")
_WORDS: Final = ("the", "quick", "simulated", "model", "answers", "every", "request", "in", "kind")


def count_tokens(text: str) -> int:
    """Tokens in ``text``: each run of letters/digits/underscores is one, each other symbol one.

    ``"Hello, world!"`` is 4 tokens. Deterministic and dependency-free; real
    BPE tokenizers give roughly 1.3 times as many for English prose.
    """
    return len(_TOKEN.findall(text))


def output_token(index: int) -> str:
    """The text of output token ``index``: a fixed word cycle, space-separated.

    Joining tokens 0..n-1 gives a text that ``count_tokens`` counts as n.
    """
    word = _WORDS[index % len(_WORDS)]
    return word if index == 0 else f" {word}"


@dataclass(frozen=True, slots=True)
class Settings:
    """The knobs of the latency and capacity model (see the module docstring)."""

    ttft_base: float = 0.005
    """Seconds to the first token for an empty prompt on an idle replica."""
    prefill_per_token: float = 0.0001
    """Extra seconds to the first token per prompt token (prefill cost)."""
    itl_base: float = 0.002
    """Seconds between two output tokens on an idle replica (decode cost)."""
    load_factor: float = 0.1
    """Slowdown per additional running request: 0.1 makes a batch of 8 run 1.7 times slower."""
    max_running: int = 8
    """Requests decoded at once; the rest wait in the queue (``num_requests_waiting``)."""
    kv_capacity: int = 2048
    """Tokens the KV cache holds; ``kv_cache_usage_perc`` is held tokens over this."""
    time_scale: float = 1.0
    """Multiplies every delay; 0 means no delay at all."""

    def __post_init__(self) -> None:
        for field in fields(self):
            if getattr(self, field.name) < 0:
                raise ValueError(f"{field.name}: must not be negative")
        if self.max_running < 1 or self.kv_capacity < 1:
            raise ValueError("max_running and kv_capacity: must be at least 1")

    def load(self, running: int) -> float:
        """The batch slowdown factor when ``running`` requests share the engine."""
        return 1.0 + self.load_factor * max(running - 1, 0)

    def ttft(self, prompt_tokens: int, running: int) -> float:
        """Seconds from admission to the first output token."""
        prefill = self.ttft_base + self.prefill_per_token * prompt_tokens
        return self.time_scale * prefill * self.load(running)

    def itl(self, running: int) -> float:
        """Seconds before each output token after the first."""
        return self.time_scale * self.itl_base * self.load(running)


class Engine:
    """The load state of one replica: what ``/metrics`` reports and what slows requests down.

    Single-threaded by construction: every change happens between two awaits
    of one event loop, so plain integers need no lock.
    """

    __slots__ = (
        "_queue",
        "_sleep",
        "generation_tokens_total",
        "kv_tokens",
        "prompt_tokens_total",
        "running",
        "running_adapters",
        "settings",
        "waiting_adapters",
    )

    def __init__(self, settings: Settings, sleep: Sleep = asyncio.sleep) -> None:
        self.settings = settings
        self._sleep = sleep
        self._queue: deque[asyncio.Future[None]] = deque()
        self.running = 0
        self.kv_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.running_adapters: Counter[str] = Counter()
        self.waiting_adapters: Counter[str] = Counter()

    @property
    def waiting(self) -> int:
        """Requests queued for a running slot."""
        return len(self._queue)

    @property
    def kv_usage(self) -> float:
        """Fraction (0-1) of the KV cache held by running requests."""
        return min(1.0, self.kv_tokens / self.settings.kv_capacity)

    async def generate(
        self, prompt_tokens: int, max_tokens: int, adapter: str | None = None
    ) -> AsyncGenerator[str, None]:
        """Yield ``max_tokens`` output tokens, each after its simulated delay.

        Consume it inside ``contextlib.aclosing`` so that a client that goes
        away mid-stream frees its slot and KV tokens at once.
        """
        if adapter:
            self.waiting_adapters[adapter] += 1
        try:
            await self._admit()
        finally:
            if adapter:
                self.waiting_adapters[adapter] -= 1
        if adapter:
            self.running_adapters[adapter] += 1
        held = prompt_tokens
        self.kv_tokens += held
        try:
            await self._sleep(self.settings.ttft(prompt_tokens, self.running))
            self.prompt_tokens_total += prompt_tokens
            for index in range(max_tokens):
                if index:
                    await self._sleep(self.settings.itl(self.running))
                held += 1
                self.kv_tokens += 1
                self.generation_tokens_total += 1
                yield output_token(index)
        finally:
            self.kv_tokens -= held
            if adapter:
                self.running_adapters[adapter] -= 1
            self._release()

    async def _admit(self) -> None:
        """Take a running slot, waiting in first-come order when all are taken."""
        if self.running < self.settings.max_running and not self._queue:
            self.running += 1
            return
        slot = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.cancelled():  # still queued: just leave the queue
                self._queue.remove(slot)
            else:  # a slot was handed over just as we were cancelled: pass it on
                self._release()
            raise

    def _release(self) -> None:
        """Free a running slot, handing it straight to the oldest waiter if there is one."""
        if self._queue:
            self._queue.popleft().set_result(None)  # ``running`` stays: the slot changes hands
        else:
            self.running -= 1
