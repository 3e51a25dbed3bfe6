"""The plugin contracts of the endpoint picker: what a filter, scorer, picker or hook is.

Plugin authors import this module (and ``plugin_api.Params`` for parameters) and
nothing else of LWEPP. Each contract is a ``typing.Protocol`` with one
method: a plugin plays every role whose method it has (``plugin_api.Role``), so
one small class can be a scorer and a picked hook at once, and a hook
implements only the steps it needs. No base class, no registration.

One request meets the plugins in this order (``plugin_api.Role``)::

    prepare            compute per-request data once (e.g. prefix hashes) into request.state
    admit_request      refuse the request outright (an admitter: no endpoint could meet its SLO)
    filter             candidates → the subset allowed, in order
    score              each scorer rates every remaining candidate in [0, 1]; weighted and summed
    pick               scored candidates → endpoints, best first (primary, then fallbacks)
    picked             learn what was chosen
    ... the request is served ...
    response_headers   headers to add to the response
    response_chunk     each piece of the response body
    response_complete  the response is over: the served endpoint and token usage

Rules every plugin follows:

- Plugins are synchronous and pure over data they are given. Anything slow
  (scraping metrics, listing models) is a ``DataSource`` running in the
  background and writing ``Measurement`` snapshots; a pick never waits on it.
- Per-request data travels in ``request.state``, a dict owned by that request;
  plugins never keep per-request state on ``self``.
- Raising means "this plugin failed". The pipeline logs the error naming the
  plugin, counts it, and answers the request with plain round-robin over the
  candidates it started with: a broken plugin never loses a request.
- Optional attributes (``plugin_api``'s rules, shared with BBR): ``reads``,
  the endpoint attributes a plugin uses (e.g. ``frozenset({"queue_depth"})``;
  configuration fails when no data source produces one), ``needs_body``
  (True: LWEPP holds the body and the plugin sees it parsed), and ``wants``
  and ``provides`` (``Want``: the other plugins it is handed by name).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pods.model import Endpoint

# --- what plugins see -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """One attribute of one endpoint, and when it was measured.

    A value is a number (queue depth, KV-cache usage 0–1, ...) or a set of
    names (LoRA adapters running, models served). ``at`` is on the clock the
    data source was given (``time.monotonic`` in the service, an injected
    clock in tests), so age is ``now - at``. The built-in data sources write,
    and the built-in plugins read:

    ================  ====================================================
    queue_depth       requests waiting in the model server's queue
    running_requests  requests the model server is running
    kv_cache_usage    fraction of the KV cache in use, 0–1
    cache_block_size  tokens per KV-cache block
    cache_num_blocks  KV-cache blocks on the accelerator
    lora_max          how many LoRA adapters can be loaded at once
    lora_running      names of the LoRA adapters running
    lora_waiting      names of the LoRA adapters requests are waiting for
    served_models     names of the models (and adapters) the server lists
    ================  ====================================================
    """

    value: float | frozenset[str]
    at: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint that may serve the request, with its attributes as last measured."""

    endpoint: Endpoint
    attributes: Mapping[str, Measurement] = field(default_factory=dict)

    def value(self, name: str, now: float, max_age: float) -> float | None:
        """A numeric attribute, or None when it is unknown or older than ``max_age`` seconds.

        None means "no usable measurement", never zero: each scorer documents
        what it does with unknown data.
        """
        value = self._fresh(name, now, max_age)
        return None if isinstance(value, frozenset) else value

    def names(self, name: str, now: float, max_age: float) -> frozenset[str] | None:
        """A set-valued attribute (adapters, models), or None when unknown or stale."""
        value = self._fresh(name, now, max_age)
        return value if isinstance(value, frozenset) else None

    def _fresh(self, name: str, now: float, max_age: float) -> float | frozenset[str] | None:
        measured = self.attributes.get(name)
        return None if measured is None or now - measured.at > max_age else measured.value


@dataclass(slots=True)
class LLMRequest:
    """One request as plugins see it.

    ``headers`` has lower-case names and the first value of each. ``body`` and
    ``parsed`` are set only when some plugin ``needs_body`` (only then does
    LWEPP hold the body); ``parsed`` is a read-only view of the JSON body, or
    None if the body is not a JSON object. ``state`` is this request's
    scratch space shared by its plugins (keys are namespaced by convention:
    ``"<plugin name>.<what>"``).
    """

    request_id: str
    headers: Mapping[str, str]
    model: str | None = None
    body: bytes | None = None
    parsed: Mapping[str, Any] | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate with its weighted total and each scorer's raw score (for pickers and explain)."""

    candidate: Candidate
    total: float
    scores: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a model server reported in the response's ``usage`` (OpenAI shape)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


# --- the contracts ----------------------------------------------------------------


class Plugin(Protocol):
    """What every plugin has: ``name``, the instance name from the configuration."""

    name: str


class PrepareHook(Plugin, Protocol):
    def prepare(self, request: LLMRequest) -> None:
        """Compute per-request data once, before filtering, into ``request.state``."""
        ...


class Admitter(Plugin, Protocol):
    def admit_request(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float, priority: int
    ) -> str | None:
        """None lets the request on to the filters; a reason refuses it (the router's
        ``Admitter``, run after its data producers and before its scheduler).

        ``priority`` is the request's InferenceObjective's (0 without one; negative:
        sheddable). The pipeline answers a refusal with HTTP 429, the reason in its
        message, and counts it (``llm_d_epp_admission_refusals_total{plugin}``).
        """
        ...


