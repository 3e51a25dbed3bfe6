"""``queue-scorer``: prefer the endpoint with the shortest model-server queue.

Formula (the llm-d router's), over the candidates with a known queue depth::

    score = (max_q - q) / (max_q - min_q)        1.0 for all when max_q == min_q

so the shortest queue scores 1, the longest 0, and the rest in between by
their distance. Reads ``queue_depth`` (the engine's waiting-requests gauge).

Parameters: ``maxAgeSeconds`` (1.0, ``staleness``); the router's scorer has none.

Unknown data: a candidate without a fresh ``queue_depth`` scores 0, as if it
had the longest queue, and takes no part in min/max. An endpoint whose
metrics stopped arriving is more likely overloaded or gone than idle, and
must not win on missing data. If no candidate is known, all score 0 and the
other scorers decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.staleness import ReadsMeasurements


class QueueScorer(ReadsMeasurements):
    reads: ClassVar[frozenset[str]] = frozenset({"queue_depth"})

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        depths = [c.value("queue_depth", now, self.max_age) for c in candidates]
        known = [q for q in depths if q is not None]
        if not known:
            return [0.0] * len(depths)
        shortest, longest = min(known), max(known)
        if longest == shortest:
            return [0.0 if q is None else 1.0 for q in depths]
        span = longest - shortest
        return [0.0 if q is None else (longest - q) / span for q in depths]
