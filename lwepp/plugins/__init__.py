"""Built-in plugins of the endpoint picker, and the one registry that names them.

``REGISTRY`` maps each configuration ``type`` (the llm-d router's names, so
configurations carry over) to its plugin class, which is its own factory:
``Class(name, params)``. It is the only list of built-ins: nothing registers
itself on import. A user's own plugin is named in the configuration by
dotted path instead (``mypackage.module.ClassName``) and built the same way.

``FOLDED`` names the router's types whose work a built-in does whole here:
their entries are built for their parameters, which the configuration hands
to the plugin they serve (``lwepp.config``). ``ALIASES`` are the router's
deprecated names for built-ins, accepted with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.kv_cache_scorer import KVCacheUtilizationScorer
from lwepp.plugins.label_selector import LabelSelectorFilter
from lwepp.plugins.load_scorers import ActiveRequestScorer, LoadAwareScorer, TokenLoadScorer
from lwepp.plugins.lora_affinity import LoraAffinityScorer
from lwepp.plugins.metrics_source import CoreMetricsExtractor, MetricsDataSource
from lwepp.plugins.models_source import ModelsDataSource
from lwepp.plugins.no_hit_lru import NoHitLRUScorer
from lwepp.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.prefix import (
    ApproxPrefixCacheProducer,
    PrecisePrefixCacheScorer,
    PrefixCacheScorer,
)
from lwepp.plugins.queue_scorer import QueueScorer
from lwepp.plugins.role_filters import ByLabelFilter, DecodeFilter, EncodeFilter, PrefillFilter
from lwepp.plugins.session_affinity import SessionAffinityScorer
from plugin_api import Factory

REGISTRY: Final[Mapping[str, Factory]] = {
    # data sources
    "metrics-data-source": MetricsDataSource,
    "models-data-source": ModelsDataSource,
    # producers (request-path data for the scorers after them)
    "inflight-load-producer": InFlightLoadProducer,
    "precise-prefix-cache-producer": PrecisePrefixCacheProducer,
    # filters
    "label-selector-filter": LabelSelectorFilter,
    "decode-filter": DecodeFilter,
    "prefill-filter": PrefillFilter,
    "encode-filter": EncodeFilter,
    "by-label": ByLabelFilter,
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
    # pickers
    "max-score-picker": MaxScorePicker,
    "random-picker": RandomPicker,
    "weighted-random-picker": WeightedRandomPicker,
}

FOLDED: Final[Mapping[str, tuple[Factory, str]]] = {
    "approx-prefix-cache-producer": (ApproxPrefixCacheProducer, "prefix-cache-scorer"),
    "core-metrics-extractor": (CoreMetricsExtractor, "metrics-data-source"),
}
"""The router's producer and extractor types, and the built-in that does their work."""

ALIASES: Final[Mapping[str, str]] = {
    "by-label-selector": "label-selector-filter",
}
"""The router's deprecated names (removed there in v0.11) → the built-in's name."""

DEPRECATED: Final[Mapping[str, str]] = {
    "by-label-selector": "use label-selector-filter",
    "by-label": "use label-selector-filter, or decode-filter/prefill-filter/encode-filter",
}
"""Types the router deprecated in v0.9: they load, with a warning saying what replaces them."""