class Filter(Plugin, Protocol):
    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        """Return the candidates the request may go to, a subset of ``candidates`` in order.

        ``now`` is the pipeline's clock, for ``Candidate.value``. Returning an
        empty sequence removes every candidate: the request is answered 503.
        """
        ...


class Scorer(Plugin, Protocol):
    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        """Rate each candidate, in order: one score per candidate, 1.0 best.

        Scores outside [0, 1] are clamped. The pipeline multiplies each by the
        scorer's configured weight (default 1.0) and sums per candidate.
        """
        ...


class Picker(Plugin, Protocol):
    def pick(self, request: LLMRequest, scored: Sequence[Scored]) -> Sequence[Endpoint]:
        """Choose from the scored candidates (never empty): best first, then fallbacks.

        The first endpoint is the destination; the rest are fallbacks Envoy may
        retry in order. Returning nothing answers the request 503.
        """
        ...


class PickedHook(Plugin, Protocol):
    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        """Learn the pick (e.g. record the prompt's prefix as cached there)."""
        ...


class ResponseHeadersHook(Plugin, Protocol):
    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        """Headers to add to the response (e.g. a session token); an empty mapping for none.

        ``served`` is the ``ip:port`` the gateway reports in ``envoy.lb``
        metadata, or None if it reported nothing; ``headers`` are the
        response's (lower-case names, first value).
        """
        ...


class ResponseChunkHook(Plugin, Protocol):
    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        """One piece of the response body as it streams (only when Envoy sends the body)."""
        ...


class ResponseCompleteHook(Plugin, Protocol):
    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        """The response is over; ``usage`` is the model server's token count when it sent one.

        Called once per response that ends: at the end of the body, at the
        trailers, or with the headers when no body follows.
        """
        ...


class AttributeWriter(Protocol):
    """Where data sources write: each call replaces one endpoint's named measurements."""

    def write(self, endpoint: str, values: Mapping[str, Measurement]) -> None: ...


EndpointsNow = Callable[[], Sequence[Endpoint]]
"""A data source's view of the pool: called each round, it returns the endpoints now."""

Clock = Callable[[], float]
"""Seconds on a monotonic clock: ``time.monotonic`` in the service, injected in tests."""


class DataSource(Protocol):
    """Background collection of endpoint attributes (metrics, served models, ...).

    ``produces`` names the attributes it writes. ``run`` loops until cancelled:
    each round it asks ``endpoints()`` for the current endpoints and writes
    what it measured for each, stamped with ``clock()``. A slow or dead
    endpoint must never hold up the others, and never a pick.
    """

    name: str

    @property
    def produces(self) -> frozenset[str]:
        """A class attribute, or set per instance when it depends on parameters."""
        ...

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None: ...


# --- plugins that name other plugins ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Want:
    """One plugin's need for another, which the configuration names (the router's data graph).

    A plugin lists its needs in ``wants`` (a sequence of these); a plugin that
    can meet one lists the word in ``provides`` (a frozenset). The
    configuration loader finds the plugin ``name`` names, checks that it
    ``provides`` the word, and hands it to ``give``, which may raise
    ``plugin_api.ConfigError`` (the two plugins' parameters clash, say).
    ``field`` is the parameter that names it, for errors.

    No plugin of that name: when ``name`` is ``default`` (the parameter was
    left at its default), that is no error, and with ``add`` the loader adds
    a plugin of type ``default`` of that name, as the router creates a
    producer for its consumers. ``name`` None: the plugin the router's
    ``dataLayer.sources`` pairs with this one, else the only plugin that
    provides the word, if exactly one does.

    A plugin with no role of its own but something it ``provides`` (the
    router's ``approx-prefix-cache-producer``, ``core-metrics-extractor``) is
    there only to be named: it never runs, and is reported when nothing names
    it.
    """

    field: str
    name: str | None
    provides: str
    give: Callable[[Any], None]
    default: str | None = None
    add: bool = False
    quiet: bool = False
    note: str = ""
    """What the warning about an added plugin says, instead of the parameter that names it."""


PREFIX_MATCH: Final = "prefix-match"
"""What a prefix producer provides: the index a prefix scorer reads (approximate or precise)."""

PREDICTED_LATENCY: Final = "predicted-latency"
"""What ``predicted-latency-producer`` provides: its predictions
(``lwepp.plugins.predicted_latency``; ``slo-deadline-ordering-policy`` reads them too)."""

IN_FLIGHT_LOAD: Final = "in-flight-load"
"""What ``inflight-load-producer`` provides: the requests and tokens in flight it counts."""

TOKENS: Final = "tokenized-prompt"
"""What ``token-producer`` provides: each request's prompt ids (``token_ids``)."""

ENDPOINT_EVENTS: Final = "endpoint-events"
"""What ``endpoint-notification-source`` provides: the pool's endpoints as they come and go,
for the extractors paired with it (the precise prefix producer subscribes to each)."""

ENDPOINTS: Final = "endpoints"
"""What ``file-discovery`` provides: the pool's endpoints (``dataLayer.discovery`` names it)."""

ENGINE_METRICS: Final = "engine-metrics"
"""What ``core-metrics-extractor`` provides: which metric each engine publishes."""
