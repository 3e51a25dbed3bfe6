"""The picker's Prometheus metrics, under the llm-d router's names and labels, so the
router's dashboards read Switchyard's pickers unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from pods.model import Endpoint
from serving.build import build_info

MODEL_HEADER: Final = "x-gateway-model-name"
FAIRNESS_HEADER: Final = "x-llm-d-inference-fairness-id"
DEFAULT_FAIRNESS: Final = "default-flow"
ERROR_CODES: Final = {
    400: "BadRequest",
    413: "ResourceExhausted",
    429: "ResourceExhausted",
    431: "BadRequest",
    503: "ServiceUnavailable",
}
"""HTTP status → the llm-d router's error code names; any other status is ``Internal``."""


class PickerMetrics:
    """The picker's Prometheus metrics, with the llm-d router's names and labels.

    What its dashboards query (``docs/metrics.md`` of llm-d-router v0.10), on a
    registry of the caller's:

    - ``llm_d_epp_request_total{model_name,target_model_name,fairness_id,priority}``:
      requests routed. The model is the request's ``x-gateway-model-name``
      (BBR's), the target the model it was sent as (an InferenceModelRewrite's
      target, else the same), the fairness id the ``x-llm-d-inference-fairness-id``
      header (else ``default-flow``), the priority its InferenceObjective's
      (``priority_of``; 0 without objectives). A model or fairness id past the
      1,000th distinct one counts as ``other``, as in the router;
    - ``llm_d_epp_request_error_total{...,error_code}``: requests refused, by
      the router's code names (``ServiceUnavailable``, ``ResourceExhausted``...);
    - ``llm_d_epp_scheduler_attempts_total{status,target_model_name,endpoint_name,namespace,port}``:
      picks, with the pod and port of a success;
    - ``llm_d_epp_ready_endpoints{name}``: endpoints in pool ``name``, set by
      ``refresh`` (a background job, as the router's
      ``--refresh-prometheus-metrics-interval``);
    - ``llm_d_epp_info{commit,build_ref}``: 1.

    Gauges say how ``--workers`` combine them (``multiprocess_mode``): the
    workers read the same pool, so the largest value of the live ones.
    """

    CAP: Final = 1000

    def __init__(
        self,
        registry: CollectorRegistry,
        pool: str = "",
        namespace: str = "",
        priority_of: Callable[[Sequence[tuple[str, str]]], int] | None = None,
    ) -> None:
        def counter(name: str, about: str, *labels: str) -> Counter:
            return Counter(f"llm_d_epp_{name}", about, labels, registry=registry)

        def gauge(name: str, about: str, *labels: str) -> Gauge:
            return Gauge(
                f"llm_d_epp_{name}", about, labels, registry=registry, multiprocess_mode="livemax"
            )

        request = ("model_name", "target_model_name", "fairness_id", "priority")
        self.namespace = namespace
        self.priority_of = priority_of
        self.requests = counter("request", "Total number of processed requests.", *request)
        self.errors = counter(
            "request_error", "Total number of request errors.", *request, "error_code"
        )
        self.attempts = counter(
            "scheduler_attempts",
            "Total number of scheduling attempts.",
            *("status", "target_model_name", "endpoint_name", "namespace", "port"),
        )
        self.ready = gauge("ready_endpoints", "Ready endpoints in the pool.", "name").labels(pool)
        gauge("info", "The current build.", "commit", "build_ref").labels(*build_info()).set(1)
        self._seen: dict[str, set[str]] = {"model": set(), "fairness": set()}

    def bounded(self, kind: str, value: str) -> str:
        """``value``, or ``other`` once ``CAP`` distinct values of its kind were counted."""
        seen = self._seen[kind]
        if value not in seen and len(seen) >= self.CAP:
            return "other"
        seen.add(value)
        return value

    def labels(
        self, headers: Sequence[tuple[str, str]], target: str | None = None
    ) -> tuple[str, str, str, str]:
        """``(model_name, target_model_name, fairness_id, priority)`` of a request with the
        client's ``headers``, sent as the model ``target`` (None: the model it named).

        The first value of each header, names compared case-insensitively (as
        ``extproc.first_header``), found in one pass: this runs on every pick,
        and a walk over the headers costs more than the rest of the labels.
        """
        model = fairness = None
        for name, value in headers:
            key = name.lower()
            if key == MODEL_HEADER and model is None:
                model = value
            elif key == FAIRNESS_HEADER and fairness is None:
                fairness = value
        bounded_model = self.bounded("model", model or "")
        return (
            bounded_model,
            bounded_model if target is None else self.bounded("model", target),
            self.bounded("fairness", fairness or DEFAULT_FAIRNESS),
            "0" if self.priority_of is None else str(self.priority_of(headers)),
        )

    def refresh(self, endpoints: Sequence[Endpoint]) -> None:
        self.ready.set(len(endpoints))
