"""``latency-slo-admitter``: a sheddable request is refused when no endpoint can meet its SLO.

The llm-d router's admitter (``pkg/epp/framework/plugins/requestcontrol/
admitter/latencyslo``), run where the router runs it: after the data
producers, before the first filter (``lwepp.pipeline``'s admit stage), over
the same candidates. A request goes on, untouched, when any of these holds:

- its priority is 0 or more (its InferenceObjective's; 0 without one): only
  sheddable requests are ever refused;
- it asks for no SLO (``x-llm-d-slo-ttft-ms`` / ``x-llm-d-slo-tpot-ms``, or
  their ``x-slo-*`` aliases, above 0);
- no prediction is made (``predicted-latency-producer`` with
  ``predictInProduce: false``): without one nothing is known, so it admits
  (the router fails open too);
- some candidate is predicted to meet the SLO (``hasValid``: the TTFT, and
  the TPOT when the producer is in streaming mode and one was asked for,
  judged as ``slo-headroom-tier-filter`` and ``latency-scorer`` judge it;
  a TPOT SLO alone is judged against a TTFT SLO of 0, as in the router, so
  only an idle or cold endpoint lets such a request on);
- some candidate is *idle*: this picker has nothing in flight there (the
  README's ``DispatchedRequestCount``; the router's code reads the engine's
  scraped running requests instead, which lag a scrape behind);
- some candidate is *cold*: its KV cache under 2% used, or never measured,
  so a prediction for it has little to stand on (the router reads 0% for a
  pod it has not scraped, and admits then too).

Otherwise it is refused: HTTP 429 (the router answers 500; the pipeline's
``admit`` says why), an OpenAI-style error whose message is the router's,
"request cannot be admitted: no valid endpoint available to serve the
request", with ``code`` ``admission-denied``, counted in
``llm_d_epp_admission_refusals_total{plugin}``. The answer comes before any
filter or scorer runs, in the pick's own time.

The predictions are the producer's for this request: made here once per
candidate, and read again, not remade, by the filter and the scorer after
(``PredictedLatencyProducer.predict``). Parameter, the router's:
``latencyPredictionInfoProducerName``, the producer to read (default
``predicted-latency-producer``, added with its defaults when the file lists
none, as the router adds it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.predicted_latency import PRODUCER, ReadsPredictions, Slo, headrooms
from plugin_api import NO_PARAMS, Params

COLD: Final = 0.02
"""KV-cache use below which an endpoint is cold (the router's 2%)."""
DENIED: Final = "no valid endpoint available to serve the request"
"""The router's reason."""


class LatencySloAdmitter(ReadsPredictions):
    """``latency-slo-admitter``: refuse a sheddable request no candidate is predicted to serve
    within its SLO, while none is idle or cold (the module docstring has the rule)."""

    reads: Final = frozenset({"kv_cache_usage"})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        producer = params.get("latencyPredictionInfoProducerName", str, "") or PRODUCER
        super().__init__(name, "latencyPredictionInfoProducerName", producer)

    def admit_request(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float, priority: int
    ) -> str | None:
        if priority >= 0:
            return None
        asked = Slo.of(request.headers)
        if not (asked.ttft or asked.tpot):  # the router: a header above 0
            return None
        found = self.predictions(request, candidates)
        if found is None:
            return None
        predictions, slo = found
        assert self.producer is not None
        ttft, tpot = headrooms(predictions, slo, self.producer.streaming)
        for i, candidate in enumerate(candidates):
            if ttft[i] >= 0 and tpot[i] >= 0:  # meets the SLO
                return None
            if predictions[i].dispatched == 0:  # idle
                return None
            kv = candidate.value("kv_cache_usage", now, math.inf)
            if kv is None or kv < COLD:  # cold
                return None
        return DENIED
