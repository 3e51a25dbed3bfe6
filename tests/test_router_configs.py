"""The llm-d router's own EndpointPickerConfig files (v0.10 and its HEAD, its chart's): each loads,
or is refused in one message naming what Switchyard does not implement."""

from __future__ import annotations

from pathlib import Path

import pytest

from lwepp.config import ConfigErrors, PickerConfig, load_config
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.prefix import PrefixCacheScorer
from lwepp.plugins.role_filters import DecodeFilter

SAMPLES = Path(__file__).parent / "data" / "llm-d-router"


def scorers(config: PickerConfig) -> list[tuple[str, float]]:
    return [(s.name, w) for s, w in config.pipeline().scorers]


def prefix_scorer(config: PickerConfig) -> PrefixCacheScorer:
    [scorer] = [s for s, _ in config.pipeline().scorers if isinstance(s, PrefixCacheScorer)]
    return scorer


LOADS = {
    "v0.10.0/epp-config.yaml": [("prefix-cache-scorer", 2.0)],
    "v0.10.0/sim-epp-config.yaml": [("prefix-cache-scorer", 2.0)],
    "v0.10.0/sim-program-aware-config.yaml": [("queue-scorer", 1.0)],
    "v0.10.0/soft-reflective-ceiling-epp-config.yaml": [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ],
    "head/epp-config.yaml": [("prefix-cache-scorer", 2.0)],
    "chart/default-plugins.yaml": [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ],
    "v0.10.0/epp-estimate-prefix-cache-config.yaml": [
        ("prefix-cache-scorer", 1.0),
        ("load-aware-scorer", 1.0),
    ],
    "chart/payload-agnostic.yaml": [
        ("active-request-scorer", 1.0),
        ("session-affinity-scorer", 1.0),
    ],
    "v0.10.0/epp-precise-prefix-cache-config.yaml": [
        ("prefix-cache-scorer", 2.0),
        ("kv-cache-utilization-scorer", 1.0),
        ("queue-scorer", 1.0),
    ],
    "v0.10.0/sim-epp-kvcache-config.yaml": [("prefix-cache-scorer", 10.0)],
    "head/sim-epp-kvcache-config.yaml": [("prefix-cache-scorer", 10.0)],
    "v0.10.0/sim-epp-tokenizer-vllm-http-config.yaml": [("prefix-cache-scorer", 10.0)],
    "v0.10.0/sim-epp-no-hit-lru.yaml": [("prefix-cache-scorer", 2.0), ("no-hit-lru-scorer", 1.0)],
    "chart/optimized-baseline-plugins.yaml": [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
        ("no-hit-lru-scorer", 2.0),
    ],
}
"""Files that load, and the scorers (with weights) they run."""

REFUSED = {
    "v0.10.0/dp-epp-config.yaml": [
        "data-parallel profile handler",
        "data-parallel-profile-handler",
    ],
    "v0.10.0/pd-epp-config.yaml": ["several scheduling profiles", "disagg-profile-handler"],
    "v0.10.0/pd-topology-epp-config.yaml": ["several scheduling profiles", "topology-extractor"],
    "v0.10.0/sim-pd-epp-config.yaml": ["several scheduling profiles", "prefix-based-pd-decider"],
    "v0.10.0/sim-e-p-d-epp-config.yaml": ["several scheduling profiles", "disagg-profile-handler"],
    "v0.10.0/sim-e-pd-epp-config.yaml": ["several scheduling profiles", "disagg-profile-handler"],
    "v0.10.0/probabilistic-admitter-epp-config.yaml": [
        "admission control",
        "probabilistic-admitter",
    ],
    "v0.10.0/sim-epp-gpu-config.yaml": ["DCGM", "dcgm-data-source", "endpoint-attribute-filter"],
    "head/sim-epp-gpu-config.yaml": ["DCGM", "dcgm-data-source", "endpoint-attribute-scorer"],
    "v0.10.0/epp-burst-prefix-cache-config.yaml": [
        "burst co-location",
        "burst-prefix-cache-producer",
    ],
    "v0.10.0/epp-mm-embeddings-cache-config.yaml": [
        "multimodal embedding-cache",
        "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer",
    ],
}
"""Files refused, and what the one message must name."""


def test_every_sample_is_accounted_for() -> None:
    """No sample file goes unchecked: each is expected to load or to be refused."""
    files = {str(p.relative_to(SAMPLES)) for p in SAMPLES.rglob("*.yaml")}
    assert files == set(LOADS) | set(REFUSED)
    assert not set(LOADS) & set(REFUSED)


@pytest.mark.parametrize("sample", sorted(LOADS))
def test_router_files_that_need_nothing_missing_load_and_run_as_written(sample: str) -> None:
    """Each loads with the scorers and weights the file gives, and its decode-filter if listed."""
    config = load_config(SAMPLES / sample)
    assert scorers(config) == LOADS[sample]
    text = (SAMPLES / sample).read_text()
    filters = config.pipeline().filters
    assert [type(f) for f in filters] == ([DecodeFilter] if "decode-filter" in text else [])


@pytest.mark.parametrize("sample", sorted(REFUSED))
def test_router_files_that_need_a_missing_feature_are_refused_in_one_message(sample: str) -> None:
    """One error line, naming the feature and each plugin that needs it; nothing else reported."""
    with pytest.raises(ConfigErrors) as refused:
        load_config(SAMPLES / sample)
    [message] = refused.value.errors
    assert "needs what Switchyard does not implement" in message
    for needed in REFUSED[sample]:
        assert needed in message


def test_the_v1_file_of_the_router_head_loads_with_its_responder_ignored() -> None:
    """apiVersion llm-d.ai/v1 loads; models-responder is ignored with a warning saying why."""
    config = load_config(SAMPLES / "head/epp-config.yaml")
    assert config.api_version == "llm-d.ai/v1"
    [responder] = [w for w in config.warnings if "models-responder" in w]
    assert "ignored: the gateway answers GET /v1/models" in responder


def test_the_approx_producer_s_parameters_reach_the_prefix_scorer() -> None:
    """sim-epp-config: approx-prefix-cache-producer's maxPrefixTokensToMatch and lruCapacityPerServer
    configure the prefix-cache-scorer that uses it."""
    scorer = prefix_scorer(load_config(SAMPLES / "v0.10.0/sim-epp-config.yaml"))
    assert (scorer.max_tokens, scorer.lru_capacity) == (16384, 31250)
    assert prefix_scorer(load_config(SAMPLES / "v0.10.0/epp-config.yaml")).max_tokens == 0


def test_the_chart_s_default_plugins_scrape_with_the_extractor_s_settings() -> None:
    """default-plugins.yaml: one metrics source, with its scheme and path; the extractor folds in."""
    config = load_config(SAMPLES / "chart/default-plugins.yaml")
    [source] = config.pipeline().sources
    assert isinstance(source, MetricsDataSource)
    assert config.warnings == ()


def test_a_file_with_no_metrics_source_gets_the_router_s_default_one() -> None:
    """soft-reflective-ceiling: its scorers read queue and KV metrics, and no source is listed:
    the metrics source the router injects is added, and said so."""
    config = load_config(SAMPLES / "v0.10.0/soft-reflective-ceiling-epp-config.yaml")
    [source] = config.pipeline().sources
    assert isinstance(source, MetricsDataSource)
    assert any("added metrics-data-source" in w for w in config.warnings)
