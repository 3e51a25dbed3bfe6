"""The services' metrics under the originals' names, and the dashboard that reads them."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS
from bbr.server import BodyBasedRouter
from demo.dashboard import legend, promql
from lwepp.config import load_config, load_text
from lwepp.contracts import Measurement
from lwepp.flowcontrol.governance import govern
from lwepp.metrics import PickerMetrics
from lwepp.picking import SUBSET_KEY, SUBSET_NAMESPACE, Pool, RequestInfo
from lwepp.pipeline import Pipeline
from lwepp.request_metrics import install
from lwepp.rewrite_control import ModelRewriteControl, RewriteMetrics
from lwepp.rewrite_sources import FixedRewrites
from lwepp.rewrites import ModelRewrite, Rule, Target
from lwepp.server import EndpointPickerService
from pods.model import Endpoint
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    response_body,
    response_headers,
    running,
)
from tests.fakes import StaticPods, pod
from wire.extproc import BodyMode

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "manifests" / "components" / "monitoring" / "switchyard-dashboard.json"
CONFIG = ROOT / "manifests" / "components" / "picker-config" / "epp-config.yaml"
PODS = (pod("p0", "10.0.0.1", 8000, pool="a"), pod("p1", "10.0.0.2", 8000, pool="a"))
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'
STREAMED = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
STREAM = (
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
)


def fail(*_args: object) -> list[float]:
    raise RuntimeError("a scorer failing")


def exported() -> dict[str, set[str]]:
    """Every series a picker (with the mounted configuration) and BBR export after a few requests
    that succeed and fail, and the labels each carries."""
    picker_registry, bbr_registry = CollectorRegistry(), CollectorRegistry()

    async def traffic() -> None:
        pipeline = load_config(CONFIG).pipeline(registry=picker_registry, pool="a")
        pool = Pool(StaticPods(*PODS), {"pool": "a"})
        metrics = PickerMetrics(picker_registry, "a", "ns")
        canary = FixedRewrites([ModelRewrite("c", "ns", "a", (Rule(("m",), (Target("c"),)),))])
        rewrite = ModelRewriteControl(canary, RewriteMetrics(picker_registry))
        strategy, controls = install("response", pipeline, metrics.labels, picker_registry)
        picker = EndpointPickerService(pool, strategy, metrics, controls=[rewrite, *controls])
        router = BodyBasedRouter(bbr_registry, DEFAULT_PLUGINS)
        async with running("lwepp", picker) as lwepp, running("bbr", router) as bbr:
            async with ExtProcClient(f"127.0.0.1:{lwepp.grpc}") as client:
                headers = {":path": "/v1/chat/completions", "x-gateway-model-name": "m"}
                await client.exchange(
                    [request_headers(headers), request_body(BODY), response_headers({})]
                )
                objectives = {**headers, "x-llm-d-slo-ttft-ms": "100", "x-llm-d-slo-tpot-ms": "1"}
                await client.exchange(
                    [
                        request_headers(objectives, body_modes=STREAMED),
                        request_body(BODY),
                        response_headers({"content-type": "text/event-stream"}),
                        response_body(STREAM[:40], end_of_stream=False),
                        response_body(STREAM[40:]),
                    ]
                )
                nowhere = {SUBSET_NAMESPACE: {SUBSET_KEY: ["10.9.9.9"]}}
                await client.exchange([request_headers(headers, metadata=nowhere)])
                scorer = pipeline.scorers[0][0]  # a scorer that fails once: counted
                scorer.score = fail  # type: ignore[method-assign,assignment]
                await client.exchange([request_headers(headers), request_body(BODY)])
            async with ExtProcClient(f"127.0.0.1:{bbr.grpc}") as client:
                for body in (BODY, b'{"prompt": "no model"}', b"not json"):
                    await client.exchange([request_headers({}), request_body(body)])
        metrics.refresh(pool.endpoints)
        pipeline.refresh_metrics(pool.endpoints)

    asyncio.run(traffic())
    flow_registry = governed_traffic()
    series: dict[str, set[str]] = {}
    for registry in (picker_registry, bbr_registry, flow_registry):
        for family in registry.collect():
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


FLOW = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins: [{type: queue-scorer}]
flowControl:
  priorityBands: [{priority: 0, maxRequests: 1}]
"""


