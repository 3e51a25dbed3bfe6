"""Predicted latency from the request path: ``predicted-latency-producer`` and ``latency-scorer``.

The llm-d router predicts each candidate's time to first token (TTFT) and
time per output token (TPOT) with XGBoost models a sidecar trains on the
responses; its ``latency-scorer`` routes on the predicted *headroom*, the
request's SLO minus the prediction. Here the model is small enough to fit on
the request path, per endpoint, with no sidecar and no training step:

    TTFT ≈ a + b × (prompt tokens the endpoint still has to prefill, this one's included)
             + c × (requests in flight on it)
    TPOT ≈ d + e × (requests in flight on it)

The features are what ``inflight-load-producer`` (``lwepp.plugins.inflight``)
counts the moment a pick is made: requests per endpoint, and the *uncached*
prompt tokens each still has to prefill (released at the first token). The
request's own uncached tokens on each candidate come from the prefix scorer's
``PrefixMatch`` when one ran before (the blocks the candidate holds are not
counted: it will not compute them), else its whole prompt.

The law (a, b, c; d, e) is the pool's, fitted online by ridge regression
over exponentially decayed sums (``Fit``) and pulled towards ``PRIOR_*``;
each endpoint has one number of its own per law, its *speed*: how many times
the pool's law its observations take (``Speed``, a decayed least-squares
ratio pulled towards 1, then shrunk towards the pool's mean speed by as much
as its own noise explains the endpoints' spread: ``shrink``), so an L4 among
H100s is learnt as about nine times slower from its first few responses,
while in a pool of equal GPUs the endpoints' noise does not become a
difference between them (a full law per
endpoint, tried first, did: on the Azure trace it lost 1% to round-robin).
Each pick records its features; the first response chunk gives the observed
TTFT (``streamingMode: true``; without it, the whole response time, as the
router trains on end-to-end latency then), the end of the stream the observed
TPOT, ``(end - first token) / (completion tokens - 1)`` from the reported
usage. Slopes are kept >= 0: more work never predicts less time. An endpoint
that has answered nothing is predicted at the fastest speed seen, so it is
tried. Nothing is scraped: a pool whose metrics stop arriving is predicted
exactly as before.

Per pick (8 candidates) the producer does a dot product per candidate; the
regression is solved when an observation arrives, on the response side, not
while a request waits (``bench/plugins.py`` measures both).

``predicted-latency-producer`` parameters, the router's names:
``streamingMode`` (false), ``sloBufferFactor`` (1.0, > 0: the TPOT SLO is
multiplied by it), ``predictInProduce`` (true; false: observe only, and the
scorer falls back to its composite). ``samplingMean``,
``maxDecodeTokenSamplesForPrediction``, ``contextTTL``, ``endpointRoleLabel``,
``useEncoderCacheFeatures`` and ``encoderCacheMatchInfoProducerName`` are
accepted and change nothing: every response's TPOT is measured whole (no
sampling is needed without a sidecar), a request's context lives in its own
state and dies with it, and disaggregated roles and multimodal caches are not
modelled. Switchyard's own: ``inFlightLoadProducerName`` and
``prefixMatchInfoProducerName``, the plugins whose counts and matches it reads
(the defaults as ``token-load-scorer``'s and ``prefix-cache-scorer``'s).

``latency-scorer`` (router's parameters ``ttftWeight`` 0.8, ``tpotWeight``
0.2, ``headroomSelectionStrategy`` ``least``/``most``, ``compositeKVWeight``,
``compositeQueueWeight``, ``compositePrefixWeight`` 1 each), as the router's
README describes it: headroom is ``SLO - predicted`` (the
``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` headers, their
``x-slo-*`` aliases too; ``0 - predicted`` without one; TPOT counts only with
``streamingMode``, as the router judges TPOT only then). When some candidates
meet the SLOs and some do not, only those that do are scored. Among those
that meet them, ``least`` prefers the one closest to the SLO (packing, to keep
headroom elsewhere), ``most`` the one furthest; among violators, the least
deficit always wins, in the best non-empty bucket (only TPOT violated, then
only TTFT, then both), and an idle candidate (nothing in flight) before a busy
one. Each dimension's headroom is scaled to [0, 1] over the candidates and
blended by the two weights; a dimension on which all candidates tie gives its
weight to the other. One deviation: the idle preference applies only when the
request carries an SLO. Without one every headroom is negative and the
router's rule would send every request to an idle endpoint whatever it
holds; the prediction already prices an idle endpoint's empty queue against
a busy one's cached prefix, which is what it is for. The composite fallback
(no predictions): KV-cache use (scraped ``kv_cache_usage``, when fresh),
requests in flight (the queue the picker knows) and the prefix match.
Switchyard's own parameter ``uncachedPrefillWeight`` (0: the router's
ranking) charges each candidate, for ranking only (not for whether it meets
the SLO), that many times the predicted prefill time of the request's own
uncached tokens there: engine time every later request on that endpoint
waits for too. A pure earliest-first-token rule sends a group of requests
sharing a prefix elsewhere whenever its endpoint is busy for a moment, the
prefix is prefilled again and evicts others, and later requests pay
(``bench.oracle``'s estimate oracle charges twice its prefill for the same
reason).

``slo-headroom-tier-filter`` (``epsilonExploreNeg`` 0.01): with an SLO on the
request, keeps the candidates predicted to meet it, or with probability
``epsilonExploreNeg`` only those that do not (exploration, so a recovering
endpoint is measured again); one tier only, or no SLO, keeps all. Filters run
before scorers, so its predictions see a prefix match only if a producer left
one before it; otherwise each candidate is charged the whole prompt.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lwepp.contracts import (
    IN_FLIGHT_LOAD,
    PREDICTED_LATENCY,
    Candidate,
    LLMRequest,
    Usage,
    Want,
)
from lwepp.flowcontrol.policies import slo_ms
from lwepp.plugins.approx_prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_PRODUCER,
    PrefixMatch,
    match_key,
)
from lwepp.plugins.inflight import PRODUCER as INFLIGHT
from lwepp.plugins.inflight import InFlight, load_key, prompt_tokens, uncached_tokens
from plugin_api import NO_PARAMS, ConfigError, Params
from pods.model import Endpoint

PRODUCER: Final = "predicted-latency-producer"
TTFT_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
TPOT_HEADERS: Final = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
DECAY: Final = 0.98
"""Each observation multiplies an endpoint's earlier ones by this (about the last 50 count)."""
POOL_DECAY: Final = 0.995
"""The pool's law forgets more slowly: every endpoint's observations feed it."""
STRENGTH: Final = 2.0
"""Ridge strength, in observations: how many an estimate needs before its data lead."""
KILO: Final = 1000.0
"""Token features are in thousands of tokens, so the coefficients are of one scale."""
PRIOR_TTFT: Final = (0.05, 0.1, 0.01)
"""The pool's TTFT prior (s, s per 1,000 tokens to prefill, s per request in flight): a
mid-range GPU, and only a start; a few responses replace it."""
PRIOR_TPOT: Final = (0.02, 0.001)
"""The pool's TPOT prior (s, s per request in flight)."""
_NOTHING: Final = InFlight({}, {})


