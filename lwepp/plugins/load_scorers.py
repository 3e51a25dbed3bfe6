"""The llm-d router's load scorers: active requests, tokens in flight, waiting queue.

The first two read what ``inflight-load-producer`` counts on the request path
(``lwepp.plugins.inflight``), so they see a pick the moment it is made; the
third reads the engines' scraped waiting queues, as the router's does.

``active-request-scorer`` (parameters ``idleThreshold`` 0, ``maxBusyScore``
1.0, ``inFlightLoadProducerName``; ``requestTimeout`` is accepted and
ignored, as the router deprecated it)::

    requests <= idleThreshold          → 1.0
    otherwise                          → (max_requests - requests) / max_requests × maxBusyScore

where ``max_requests`` is the busiest candidate's count. As in the router, a
negative ``idleThreshold`` counts as 0 and a ``maxBusyScore`` outside [0, 1]
as 1.0.

``token-load-scorer`` (``queueThresholdTokens`` 4194304, ``inFlightLoadProducerName``)::

    1 - min(1, (tokens + this request's uncached tokens) / queueThresholdTokens)

where the request's uncached tokens on a candidate are its prompt less the
blocks that candidate holds (the producer's ``request_tokens``; the router's
``UncachedRequestTokens`` since v0.10): of two idle endpoints, the one that
holds the prompt scores higher.

``load-aware-scorer`` (``threshold`` 128; the router replaces a value <= 0
by 128), on the engine's ``queue_depth``::

    q == 0 → 0.5        otherwise 0.5 × (1 - min(q, threshold) / threshold)

It tops out at 0.5, not 1: an empty queue is the best a scrape can show, not
proof of spare capacity (the router's reasoning). Unknown data: a candidate
without a fresh ``queue_depth`` scores 0, as ``queue-scorer``'s do, where the
router's reads a missing metric as an empty queue (0.5): an endpoint whose
metrics stopped arriving must not win on missing data. ``maxAgeSeconds``
(1.0) is Switchyard's, as on the other metric scorers.

The in-flight scorers' unknown data: an endpoint the producer holds nothing
for has nothing in flight (0), which is what it means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from lwepp.contracts import IN_FLIGHT_LOAD, Candidate, LLMRequest, Want
from lwepp.plugins.inflight import PRODUCER, InFlight, InFlightLoadProducer, load_key
from lwepp.plugins.staleness import ReadsMeasurements
from plugin_api import NO_PARAMS, Params

_NOTHING: InFlight = InFlight({}, {})


class ReadsInFlight:
    """What the in-flight scorers share: a name, and the ``inflight-load-producer`` whose
    counts they read from the request (``inFlightLoadProducerName``; the configuration adds
    the default one, as the router does)."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        producer = params.get("inFlightLoadProducerName", str, "") or PRODUCER
        self.in_flight_producer = producer
        self.wants = (
            Want(
                "inFlightLoadProducerName",
                producer,
                IN_FLIGHT_LOAD,
                self._read_from_the_request,
                default=PRODUCER,
                add=True,
            ),
        )
        self._key = load_key(producer)
        self.counter: InFlightLoadProducer | None = None
        """The producer; its counts are read from ``request.state``."""

    def _read_from_the_request(self, producer: InFlightLoadProducer) -> None:
        """Keep the producer (``Want.give``): the counts themselves come with each request."""
        self.counter = producer


class ActiveRequestScorer(ReadsInFlight):
    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name, params)
        params.get("requestTimeout", str, "")  # deprecated in the router, and ignored there
        self.idle = max(0, params.get("idleThreshold", int, 0))
        busy = params.get("maxBusyScore", float, 1.0)
        self.max_busy = busy if 0.0 <= busy <= 1.0 else 1.0

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        counts = request.state.get(self._key, _NOTHING).requests
        requests = [counts.get(c.endpoint.hostport, 0) for c in candidates]
        busiest = max(requests, default=0)
        idle, max_busy = self.idle, self.max_busy
        return [
            1.0 if n <= idle else (busiest - n) / busiest * max_busy  # n > idle >= 0: busiest > 0
            for n in requests
        ]


class TokenLoadScorer(ReadsInFlight):
    needs_body = True  # the producer estimates tokens from the prompt, when the body is parsed

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name, params)
        self.threshold = params.get("queueThresholdTokens", int, 4194304, above=0)

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        tokens = request.state.get(self._key, _NOTHING).tokens
        added = (
            {} if self.counter is None else self.counter.request_tokens(request, candidates, now)
        )
        threshold = self.threshold
        return [
            1.0 - min(1.0, (tokens.get(key, 0) + added.get(key, 0)) / threshold)
            for key in (c.endpoint.hostport for c in candidates)
        ]


class LoadAwareScorer(ReadsMeasurements):
    reads: ClassVar[frozenset[str]] = frozenset({"queue_depth"})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name, params)
        threshold = params.get("threshold", int, 128)
        self.threshold = float(threshold if threshold > 0 else 128)

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        scores = []
        for candidate in candidates:
            q = candidate.value("queue_depth", now, self.max_age)
            if q is None:
                scores.append(0.0)
            elif q <= 0:
                scores.append(0.5)
            else:
                scores.append(0.5 * (1.0 - min(q, self.threshold) / self.threshold))
        return scores
