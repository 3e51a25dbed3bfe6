"""The llm-d router's configuration as Switchyard reads it: its spellings, sections and features.

``lwepp.config`` decodes an ``EndpointPickerConfig`` strictly, as its schema;
this module is the layer in front of it that knows the router's file as
users write it (v0.10, and its HEAD's ``llm-d.ai/v1``), so that a router's
file carries over or is refused in one line naming what is missing:

- **Types** (``verdict``): the router's types Switchyard does not implement
  (``UNSUPPORTED``, by feature: the file is refused naming the feature and
  the plugins that need it), those it accepts without effect
  (``IGNORED_TYPES``: nothing they do changes where a request goes here), and
  deprecated names (``ALIASES``, ``DEPRECATED``: they load, with a warning).
- **Feature gates** (``gate_problems``): the router's gates and their
  defaults; a gate set away from its default here changes nothing, and says so
  (but ``flowControl``, which turns flow control on: ``lwepp.flowcontrol``).
- **Sections** (``section_problems``): ``dataLayer``, ``requestHandler`` and
  the deprecated ``parser``, decoded (their fields checked, every plugin they
  name must exist) and ignored with a warning, but for what ``dataLayer``
  says that Switchyard does: ``injectDefaults``, and ``sources``, which pair
  extractors with sources (``extractor_pairs``). ``flowControl`` and the
  deprecated top-level ``saturationDetector`` are Switchyard's too, decoded
  by ``lwepp.flowcontrol.config``.

Refusing what changes nothing would stop router files from carrying over;
dropping it silently would hide that it has no effect here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

API_VERSION: Final = "llm-d.ai/v1alpha1"
API_VERSIONS: Final = (API_VERSION, "llm-d.ai/v1")
DEPRECATED_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha1"
KIND: Final = "EndpointPickerConfig"

FEATURE_GATES: Final[Mapping[str, tuple[bool, str | None]]] = {
    "flowControl": (False, None),  # flow control (lwepp.flowcontrol): honoured
    "haPopulateNonLeaderDatastore": (
        True,
        "a standby picker always watches its pods (--leader-elect), as the gate's default",
    ),
}
"""The router's registered gates (v0.10): their default, and why a different value changes
nothing here (None: it does change something). Any other name is an error there, and here."""

REMOVED_GATES: Final = {
    "enableLegacyMetrics": "removed from the router before v0.10; legacy metrics are gone",
    "dataLayer": "removed from the router before v0.10; the data layer is always on",
}

SECTIONS: Final = {
    "dataLayer": (
        {
            "injectDefaults", "sources", "discovery", "peerDiscovery", "crossReplica",
            "crossReplicaSyncerPluginRef", "crossReplicaSyncInterval", "crossReplicaPublishTimeout",
        },
        "data sources listed under plugins run without it (sources pair extractors, discovery "
        "names the endpoints file)",
    ),
    "requestHandler": (
        {"parsers", "propagatePriority"},
        "Switchyard parses OpenAI bodies itself (lwepp/body.py)",
    ),
    "parser": ({"pluginRef"}, "deprecated, use requestHandler.parsers; Switchyard parses OpenAI "
               "bodies itself"),
}  # fmt: skip
"""Top-level sections decoded and ignored: their fields (v1alpha1's and v1's), and why."""

_EVICTION: Final = "in-flight eviction (flowControl.enableEviction) is not implemented"
_PARSE: Final = "Switchyard parses OpenAI bodies itself (lwepp/body.py)"
IGNORED_TYPES: Final = {
    "single-profile-handler": "Switchyard runs its one scheduling profile directly",
    "models-data-extractor": "models-data-source reads the model lists itself",
    "models-responder": "the gateway answers GET /v1/models (manifests/envoy-gateway/models.yaml, "
    "the demo); a picker sends it on to one endpoint",
    **dict.fromkeys(
        ("header-based-testing-filter", "destination-endpoint-served-verifier"),
        "GIE's conformance header and served-endpoint report are built in "
        "(--enable-test-selection-header, --report-served-endpoint)",
    ),
    **dict.fromkeys(
        ("openai-parser", "anthropic-parser", "vllmhttp-parser", "vllmgrpc-parser",
         "sglanghttp-parser", "vertexai-parser", "passthrough-parser"),
        _PARSE,
    ),
    "program-aware-fairness":
        "not implemented: a band naming it uses global-strict-fairness-policy",
    **dict.fromkeys(("sheddable-eviction-filter", "priority-then-time-eviction-order-policy"),
                    _EVICTION),
}  # fmt: skip
"""Router plugin types accepted without effect: none changes where a request goes here."""

UNSUPPORTED: Final = {
    "several scheduling profiles per request (prefill/decode and encode disaggregation)": (
        "disagg-profile-handler", "pd-profile-handler", "prefill-header-handler",
        "disagg-headers-handler", "header-profile-handler", "prefix-based-pd-decider",
        "always-disagg-pd-decider", "always-disagg-multimodal-decider", "topology-extractor",
        "topology-affinity-filter", "topology-affinity-scorer",
        "disaggregatedset-rollout-screener", "header-phase-profile-handler",
    ),
    "a data-parallel profile handler (list each rank's port as an endpoint instead)": (
        "data-parallel-profile-handler",
    ),
    "notifications from Kubernetes objects (the pod source names the endpoints)": (
        "k8s-notification-source",
    ),
    "multimodal embedding-cache affinity": (
        "mm-embeddings-cache-producer", "mm-embeddings-cache-scorer",
    ),
    "burst co-location of prompt-sharing requests": ("burst-prefix-cache-producer",),
    "running-request and context-length scoring": (
        "running-requests-size-scorer", "context-length-aware",
    ),
    "endpoint attributes beyond the metrics source (DCGM GPU telemetry, attribute filters)": (
        "dcgm-data-source", "dcgm-extractor", "endpoint-attribute-filter",
        "endpoint-attribute-scorer", "utilization-filter",
    ),
    "probabilistic admission control (sheddable requests shed by a probability under load)": (
        "probabilistic-admitter",
    ),
    "routing by request headers and attributes (agent identity, header-label affinity, "
    "attribute reports)": (
        "agent-identity", "header-label-affinity-scorer", "request-attribute-reporter",
    ),
    "KV-cache transfer between engines (P2P source)": ("p2p-source-producer",),
    "multi-cluster endpoint discovery (give --pods, --pool-name or --endpoint-selector)": (
        "multicluster-file-discovery",
    ),
    "state shared between picker replicas": ("local-syncer", "cross-replica-publisher"),
    "multi-cluster routing": (
        "multicluster-metrics-data-source", "multicluster-metrics-extractor",
        "multicluster-session-affinity-filter", "multicluster-queue-scorer",
        "multicluster-kv-cache-utilization-scorer", "multicluster-prefix-cache-scorer",
        "multicluster-approx-prefix-cache-producer", "latency-observer-producer-hub",
        "latency-observation-scorer-hub",
    ),
    "LMetric scoring (lmetric-scorer, an experiment outside the router's releases)": (
        "lmetric-scorer",
    ),
    "the router's integration-test metrics double": ("mock-metrics-source",),
}  # fmt: skip
"""Router features Switchyard does not implement, and the plugin types that need them."""

FEATURE_OF: Final = {kind: feature for feature, kinds in UNSUPPORTED.items() for kind in kinds}

_PD: Final = next(iter(UNSUPPORTED))
_PROFILE: Final = {"profileName": (None, _PD)}
_SIDECAR: Final = (
    None,
    "the router's tokenizer sidecar over a Unix socket (give token-producer vllm.url, "
    "llamacpp.url or local instead)",
)
UNSUPPORTED_PARAMETERS: Final[Mapping[str, Mapping[str, tuple[str | None, str]]]] = {
    "session-affinity-filter": _PROFILE,
    "session-affinity-scorer": _PROFILE,
    "token-producer": {"udsTokenizerConfig": _SIDECAR},
    "tokenizer": {"udsTokenizerConfig": _SIDECAR},
    "precise-prefix-cache-scorer": {"indexerConfig.tokenizersPoolConfig.uds": _SIDECAR},
}
"""Parameters of types Switchyard has that need a feature it has not (a dotted path into the
parameters): the value that does (None: any but empty), and the feature."""

ALIASES: Final[Mapping[str, str]] = {
    "by-label-selector": "label-selector-filter",
    "tokenizer": "token-producer",
}
"""The router's deprecated names (removed there in v0.11) → the built-in's name."""

DEPRECATED: Final[Mapping[str, str]] = {
    "by-label-selector": "use label-selector-filter",
    "by-label": "use label-selector-filter, or decode-filter/prefill-filter/encode-filter",
    "tokenizer": "use token-producer",
}
"""Types the router deprecated in v0.9: they load, with a warning saying what replaces them."""

DEPRECATED_PARAMETERS: Final[Mapping[str, Mapping[str, str]]] = {
    "prefix-cache-affinity-filter": {
        "maxTokensInFlightPenalty": "removed from the router in v0.10 (which refuses it) in "
        "favour of maxTTFTPenaltyMs with peakPrefillThroughput; applied here as before",
    },
    "approx-prefix-cache-producer": {"blockSize": "deprecated: use blockSizeTokens"},
}
"""Plugin parameters the router deprecated or removed that still work here: a warning each."""


def parameter_notes(kind: str, parameters: object) -> Iterator[tuple[str, str]]:
    """The deprecated parameters a plugin entry of type ``kind`` sets, and what to say."""
    notes = DEPRECATED_PARAMETERS.get(kind, {})
    if isinstance(parameters, Mapping):
        yield from ((field, notes[field]) for field in parameters if field in notes)


_REF_KEY: Final = re.compile(r"(pluginRef|.+PluginRef|.+PolicyRef)$")
"""Section fields that name a plugin: ``pluginRef``, ``usageLimitPolicyPluginRef``,
``fairnessPolicyRef``..."""


Keys = Sequence[str | int]
"""A path into the document: mapping keys and list indexes."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What Switchyard does with a router type: ``unsupported`` names the feature it needs,
    ``ignored`` why it changes nothing here, ``deprecated`` what replaces it; ``builtin`` is
    the registry's name for it."""

    builtin: str
    unsupported: str | None = None
    ignored: str | None = None
    deprecated: str | None = None