class Fit:
    """A decayed ridge regression ``y ≈ θ·x``, pulled towards a prior (``solve``)."""

    __slots__ = ("decay", "gram", "moment", "theta", "weight")

    def __init__(self, prior: Sequence[float], decay: float) -> None:
        k = len(prior)
        self.decay = decay
        self.gram = [[0.0] * k for _ in range(k)]
        self.moment = [0.0] * k
        self.theta = list(prior)
        self.weight = 0.0
        """The decayed count of observations."""

    def observe(self, x: Sequence[float], y: float) -> None:
        """Add one observation (features ``x``, value ``y``), the earlier ones decayed."""
        d = self.decay
        for i, row in enumerate(self.gram):
            xi = x[i]
            for j in range(len(row)):
                row[j] = d * row[j] + xi * x[j]
            self.moment[i] = d * self.moment[i] + xi * y
        self.weight = d * self.weight + 1.0

    def solve(self, prior: Sequence[float], strength: float = STRENGTH) -> None:
        """θ = (XᵀX + λI)⁻¹ (Xᵀy + λ prior), slopes clipped at 0 (more work is never faster)."""
        k = len(prior)
        rows = [
            [*(g + (strength if i == j else 0.0) for j, g in enumerate(self.gram[i])),
             self.moment[i] + strength * prior[i]]
            for i in range(k)
        ]  # fmt: skip
        theta = _gauss(rows)
        if theta is not None:
            self.theta = [theta[0], *(max(0.0, t) for t in theta[1:])]

    def predict(self, x: Sequence[float]) -> float:
        return max(0.0, sum(t * v for t, v in zip(self.theta, x, strict=True)))


