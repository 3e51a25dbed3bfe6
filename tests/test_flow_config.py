"""The ``flowControl`` section (and the deprecated ``saturationDetector``), decoded as the router's."""

from __future__ import annotations

import pytest

from lwepp.config import ConfigErrors, PickerConfig, load_text
from lwepp.flowcontrol.policies import (
    EdfOrdering,
    FcfsOrdering,
    GlobalStrictFairness,
    RoundRobinFairness,
)
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.saturation import ConcurrencyDetector, UtilizationDetector, Watching

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def load(body: str) -> PickerConfig:
    return load_text(HEADER + body, "picker.yaml")


def test_the_routers_section_decodes_with_its_defaults() -> None:
    """Bands with their limits (Kubernetes quantities) and policies, templates, global limits,
    budgets; the defaults the router registers made when named or left unset."""
    config = load(
        """\
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {type: round-robin-fairness-policy, name: fair}
- type: edf-ordering-policy
flowControl:
  maxRequests: 100
  maxBytes: 512Mi
  defaultRequestTTL: 1m30s
  defaultPriorityBand: {maxRequests: "20", fairnessPolicyRef: fair}
  defaultNegativePriorityBand: {maxBytes: 1k}
  priorityBands:
  - {priority: 10, maxRequests: 5}
  - {priority: 0, maxBytes: 1G, orderingPolicyRef: edf-ordering-policy}
"""
    )
    flow = config.flow
    assert flow.gate
    settings = flow.settings
    assert settings is not None
    assert isinstance(flow.detector, UtilizationDetector)  # the router's default detector
    assert (settings.max_requests, settings.max_bytes) == (100, 512 * 2**20)
    assert (settings.ttl, settings.no_endpoint_ttl) == (90.0, 90.0)
    assert (settings.template.max_requests, settings.template.max_bytes) == (20, 10**9)
    assert isinstance(settings.template.fairness, RoundRobinFairness)
    assert settings.negative is not None
    assert settings.negative.max_bytes == 1000
    assert isinstance(settings.negative.fairness, GlobalStrictFairness)
    ten, zero = settings.bands
    assert (ten.priority, ten.max_requests, ten.max_bytes) == (10, 5, 10**9)
    assert isinstance(ten.ordering, FcfsOrdering)
    assert isinstance(zero.ordering, EdfOrdering)
    assert zero.max_bytes == 10**9
    names = [p.name for p in config.plugins]
    assert "utilization-detector" in names
    assert "metrics-data-source" in names  # the detector reads the engines' queues and KV
    assert config.pipeline().filters == ()  # listed nowhere: it is no filter
    assert any(isinstance(p, Watching) for p in config.running)
    assert not any("does nothing" in w or "does not run" in w for w in config.warnings)


def test_a_detector_in_the_profile_also_filters() -> None:
    """Listed in the scheduling profile, the same detector filters there too; the concurrency
    detector gets the in-flight producer the router creates for it."""
    config = load(
        """\
featureGates: [flowControl]
plugins:
- {type: concurrency-detector, parameters: {maxConcurrency: 8}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: concurrency-detector}, {pluginRef: queue-scorer}]
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
"""
    )
    detector = config.flow.detector
    assert isinstance(detector, ConcurrencyDetector)
    pipeline = config.pipeline()
    assert pipeline.filters == (detector,)
    producer = next(p for p in pipeline.plugins if isinstance(p, InFlightLoadProducer))
    assert detector.load is producer.load


def test_with_the_gate_off_only_the_detector_counts() -> None:
    """The gate off: the section's other settings are ignored with the router's warning; the
    detector it names serves the legacy rule. The deprecated top-level field is read, with a
    warning, unless the section names one."""
    config = load(
        """\
plugins:
- type: queue-scorer
- {type: concurrency-detector, name: busy}
saturationDetector: {pluginRef: busy}
flowControl: {maxRequests: 3}
"""
    )
    assert not config.flow.gate
    assert config.flow.settings is None
    assert isinstance(config.flow.detector, ConcurrencyDetector)
    text = "\n".join(config.warnings)
    assert (
        "picker.yaml:6: saturationDetector: deprecated: use flowControl.saturationDetector" in text
    )
    assert "picker.yaml:7: flowControl: the flowControl feature gate is off" in text
    assert "utilization-detector" not in [p.name for p in config.plugins]
    plain = load("plugins:\n- type: queue-scorer\n")
    assert plain.flow.detector is None  # no detector named: nothing scrapes for one


def test_a_band_naming_an_ignored_policy_gets_the_default() -> None:
    """program-aware-fairness is listed but not implemented: the band uses global-strict, and
    says so."""
    config = load(
        """\
featureGates: [flowControl]
plugins:
- {type: program-aware-fairness, name: pa}
flowControl:
  priorityBands: [{priority: 1, fairnessPolicyRef: pa}]
"""
    )
    assert config.flow.settings is not None
    assert isinstance(config.flow.settings.bands[0].fairness, GlobalStrictFairness)
    text = "\n".join(config.warnings)
    assert "flowControl.priorityBands[0].fairnessPolicyRef: 'pa' is ignored here" in text


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ("  maxRequest: 3\n", "picker.yaml:7: flowControl: unknown field 'maxRequest'"),
        ("  maxBytes: lots\n", "picker.yaml:7: flowControl.maxBytes: expected a quantity"),
        ("  defaultRequestTTL: 60\n", "picker.yaml:7: flowControl.defaultRequestTTL: expected str"),
        ("  noEndpointRequestTTL: soon\n", "flowControl.noEndpointRequestTTL: expected a duration"),
        (
            "  priorityBands: [{maxRequests: 1}]\n",
            "picker.yaml:7: flowControl.priorityBands[0].priority: required",
        ),
        (
            "  priorityBands: [{priority: 1}, {priority: 1}]\n",
            "flowControl.priorityBands: priority 1 is configured twice",
        ),
        (
            "  usageLimitPolicyPluginRef: nope\n",
            "flowControl.usageLimitPolicyPluginRef: 'nope' names no plugin",
        ),
        (
            "  saturationDetector: {pluginRef: queue-scorer}\n",
            "flowControl.saturationDetector.pluginRef: 'queue-scorer' is a queue-scorer, which is "
            "no saturation",
        ),
        (
            "  defaultPriorityBand: {fairnessPolicyRef: queue-scorer}\n",
            "'queue-scorer' is a queue-scorer, which is no fairness-policy",
        ),
    ],
    ids=["unknown", "quantity", "ttl-type", "ttl", "priority", "twice", "ref", "kind", "word"],
)
def test_mistakes_are_errors_at_their_line(section: str, problem: str) -> None:
    """Strict: each mistake is an error naming the field, at its line in the file."""
    body = "featureGates: [flowControl]\nplugins:\n- type: queue-scorer\nflowControl:\n" + section
    with pytest.raises(ConfigErrors) as raised:
        load(body)
    assert problem in str(raised.value)
