"""Built-in plugins of the endpoint picker, and the one registry that names them.

``REGISTRY`` maps each configuration ``type`` (the llm-d router's names, so
configurations carry over) to its plugin class, which is its own factory:
``Class(name, params)``. It is the only list of built-ins: nothing registers
itself on import. A user's own plugin is named in the configuration by
dotted path instead (``mypackage.module.ClassName``) and built the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from lwepp.plugins.kv_cache_scorer import KVCacheUtilizationScorer
from lwepp.plugins.label_selector import LabelSelectorFilter
from lwepp.plugins.lora_affinity import LoraAffinityScorer
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.models_source import ModelsDataSource
from lwepp.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from lwepp.plugins.prefix import PrefixCacheScorer
from lwepp.plugins.queue_scorer import QueueScorer
from lwepp.plugins.session_affinity import SessionAffinityScorer
from plugin import Factory

REGISTRY: Final[Mapping[str, Factory]] = {
    # data sources
    "metrics-data-source": MetricsDataSource,
    "models-data-source": ModelsDataSource,
    # filters
    "label-selector-filter": LabelSelectorFilter,
    # scorers
    "queue-scorer": QueueScorer,
    "kv-cache-utilization-scorer": KVCacheUtilizationScorer,
    "prefix-cache-scorer": PrefixCacheScorer,
    "session-affinity-scorer": SessionAffinityScorer,
    "lora-affinity-scorer": LoraAffinityScorer,
    # pickers
    "max-score-picker": MaxScorePicker,
    "random-picker": RandomPicker,
    "weighted-random-picker": WeightedRandomPicker,
}