def _gauss(rows: list[list[float]]) -> list[float] | None:
    """Solve the augmented system ``rows`` (k × k+1) by elimination with partial pivoting."""
    k = len(rows)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        top = rows[col]
        for r in range(col + 1, k):
            factor = rows[r][col] / top[col]
            if factor:
                rows[r] = [a - factor * b for a, b in zip(rows[r], top, strict=True)]
    out = [0.0] * k
    for r in range(k - 1, -1, -1):
        out[r] = (rows[r][k] - sum(rows[r][c] * out[c] for c in range(r + 1, k))) / rows[r][r]
    return out


class Speed:
    """How much slower than the pool's law one endpoint runs: ``y ≈ scale × law(x)``.

    ``raw`` is fitted by decayed least squares and pulled towards 1 by ``STRENGTH``
    observations' worth of the pool's own speed; ``variance`` is how uncertain it is (the
    residuals' variance over the law's decayed sum of squares). ``scale``, what predictions
    use, is ``raw`` shrunk towards the pool's mean speed by ``shrink``."""

    __slots__ = ("count", "cross", "raw", "scale", "square", "squares", "variance")

    def __init__(self, scale: float = 1.0) -> None:
        self.cross = self.square = self.squares = self.count = 0.0
        self.raw = self.scale = scale
        self.variance = math.inf

    def observe(self, law: float, y: float) -> None:
        if law <= 0:
            return
        self.cross = DECAY * self.cross + y * law
        self.square = DECAY * self.square + law * law
        self.squares = DECAY * self.squares + y * y
        self.count = DECAY * self.count + 1.0
        prior = STRENGTH * self.square / self.count  # STRENGTH observations at scale 1
        self.raw = raw = (self.cross + prior) / (self.square + prior)
        residuals = max(0.0, self.squares - 2 * raw * self.cross + raw * raw * self.square)
        self.variance = residuals / self.count / (self.square + prior)


def shrink(speeds: Sequence[Speed]) -> None:
    """Each endpoint's ``scale``: its ``raw`` speed shrunk towards the pool's mean by as much
    as its noise explains the endpoints' spread (empirical Bayes, as James and Stein's
    estimator): ``scale = mean + τ² / (τ² + variance) × (raw - mean)``, ``τ²`` the spread
    of the raw speeds beyond their average variance. Equal GPUs then share one speed: on
    traffic that shares nothing a raw speed is mostly noise (the Azure trace's rows
    2000-2999: equal engines fitted 1.08-1.34, and the picker lost 7.5% to round-robin),
    while an L4 among H100s, nine times slower, is far outside it and keeps its own."""
    known = [s for s in speeds if s.count > 0 and math.isfinite(s.variance)]
    if len(known) < 2:
        return
    mean = sum(s.raw for s in known) / len(known)
    spread = sum((s.raw - mean) ** 2 for s in known) / (len(known) - 1)
    tau = max(0.0, spread - sum(s.variance for s in known) / len(known))
    for s in known:
        s.scale = mean + (tau / (tau + s.variance) if tau > 0 else 0.0) * (s.raw - mean)


