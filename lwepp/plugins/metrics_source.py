"""``metrics-data-source``: scrape each endpoint's Prometheus ``/metrics`` into endpoint attributes.

Every ``refreshIntervalSeconds`` (default 0.1 s) each endpoint is asked for
``<scheme>://<ip:port><path>``, on its own task (``polling``), and what its
engine's mapping finds is written to the store, stamped with the source's
clock when the answer arrived. Attributes written (``contracts.Measurement``):

==================  ==========================================================
queue_depth         the engine's queued-requests gauge
running_requests    the engine's running-requests gauge
kv_cache_usage      the engine's KV-cache usage, 0–1
cache_block_size    tokens per KV block (a label of an info gauge, or a gauge)
cache_num_blocks    KV blocks on the accelerator (likewise)
lora_max            ``max_lora`` of the newest LoRA info series
lora_running        its ``running_lora_adapters`` (comma-separated → a set)
lora_waiting        its ``waiting_lora_adapters``
==================  ==========================================================

Engines built in (the llm-d router's names and metrics, plus llama.cpp)::

    vllm                 vllm:num_requests_waiting / vllm:num_requests_running /
                         vllm:kv_cache_usage_perc / vllm:lora_requests_info /
                         vllm:cache_config_info{block_size, num_gpu_blocks}
    sglang               sglang:num_queue_reqs / sglang:num_running_reqs /
                         sglang:token_usage / sglang:cache_config_info{page_size, num_pages}
    trtllm-serve         trtllm_num_requests_waiting / trtllm_num_requests_running /
                         trtllm_kv_cache_utilization / trtllm_kv_cache_tokens_per_block /
                         trtllm_kv_cache_max_blocks
    triton-tensorrt-llm  nv_trt_llm_request_metrics{request_type=waiting|scheduled} /
                         nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction|tokens_per|max}
    llamacpp             llamacpp:requests_deferred / llamacpp:requests_processing,
                         and no KV gauge: kv_cache_usage is never written (unknown, not 0)

Parameters (the llm-d router splits them between ``metrics-data-source`` and
``core-metrics-extractor``; here one plugin does both, and a configuration that
lists a ``core-metrics-extractor`` hands it the extractor's: ``engineLabelKey``,
``defaultEngine``, ``engineConfigs``):

- ``scheme`` (``http``), ``path`` (``/metrics``), ``insecureSkipVerify`` (true);
- ``refreshIntervalSeconds`` (0.1; the router's default is 0.05 s: twice as long
  here because a Python event loop shares its core with the picks, and a
  scrape costs a few hundred µs of it — see ``bench/plugins.py``);
- ``timeoutSeconds`` (1.0): a scrape slower than that is abandoned;
- ``engineLabelKey`` (``llm-d.ai/engine-type``; the pod label
  ``inference.networking.k8s.io/engine-type`` is read when it is absent);
- ``defaultEngine`` (``vllm``): for endpoints without the label, or naming an
  engine nobody configured;
- ``engineConfigs``: ``[{name, queuedRequestsSpec, runningRequestsSpec,
  kvUsageSpec, loraSpec, cacheInfoSpec, cacheBlockSizeLabelName,
  cacheNumBlocksLabelName, cacheBlockSizeSpec, cacheNumBlocksSpec}]``, each
  spec a selector like ``my_queue{state="waiting"}`` (exact matches only) or
  empty; an entry replaces the built-in engine of the same name whole.

Unknown and stale data: a metric missing from a page, or whose value is NaN,
is not written, so the attribute stays unknown or keeps ageing; an endpoint
that does not answer (refused, timed out, not 200) gets no write at all, and
its last values grow stale. When a metric has several matching series the
first on the page is used, except the LoRA info gauge, whose value is a
timestamp: the newest series wins (as the router does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import aiohttp

from lwepp.contracts import ENGINE_METRICS, Want
from lwepp.plugins import polling
from lwepp.plugins.polling import Values
from lwepp.plugins.prometheus import Families, Selector, parse, parse_selector
from plugin_api import NO_PARAMS, ConfigError, Params
from pods.model import Endpoint

ENGINE_LABEL: Final = "llm-d.ai/engine-type"
LEGACY_ENGINE_LABEL: Final = "inference.networking.k8s.io/engine-type"


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """Which series of one engine's ``/metrics`` carry which attribute.

    ``gauges``: attribute → the series whose value it is (``queue_depth``,
    ``running_requests``, ``kv_cache_usage``; ``cache_block_size`` and
    ``cache_num_blocks`` for engines that publish them as gauges).
    ``cache_info``: an info series whose labels ``cache_labels`` carry the block
    size and count instead. ``lora``: the LoRA info series (vLLM's shape).
    """

    name: str
    gauges: Mapping[str, Selector] = field(default_factory=dict)
    cache_info: Selector | None = None
    cache_labels: tuple[str, str] = ("block_size", "num_gpu_blocks")
    lora: Selector | None = None
    custom: Mapping[str, Selector] = field(default_factory=dict)
    """``customMetrics``: an endpoint attribute of the configuration's naming → its series."""

    @property
    def metric_names(self) -> frozenset[str]:
        selectors = (*self.gauges.values(), *self.custom.values(), self.cache_info, self.lora)
        return frozenset(s.name for s in selectors if s is not None)

    def produces(self) -> frozenset[str]:
        """The attributes this engine's page can give."""
        found = {*self.gauges, *self.custom}
        if self.cache_info is not None:
            found |= set(CACHE_ATTRIBUTES)
        if self.lora is not None:
            found |= {"lora_max", "lora_running", "lora_waiting"}
        return frozenset(found)

    def extract(self, families: Families) -> dict[str, float | frozenset[str]]:
        """The attributes found in a parsed page; those not found are left out."""
        values: dict[str, float | frozenset[str]] = {}
        for attribute, selector in (*self.gauges.items(), *self.custom.items()):
            series = selector.select(families)
            if series and not math.isnan(series[0][1]):
                values[attribute] = series[0][1]
        if self.cache_info is not None and (series := self.cache_info.select(families)):
            labels = series[0][0]
            for attribute, label in zip(CACHE_ATTRIBUTES, self.cache_labels, strict=True):
                if (number := _number(labels.get(label))) is not None:
                    values[attribute] = number
        if self.lora is not None and (series := self.lora.select(families)):
            # The value is the series' creation time: the newest is the current state.
            labels = max(series, key=lambda s: s[1])[0]
            if (lora_max := _number(labels.get("max_lora"))) is not None:
                values["lora_max"] = lora_max
            values["lora_running"] = _names(labels.get("running_lora_adapters", ""))
            values["lora_waiting"] = _names(labels.get("waiting_lora_adapters", ""))
        return values


CACHE_ATTRIBUTES: Final = ("cache_block_size", "cache_num_blocks")


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def _gauges(**selectors: str) -> dict[str, Selector]:
    return {attribute: parse_selector(text) for attribute, text in selectors.items()}


BUILTIN_ENGINES: Final[Mapping[str, EngineMapping]] = {
    m.name: m
    for m in (
        EngineMapping(
            "vllm",
            _gauges(
                queue_depth="vllm:num_requests_waiting",
                running_requests="vllm:num_requests_running",
                kv_cache_usage="vllm:kv_cache_usage_perc",
            ),
            cache_info=parse_selector("vllm:cache_config_info"),
            lora=parse_selector("vllm:lora_requests_info"),
        ),
        EngineMapping(
            "sglang",
            _gauges(
                queue_depth="sglang:num_queue_reqs",
                running_requests="sglang:num_running_reqs",
                kv_cache_usage="sglang:token_usage",
            ),
            cache_info=parse_selector("sglang:cache_config_info"),
            cache_labels=("page_size", "num_pages"),
        ),
        EngineMapping(
            "trtllm-serve",
            _gauges(
                queue_depth="trtllm_num_requests_waiting",
                running_requests="trtllm_num_requests_running",
                kv_cache_usage="trtllm_kv_cache_utilization",
                cache_block_size="trtllm_kv_cache_tokens_per_block",
                cache_num_blocks="trtllm_kv_cache_max_blocks",
            ),
        ),
        EngineMapping(
            "triton-tensorrt-llm",
            _gauges(
                queue_depth="nv_trt_llm_request_metrics{request_type=waiting}",
                running_requests="nv_trt_llm_request_metrics{request_type=scheduled}",
                kv_cache_usage="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
                cache_block_size="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}",
                cache_num_blocks="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}",
            ),
        ),
        # Triton Inference Server's own metrics, for models other than LLMs (the router's
        # "triton" engine): pending requests, and executions as its running count.
        EngineMapping(
            "triton",
            _gauges(
                queue_depth="nv_inference_pending_request_count",
                running_requests="nv_inference_exec_count",
            ),
        ),
        # llama.cpp's server (--metrics): "deferred" requests wait for a slot,
        # "processing" ones hold one. It publishes no KV-cache usage gauge.
        EngineMapping(
            "llamacpp",
            _gauges(
                queue_depth="llamacpp:requests_deferred",
                running_requests="llamacpp:requests_processing",
            ),
        ),
    )
}


class MetricsDataSource(polling.HttpSource):
    """Scrapes ``/metrics`` of every endpoint; see the module docstring."""

    produces: frozenset[str] = frozenset(
        {
            "queue_depth",
            "running_requests",
            "kv_cache_usage",
            "cache_block_size",
            "cache_num_blocks",
            "lora_max",
            "lora_running",
            "lora_waiting",
        }
    )
    what: ClassVar[str] = "metrics scrape"
    default_path: ClassVar[str] = "/metrics"
    default_interval: ClassVar[float] = 0.1

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        super().__init__(name, params)
        self.own_settings = [key for key in ENGINE_PARAMETERS if key in params]
        """The extractor parameters set on the source itself (then no extractor may set them)."""
        self.use(Engines.read(params))
        self.wants = (Want("engineConfigs", None, ENGINE_METRICS, self.use_extractor),)
        """The ``core-metrics-extractor`` the router's data layer pairs it with, or the only one."""
        self.wanted: frozenset[str] = frozenset()
        """The attributes the running plugins read (the pipeline tells it, as ``readers``)."""
        self.readers: tuple[str, ...] = ()
        self._other_engine: dict[str, str] = {}

    def use_extractor(self, extractor: Any) -> None:
        """Read pages as the extractor's engine configs say (``Want.give``)."""
        if self.own_settings:
            raise ConfigError(
                f"parameters: {', '.join(self.own_settings)} belong to its extractor "
                f"{extractor.name!r}: set them there only"
            )
        self.use(extractor.engines)

    def use(self, engines: Engines) -> None:
        """Read pages with ``engines`` (a ``core-metrics-extractor``'s, when one is configured)."""
        self.engines, self.default_engine = engines.mappings, engines.default
        self.engine_label = engines.label_key
        self._names = {key: m.metric_names for key, m in self.engines.items()}
        custom = {attribute for m in self.engines.values() for attribute in m.custom}
        self.produces = MetricsDataSource.produces | custom

    def unusable(self, endpoint: Endpoint, values: Values) -> str | None:
        """An endpoint whose page lacks what the running plugins read (``wanted``), or every
        attribute of its engine when nothing is wanted: why, and the engine it looks like."""
        engine = self.engine_of(endpoint)
        expected = self.wanted & engine.produces() if self.wanted else engine.produces()
        lacking = sorted(expected - values.keys())
        if not lacking or (values and not self.wanted):
            return None
        readers = f", which {', '.join(self.readers)} read" if self.readers else ""
        found = f"{len(values)} of its attributes" if values else "none of its metrics"
        problem = (
            f"its page has {found} as engine {engine.name!r} names them (no "
            f"{', '.join(lacking)}{readers})"
        )
        other = self._other_engine.get(endpoint.hostport)
        if other and other != engine.name:
            problem += (
                f"; it looks like {other!r}: set defaultEngine: {other} or the pod label "
                f"{self.engine_label}={other}"
            )
        return problem

    def engine_of(self, endpoint: Endpoint) -> EngineMapping:
        """The mapping named by the endpoint's engine label, else the default engine's."""
        labels = endpoint.labels
        engine = labels.get(self.engine_label) or labels.get(LEGACY_ENGINE_LABEL)
        return self.engines.get(engine or self.default_engine) or self.engines[self.default_engine]

    def read(self, endpoint: Endpoint, text: str) -> dict[str, float | frozenset[str]]:
        """The attributes one ``/metrics`` page of ``endpoint`` holds."""
        engine = self.engine_of(endpoint)
        values = engine.extract(parse(text, self._names[engine.name]))
        if not values or (self.wanted and not self.wanted <= values.keys()):  # a problem: whose?
            self._other_engine[endpoint.hostport] = next(
                (n for n, names in self._names.items() if any(m in text for m in names)), ""
            )
        return values

    async def answer(
        self, endpoint: Endpoint, response: aiohttp.ClientResponse
    ) -> dict[str, float | frozenset[str]]:
        return self.read(endpoint, await response.text())


ENGINE_PARAMETERS: Final = ("engineLabelKey", "defaultEngine", "engineConfigs")


@dataclass(frozen=True, slots=True)
class Engines:
    """Which metrics each engine publishes, the default engine, and the label naming it."""

    mappings: Mapping[str, EngineMapping]
    default: str = "vllm"
    label_key: str = ENGINE_LABEL

    @classmethod
    def read(cls, params: Params) -> Engines:
        mappings = dict(BUILTIN_ENGINES)
        for index, raw in enumerate(params.get("engineConfigs", list, [])):
            mapping = _engine_config(params, index, raw)
            mappings[mapping.name] = mapping  # replaces a built-in engine of the same name whole
        default = params.get("defaultEngine", str, "vllm")
        if default not in mappings:
            raise params.error("defaultEngine", f"no engine named {default!r}")
        return cls(mappings, default, params.get("engineLabelKey", str, ENGINE_LABEL))


class CoreMetricsExtractor:
    """The router's ``core-metrics-extractor``: here, engine mappings for a metrics source.

    It plays no role of its own: it is handed to the ``metrics-data-source``
    that ``dataLayer.sources`` pairs it with, or to the only one, which reads
    pages with its ``Engines`` (``lwepp.contracts.Want``).
    """

    provides: Final = frozenset({ENGINE_METRICS})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.engines = Engines.read(params)


GAUGE_SPECS: Final = {
    "queuedRequestsSpec": "queue_depth",
    "runningRequestsSpec": "running_requests",
    "kvUsageSpec": "kv_cache_usage",
    "cacheBlockSizeSpec": "cache_block_size",
    "cacheNumBlocksSpec": "cache_num_blocks",
}
"""The router's engine config fields that name a gauge, and the attribute each one feeds."""


def _engine_config(params: Params, index: int, raw: Any) -> EngineMapping:
    """One ``engineConfigs`` entry; an empty spec leaves that attribute unmapped, as the router."""
    entry = params.entry(f"engineConfigs[{index}]", raw)
    name = entry.require("name", str)

    def selector(key: str) -> Selector | None:
        text = entry.get(key, str, "")
        try:
            return parse_selector(text) if text else None
        except ValueError as error:
            raise entry.error(key, str(error)) from None

    gauges = {attribute: s for key, attribute in GAUGE_SPECS.items() if (s := selector(key))}
    block_label = entry.get("cacheBlockSizeLabelName", str, "") or "block_size"
    count_label = entry.get("cacheNumBlocksLabelName", str, "") or "num_gpu_blocks"
    custom: dict[str, Selector] = {}
    for item in entry.entries("customMetrics"):
        key, spec = item.require("attributeKey", str), item.require("metricSpec", str)
        item.done()
        if not key or key in gauges or key in custom:
            raise item.error("attributeKey", f"must be a new, non-empty name, got {key!r}")
        try:
            custom[key] = parse_selector(spec)
        except ValueError as error:
            raise item.error("metricSpec", str(error)) from None
    mapping = EngineMapping(
        name,
        gauges,
        selector("cacheInfoSpec"),
        (block_label, count_label),
        selector("loraSpec"),
        custom,
    )
    entry.done()
    if not name:
        raise entry.error("name", "must not be empty")
    return mapping