def verdict(kind: str, parameters: object = None) -> Verdict:
    """How a ``plugins[].type`` of the router's, with these ``parameters``, is read here."""
    needs = [
        feature
        for field, (value, feature) in UNSUPPORTED_PARAMETERS.get(kind, {}).items()
        if (given := _field(parameters, field)) and (value is None or given == value)
    ]
    return Verdict(
        ALIASES.get(kind, kind),
        unsupported=FEATURE_OF.get(kind) or next(iter(needs), None),
        ignored=IGNORED_TYPES.get(kind),
        deprecated=DEPRECATED.get(kind),
    )


def _field(parameters: object, dotted: str) -> object:
    """The value at ``dotted`` in nested mappings (None where a step is missing)."""
    for key in dotted.split("."):
        parameters = parameters.get(key) if isinstance(parameters, Mapping) else None
    return parameters


def gate_problems(gates: Sequence[Any]) -> Iterator[tuple[Keys, bool, str]]:
    """``featureGates``: ``name``, ``name=true`` or ``name=false``, as the router reads them, of
    its names only. Yields (where, is it an error, message); a warning otherwise."""
    for index, gate in enumerate(gates):
        at: list[str | int] = ["featureGates", index]
        if not isinstance(gate, str):
            yield at, True, f"featureGates[{index}]: expected a string, got {gate!r}"
            continue
        name, sep, text = gate.partition("=")
        value = True
        if sep:
            value = text.strip().lower() in ("1", "t", "true")
            if text.strip().lower() not in ("1", "t", "true", "0", "f", "false"):
                yield at, True, f"featureGates: {gate!r}: expected {name}=true or {name}=false"
                continue
        if name in REMOVED_GATES:
            yield at, True, f"featureGates: {name!r}: {REMOVED_GATES[name]}"
        elif name not in FEATURE_GATES:
            yield (
                at,
                True,
                f"featureGates: unknown gate {name!r} (known: {', '.join(FEATURE_GATES)})",
            )
        elif value != FEATURE_GATES[name][0] and (why := FEATURE_GATES[name][1]) is not None:
            yield at, False, f"featureGates: {name}={str(value).lower()}: ignored: {why}"