class _Model:
    """One endpoint's two speeds (TTFT, TPOT) against the pool's laws."""

    __slots__ = ("tpot", "ttft")

    def __init__(self, ttft: float = 1.0, tpot: float = 1.0) -> None:
        self.ttft = Speed(ttft)
        self.tpot = Speed(tpot)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate's prediction for one request (the router's ``LatencyPredictionInfo``).

    Seconds; ``dispatched`` is the requests the picker has in flight there."""

    ttft: float
    tpot: float
    dispatched: int
    features: tuple[float, float, float]
    prefill: float = 0.0
    """The part of ``ttft`` this request's own uncached tokens take there: engine time every
    request after it on that endpoint waits for too."""


@dataclass(frozen=True, slots=True)
class Slo:
    """The SLOs a request asked for, in seconds (None: not asked)."""

    ttft: float | None
    tpot: float | None

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Slo:
        def first(names: Sequence[str]) -> float | None:
            for name in names:
                ms = slo_ms(headers.get(name))
                if ms is not None:
                    return ms / 1000
            return None

        return cls(first(TTFT_HEADERS), first(TPOT_HEADERS))


class _Context:
    """What one request's pick recorded, for the observations its response brings."""

    __slots__ = ("endpoint", "first", "picked", "tpot_x", "ttft_x")

    def __init__(
        self, endpoint: str, picked: float, ttft_x: Sequence[float], tpot_x: Sequence[float]
    ) -> None:
        self.endpoint, self.picked, self.ttft_x, self.tpot_x = endpoint, picked, ttft_x, tpot_x
        self.first: float | None = None


