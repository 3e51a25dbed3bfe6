"""``kv-cache-utilization-scorer``: prefer the endpoint with the most free KV cache.

Formula (the llm-d router's): ``score = 1 - kv_cache_usage``, usage being the
engine's 0–1 gauge (``vllm:kv_cache_usage_perc``, ``sglang:token_usage``);
a reading outside [0, 1] is clamped. Reads ``kv_cache_usage``.

Parameters: ``maxAgeSeconds`` (1.0, ``staleness``); the router's scorer has none.

Unknown data: a candidate without a fresh ``kv_cache_usage`` scores 0.5,
the middle of the range. Some engines never publish the gauge (llama.cpp's
server); they must be neither shunned as full nor preferred as empty. An
endpoint whose metrics stopped arriving also lands here, and ``queue-scorer``
is the one that marks it down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.staleness import ReadsMeasurements

UNKNOWN_SCORE: Final = 0.5


class KVCacheUtilizationScorer(ReadsMeasurements):
    reads: ClassVar[frozenset[str]] = frozenset({"kv_cache_usage"})

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        scores = []
        for candidate in candidates:
            usage = candidate.value("kv_cache_usage", now, self.max_age)
            scores.append(UNKNOWN_SCORE if usage is None else 1.0 - min(max(usage, 0.0), 1.0))
        return scores
