"""LWEPP hosting the pipeline: the core service plus what hooks need around the pick.

``HookedService`` is the core ``EndpointPickerService`` (``lwepp.server``)
with four of its methods overridden; the stream handling, candidates,
refusals and replies are the core's own:

``pick``
    Runs the ``Pipeline`` (``lwepp.pipeline``) instead of a bare strategy,
    handing it the held body only when a plugin needs it, and keeps the
    decision in the stream's state (``RequestState.exchange``) when the
    response side will want it: for response hooks, or to explain.
``on_response_headers``
    Adds what the response hooks return, and the explanation, to the
    response headers; completes the exchange when no body will follow.
``on_response_body`` / ``on_response_trailers``
    Hand each body chunk to the response hooks and, at the end, the token
    usage read from the body (a JSON answer, or an event stream's last
    usage event).

Explaining: a request with ``x-switchyard-explain: 1`` gets, on its
response, ``x-switchyard-decision``: compact JSON of every candidate's
scores (raw, weight, total), what each filter removed, and what was picked
(or why the request fell back to round-robin). The last decisions explained,
and every fallback, are kept for ``GET /debug/decisions`` on the metrics port.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
import structlog
from prometheus_client import CollectorRegistry

from lwepp.attributes import AttributeStore, background_jobs
from lwepp.body import SSE_TAIL, response_usage
from lwepp.config import PickerConfig
from lwepp.picking import PickRequest, Pool
from lwepp.pipeline import Decision, Pipeline, PipelineMetrics
from lwepp.server import (
    MAX_BODY_BYTES,
    EndpointPickerService,
    Metrics,
    Refusal,
    RequestState,
    served_endpoint,
    served_endpoint_reply,
)
from protos import extproc
from protos.extproc import BodyMode, ProcessingRequest, ProcessingResponse

EXPLAIN_HEADER: Final = "x-switchyard-explain"
"""Request header asking for the decision to be explained (``1``, ``true``, ``yes``)."""

DECISION_HEADER: Final = "x-switchyard-decision"
"""Response header carrying the explained decision, compact JSON."""

ExplainMode = Literal["header", "all", "off"]
"""When to explain: on request (the header), every request, or never."""

_YES: Final = frozenset({"1", "true", "yes", "on"})

log = structlog.get_logger()


class DecisionLog:
    """The last decisions explained, and every fallback, for ``GET /debug/decisions``.

    A bounded deque: the oldest record goes when a new one comes. A fallback
    is kept even unexplained (a short record) — a failing plugin is exactly
    what one looks for here.
    """

    def __init__(self, size: int = 100) -> None:
        self._records: collections.deque[Mapping[str, Any]] = collections.deque(maxlen=size)

    def add(self, decision: Decision) -> None:
        record = decision.explanation
        if record is None:
            record = {
                "request": decision.request.request_id,
                "picked": [e.hostport for e in decision.endpoints],
                "fallback": str(decision.failure),
            }
        self._records.append(record)

    def render(self) -> bytes:
        """The records, oldest first, as a JSON array."""
        return orjson.dumps(list(self._records))


def header_json(data: Mapping[str, Any]) -> str:
    """Compact JSON that is safe in a header value: ASCII only, no line breaks."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True)


@dataclass(slots=True)
class Exchange:
    """One request's pipeline state, from the pick to the end of the response.

    ``body`` is what is kept of the response body for its usage while it
    streams (None when nothing is kept); ``complete`` once the response
    hooks were told the response is over.
    """

    decision: Decision
    served: str | None = None
    event_stream: bool = False
    body: bytearray | None = None
    complete: bool = False