class PredictedLatencyProducer:
    """``predicted-latency-producer``: per-endpoint TTFT/TPOT models fitted from the responses."""

    provides: Final = frozenset({PREDICTED_LATENCY})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.streaming = params.get("streamingMode", bool, False)
        self.buffer = params.get("sloBufferFactor", float, 1.0, above=0)
        self.enabled = params.get("predictInProduce", bool, True)
        params.get("samplingMean", float, 1000.0)
        params.get("maxDecodeTokenSamplesForPrediction", int, 0)
        params.get("contextTTL", str, "5m")
        params.get("endpointRoleLabel", str, "")
        params.get("useEncoderCacheFeatures", bool, False)
        params.get("encoderCacheMatchInfoProducerName", str, "")
        inflight = params.get("inFlightLoadProducerName", str, "") or INFLIGHT
        prefix = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        self.wants = (
            Want(
                "inFlightLoadProducerName",
                inflight,
                IN_FLIGHT_LOAD,
                _read_from_the_request,
                default=INFLIGHT,
                add=True,
            ),
        )
        self.clock: Callable[[], float] = time.monotonic
        """When picks and responses happen (the pipeline's clock; injected in tests)."""
        self._load, self._match = load_key(inflight), match_key(prefix)
        self._key, self._predicted = f"{name}.context", f"{name}.predictions"
        self._basis = f"{name}.basis"
        self.models: dict[str, _Model] = {}
        self.ttft_law = Fit(PRIOR_TTFT, POOL_DECAY)
        self.tpot_law = Fit(PRIOR_TPOT, POOL_DECAY)
        self._optimist: _Model | None = None
        """What an endpoint with no observations is predicted by (``_untried``)."""
        self.errors: list[tuple[str, float, float]] = []
        """(endpoint, predicted, observed) TTFT of each response, when ``record_errors``."""
        self.record_errors = False

    # --- predictions -------------------------------------------------------------

    def predict(self, request: LLMRequest, candidates: Sequence[Candidate]) -> list[Prediction]:
        """Each candidate's prediction for ``request``, in order (kept for ``picked``).

        Made once per candidate and request: the admitter, the filter and the scorer all
        read the same one (the router's producer predicts once, in Produce), unless a
        prefix match arrived in between (a scorer's), which changes the uncached tokens."""
        state = request.state
        load: InFlight = state.get(self._load, _NOTHING)
        requests, tokens = load.requests, load.tokens
        own = prompt_tokens(request)
        match: PrefixMatch | None = state.get(self._match)
        models, ttft_law, tpot_law = self.models, self.ttft_law, self.tpot_law
        found: dict[str, Prediction] = state.setdefault(self._predicted, {})
        if found and state.get(self._basis) is not match:
            found.clear()
        state[self._basis] = match
        out = []
        for candidate in candidates:
            key = candidate.endpoint.hostport
            if (known := found.get(key)) is not None:
                out.append(known)
                continue
            uncached = uncached_tokens(match, key, own)
            n = requests.get(key, 0)
            x = (1.0, (tokens.get(key, 0) + uncached) / KILO, float(n))
            model = models.get(key) or self._untried()
            ttft = model.ttft.scale * ttft_law.predict(x)
            tpot = model.tpot.scale * tpot_law.predict((1.0, n + 1.0))
            prefill = model.ttft.scale * ttft_law.theta[1] * uncached / KILO
            found[key] = prediction = Prediction(ttft, tpot, n, x, prefill)
            out.append(prediction)
        return out

    def _untried(self) -> _Model:
        """An endpoint that answered nothing yet is predicted as fast as the fastest one that
        did, so a new replica is tried, and then known; the pool's average would keep a fast
        replica idle behind slower ones whose times it mixes in."""
        if self._optimist is None:
            models = self.models.values()
            self._optimist = _Model(
                min((m.ttft.scale for m in models), default=1.0),
                min((m.tpot.scale for m in models), default=1.0),
            )
        return self._optimist

    def own_ttft(self, body_bytes: int) -> float:
        """The TTFT a request whose body is ``body_bytes`` long is predicted on the fastest
        endpoint with nothing in flight and nothing cached (its prompt's tokens estimated
        from its bytes, as the prefix producer estimates them): the part of its wait that is
        its own; the queue's part is the same for every request waiting beside it."""
        law = self.ttft_law.predict((1.0, body_bytes / CHARS_PER_TOKEN / KILO, 0.0))
        return self._untried().ttft.scale * law

    def slo(self, request: LLMRequest) -> Slo:
        """The request's SLOs; the TPOT one buffered, and only in streaming mode."""
        asked = Slo.of(request.headers)
        tpot = asked.tpot * self.buffer if self.streaming and asked.tpot is not None else None
        return Slo(asked.ttft, tpot)

    # --- the request's life -----------------------------------------------------

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            return
        key = endpoints[0].hostport
        found: dict[str, Prediction] = request.state.get(self._predicted, {})
        prediction = found.get(key)
        if prediction is None:  # nothing scored: predict for the pick alone
            load: InFlight = request.state.get(self._load, _NOTHING)
            n = load.requests.get(key, 0)
            x = (1.0, (load.tokens.get(key, 0) + prompt_tokens(request)) / KILO, float(n))
            prediction = Prediction(math.nan, math.nan, n, x)
        context = _Context(
            key, self.clock(), prediction.features, (1.0, prediction.dispatched + 1.0)
        )
        request.state[self._key] = context
        if self.record_errors:
            request.state[f"{self.name}.ttft"] = prediction.ttft

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        context: _Context | None = request.state.get(self._key)
        if context is None or context.first is not None:
            return
        context.first = now = self.clock()
        if self.streaming:
            self._observe_ttft(request, context, now - context.picked)

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        context: _Context | None = request.state.pop(self._key, None)
        if context is None or (served is not None and served != context.endpoint):
            return  # another endpoint answered: its time says nothing of the pick's
        now = self.clock()
        if not self.streaming:
            self._observe_ttft(request, context, now - context.picked)
            return
        tokens = usage.completion_tokens if usage is not None else None
        if context.first is not None and tokens is not None and tokens >= 2:
            tpot = (now - context.first) / (tokens - 1)
            speed = self._model(context.endpoint).tpot
            speed.observe(self.tpot_law.predict(context.tpot_x), tpot)
            shrink([m.tpot for m in self.models.values()])
            self.tpot_law.observe(context.tpot_x, tpot / speed.scale)
            self.tpot_law.solve(PRIOR_TPOT)

    def _observe_ttft(self, request: LLMRequest, context: _Context, seconds: float) -> None:
        if self.record_errors:
            predicted = request.state.get(f"{self.name}.ttft", math.nan)
            self.errors.append((context.endpoint, predicted, seconds))
        speed = self._model(context.endpoint).ttft
        speed.observe(self.ttft_law.predict(context.ttft_x), seconds)
        shrink([m.ttft for m in self.models.values()])
        self.ttft_law.observe(context.ttft_x, seconds / speed.scale)
        self.ttft_law.solve(PRIOR_TTFT)

    def _model(self, endpoint: str) -> _Model:
        self._optimist = None  # the fits move: recomputed when next needed
        model = self.models.get(endpoint)
        if model is None:  # starts at the pool's speed
            model = self.models[endpoint] = _Model()
        return model


