"""Each request's own latency, sizes and tokens, and whether its latency objectives were met.

The llm-d router records these around every request it routes
(``pkg/epp/handlers/server.go`` and ``response.go``, names in its
``docs/metrics.md``); Switchyard observes them where the picker stands, on
the request path, at one of three levels (``--request-metrics``):

``off``
    Nothing here: the picker of before, to the instruction.
``request`` (the default)
    What the request alone tells, with no exchange added: its body's size
    (``llm_d_epp_request_size_bytes``) and the time the choice took
    (``llm_d_epp_scheduler_e2e_duration_seconds``), by wrapping the strategy
    (``Timed``).
``response``
    Also what only the response tells. A request control (``RequestMetrics``,
    the picker's second seam) admits each request and hears its response
    through a followup (``Observed``): the headers, each body chunk, the
    end. The gateway must stream the response body through the picker for
    that (the picker says so in its ``listening`` line, and the demo's Envoy
    does it; every chunk is then an exchange with Python, which is what this
    level costs: ``docs/benchmarks.md``). It records, as the router does:

    - ``request_duration_seconds``: from the request made whole (admitted) to
      the response's end (the router starts at the request's headers; the two
      differ by the time the body takes to arrive);
    - ``request_ttft_seconds{...,streaming}``: to the first body chunk of an
      event stream; for a JSON answer, the whole duration (the router's rule:
      its first token arrives with the rest);
    - ``request_streaming_itl_seconds``: between consecutive chunks of a
      stream; ``request_streaming_tpot_seconds``: (duration − TTFT) / (output
      tokens − 1), for a stream of two tokens or more;
      ``request_ntpot_seconds``: duration / output tokens;
    - ``request_input_tokens``, ``request_output_tokens``,
      ``request_cached_tokens``: from the response's ``usage``; a stream that
      carries none (the client did not ask ``stream_options.include_usage``)
      has its output tokens counted as its ``data:`` events, one token each
      as vLLM sends them (the router records nothing then);
    - ``response_size_bytes``; ``request_running``, requests admitted whose
      response has not ended;
    - ``request_slo_total{model_name,target_model_name,objective,slo,outcome}``
      (Switchyard's): a request that states a TTFT or TPOT objective, in
      milliseconds, in ``x-llm-d-slo-ttft-ms`` / ``x-llm-d-slo-tpot-ms`` (the
      router's headers; ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` are their old
      names), is counted once per objective as ``met`` or ``missed``. A TPOT
      objective is judged only where TPOT is measured (a stream of two tokens
      or more). ``objective`` names the request's InferenceObjective: empty
      until the picker resolves one (``RequestMetrics.objective_of``).

Labels are the router's ``{model_name,target_model_name,fairness_id,priority}``,
computed by ``PickerMetrics.labels`` (one place, with its cardinality cap).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lwepp.body import UsageReader
from lwepp.contracts import Usage
from lwepp.picking import Admitted, Choice, RequestControl, RequestInfo, Strategy
from pods.model import Endpoint
from wire import extproc

Level = Literal["off", "request", "response"]
LEVELS: Final[tuple[Level, ...]] = ("off", "request", "response")

Labels = tuple[str, str, str, str]
"""``(model_name, target_model_name, fairness_id, priority)``."""

SLO_HEADERS: Final = {
    "ttft": ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"),
    "tpot": ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"),
}
"""Each latency objective's header, then its deprecated alias (the router's
``pkg/epp/metadata/consts.go``)."""

# The router's buckets (pkg/epp/metrics/llm_d_router_metrics.go, metrics.go).
LATENCY_BUCKETS: Final = (
    *(0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10),
    *(15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600),
)
TTFT_BUCKETS: Final = LATENCY_BUCKETS[:24]
"""5 ms to 2 minutes: the general latency buckets up to 120 s."""
TPOT_BUCKETS: Final = (
    *(0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2),
    *(0.3, 0.4, 0.5, 0.6, 0.8, 1, 2),
)
ITL_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    2,
)
NTPOT_BUCKETS: Final = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
SCHEDULER_BUCKETS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
REQUEST_SIZE_BUCKETS: Final = tuple(float(2**k) for k in range(6, 31))
"""64 B to 1 GiB, doubling."""
RESPONSE_SIZE_BUCKETS: Final = (1, *(float(2**k) for k in range(3, 15)), 32778, 65536)
"""1 B to 64 KiB; 32,778 (not 32,768) is the router's."""
INPUT_TOKEN_BUCKETS: Final = (
    *RESPONSE_SIZE_BUCKETS,
    *(131072, 262144, 524288, 1048576),
)
"""1 to 1,048,576 tokens: the response sizes' buckets, then on to 2**20."""
OUTPUT_TOKEN_BUCKETS: Final = (1, *(float(2**k) for k in range(3, 14)))
"""1 to 8,192 tokens."""


