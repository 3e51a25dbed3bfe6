"""``lora-affinity-scorer``: prefer endpoints where the requested LoRA adapter is or can be loaded.

Scores (the llm-d router's, from vLLM's ``vllm:lora_requests_info``), first
rule that holds, for the request's ``model``::

    1.0   the adapter is running here            model in lora_running
    0.8   this server can load one more adapter  len(lora_running) + len(lora_waiting) < lora_max
    0.6   the adapter is waiting to load here    model in lora_waiting
    0.0   otherwise: full, and the adapter is not here

Reads ``lora_running``, ``lora_waiting`` and ``lora_max``. A request for a
base model scores the same way (it is never "running" as an adapter), so
the scorer ranks servers by free adapter slots for it, as the router does.

Parameters: ``maxAgeSeconds`` (1.0, ``staleness``); the router's scorer has none.

Unknown data: without a fresh running set the candidate scores 0 (a server
that reports no adapters cannot be shown to hold one); a missing waiting
set counts as empty and a missing ``lora_max`` as 0 slots. A request without
a model scores 0 everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.staleness import ReadsMeasurements

RUNNING: Final = 1.0
ROOM: Final = 0.8
WAITING: Final = 0.6


class LoraAffinityScorer(ReadsMeasurements):
    reads: ClassVar[frozenset[str]] = frozenset({"lora_running", "lora_waiting", "lora_max"})

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        model = request.model
        if not model:
            return [0.0] * len(candidates)
        return [self._one(model, candidate, now) for candidate in candidates]

    def _one(self, model: str, candidate: Candidate, now: float) -> float:
        running = candidate.names("lora_running", now, self.max_age)
        if running is None:
            return 0.0
        if model in running:
            return RUNNING
        waiting = candidate.names("lora_waiting", now, self.max_age) or frozenset()
        slots = candidate.value("lora_max", now, self.max_age) or 0.0
        if len(running) + len(waiting) < slots:
            return ROOM
        return WAITING if model in waiting else 0.0
