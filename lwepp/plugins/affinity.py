"""``prefix-cache-affinity-filter``: keep only the endpoints that hold most of the prompt, unless
they are too busy.

A scorer weighs cache affinity against load and always picks the top total,
so requests sharing a prompt pile onto one endpoint (hot-spotting); a
random picker spreads them and loses the cache. The llm-d router's filter
(the default of its optimized-baseline guide since June 2026) does it in two
steps instead: first narrow the candidates to the *sticky* ones, those
holding at least ``affinityThreshold`` of the prompt's blocks; then let the
scorers after it (``token-load-scorer`` there) choose among them. Its rules:

- fewer than two candidates, or ``affinityThreshold`` <= 0: keep all;
- with probability ``explorationProbability``, keep all (exploration seeds
  the cache elsewhere; default 0, off);
- no candidate is sticky: keep all;
- the TTFT load gate: when some are not sticky, estimate each endpoint's time
  to first token from the prompt tokens it has in flight,
  ``tokens / peakPrefillThroughput × 1000`` ms, and when the best sticky
  endpoint's estimate exceeds the best non-sticky one's by more than
  ``maxTTFTPenaltyMs``, keep all: the cache is not worth the wait (0: always
  stick);
- the in-flight token gate of the router before v0.10
  (``maxTokensInFlightPenalty``, which llm-d's optimized-baseline guide
  still sets): when the best sticky endpoint has that many more tokens in
  flight than the best non-sticky one, keep all (0: off). v0.10 replaced it
  with the TTFT gate (the same test, in milliseconds) and refuses the field;
  it works here, with a warning;
- otherwise keep the sticky ones, in order.

What it reads: the request's ``PrefixMatch`` from the prefix producer
``prefixMatchInfoProducerName`` names (``lwepp.plugins.approx_prefix``, added
when the file lists none, as the router spawns it; a precise producer works
too), and the tokens in flight per endpoint that ``inflight-load-producer``
(``inFlightLoadProducerName``) counts, when a gate is on (added too). An
endpoint it holds nothing for has none in flight. ``ttftSource:
latencyPredictor`` takes each endpoint's TTFT from the predictions of
``predicted-latency-producer`` (``latencyPredictionInfoProducerName``, added
when the file lists none; ``lwepp.plugins.predicted_latency``) instead; when
that producer does not predict (``predictInProduce: false``) the gate is
skipped, as the router skips it when no endpoint has a prediction.

Parameters (the router's, with its defaults): ``affinityThreshold`` 0.80
(at most 1), ``explorationProbability`` 0 (0–1), ``maxTTFTPenaltyMs`` 18000
(>= 0), ``ttftSource`` ``prefillThroughput``, ``peakPrefillThroughput``
15928 tokens/s (> 0 when the TTFT gate is on; the router calibrated it for
Qwen3-32B on two H100s), ``maxTokensInFlightPenalty`` 0, and the producers'
names.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Final

from lwepp.contracts import (
    IN_FLIGHT_LOAD,
    PREDICTED_LATENCY,
    PREFIX_MATCH,
    Candidate,
    LLMRequest,
    Want,
)
from lwepp.plugins.approx_prefix import DEFAULT_PRODUCER
from lwepp.plugins.inflight import PRODUCER as IN_FLIGHT_PRODUCER
from lwepp.plugins.inflight import InFlight, load_key
from lwepp.plugins.predicted_latency import PRODUCER as PREDICTOR
from plugin_api import NO_PARAMS, ConfigError, Params

TTFT_SOURCES: Final = ("prefillThroughput", "latencyPredictor")
_NOTHING: Final = InFlight({}, {})


class PrefixCacheAffinityFilter:
    needs_body = True  # the prefix producer hashes the prompt

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.threshold = params.get("affinityThreshold", float, 0.80)
        if self.threshold > 1:
            raise params.error("affinityThreshold", f"must be <= 1, got {self.threshold:g}")
        self.exploration = params.get("explorationProbability", float, 0.0, at_least=0)
        if self.exploration > 1:
            raise params.error("explorationProbability", "must be in [0, 1]")
        self.max_ttft_ms = params.get("maxTTFTPenaltyMs", float, 18000.0, at_least=0)
        source = params.get("ttftSource", str, "prefillThroughput")
        if source not in TTFT_SOURCES:
            raise params.error("ttftSource", f"must be one of {', '.join(TTFT_SOURCES)}")
        predicted = source == "latencyPredictor"
        self.peak = params.get("peakPrefillThroughput", float, 15928.0, at_least=0)
        if not predicted and self.max_ttft_ms > 0 and self.peak == 0:
            raise params.error(
                "peakPrefillThroughput", "must be > 0 when ttftSource is prefillThroughput"
            )
        self.max_tokens = params.get("maxTokensInFlightPenalty", int, 0, at_least=0)
        predictor = params.get("latencyPredictionInfoProducerName", str, "") or PREDICTOR
        producer = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        counter = params.get("inFlightLoadProducerName", str, "") or IN_FLIGHT_PRODUCER
        self.rng = random.Random()
        """Draws the exploration (injected in tests)."""
        self.prefix: Any = None
        """The prefix producer, handed over by the configuration (``Want``)."""
        self.predictor: Any = None
        """With ``ttftSource: latencyPredictor``: the predicted-latency producer (``Want``)."""
        wants = [
            Want(
                "prefixMatchInfoProducerName",
                producer,
                PREFIX_MATCH,
                self.use_prefix,
                default=DEFAULT_PRODUCER,
                add=True,
                quiet=True,
            )
        ]
        if predicted:
            wants.append(
                Want(
                    "latencyPredictionInfoProducerName",
                    predictor,
                    PREDICTED_LATENCY,
                    self.use_predictor,
                    default=PREDICTOR,
                    add=True,
                )
            )
        if (self.max_ttft_ms > 0 and not predicted) or self.max_tokens > 0:  # tokens in flight
            wants.append(
                Want(
                    "inFlightLoadProducerName",
                    counter,
                    IN_FLIGHT_LOAD,
                    _read_from_the_request,
                    default=IN_FLIGHT_PRODUCER,
                    add=True,
                )
            )
        self.wants = tuple(wants)
        self._load = load_key(counter)

    def use_prefix(self, producer: Any) -> None:
        """Read the named producer's match (``Want.give``)."""
        self.prefix = producer

    def use_predictor(self, producer: Any) -> None:
        """Read the named producer's TTFT predictions (``Want.give``)."""
        self.predictor = producer

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        if len(candidates) <= 1 or self.threshold <= 0:
            return candidates
        if self.exploration and self.rng.random() < self.exploration:
            return candidates
        if self.prefix is None:
            raise ConfigError(f"{self.name}: no prefix producer (it was never configured)")
        found = self.prefix.prefix_match(request, candidates, now)
        if found is None:
            return candidates
        sticky = [c for c in candidates if found.ratio(c.endpoint.hostport) >= self.threshold]
        if not sticky:
            return candidates
        if len(sticky) < len(candidates) and self._too_busy(request, candidates, sticky):
            return candidates
        return sticky

    def _too_busy(
        self, request: LLMRequest, candidates: Sequence[Candidate], sticky: Sequence[Candidate]
    ) -> bool:
        """Do the load gates break stickiness? The best sticky endpoint against the best other
        one, in tokens in flight and in (estimated or predicted) TTFT."""
        chosen = {id(c) for c in sticky}
        others = [c for c in candidates if id(c) not in chosen]
        if self.max_tokens:
            tokens = request.state.get(self._load, _NOTHING).tokens
            excess = min(tokens.get(c.endpoint.hostport, 0) for c in sticky) - min(
                tokens.get(c.endpoint.hostport, 0) for c in others
            )
            if excess > self.max_tokens:
                return True
        if not self.max_ttft_ms:
            return False
        ttft = self._ttft_ms(request, candidates)
        if ttft is None:
            return False
        best_sticky = min(ttft[id(c)] for c in sticky)
        return best_sticky - min(ttft[id(c)] for c in others) > self.max_ttft_ms

    def _ttft_ms(
        self, request: LLMRequest, candidates: Sequence[Candidate]
    ) -> dict[int, float] | None:
        """Each candidate's TTFT in ms (by ``id``): predicted, or its prompt tokens in flight
        over ``peakPrefillThroughput``; None when the predictor does not predict."""
        if self.predictor is not None:
            if not self.predictor.enabled:
                return None
            predictions = self.predictor.predict(request, candidates)
            return {id(c): p.ttft * 1000.0 for c, p in zip(candidates, predictions, strict=True)}
        tokens = request.state.get(self._load, _NOTHING).tokens
        return {id(c): tokens.get(c.endpoint.hostport, 0) / self.peak * 1000.0 for c in candidates}


def _read_from_the_request(_producer: object) -> None:
    """The filter reads the producer's counts from ``request.state``: nothing to keep."""