class Children(NamedTuple):
    """One label set's series of ``RequestSeries``, looked up once (``RequestSeries.of``)."""

    duration: Any
    response_size: Any
    input_tokens: Any
    output_tokens: Any
    cached_tokens: Any
    ntpot: Any
    ttft_streamed: Any
    ttft_whole: Any
    tpot: Any
    itl: Any
    running: Any


class RequestSeries:
    """The request series' families, with the router's names, labels and buckets, on a registry
    of the caller's (the picker's)."""

    LABELS: Final = ("model_name", "target_model_name", "fairness_id", "priority")

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, about: str, buckets: Sequence[float], *extra: str) -> Histogram:
            return Histogram(
                f"llm_d_epp_{name}",
                about,
                (*self.LABELS, *extra),
                buckets=buckets,
                registry=registry,
            )

        self.request_size: Final = histogram(
            "request_size_bytes", "Incoming request body size in bytes.", REQUEST_SIZE_BUCKETS
        )
        self.scheduler: Final = Histogram(
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency in seconds.",
            buckets=SCHEDULER_BUCKETS,
            registry=registry,
        )
        self.duration: Final = histogram(
            "request_duration_seconds", "End-to-end request latency in seconds.", LATENCY_BUCKETS
        )
        self.response_size: Final = histogram(
            "response_size_bytes", "Outgoing response body size in bytes.", RESPONSE_SIZE_BUCKETS
        )
        self.input_tokens: Final = histogram(
            "request_input_tokens", "Input tokens per request.", INPUT_TOKEN_BUCKETS
        )
        self.output_tokens: Final = histogram(
            "request_output_tokens", "Output tokens per request.", OUTPUT_TOKEN_BUCKETS
        )
        self.cached_tokens: Final = histogram(
            "request_cached_tokens", "Prompt tokens read from cache.", INPUT_TOKEN_BUCKETS
        )
        self.ntpot: Final = histogram(
            "request_ntpot_seconds", "Duration per output token in seconds.", NTPOT_BUCKETS
        )
        self.ttft: Final = histogram(
            "request_ttft_seconds", "Time to first token in seconds.", TTFT_BUCKETS, "streaming"
        )
        self.tpot: Final = histogram(
            "request_streaming_tpot_seconds", "Time per output token, streams.", TPOT_BUCKETS
        )
        self.itl: Final = histogram(
            "request_streaming_itl_seconds", "Time between stream chunks.", ITL_BUCKETS
        )
        self.running: Final = Gauge(
            "llm_d_epp_request_running",
            "Requests admitted whose response has not ended.",
            self.LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.slo: Final = Counter(
            "llm_d_epp_request_slo",
            "Requests with a latency objective, by objective, kind and whether it was met.",
            ("model_name", "target_model_name", "objective", "slo", "outcome"),
            registry=registry,
        )

    def of(self, *labels: str) -> Children:
        """The series of one label set (``Labels``)."""
        return Children(
            duration=self.duration.labels(*labels),
            response_size=self.response_size.labels(*labels),
            input_tokens=self.input_tokens.labels(*labels),
            output_tokens=self.output_tokens.labels(*labels),
            cached_tokens=self.cached_tokens.labels(*labels),
            ntpot=self.ntpot.labels(*labels),
            ttft_streamed=self.ttft.labels(*labels, "true"),
            ttft_whole=self.ttft.labels(*labels, "false"),
            tpot=self.tpot.labels(*labels),
            itl=self.itl.labels(*labels),
            running=self.running.labels(*labels),
        )


class Timed:
    """A strategy that times the one it wraps (``scheduler_e2e_duration_seconds``) and records
    the size of the body it chose for (``request_size_bytes``; the ``content-length`` header
    when the body was not held, as in a mode other than full duplex)."""

    __slots__ = ("clock", "labels", "series", "sizes", "strategy")

    def __init__(
        self,
        strategy: Strategy,
        series: RequestSeries,
        labels: Callable[[Sequence[tuple[str, str]]], Labels],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.strategy, self.series, self.labels, self.clock = strategy, series, labels, clock
        # Speed: a label set's child is looked up once (prometheus_client's lookup costs more
        # than the observation); bounded, as the labels are (PickerMetrics.CAP).
        self.sizes = functools.lru_cache(maxsize=4096)(series.request_size.labels)

    @property
    def hears_response(self) -> bool:
        return self.strategy.hears_response

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        started = self.clock()
        try:
            choice = self.strategy.choose(request, candidates)
        finally:
            self.series.scheduler.observe(self.clock() - started)
        size = len(request.body) if request.body is not None else content_length(request)
        self.sizes(*self.labels(request.headers)).observe(size)
        return choice


def content_length(request: RequestInfo) -> int:
    """The request's declared body length; 0 when it declares none (or none that reads)."""
    value = extproc.first_header(request.headers, "content-length")
    return int(value) if value is not None and value.isdigit() else 0


def no_objective(_request: RequestInfo) -> str:
    """The request's InferenceObjective's name: none yet. The objective's resource and its
    header (``x-llm-d-inference-objective``) arrive with the governance work; until then the
    ``objective`` label is present, and empty."""
    return ""


class RequestMetrics:
    """The request control (``lwepp.picking.RequestControl``) that observes each request and
    hears its response, at the ``response`` level: it adds an ``Observed`` followup.

    ``labels`` computes a request's labels from its headers (``PickerMetrics.labels``);
    ``objective_of`` names its InferenceObjective (``no_objective`` until the picker reads
    them); ``clock`` is a monotonic clock in seconds.
    """

    hears_response: Final = True
    reads_response_body: Final = True

    def __init__(
        self,
        series: RequestSeries,
        labels: Callable[[Sequence[tuple[str, str]]], Labels],
        *,
        objective_of: Callable[[RequestInfo], str] = no_objective,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.series, self.labels, self.clock = series, labels, clock
        self.objective_of = objective_of
        # Speed: a label set's series are looked up once (prometheus_client's lookup costs
        # more than an observation, and a stream observes once a chunk); bounded, as the
        # labels are (PickerMetrics.CAP).
        self.children = functools.lru_cache(maxsize=4096)(series.of)

    async def admit(self, admitted: Admitted) -> Admitted:
        request = admitted.request
        objectives = {
            slo: limit
            for slo, names in SLO_HEADERS.items()
            if (limit := objective_seconds(request, names)) is not None
        }
        labels = self.labels(request.headers)
        observed = Observed(self, labels, self.objective_of(request), objectives)
        return admitted._replace(followups=(*admitted.followups, observed))


def objective_seconds(request: RequestInfo, names: Sequence[str]) -> float | None:
    """The objective the first of ``names`` the request carries states in milliseconds, in
    seconds; None when absent, or not a positive number (ignored, as the router ignores it)."""
    for name in names:
        value = extproc.first_header(request.headers, name)
        if value is not None:
            try:
                limit = float(value)
            except ValueError:
                return None
            return limit / 1000 if limit > 0 and math.isfinite(limit) else None
    return None


class Observed:
    """One request's response as ``RequestMetrics`` hears it (a ``Followup``): times, bytes,
    events; observed all at once at the end.

    A response that breaks off never ends (``Followup``): its running count is taken back
    when the stream lets go of this object, and nothing else is observed, as the router
    observes nothing of a request it did not see finish.
    """

    __slots__ = (
        "children",
        "control",
        "ended",
        "events",
        "first",
        "labels",
        "last",
        "objective",
        "objectives",
        "reader",
        "received",
        "size",
        "streaming",
    )

    def __init__(
        self,
        control: RequestMetrics,
        labels: Labels,
        objective: str,
        objectives: Mapping[str, float],
    ) -> None:
        self.control, self.labels = control, labels
        self.objective, self.objectives = objective, objectives
        self.received = control.clock()
        self.first: float | None = None
        self.last = 0.0
        self.size = self.events = 0
        self.streaming = False
        self.reader: UsageReader | None = None
        self.ended = False
        self.children: Children = control.children(*labels)
        self.children.running.inc()

    def headers(self, served: str | None, headers: Mapping[str, str]) -> Sequence[tuple[str, str]]:
        self.streaming = "text/event-stream" in headers.get("content-type", "")
        self.reader = UsageReader(self.streaming)
        return ()

    def chunk(self, chunk: bytes) -> None:
        if not chunk:
            return
        now = self.control.clock()
        if self.first is None:
            self.first = now
        elif self.streaming:
            self.children.itl.observe(now - self.last)
        self.last = now
        self.size += len(chunk)
        if self.streaming:
            self.events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        if self.reader is not None:
            self.reader.add(chunk)

    def end(self) -> None:
        now, series, labels = self.control.clock(), self.children, self.labels
        self.ended = True
        series.running.dec()
        duration = now - self.received
        series.duration.observe(duration)
        series.response_size.observe(self.size)
        usage = self.reader.usage() if self.reader is not None else None
        output = self.output_tokens(usage)
        self.observe_tokens(usage, output)
        ttft = (self.first if self.streaming and self.first is not None else now) - self.received
        (series.ttft_streamed if self.streaming else series.ttft_whole).observe(ttft)
        measured = {"ttft": ttft}
        if output:
            series.ntpot.observe(duration / output)
            if self.streaming and output > 1:
                measured["tpot"] = tpot = (duration - ttft) / (output - 1)
                series.tpot.observe(tpot)
        for slo, limit in self.objectives.items():
            if slo in measured:
                outcome = "met" if measured[slo] <= limit else "missed"
                slos = self.control.series.slo
                slos.labels(labels[0], labels[1], self.objective, slo, outcome).inc()

    def output_tokens(self, usage: Usage | None) -> int:
        """The completion tokens the usage reports, else a stream's token events (its
        ``data:`` events but the ``[DONE]`` that closes it)."""
        if usage is not None and usage.completion_tokens is not None:
            return usage.completion_tokens
        return self.events

    def observe_tokens(self, usage: Usage | None, output: int) -> None:
        """The token histograms, each only when its count is known and above zero (the router
        records no zero)."""
        series = self.children
        if usage is not None and usage.prompt_tokens:
            series.input_tokens.observe(usage.prompt_tokens)
        if output:
            series.output_tokens.observe(output)
        if usage is not None and usage.cached_tokens is not None:
            series.cached_tokens.observe(usage.cached_tokens)

    def __del__(self) -> None:
        if not self.ended:  # the response broke off (or never came): it is running no more
            self.children.running.dec()


def install(
    level: Level,
    strategy: Strategy,
    labels: Callable[[Sequence[tuple[str, str]]], Labels],
    registry: CollectorRegistry,
    objective_of: Callable[[RequestInfo], str] = no_objective,
) -> tuple[Strategy, list[RequestControl]]:
    """The strategy and request controls that observe requests at ``level`` (``off``: the
    strategy as it is, and none). ``objective_of`` names a request's InferenceObjective, for
    the ``objective`` label (the picker that resolves objectives passes its own)."""
    if level == "off":
        return strategy, []
    series = RequestSeries(registry)
    timed = Timed(strategy, series, labels)
    if level == "request":
        return timed, []
    return timed, [RequestMetrics(series, labels, objective_of=objective_of)]
