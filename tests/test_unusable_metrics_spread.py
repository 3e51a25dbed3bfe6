"""Metrics that never match their servers do not make picking collapse onto one replica.

``demo/configs/sglang.yaml`` in front of servers that publish vLLM's names
(``bench.routing.MISMATCHED``): its metrics source reads nothing its scorer
needs from any of them, and says so; the load the picker sends is counted on
the request path, so a system prompt every session shares still spreads over
the eight engines. The old file (the router's default weights, prefix ×3,
queue ×2, KV ×2, with nothing else) sent every request to one engine there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import workloads
from bench.routing import CONFIG_FILES, FULL, MISMATCHED, engine_state, profile_for, simulate
from bench.workloads import MultiTurn
from lwepp.config import load_config, load_text
from lwepp.plugins.metrics_source import MetricsDataSource
from pods.model import Endpoint
from simulator import metrics
from simulator.engine import Engine

SHARED_SYSTEM_PROMPT = MultiTurn(  # enough load that an idle engine would be a loss
    sessions=200,
    turns=3,
    session_rate=4.0,
    system_tokens=512,
    user_tokens=96,
    max_tokens=16,
    think_seconds=5.0,
)
OLD_SGLANG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
  parameters: {defaultEngine: sglang}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
"""


def test_the_sglang_config_reads_nothing_usable_from_a_vllm_page_and_says_so() -> None:
    """Its source finds none of the names its scorer reads, and names the engine the page is."""
    pipeline = load_config(CONFIG_FILES[MISMATCHED]).pipeline()
    [source] = pipeline.sources
    assert isinstance(source, MetricsDataSource)
    endpoint = Endpoint("sim-0", "10.0.0.1", 8000)
    page = metrics.render("vllm", engine_state(Engine(profile_for(FULL)), 0.0))
    values = source.read(endpoint, page)
    assert "kv_cache_usage" not in values
    problem = source.unusable(endpoint, values)
    assert problem is not None
    assert "no kv_cache_usage" in problem


@pytest.mark.parametrize(("config", "engines"), [(None, 8), (OLD_SGLANG, 1)])
def test_picks_spread_over_every_engine_when_the_metrics_never_match(
    tmp_path: Path, config: str | None, engines: int
) -> None:
    """A system prompt every session shares, routed by sglang.yaml over vLLM pages: every engine
    serves, none more than 1.25× the mean. The old file, for contrast, used one engine."""
    arrivals = workloads.multi_turn(SHARED_SYSTEM_PROMPT, 0)
    path = None
    if config is not None:
        path = tmp_path / "old-sglang.yaml"
        path.write_text(config)
        load_text(config)  # it loads: the collapse is the weights', not a refusal
    outcome = simulate("system-prompt", arrivals, MISMATCHED, profile_for(FULL), config=path)
    assert outcome.failed == 0
    assert sum(1 for served in outcome.per_engine if served) == engines
    if engines == 8:
        assert outcome.spread_max_mean < 1.25
