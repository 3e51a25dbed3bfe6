"""llm-d's router configurations as its guides ship them, for the routing benchmark and the tests.

A guide of llm-d (``llm-d/llm-d``, ``guides/*/router/*.values.yaml``) is a
set of Helm values for the router's chart: each EndpointPickerConfig is a
string under ``router.epp.pluginsCustomConfig``, keyed by the file name the
router reads (``router.epp.pluginsConfigFile`` names the one it runs).
``tests/data/upstream/`` keeps those files verbatim, with where each came
from (``SOURCES.md``); these functions take the configurations out of them
unchanged, as the chart hands them to the router.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml

from lwepp.config import PickerConfig, load_text

UPSTREAM: Final = Path(__file__).resolve().parent.parent / "tests" / "data" / "upstream"
OPTIMIZED_BASELINE: Final = (
    UPSTREAM
    / "llm-d"
    / "guides"
    / "optimized-baseline"
    / "router"
    / "optimized-baseline.values.yaml"
)
"""llm-d's current default (llm-d/llm-d PR #1651): prefix-cache-affinity-filter, then
token-load-scorer."""


def guide_configs(path: Path) -> dict[str, str]:
    """Every EndpointPickerConfig of the values file ``path``, by the file name it is given."""
    custom = _mapping(_epp(path).get("pluginsCustomConfig"))
    return {str(name): text for name, text in custom.items() if isinstance(text, str)}


def guide_config(path: Path) -> PickerConfig:
    """The configuration the guide ``path`` runs: the one ``pluginsConfigFile`` names, or its
    only one."""
    configs = guide_configs(path)
    name = _epp(path).get("pluginsConfigFile")
    if name not in configs:
        if len(configs) != 1:
            raise ValueError(f"{path}: no single EndpointPickerConfig ({', '.join(configs)})")
        name = next(iter(configs))
    return load_text(configs[name], f"{path.name}: {name}")


def _epp(path: Path) -> dict[str, Any]:
    values: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    return _mapping(_mapping(_mapping(values).get("router")).get("epp"))


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