class HookedService(EndpointPickerService):
    """The endpoint picker with a pipeline: the core's stream, the pipeline's picks and hooks."""

    def __init__(
        self,
        pool: Pool,
        pipeline: Pipeline,
        metrics: Metrics,
        max_body_bytes: int = MAX_BODY_BYTES,
        *,
        explain: ExplainMode = "header",
        decisions: DecisionLog | None = None,
    ) -> None:
        super().__init__(pool, pipeline, metrics, max_body_bytes)
        self.pipeline = pipeline
        self.explain = explain
        self.decisions = decisions or DecisionLog()

    # --- request side ------------------------------------------------------------

    def pick(self, state: RequestState, body: bytes | None = None) -> ProcessingResponse:
        """Run the pipeline; keep its decision for the response side when that needs it."""
        held = body if self.pipeline.needs_body else None
        request = self.pipeline.request_of(PickRequest(state.headers, held))
        explain = self.explain == "all" or (
            self.explain == "header" and request.headers.get(EXPLAIN_HEADER, "").lower() in _YES
        )
        decision = self.pipeline.decide(request, state.candidates, explain=explain)
        if decision.explanation is not None or decision.failure is not None:
            self.decisions.add(decision)
        if self.pipeline.responses or decision.explanation is not None:
            state.exchange = Exchange(decision)
        if not decision.endpoints:
            explained = decision.explanation
            headers = [(DECISION_HEADER, header_json(explained))] if explained else []
            raise Refusal(503, "no_pick", "no endpoint accepted the request", headers)
        return self.route(decision.endpoints)

    # --- response side -----------------------------------------------------------

    def on_response_headers(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        exchange: Exchange | None = state.exchange
        if exchange is None:
            return super().on_response_headers(message, state)
        exchange.served = served_endpoint(message)
        decision = exchange.decision
        added: list[tuple[str, str]] = []
        if self.pipeline.responses:
            headers: dict[str, str] = {}
            for name, value in extproc.header_pairs(message.response_headers):
                headers.setdefault(name.lower(), value)
            added = self.pipeline.response_headers(decision.request, exchange.served, headers)
            # The body comes to us only in a body mode other than NONE, and only if there is one.
            if message.response_headers.end_of_stream or state.response_body_mode in (
                None,
                BodyMode.NONE,
            ):
                self._complete(exchange)
            else:
                exchange.event_stream = "text/event-stream" in headers.get("content-type", "")
                exchange.body = bytearray()
        if decision.explanation is not None:
            added.append((DECISION_HEADER, header_json(decision.explanation)))
        return [served_endpoint_reply(message, added)]

    def on_response_body(
        self, message: ProcessingRequest, state: RequestState
    ) -> list[ProcessingResponse]:
        replies = super().on_response_body(message, state)
        exchange: Exchange | None = state.exchange
        if exchange is None or exchange.complete or not self.pipeline.responses:
            return replies
        chunk = message.response_body
        self.pipeline.response_chunk(exchange.decision.request, chunk.body)
        if exchange.body is not None:
            exchange.body += chunk.body
            if exchange.event_stream:
                del exchange.body[:-SSE_TAIL]  # the usage event is at the end
            elif len(exchange.body) > self.max_body_bytes:
                exchange.body = None  # too big to parse for its usage: report none
        if chunk.end_of_stream:
            self._complete(exchange)
        return replies

    def on_response_trailers(self, state: RequestState) -> list[ProcessingResponse]:
        exchange: Exchange | None = state.exchange
        if exchange is not None and not exchange.complete and self.pipeline.responses:
            self._complete(exchange)
        return super().on_response_trailers(state)

    def _complete(self, exchange: Exchange) -> None:
        """Tell the response hooks the response is over, with its usage when the body had one."""
        exchange.complete = True
        body, exchange.body = exchange.body, None
        usage = response_usage(bytes(body), exchange.event_stream) if body else None
        self.pipeline.response_complete(exchange.decision.request, exchange.served, usage)


# --- hosting a configuration ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hosted:
    """A configured picker ready to serve: the service, its background jobs, its debug pages."""

    service: HookedService
    background: list[Callable[[], Coroutine[Any, Any, None]]]
    json_routes: dict[str, Callable[[], bytes]]


def host(
    config: PickerConfig,
    pool: Pool,
    registry: CollectorRegistry,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    explain: ExplainMode = "header",
    keep_decisions: int = 100,
    clock: Callable[[], float] = time.monotonic,
) -> Hosted:
    """Wire a configuration: one attribute store, the pipeline, the service, the sources' tasks.

    The data sources get the pool's current endpoints and the clock; a
    source that fails is counted as ``lwepp_plugin_errors_total{stage="source"}``
    and restarted. Debug pages: ``/debug/decisions`` and ``/debug/attributes``.
    """
    store = AttributeStore()
    metrics = PipelineMetrics(registry)
    decisions = DecisionLog(keep_decisions)
    service = HookedService(
        pool,
        config.pipeline(store, clock, metrics),
        Metrics(registry),
        max_body_bytes,
        explain=explain,
        decisions=decisions,
    )

    def source_failed(source: str, error: BaseException) -> None:
        metrics.plugin_errors.labels(source, "source").inc()
        log.warning("data source failed; restarting it", source=source, exc_info=error)

    for warning in config.warnings:
        log.warning("configuration", detail=warning)
    return Hosted(
        service,
        background_jobs(config.sources, lambda: pool.endpoints, store, clock, source_failed),
        {
            "/debug/decisions": decisions.render,
            "/debug/attributes": lambda: orjson.dumps(store.describe(clock())),
        },
    )
