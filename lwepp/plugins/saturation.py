"""The llm-d router's saturation detectors: how full the pool is, and which endpoints are too full.

A detector answers two questions. **How saturated is the pool?** A number,
1.0 at the set point: flow control (``lwepp.flowcontrol``) dispatches a
queued request only while it is below a band's ceiling, and with the
``flowControl`` gate off a sheddable request (priority < 0) is refused once
it reaches 1.0. **Which endpoints may take more?** As a filter in the
scheduling profile it drops the endpoints over their limit. The two use
different limits on purpose: the pool is held to the ideal threshold, while
one endpoint may burst ``headroom`` past it (to keep an affinity, say).

``utilization-detector`` (the router's default), from the engines' scraped
metrics::

    endpoint score   = max(queue_depth / queueDepthThreshold,
                           kv_cache_usage / kvCacheUtilThreshold)
    pool saturation  = the unweighted mean of the endpoint scores (an empty pool: 1.0)
    filter keeps     queue_depth < queueDepthThreshold × (1 + headroom)
                     and kv_cache_usage < kvCacheUtilThreshold × (1 + headroom)

Parameters: ``queueDepthThreshold`` (5, > 0), ``kvCacheUtilThreshold`` (0.8,
in (0, 1]), ``metricsStalenessThreshold`` (``200ms``, > 0), ``headroom``
(0.0, >= 0). **Stale metrics count as saturated** (the router's fail-closed
posture): an endpoint whose queue depth was not measured within the
staleness threshold scores 1.0 and is filtered out; ``stale`` holds how many
the last evaluation found (``llm_d_epp_flow_control_stale_endpoints``). The
router times an endpoint's whole scrape; here every attribute carries its own
time, and the queue depth, which every engine publishes, is the one judged.
A KV usage the engine does not publish (llama.cpp) counts as 0, as a metric
missing from a scrape reads in the router. If every endpoint would be
filtered out the filter keeps them all (fail-open), so the scorers can still
pick the least bad.

``concurrency-detector``, from what the picker itself has in flight (the
requests and prompt tokens ``inflight-load-producer`` counts from the pick to
the end of the response, so a burst is seen at once, with no scrape)::

    requests mode    pool saturation = Σ requests / (endpoints × maxConcurrency)
    tokens mode      pool saturation = Σ tokens / (endpoints × maxTokenConcurrency)
    hybrid mode      the mean over endpoints of max(requests / maxConcurrency,
                                                    tokens / maxTokenConcurrency)
    filter keeps     load < capacity × (1 + headroom), by the mode's measure(s)

Parameters: ``concurrencyMode`` (``requests``; ``tokens``, ``hybrid``),
``maxConcurrency`` (100, > 0), ``maxTokenConcurrency`` (1,000,000, > 0),
``headroom`` (0.0, >= 0), ``inFlightLoadProducerName`` (the producer it
reads; the configuration adds ``inflight-load-producer`` when none is named,
as the router does). Its filter does not fall back: as in the router, when
every endpoint is at its limit none is kept, and the request is answered
503. Counting tokens needs the request's body parsed (``needs_body`` in the
``tokens`` and ``hybrid`` modes).

For a counted request to leave the count when its response ends, the picker
must hear the end of the response: a picker running this detector asks its
gateway to stream the response body through it (``lwepp.flowcontrol``'s
admission control says so), as the router's Envoy always does.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import ClassVar, Final

from lwepp.contracts import IN_FLIGHT_LOAD, Candidate, LLMRequest, Want
from lwepp.plugins.inflight import PRODUCER, InFlight, InFlightLoadProducer
from plugin_api import NO_PARAMS, ConfigError, Params
from serving.cli import duration

SATURATION: Final = "saturation"
"""What a detector provides to what names it (``flowControl.saturationDetector``)."""

MODES: Final = ("requests", "tokens", "hybrid")


def duration_param(params: Params, name: str, default: str) -> float:
    """A Go duration parameter (``200ms``, ``1m30s``), in seconds; it must be > 0."""
    text = params.get(name, str, default)
    seconds = parse_duration(text)
    if seconds is None or seconds <= 0:
        raise params.error(name, f"expected a duration above 0 (200ms, 1s...), got {text!r}")
    return seconds


def parse_duration(text: str) -> float | None:
    """Seconds from Go's ``time.ParseDuration`` syntax (the flags' parser), or None if it is
    no duration."""
    try:
        return duration(text)
    except argparse.ArgumentTypeError:
        return None


class UtilizationDetector:
    """``utilization-detector``: saturation from queue depth and KV usage (module docstring)."""

    reads: ClassVar[frozenset[str]] = frozenset({"queue_depth", "kv_cache_usage"})
    provides: ClassVar[frozenset[str]] = frozenset({SATURATION})
    counts_in_flight: ClassVar[bool] = False

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.queue_threshold = params.get("queueDepthThreshold", int, 5, above=0)
        self.kv_threshold = params.get("kvCacheUtilThreshold", float, 0.8, above=0)
        if self.kv_threshold > 1:
            raise params.error(
                "kvCacheUtilThreshold", f"must be in (0, 1], got {self.kv_threshold}"
            )
        self.staleness = duration_param(params, "metricsStalenessThreshold", "200ms")
        self.headroom = params.get("headroom", float, 0.0, at_least=0)
        self.stale = 0
        """Endpoints with missing or stale metrics at the last ``saturation``."""

    def _measured(self, candidate: Candidate, now: float) -> tuple[float, float] | None:
        """(queue depth, KV usage) when the queue depth is fresh, else None (stale)."""
        queue = candidate.value("queue_depth", now, self.staleness)
        if queue is None:
            return None
        kv = candidate.value("kv_cache_usage", now, self.staleness)
        return queue, 0.0 if kv is None else kv

    def saturation(self, candidates: Sequence[Candidate], now: float) -> float:
        """The mean endpoint score; a stale endpoint scores 1.0, an empty pool reads 1.0."""
        if not candidates:
            self.stale = 0
            return 1.0
        total, stale = 0.0, 0
        for candidate in candidates:
            measured = self._measured(candidate, now)
            if measured is None:
                total += 1.0
                stale += 1
                continue
            queue, kv = measured
            total += max(queue / self.queue_threshold, kv / self.kv_threshold)
        self.stale = stale
        return total / len(candidates)

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        queue_limit = self.queue_threshold * (1.0 + self.headroom)
        kv_limit = self.kv_threshold * (1.0 + self.headroom)
        kept = []
        for candidate in candidates:
            measured = self._measured(candidate, now)
            if measured is not None and measured[0] < queue_limit and measured[1] < kv_limit:
                kept.append(candidate)
        return kept or candidates  # every endpoint over its limit: let the scorers choose


class ConcurrencyDetector:
    """``concurrency-detector``: saturation from the requests and tokens in flight (module
    docstring)."""

    provides: ClassVar[frozenset[str]] = frozenset({SATURATION})
    counts_in_flight: ClassVar[bool] = True
    """It sees a request leave only when its response ends: the gateway must send the end."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.mode = params.get("concurrencyMode", str, "requests")
        if self.mode not in MODES:
            raise params.error(
                "concurrencyMode", f"expected one of {', '.join(MODES)}, got {self.mode!r}"
            )
        self.max_requests = params.get("maxConcurrency", int, 100, above=0)
        self.max_tokens = params.get("maxTokenConcurrency", int, 1_000_000, above=0)
        self.headroom = params.get("headroom", float, 0.0, at_least=0)
        producer = params.get("inFlightLoadProducerName", str, "") or PRODUCER
        self.needs_body = self.mode != "requests"
        self.load = InFlight({}, {})
        """The producer's live counts, once the configuration handed it over."""
        self.stale = 0
        self.wants = (
            Want(
                "inFlightLoadProducerName",
                producer,
                IN_FLIGHT_LOAD,
                self._count_with,
                default=PRODUCER,
                add=True,
            ),
        )

    def _count_with(self, producer: object) -> None:
        if not isinstance(producer, InFlightLoadProducer):  # a user's producer must count alike
            raise ConfigError(f"{type(producer).__name__} keeps no in-flight counts to read")
        self.load = producer.load

    def saturation(self, candidates: Sequence[Candidate], now: float) -> float:
        if not candidates:
            return 1.0
        requests, tokens = self.load.requests, self.load.tokens
        if self.mode == "hybrid":
            return math.fsum(
                max(
                    requests.get(c.endpoint.hostport, 0) / self.max_requests,
                    tokens.get(c.endpoint.hostport, 0) / self.max_tokens,
                )
                for c in candidates
            ) / len(candidates)
        counts, capacity = (
            (tokens, self.max_tokens) if self.mode == "tokens" else (requests, self.max_requests)
        )
        return sum(counts.get(c.endpoint.hostport, 0) for c in candidates) / (
            capacity * len(candidates)
        )

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        request_limit = int(self.max_requests * (1.0 + self.headroom))
        token_limit = int(self.max_tokens * (1.0 + self.headroom))
        requests, tokens = self.load.requests, self.load.tokens
        kept = []
        for candidate in candidates:
            endpoint = candidate.endpoint.hostport
            fits_requests = requests.get(endpoint, 0) < request_limit
            fits_tokens = tokens.get(endpoint, 0) < token_limit
            if self.mode == "requests":
                fits = fits_requests
            elif self.mode == "tokens":
                fits = fits_tokens
            else:
                fits = fits_requests and fits_tokens
            if fits:
                kept.append(candidate)
        return kept


class Watching:
    """A detector the profile does not list, as the pipeline sees it: no filter, but the
    attributes it reads are measured (a data source is added for them) and the body it
    needs is parsed. Flow control reads the detector itself."""

    def __init__(self, detector: object) -> None:
        self.name: str = getattr(detector, "name", "")
        self.reads: frozenset[str] = getattr(detector, "reads", frozenset())
        self.needs_body: bool = getattr(detector, "needs_body", False)
