"""Built-in plugins of the endpoint picker, and the one registry that names them.

``REGISTRY`` maps each configuration ``type`` (the llm-d router's names, so
configurations carry over) to its plugin class, which is its own factory:
``Class(name, params)``. It is the only list of built-ins: nothing registers
itself on import. A user's own plugin is named in the configuration by
dotted path instead (``mypackage.module.ClassName``) and built the same way.

Some play no role of their own but are handed to the plugins that name them
(``provides``; ``lwepp.contracts.Want``): the router's
``approx-prefix-cache-producer`` and ``core-metrics-extractor``. The
router's other spellings (deprecated names, types accepted and ignored) are
``lwepp.router_compat``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from lwepp.flowcontrol.policies import (
    EdfOrdering,
    FcfsOrdering,
    GlobalStrictFairness,
    PriorityHoldback,
    RoundRobinFairness,
    SloDeadlineOrdering,
    SoftReflectiveCeiling,
    StaticUsageLimit,
)
from lwepp.plugins.affinity import PrefixCacheAffinityFilter
from lwepp.plugins.approx_prefix import ApproxPrefixCacheProducer
from lwepp.plugins.discovery import EndpointNotificationSource, FileDiscovery
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.kv_cache_scorer import KVCacheUtilizationScorer
from lwepp.plugins.label_selector import LabelSelectorFilter
from lwepp.plugins.latency_slo import LatencySloAdmitter
from lwepp.plugins.load_scorers import ActiveRequestScorer, LoadAwareScorer, TokenLoadScorer
from lwepp.plugins.lora_affinity import LoraAffinityScorer
from lwepp.plugins.metrics_source import CoreMetricsExtractor, MetricsDataSource
from lwepp.plugins.models_source import ModelsDataSource
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.predicted_latency import (
    LatencyScorer,
    PredictedLatencyProducer,
    SloHeadroomTierFilter,
)
from lwepp.plugins.prefix import PrecisePrefixCacheScorer, PrefixCacheScorer
from lwepp.plugins.queue_scorer import QueueScorer
from lwepp.plugins.role_filters import ByLabelFilter, DecodeFilter, EncodeFilter, PrefillFilter
from lwepp.plugins.saturation import ConcurrencyDetector, UtilizationDetector
from lwepp.plugins.session_affinity import (
    SessionAffinityFilter,
    SessionAffinityScorer,
    SessionIdProducer,
)
from lwepp.plugins.tokens import TokenProducer
from plugin_api import Factory

REGISTRY: Final[Mapping[str, Factory]] = {
    # where the endpoints come from
    "file-discovery": FileDiscovery,
    "endpoint-notification-source": EndpointNotificationSource,
    # data sources
    "metrics-data-source": MetricsDataSource,
    "models-data-source": ModelsDataSource,
    # producers (request-path data for the scorers after them), and what the router's
    # producers and extractors hand the plugins that name them
    "inflight-load-producer": InFlightLoadProducer,
    "approx-prefix-cache-producer": ApproxPrefixCacheProducer,
    "precise-prefix-cache-producer": PrecisePrefixCacheProducer,
    "token-producer": TokenProducer,
    "core-metrics-extractor": CoreMetricsExtractor,
    "session-id-producer": SessionIdProducer,
    "predicted-latency-producer": PredictedLatencyProducer,
    # filters
    "label-selector-filter": LabelSelectorFilter,
    "decode-filter": DecodeFilter,
    "prefill-filter": PrefillFilter,
    "encode-filter": EncodeFilter,
    "by-label": ByLabelFilter,
    "prefix-cache-affinity-filter": PrefixCacheAffinityFilter,
    "session-affinity-filter": SessionAffinityFilter,
    "slo-headroom-tier-filter": SloHeadroomTierFilter,
    # scorers
    "queue-scorer": QueueScorer,
    "kv-cache-utilization-scorer": KVCacheUtilizationScorer,
    "prefix-cache-scorer": PrefixCacheScorer,
    "precise-prefix-cache-scorer": PrecisePrefixCacheScorer,
    "session-affinity-scorer": SessionAffinityScorer,
    "lora-affinity-scorer": LoraAffinityScorer,
    "active-request-scorer": ActiveRequestScorer,
    "token-load-scorer": TokenLoadScorer,
    "load-aware-scorer": LoadAwareScorer,
    "no-hit-lru-scorer": NoHitLRUScorer,
    "latency-scorer": LatencyScorer,
    "latency-slo-admitter": LatencySloAdmitter,
    # pickers
    "max-score-picker": MaxScorePicker,
    "random-picker": RandomPicker,
    "weighted-random-picker": WeightedRandomPicker,
    # saturation detectors: filters in a profile, and what flow control reads (flowControl)
    "utilization-detector": UtilizationDetector,
    "concurrency-detector": ConcurrencyDetector,
    # flow control's policies, named by the flowControl section (lwepp.flowcontrol.policies)
    "global-strict-fairness-policy": GlobalStrictFairness,
    "round-robin-fairness-policy": RoundRobinFairness,
    "fcfs-ordering-policy": FcfsOrdering,
    "edf-ordering-policy": EdfOrdering,
    "slo-deadline-ordering-policy": SloDeadlineOrdering,
    "static-usage-limit-policy": StaticUsageLimit,
    "priority-holdback-policy": PriorityHoldback,
    "soft-reflective-ceiling-policy": SoftReflectiveCeiling,
}