def _read_from_the_request(_producer: object) -> None:
    """The producer reads the in-flight counts from ``request.state``: nothing to keep."""


class ReadsPredictions:
    """A consumer of ``predicted-latency-producer``'s predictions (the one the file lists, or
    the one the configuration adds, as the router creates it)."""

    needs_body = True  # the prompt's tokens are part of the prediction

    def __init__(
        self, name: str, field: str = "predictedLatencyProducerName", producer: str = PRODUCER
    ) -> None:
        self.name = name
        self.producer: PredictedLatencyProducer | None = None
        self.wants = (
            Want(
                field,
                producer,
                PREDICTED_LATENCY,
                self._use,
                default=PRODUCER,
                add=True,
            ),
        )

    def _use(self, producer: Any) -> None:
        if not isinstance(producer, PredictedLatencyProducer):
            raise ConfigError(f"{producer!r} is not a {PRODUCER}")
        self.producer = producer

    def predictions(
        self, request: LLMRequest, candidates: Sequence[Candidate]
    ) -> tuple[list[Prediction], Slo] | None:
        producer = self.producer
        if producer is None or not producer.enabled:
            return None
        return producer.predict(request, candidates), producer.slo(request)


def headrooms(
    predictions: Sequence[Prediction], slo: Slo, streaming: bool
) -> tuple[list[float], list[float]]:
    """TTFT and TPOT headroom per candidate: SLO - predicted (0 - predicted without an SLO;
    TPOT's 0 when not streaming, as the router neutralises it then, and when only a TTFT SLO
    was asked: the router would count a TPOT SLO of 0, which no endpoint meets)."""
    ttft = [(slo.ttft or 0.0) - p.ttft for p in predictions]
    if not streaming or (slo.tpot is None and slo.ttft is not None):
        return ttft, [0.0] * len(predictions)  # a TTFT SLO alone is judged on TTFT alone
    return ttft, [(slo.tpot or 0.0) - p.tpot for p in predictions]


