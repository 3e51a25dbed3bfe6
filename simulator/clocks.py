"""The two clocks that drive one engine model: virtual time in-process, and real time for HTTP.

``simulator.engine.Engine`` never reads a clock: ``step(now)`` schedules a
batch and says how long it takes, ``finish(step, now)`` applies it. A driver
decides what "takes" means:

- ``VirtualEngine`` on a ``VirtualLoop``: discrete-event time. A step's end
  is an event ``duration`` seconds later on the loop; nothing sleeps, so a
  benchmark can push 10^5 requests through several engines in seconds of
  wall time, and the same inputs give the same results every run.
- ``RealTimeEngine``: an asyncio task that really waits ``duration *
  time_scale`` seconds per step, behind the HTTP server. ``time_scale`` 0
  means no delay at all (each step still yields to the event loop once, so
  streams interleave and tokens arrive in order).

Both step the engine back to back while it has work, exactly as vLLM's
engine core loop does, and go quiet when it is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Literal

from simulator.engine import Engine, Event, Request, Step

Sleep = Callable[[float], Awaitable[None]]
"""How the real-time driver waits; ``asyncio.sleep``, or a gate in tests."""


class VirtualLoop:
    """Discrete-event time: callbacks run in time order, equal times in insertion order."""

    __slots__ = ("_counter", "_queue", "now")

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._counter = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at time ``when`` (not before ``now``)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when}, before now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._counter), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` ``delay`` seconds from now."""
        self.at(self.now + delay, callback)

    def run(self, until: float | None = None) -> None:
        """Process events in time order, all of them or those up to ``until`` (then now = until)."""
        queue = self._queue
        while queue and (until is None or queue[0][0] <= until):
            when, _, callback = heapq.heappop(queue)
            self.now = when
            callback()
        if until is not None and until > self.now:
            self.now = until

    @property
    def pending(self) -> int:
        """Events not yet processed."""
        return len(self._queue)


class VirtualEngine:
    """Drives one ``Engine`` on a ``VirtualLoop``; every event goes to ``on_event``."""

    __slots__ = ("_active", "_epoch", "engine", "loop", "on_event", "steps")

    def __init__(
        self, engine: Engine, loop: VirtualLoop, on_event: Callable[[Event], None]
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.on_event = on_event
        self.steps = 0
        """Steps run so far."""
        self._active = False  # a step is scheduled or running
        self._epoch = 0  # invalidates a pending wake-up when stepping restarts earlier

    def submit(self, request: Request) -> None:
        """Add ``request`` (its ``arrival`` should be ``loop.now``) and step if idle."""
        self.engine.add(request)
        self._kick()

    def abort(self, request_id: str) -> None:
        """Drop a request (the client gave up)."""
        self.engine.abort(request_id)
        self._kick()

    def _kick(self) -> None:
        if not self._active:
            self._active = True
            self._epoch += 1
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        loop = self.loop
        step = self.engine.step(loop.now)
        if step is None:
            self._active = False
            wake = self.engine.wake_at
            if wake is not None:
                epoch = self._epoch
                loop.at(max(wake, loop.now), lambda: self._wake(epoch))
            return
        self.steps += 1
        loop.at(loop.now + step.duration, lambda: self._finish(step))

    def _wake(self, epoch: int) -> None:
        if epoch == self._epoch and not self._active:
            self._kick()

    def _finish(self, step: Step) -> None:
        for event in self.engine.finish(step, self.loop.now):
            self.on_event(event)
        self._step()


class EngineError(Exception):
    """The engine answered a request with an error (``Request.error`` says why)."""


_Item = tuple[Literal["token", "done", "error"], int]


class RealTimeEngine:
    """Drives one ``Engine`` in asyncio time: each step really takes ``duration * time_scale``.

    Engine time is model seconds: it advances by each step's duration while
    the engine is busy, and catches up with the wall clock (divided by
    ``time_scale``) when work arrives at an idle engine. With ``time_scale``
    0 it is the sum of the step durations.
    """

    __slots__ = ("_kick", "_now", "_origin", "_queues", "_sleep", "_task", "engine", "time_scale")

    def __init__(
        self, engine: Engine, *, time_scale: float = 1.0, sleep: Sleep = asyncio.sleep
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale: must not be negative")
        self.engine = engine
        self.time_scale = time_scale
        self._sleep = sleep
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._now = 0.0
        self._origin: float | None = None

    def now(self) -> float:
        """The engine's clock, in model seconds."""
        if self.time_scale > 0:
            loop = asyncio.get_running_loop()
            if self._origin is None:
                self._origin = loop.time()
            self._now = max(self._now, (loop.time() - self._origin) / self.time_scale)
        return self._now

    async def generate(self, request: Request) -> AsyncGenerator[int, None]:
        """Yield the index of each output token as the engine produces it.

        Raises ``EngineError`` for a request the engine fails (an injected
        error, a crash, a request too large for the KV cache). Closing or
        cancelling the iterator aborts the request and frees its blocks.
        """
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[request.id] = queue
        finished = False
        try:
            self.engine.add(request)
            self._wake()
            if request.error is not None:
                finished = True
                raise EngineError(request.error)
            while True:
                kind, index = await queue.get()
                if kind == "token":
                    yield index
                elif kind == "done":
                    finished = True
                    return
                else:
                    finished = True
                    raise EngineError(request.error or "engine error")
        finally:
            del self._queues[request.id]
            if not finished:
                self.engine.abort(request.id)
                self._wake()

    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        else:
            self._kick.set()

    async def _run(self) -> None:
        engine = self.engine
        busy = False
        while True:
            start = self._now if busy else self.now()
            step = engine.step(start)
            if step is None:
                busy = False
                if engine.idle:
                    return
                self._kick.clear()
                wake = engine.wake_at
                if wake is None:
                    await self._kick.wait()  # blocked (a stall without end): until news
                elif self.time_scale == 0:
                    self._now = max(self._now, wake)
                else:
                    timeout = (wake - start) * self.time_scale
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._kick.wait(), timeout)
                continue
            busy = True
            await self._sleep(step.duration * self.time_scale)
            end = start + step.duration
            self._now = max(self._now, end)
            for event in engine.finish(step, end):
                self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        queue = self._queues.get(event.request.id)
        if queue is not None:  # None: the caller already gave up or was answered
            queue.put_nowait((event.kind, event.request.generated - 1))

    async def aclose(self) -> None:
        """Stop stepping (requests still in flight get no more tokens)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
