"""Built-in plugins of the endpoint picker, and the one registry that names them.

``REGISTRY`` maps each configuration ``type`` (the llm-d router's names, so
configurations carry over) to a factory ``(name, params) -> plugin``. It is
the only list of built-ins: nothing registers itself on import. A user's own
plugin is named in the configuration by dotted path instead
(``mypackage.module.ClassName``) and built the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from lwepp.plugins import (
    kv_cache_scorer,
    label_selector,
    lora_affinity,
    metrics_source,
    models_source,
    pickers,
    prefix,
    queue_scorer,
    session_affinity,
)
from lwepp.plugins.params import Params

Factory = Callable[[str, Params], Any]
"""Builds one plugin instance from its configured name and parameters."""

REGISTRY: Final[dict[str, Factory]] = {
    # data sources
    "metrics-data-source": metrics_source.build,
    "models-data-source": models_source.build,
    # filters
    "label-selector-filter": label_selector.build,
    # scorers
    "queue-scorer": queue_scorer.build,
    "kv-cache-utilization-scorer": kv_cache_scorer.build,
    "prefix-cache-scorer": prefix.build,
    "session-affinity-scorer": session_affinity.build,
    "lora-affinity-scorer": lora_affinity.build,
    # pickers
    "max-score-picker": pickers.max_score,
    "random-picker": pickers.random_picker,
    "weighted-random-picker": pickers.weighted_random,
}