class LatencyScorer(ReadsPredictions):
    """``latency-scorer``: prefer the candidate with the best predicted headroom."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name)
        self.ttft_weight = params.get("ttftWeight", float, 0.8, at_least=0)
        self.tpot_weight = params.get("tpotWeight", float, 0.2, at_least=0)
        self.strategy = params.get("headroomSelectionStrategy", str, "least")
        if self.strategy not in ("least", "most"):
            raise params.error("headroomSelectionStrategy", "must be least or most")
        self.kv_weight = params.get("compositeKVWeight", float, 1.0, at_least=0)
        self.queue_weight = params.get("compositeQueueWeight", float, 1.0, at_least=0)
        self.prefix_weight = params.get("compositePrefixWeight", float, 1.0, at_least=0)
        self.work_weight = params.get("uncachedPrefillWeight", float, 0.0, at_least=0)

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        found = self.predictions(request, candidates)
        if found is None:
            return self._composite(request, candidates, now)
        predictions, slo = found
        assert self.producer is not None
        ttft, tpot = headrooms(predictions, slo, self.producer.streaming)
        asked = slo.ttft is not None or slo.tpot is not None
        meets = [t >= 0 and p >= 0 for t, p in zip(ttft, tpot, strict=True)]
        chosen = list(range(len(candidates)))
        packing = False
        if any(meets):
            chosen = [i for i in chosen if meets[i]]
            packing = self.strategy == "least"
        elif asked:
            idle = [i for i in chosen if predictions[i].dispatched == 0]
            if idle:
                chosen = idle
            else:  # the least severe bucket: TPOT only, TTFT only, both
                for bucket in (
                    [i for i in chosen if ttft[i] >= 0],
                    [i for i in chosen if tpot[i] >= 0],
                ):
                    if bucket:
                        chosen = bucket
                        break
        if self.work_weight:  # rank by the time the choice costs, its own and later requests'
            w = self.work_weight
            ttft = [h - w * p.prefill for h, p in zip(ttft, predictions, strict=True)]
        return _blend(ttft, tpot, chosen, packing, self.ttft_weight, self.tpot_weight)

    def _composite(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        """No predictions: KV use, requests in flight and the prefix match, weighted."""
        load: InFlight = request.state.get(load_key(INFLIGHT), _NOTHING)
        match: PrefixMatch | None = request.state.get(match_key(DEFAULT_PRODUCER))
        busiest = max((load.requests.get(c.endpoint.hostport, 0) for c in candidates), default=0)
        total = self.kv_weight + self.queue_weight + self.prefix_weight
        scores = []
        for c in candidates:
            key = c.endpoint.hostport
            kv = c.value("kv_cache_usage", now, 1.0)
            queue = 1.0 - load.requests.get(key, 0) / busiest if busiest else 1.0
            prefix = match.matched.get(key, 0) / match.total if match and match.total else 0.0
            s = self.kv_weight * (1.0 - kv if kv is not None else 0.0)
            s += self.queue_weight * queue + self.prefix_weight * prefix
            scores.append(s / total if total else 0.0)
        return scores


def _blend(
    ttft: Sequence[float],
    tpot: Sequence[float],
    chosen: Sequence[int],
    packing: bool,
    ttft_weight: float,
    tpot_weight: float,
) -> list[float]:
    """Scores in [0, 1]: each headroom scaled over ``chosen`` and blended; others score 0."""
    scores = [0.0] * len(ttft)
    if not chosen:
        return scores
    spans = []
    for values in (ttft, tpot):
        low = min(values[i] for i in chosen)
        spans.append((low, max(values[i] for i in chosen) - low))
    wt = ttft_weight if spans[0][1] > 0 else 0.0
    wp = tpot_weight if spans[1][1] > 0 else 0.0
    if wt + wp == 0:  # every chosen candidate ties
        for i in chosen:
            scores[i] = 1.0
        return scores
    for i in chosen:
        nt = (ttft[i] - spans[0][0]) / spans[0][1] if wt else 0.0
        np_ = (tpot[i] - spans[1][0]) / spans[1][1] if wp else 0.0
        if packing:  # closest to the SLO: the least headroom
            nt, np_ = 1.0 - nt, 1.0 - np_
        scores[i] = (wt * nt + wp * np_) / (wt + wp)
    return scores


class SloHeadroomTierFilter(ReadsPredictions):
    """``slo-headroom-tier-filter``: the candidates predicted to meet the request's SLO."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name)
        self.epsilon = params.get("epsilonExploreNeg", float, 0.01, at_least=0)
        if self.epsilon > 1:
            raise params.error("epsilonExploreNeg", "must be at most 1")
        self.rng = random.Random()
        """Draws the exploration (seeded in tests)."""

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        found = self.predictions(request, candidates)
        if found is None:
            return candidates
        predictions, slo = found
        if slo.ttft is None and slo.tpot is None:
            return candidates
        assert self.producer is not None
        ttft, tpot = headrooms(predictions, slo, self.producer.streaming)
        good = [c for c, t, p in zip(candidates, ttft, tpot, strict=True) if t >= 0 and p >= 0]
        if not good or len(good) == len(candidates):
            return candidates
        if self.rng.random() < self.epsilon:
            kept = {id(c) for c in good}
            return [c for c in candidates if id(c) not in kept]
        return good