def section_problems(
    sections: Mapping[str, Any], named: Mapping[str, str]
) -> Iterator[tuple[Keys, bool, str]]:
    """The top-level sections: known fields only; every plugin reference names a plugin of
    ``named``. Yields (where, is it an error, message)."""
    for section, value in sections.items():
        if value is None or section not in SECTIONS:  # None: absent; else decoded elsewhere
            continue
        fields, why = SECTIONS[section]
        for unknown in sorted(set(value) - fields):
            known = ", ".join(sorted(fields))
            yield [section, unknown], True, f"{section}: unknown field {unknown!r} (known: {known})"
        for keys, ref in _plugin_refs(value, [section]):
            if ref not in named:
                where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)
                yield keys, True, f"{where[1:]}: {ref!r} names no plugin"
        if section == "dataLayer" and set(value) <= {"injectDefaults", "sources", "discovery"}:
            continue  # what the file says there, Switchyard does
        yield [section], False, f"{section}: decoded and ignored: {why}"


def discovery_ref(data_layer: Mapping[str, Any] | None) -> str | None:
    """The plugin ``dataLayer.discovery.pluginRef`` names: it lists the endpoints (the router
    then runs without Kubernetes)."""
    discovery = (data_layer or {}).get("discovery")
    return discovery.get("pluginRef") if isinstance(discovery, Mapping) else None


def extractor_pairs(data_layer: Mapping[str, Any] | None) -> dict[str, str]:
    """``dataLayer.sources``: each source's name → the first extractor listed with it, and each
    extractor's → its source (plugin names are unique, so one mapping holds both ways)."""
    pairs: dict[str, str] = {}
    for source in (data_layer or {}).get("sources") or []:
        if not isinstance(source, Mapping):
            continue
        for extractor in source.get("extractors") or []:
            if isinstance(extractor, Mapping):
                name, of = str(source.get("pluginRef")), str(extractor.get("pluginRef"))
                pairs.setdefault(name, of)
                pairs.setdefault(of, name)
    return pairs


def _plugin_refs(value: Any, keys: list[str | int]) -> Iterator[tuple[list[str | int], Any]]:
    """Every plugin reference in a nested section (``_REF_KEY``), with its path."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and _REF_KEY.fullmatch(key) and isinstance(item, str):
                yield [*keys, key], item
            else:
                yield from _plugin_refs(item, [*keys, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _plugin_refs(item, [*keys, index])