def governed_traffic() -> CollectorRegistry:
    """A picker with flow control on (the utilization detector, no metrics yet: the pool reads
    saturated): one request waits, the next is refused for capacity."""
    registry = CollectorRegistry()

    async def traffic() -> None:
        config = load_text(FLOW)
        pipeline = config.pipeline(registry=registry, pool="a")
        pool = Pool(StaticPods(*PODS), {"pool": "a"})
        governed = govern(
            config.flow,
            lambda: pipeline.candidates(pool.endpoints).candidates,
            pipeline.clock,
            None,
            registry,
            "a",
        )
        picker = EndpointPickerService(
            pool, pipeline, PickerMetrics(registry, "a", "ns"), controls=governed.controls
        )
        async with (
            running("lwepp", picker, background=governed.jobs) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            headers = {":path": "/v1/completions", "x-gateway-model-name": "m"}
            waiting = asyncio.create_task(
                client.exchange([request_headers(headers), request_body(BODY)])
            )
            assert governed.controller is not None
            for _ in range(10_000):  # the first waits, then the next is refused
                if governed.controller.length:
                    break
                await asyncio.sleep(0.001)
            await client.exchange([request_headers(headers), request_body(BODY)])
            for hook in governed.stopping:
                hook()
            await waiting

    asyncio.run(traffic())
    return registry


def queries() -> Iterator[str]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            yield target["expr"]


def test_every_series_the_dashboard_queries_is_exported_with_its_labels() -> None:
    """Each metric a panel reads exists, and each label it groups or filters by is on it
    (``namespace`` comes from Prometheus's scrape, ``le`` from the histogram)."""
    series = exported()
    checked = 0
    for expr in queries():
        names = set(re.findall(r"\b((?:llm_d_epp|bbr|ipp)_[a-z0-9_]+)\b", expr))
        assert names, expr
        grouped = {
            label.strip()
            for group in re.findall(r"by \(([^)]*)\)", expr)
            for label in group.split(",")
        }
        filtered = set(re.findall(r"([a-z_]+)=~?\"", expr))
        for name in names:
            assert name in series, f"{name} (in {expr}) is not exported"
            missing = (grouped | filtered) - series[name] - {"namespace", "le"}
            assert not missing, f"{name} has no label {missing} (in {expr})"
            checked += 1
    assert checked >= 29


REQUEST = {"model_name", "target_model_name", "fairness_id", "priority"}


def test_the_screenshot_s_renderer_fills_in_every_variable_and_legend() -> None:
    """``demo.dashboard`` sends Prometheus each panel's query with no Grafana variable left,
    and writes a dropped (empty) label as ``""`` in a legend."""
    assert all("$" not in promql(expr) for expr in queries())
    assert legend("{{model_name}} {{objective}}", {"model_name": "m"}) == 'm ""'


def test_the_picker_exports_the_router_s_families_with_its_labels() -> None:
    """The names and label sets of llm-d-router v0.10 (docs/metrics.md), the request series
    of its HEAD (pkg/epp/metrics/llm_d_router_metrics.go), and the payload processor's ipp_*
    beside bbr_* (pkg/metrics/metrics.go at main)."""
    series = exported()
    expected = {
        "llm_d_epp_request_total": {"model_name", "target_model_name", "fairness_id", "priority"},
        "llm_d_epp_request_error_total": {
            *("model_name", "target_model_name", "fairness_id", "priority", "error_code"),
        },
        "llm_d_epp_scheduler_attempts_total": {
            *("status", "target_model_name", "endpoint_name", "namespace", "port"),
        },
        "llm_d_epp_ready_endpoints": {"name"},
        "llm_d_epp_plugin_duration_seconds_bucket": {
            *("extension_point", "plugin_type", "plugin_name", "le"),
        },
        "llm_d_epp_average_kv_cache_utilization": {"name"},
        "llm_d_epp_average_queue_size": {"name"},
        "llm_d_epp_average_running_requests": {"name"},
        "llm_d_epp_info": {"commit", "build_ref"},
        "bbr_info": {"commit", "build_ref"},
        "bbr_success_total": set(),
        "bbr_body_field_not_found_total": {"field"},
        "ipp_info": {"commit", "build_ref"},
        "ipp_success_total": set(),
        "ipp_body_field_not_found_total": {"field"},
        "ipp_body_field_empty_total": {"field"},
        "ipp_plugin_duration_seconds_bucket": {
            *("extension_point", "plugin_type", "plugin_name", "le"),
        },
        "llm_d_epp_scheduler_e2e_duration_seconds_bucket": {"le"},
        "llm_d_epp_request_running": REQUEST,
        "llm_d_epp_request_ttft_seconds_bucket": {*REQUEST, "streaming", "le"},
        "llm_d_epp_request_slo_total": {
            *("model_name", "target_model_name", "objective", "slo", "outcome"),
        },
        **{
            f"llm_d_epp_{name}_bucket": {*REQUEST, "le"}
            for name in (
                "request_duration_seconds",
                "request_size_bytes",
                "response_size_bytes",
                "request_input_tokens",
                "request_output_tokens",
                "request_ntpot_seconds",
                "request_streaming_tpot_seconds",
                "request_streaming_itl_seconds",
            )
        },
        "llm_d_epp_model_rewrite_decisions_total": {
            *("model_rewrite_name", "model_name", "target_model"),
        },
    }
    for name, labels in expected.items():
        assert series.get(name) == labels, name


def endpoint(name: str) -> Endpoint:
    return Endpoint(name, f"10.0.0.{name[-1]}", 8000)


def test_pool_gauges_are_the_mean_and_spread_of_fresh_measurements() -> None:
    """Means and population standard deviations over the endpoints measured within 2 s;
    a stale or missing measurement is left out; no fresh one at all reports 0."""
    registry, now = CollectorRegistry(), [100.0]
    pipeline = Pipeline(registry=registry, clock=lambda: now[0], pool="a")
    for name, kv, queue, at in [("e1", 0.2, 1, 99.5), ("e2", 0.6, 3, 99.0), ("e3", 0.9, 9, 90.0)]:
        pipeline.store.write(
            f"10.0.0.{name[-1]}:8000",
            {"kv_cache_usage": Measurement(kv, at), "queue_depth": Measurement(queue, at)},
        )
    pipeline.refresh_metrics([endpoint("e1"), endpoint("e2"), endpoint("e3")])

    def gauge(name: str) -> float:
        value = registry.get_sample_value(f"llm_d_epp_{name}", {"name": "a"})
        assert value is not None
        return value

    assert math.isclose(gauge("average_kv_cache_utilization"), 0.4)
    assert math.isclose(gauge("std_dev_kv_cache_utilization"), 0.2)
    assert math.isclose(gauge("average_queue_size"), 2.0)
    assert gauge("average_running_requests") == 0.0  # nobody measured it
    now[0] = 1000.0
    pipeline.refresh_metrics([endpoint("e1")])
    assert gauge("average_kv_cache_utilization") == 0.0


def test_each_plugin_call_is_timed_under_the_router_s_extension_point_and_type() -> None:
    """One pick through the mounted configuration: each scorer's and the picker's call is
    observed once, under the router's extension-point names and the configured types."""
    registry = CollectorRegistry()
    pipeline = load_config(CONFIG).pipeline(registry=registry, pool="a")
    pipeline.choose(RequestInfo((), BODY), [endpoint("e1"), endpoint("e2")])
    counts = {
        (s.labels["extension_point"], s.labels["plugin_type"]): s.value
        for family in registry.collect()
        if family.name == "llm_d_epp_plugin_duration_seconds"
        for s in family.samples
        if s.name.endswith("_count")
    }
    assert counts == {
        ("DataProducer", "approx-prefix-cache-producer"): 1,
        ("Scorer", "queue-scorer"): 1,
        ("Scorer", "kv-cache-utilization-scorer"): 1,
        ("Scorer", "prefix-cache-scorer"): 1,
        ("Picker", "MaxScorePicker"): 1,
        ("PreRequest", "approx-prefix-cache-producer"): 1,
        ("ResponseComplete", "approx-prefix-cache-producer"): 0,
    }


def test_client_chosen_label_values_are_capped_as_the_router_caps_them() -> None:
    """Model names and fairness ids come from requests: past the 1,000th distinct value of
    each, a new one is counted as ``other`` (known ones keep their own series)."""
    metrics = PickerMetrics(CollectorRegistry())
    for i in range(PickerMetrics.CAP):
        assert metrics.bounded("model", f"m{i}") == f"m{i}"
    assert metrics.bounded("model", "one-too-many") == "other"
    assert metrics.bounded("model", "m7") == "m7"
    assert metrics.bounded("fairness", "tenant-a") == "tenant-a"  # each kind has its own cap
    labels = metrics.labels(
        [("x-gateway-model-name", "m1"), ("x-llm-d-inference-fairness-id", "t")]
    )
    assert labels == ("m1", "m1", "t", "0")
    assert metrics.labels([])[2] == "default-flow"


def test_label_values_are_each_headers_first_value_whatever_its_case() -> None:
    """A request's model and fairness id are the first value of each header, names compared
    case-insensitively; an empty fairness id is the default flow."""
    metrics = PickerMetrics(CollectorRegistry())
    headers = [
        ("X-LLM-D-Inference-Fairness-Id", "tenant-a"),
        ("x-gateway-model-name", "m1"),
        ("X-Gateway-Model-Name", "m2"),
        ("x-llm-d-inference-fairness-id", "tenant-b"),
    ]
    assert metrics.labels(headers) == ("m1", "m1", "tenant-a", "0")
    assert metrics.labels(
        [("x-llm-d-inference-fairness-id", ""), ("x-gateway-model-name", "")]
    ) == (
        "",
        "",
        "default-flow",
        "0",
    )
