"""The picker's configuration file: the llm-d router's ``EndpointPickerConfig``, decoded strictly.

A file written for the router (v0.10, and its HEAD's ``llm-d.ai/v1``) carries
over, for the plugins Switchyard has::

    apiVersion: llm-d.ai/v1alpha1      # or llm-d.ai/v1 (inference.networking.x-k8s.io/...: old)
    kind: EndpointPickerConfig
    plugins:
    - type: queue-scorer               # built-in (lwepp.plugins.REGISTRY), or pkg.module.Class
      name: queue                      # optional: defaults to the type
      parameters: {maxAgeSeconds: 2}   # optional: the plugin's own, decoded strictly
    - type: metrics-data-source
    schedulingProfiles:                # optional; at most one
    - name: default
      plugins:
      - pluginRef: queue
        weight: 2                      # scorers only; default 1.0; never negative

**What runs.** A plugin plays every role whose method it has (``plugin_api``).
Filters, scorers and pickers run only where the scheduling profile lists
them (with no profile, one named ``default`` lists every plugin, as the
router does); every other plugin (data sources, plugins that are only hooks)
runs unlisted. Each stage runs its plugins in one order: the profile's, then
the unlisted ones in file order. A profile without a picker gets
``max-score-picker``. Data sources run in the background.

**The router's defaults, as it applies them.** When a running plugin reads
an attribute no configured data source produces and ``metrics-data-source``
does, one is added (the router's ``dataLayer.injectDefaults``, true unless set
false; then it is an error instead). The router's producer and extractor
types whose work a built-in does whole here (``lwepp.plugins.FOLDED``) are
built for their parameters and handed to it: ``approx-prefix-cache-producer``
to the ``prefix-cache-scorer`` naming it in ``prefixMatchInfoProducerName``
(by default, the one named ``approx-prefix-cache-producer``),
``core-metrics-extractor`` to the ``metrics-data-source`` that
``dataLayer.sources`` pairs it with (or the only one, or the added one).

**User plugins.** A ``type`` with a dot is a dotted path, imported when the
file is loaded, and called as ``factory(name, params)`` (``plugin_api.Params``):
a class, a function, or a classmethod named in the path
(``pkg.module.Class.from_params``). ``examples/custom_scorer/`` shows one.

**Strict.** An unknown field, an unknown type, a parameter the plugin does
not read, a dangling ``pluginRef``, a duplicate name, a negative weight, a
second profile or picker, an unknown feature gate, or an attribute a plugin
reads that nothing produces is an error naming the file and line, the plugin
and the field. Every error is reported, not just the first.

**Router features Switchyard does not implement** (``UNSUPPORTED``: several
profiles per request for disaggregated serving, the precise prefix cache,
admission control, ...) refuse the file in one message naming the feature and
the plugins that need it, and nothing that follows from them (their
``pluginRef``s, the profiles of a profile handler) is reported again.

**Decoded but ignored, with a warning:** the ``featureGates`` that change
nothing here (``flowControl=true``, ``haPopulateNonLeaderDatastore=false``;
``name``, ``name=true`` and ``name=false`` are read as the router reads them),
the sections ``dataLayer`` (but ``injectDefaults`` and ``sources``, which
pair extractors), ``flowControl``, ``requestHandler`` and the deprecated
``saturationDetector`` and ``parser`` (their fields checked, every
``pluginRef`` in them must name a configured plugin), and plugin types
without an effect on where a request goes here (``IGNORED_TYPES``: the
single-profile handler, request parsers, flow-control policies and
saturation detectors). Refusing them would stop router files from carrying
over for features that do not change where Switchyard sends a request;
dropping them silently would hide that they have no effect here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from lwepp.pipeline import ROLES, Pipeline
from lwepp.plugins import ALIASES, DEPRECATED, FOLDED, REGISTRY
from lwepp.plugins.inflight import PRODUCER as IN_FLIGHT
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.metrics_source import CoreMetricsExtractor, MetricsDataSource
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.prefix import DEFAULT_PRODUCER, ApproxPrefixCacheProducer, PrefixCacheScorer
from plugin_api import Built, ConfigError, Factory, Params, Role, build, needs_body
from pods.file import read_utf8

API_VERSION: Final = "llm-d.ai/v1alpha1"
API_VERSIONS: Final = (API_VERSION, "llm-d.ai/v1")
DEPRECATED_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha1"
KIND: Final = "EndpointPickerConfig"

FEATURE_GATES: Final = {
    "flowControl": (False, "Switchyard has no flow control (requests are never queued or shed)"),
    "haPopulateNonLeaderDatastore": (
        True,
        "a standby picker always watches its pods (--leader-elect), as the gate's default",
    ),
}
"""The router's registered gates (v0.10): their default, and why a different value changes
nothing here. Any other name is an error there, and here."""

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
        "data sources listed under plugins run without it (sources pair extractors)",
    ),
    "flowControl": (
        {
            "maxBytes", "maxRequests", "defaultRequestTTL", "noEndpointRequestTTL",
            "defaultPriorityBand", "defaultNegativePriorityBand", "priorityBands",
            "usageLimitPolicyPluginRef", "saturationDetector", "enableEviction",
        },
        "Switchyard has no flow control (requests are never queued or shed)",
    ),
    "requestHandler": (
        {"parsers", "propagatePriority"},
        "Switchyard parses OpenAI bodies itself (lwepp/body.py)",
    ),
    "saturationDetector": (
        {"pluginRef"},
        "deprecated, use flowControl.saturationDetector; Switchyard has no saturation detector",
    ),
    "parser": ({"pluginRef"}, "deprecated, use requestHandler.parsers; Switchyard parses OpenAI "
               "bodies itself"),
}  # fmt: skip
"""Top-level sections decoded and ignored: their fields (v1alpha1's and v1's), and why."""

_FLOW: Final = "Switchyard has no flow control or saturation detection"
_PARSE: Final = "Switchyard parses OpenAI bodies itself (lwepp/body.py)"
IGNORED_TYPES: Final = {
    "single-profile-handler": "Switchyard runs its one scheduling profile directly",
    "models-data-extractor": "models-data-source reads the model lists itself",
    "models-responder": "the gateway answers GET /v1/models (manifests/envoy-gateway/models.yaml, "
    "the demo); a picker sends it on to one endpoint",
    **dict.fromkeys(
        ("openai-parser", "anthropic-parser", "vllmhttp-parser", "vllmgrpc-parser",
         "vertexai-parser", "passthrough-parser"),
        _PARSE,
    ),
    **dict.fromkeys(
        ("utilization-detector", "concurrency-detector", "global-strict-fairness-policy",
         "round-robin-fairness-policy", "program-aware-fairness", "fcfs-ordering-policy",
         "edf-ordering-policy", "slo-deadline-ordering-policy", "static-usage-limit-policy",
         "soft-reflective-ceiling-policy", "priority-holdback-policy",
         "sheddable-eviction-filter", "priority-then-time-eviction-order-policy"),
        _FLOW,
    ),
}  # fmt: skip
"""Router plugin types accepted without effect: none changes where a request goes here."""

UNSUPPORTED: Final = {
    "several scheduling profiles per request (prefill/decode and encode disaggregation)": (
        "disagg-profile-handler", "pd-profile-handler", "prefill-header-handler",
        "disagg-headers-handler", "header-profile-handler", "prefix-based-pd-decider",
        "always-disagg-pd-decider", "always-disagg-multimodal-decider", "topology-extractor",
        "topology-affinity-filter", "topology-affinity-scorer",
        "disaggregatedset-rollout-screener",
    ),
    "a data-parallel profile handler (list each rank's port as an endpoint instead)": (
        "data-parallel-profile-handler",
    ),
    "prompts tokenized by a separate token producer or the engine's render endpoint "
    "(precise-prefix-cache-producer takes a local tokenizer instead)": (
        "token-producer", "tokenizer", "endpoint-notification-source", "k8s-notification-source",
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
    "admission control (requests refused under saturation or for their SLO)": (
        "probabilistic-admitter", "latency-slo-admitter", "slo-headroom-tier-filter",
    ),
    "predicted-latency routing": ("predicted-latency-producer", "latency-scorer"),
    "session affinity by header filter": (
        "session-affinity-filter", "session-id-producer", "prefix-cache-affinity-filter",
    ),
    "endpoint discovery plugins (give --pods, --pool-name or --endpoint-selector)": (
        "file-discovery", "multicluster-file-discovery",
    ),
    "state shared between picker replicas": ("local-syncer", "cross-replica-publisher"),
    "multi-cluster routing": (
        "multicluster-metrics-data-source", "multicluster-metrics-extractor",
        "multicluster-session-affinity-filter", "multicluster-queue-scorer",
        "multicluster-kv-cache-utilization-scorer", "multicluster-prefix-cache-scorer",
        "multicluster-approx-prefix-cache-producer",
    ),
}  # fmt: skip
"""Router features Switchyard does not implement, and the plugin types that need them."""

TOKENS_FEATURE: Final = next(f for f in UNSUPPORTED if "token-producer" in UNSUPPORTED[f])
"""The router's separate tokenizing plugins: a precise producer without a tokenizer of its
own relies on them, and is reported through them."""

FEATURE_OF: Final = {kind: feature for feature, kinds in UNSUPPORTED.items() for kind in kinds}

PROFILED: Final = frozenset({Role.FILTER, Role.SCORE, Role.PICK})
"""The roles that run only where a scheduling profile lists the plugin."""

LEARNING: Final = frozenset(ROLES[ROLES.index(Role.PICKED) :])
"""The roles that learn from the requests served (picked and response hooks)."""

_REF_KEY: Final = re.compile(r"(pluginRef|.+PluginRef|.+PolicyRef)$")
"""Section fields that name a plugin: ``pluginRef``, ``usageLimitPolicyPluginRef``,
``fairnessPolicyRef``..."""


class ConfigErrors(ConfigError):
    """Every problem found in one configuration file, one per line."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True, slots=True)
class Configured:
    """One plugin as the file configures it, the roles it plays, and where (``plugins[i]``)."""

    name: str
    type: str
    plugin: Any
    roles: tuple[Role, ...]
    path: str


@dataclass(frozen=True, slots=True)
class PickerConfig:
    """A configuration file, resolved: which plugins run, in which order, with which weights."""

    path: str
    api_version: str
    profile: str
    plugins: tuple[Configured, ...]
    """Every plugin the file builds, in file order."""
    running: tuple[Any, ...]
    """The plugins that run, in stage order: the profile's, then the unlisted ones."""
    weights: Mapping[str, float]
    warnings: tuple[str, ...] = ()

    def pipeline(self, **options: Any) -> Pipeline:
        """The pipeline this file describes (``options``: ``Pipeline``'s keyword arguments)."""
        types = {p.name: p.type for p in self.plugins}
        return Pipeline(self.running, weights=self.weights, types=types, **options)

    @property
    def learning(self) -> list[str]:
        """The running plugins that learn from the requests served (picked or response hooks)."""
        running = {id(p) for p in self.running}
        return [p.name for p in self.plugins if id(p.plugin) in running and LEARNING & {*p.roles}]

    def describe(self) -> str:
        """The resolved pipeline as ``--check-config`` prints it."""
        return "\n".join(_describe(self))


# --- loading -------------------------------------------------------------------------


def load_config(path: str | Path, registry: Mapping[str, Factory] = REGISTRY) -> PickerConfig:
    """Read, check and build the configuration in ``path``; raise ``ConfigErrors`` listing all."""
    try:
        text = read_utf8(path)
    except OSError as error:
        raise ConfigErrors([f"{path}: cannot read: {error.strerror or error}"]) from None
    except ValueError as error:
        raise ConfigErrors([str(error)]) from None
    return load_text(text, str(path), registry)


def load_text(
    text: str, where: str = "--config-text", registry: Mapping[str, Factory] = REGISTRY
) -> PickerConfig:
    """Check and build the configuration ``text`` (messages name ``where``); as ``load_config``."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigErrors([f"{where}{line}: not YAML: {error.problem}"]) from None
    except yaml.YAMLError as error:
        raise ConfigErrors([f"{where}: not YAML: {error}"]) from None
    decoder = _Decoder(where, node, registry)
    config = decoder.decode(data)
    if decoder.errors or config is None:
        raise ConfigErrors(decoder.errors or [f"{where}: no configuration"])
    return config


Keys = Sequence[str | int]
"""A path into the document: mapping keys and list indexes."""


def _keys(field: str) -> list[str | int]:
    """A field's path as ``Params`` reports it (``plugins[0].parameters.x``) → document keys."""
    return [
        int(index) if index else key for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", field)
    ]


@dataclass(slots=True)
class _Decoder:
    """Walks the parsed file with ``plugin_api.Params``, collecting every error with its line."""

    path: str
    node: yaml.Node | None
    registry: Mapping[str, Factory]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    _extractors: list[Configured] = field(default_factory=list)
    """Extractors no configured source took: an added metrics source takes them."""

    # --- messages ---

    def line(self, keys: Keys) -> int:
        """The line of the deepest of ``keys`` found in the document (1-based; 0 if none)."""
        node, line = self.node, 0
        for key in keys:
            if isinstance(node, yaml.MappingNode):
                match = [(k, v) for k, v in node.value if getattr(k, "value", None) == key]
                if not match:
                    break
                line, node = match[0][0].start_mark.line + 1, match[0][1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int):
                if key >= len(node.value):
                    break
                node = node.value[key]
                line = node.start_mark.line + 1
            else:
                break
        return line

    def at(self, keys: Keys, message: str) -> str:
        line = self.line(keys)
        return f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}"

    def error(self, keys: Keys, message: str) -> None:
        self.errors.append(self.at(keys, message))

    def warn(self, keys: Keys, message: str) -> None:
        self.warnings.append(self.at(keys, message))

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Record a ``ConfigError`` raised inside, at its field's line, and go on."""
        try:
            yield
        except ConfigError as error:
            self.error(_keys(error.field or ""), str(error))

    # --- the document ---

    def decode(self, data: Any) -> PickerConfig | None:
        try:
            doc = Params(data, "", path="")
            api_version = doc.get("apiVersion", str, "")
            kind = doc.get("kind", str, "")
            gates = doc.get("featureGates", list, [])
            entries, profiles = doc.entries("plugins"), doc.entries("schedulingProfiles")
            sections = {name: doc.get(name, dict, None) for name in SECTIONS}
            doc.done()
        except ConfigError as error:
            self.error(_keys(error.field or ""), str(error))
            return None
        if api_version == DEPRECATED_API_VERSION:
            self.warn(["apiVersion"], f"apiVersion: deprecated: use {API_VERSIONS[-1]}")
        elif api_version not in API_VERSIONS:
            expected = " or ".join(API_VERSIONS)
            self.error(["apiVersion"], f"apiVersion: expected {expected}, got {api_version!r}")
        if kind != KIND:
            self.error(["kind"], f"kind: expected {KIND}, got {kind!r}")
        self.feature_gates(gates)
        plugins: list[Configured] = []
        folded: dict[str, Configured] = {}
        named: dict[str, str] = {}  # every plugin name in the file → its path
        needing: dict[str, list[str]] = {}  # unsupported feature → "type (line n)"
        untokenized: list[ConfigError] = []  # precise producers with no tokenizer of their own
        for entry in entries:
            with self.checking():
                try:
                    made = self.plugin(entry, named, needing)
                except ConfigError as error:
                    if not (error.field or "").endswith(".tokenizer"):
                        raise
                    untokenized.append(error)
                    made = None
                if made is not None and made.type in FOLDED:
                    folded[made.name] = made
                elif made is not None:
                    plugins.append(made)
        if TOKENS_FEATURE not in needing:  # else the token producer they rely on is reported
            for missing in untokenized:
                self.error(_keys(missing.field or ""), str(missing))
        skipped = {n for n, p in named.items() if n not in {c.name for c in plugins}}
        if needing:
            features = "; ".join(f"{f} ({', '.join(kinds)})" for f, kinds in needing.items())
            self.error([], f"needs what Switchyard does not implement: {features}")
        self.sections(sections, named)
        by_name = {p.name: p for p in plugins}
        self.fold(folded, by_name, sections.get("dataLayer"), skipped)
        profile = self.profile(profiles, by_name, skipped, bool(needing))
        if profile is None:
            return None
        name, listed, weights = profile
        running = self.running(plugins, name, listed)
        self.defaults(plugins, running, folded, sections.get("dataLayer"))
        self.in_flight(plugins, running)
        self.check_attributes(running)
        return PickerConfig(
            self.path,
            api_version,
            name,
            tuple(plugins),
            tuple(p.plugin for p in running),
            weights,
            tuple(self.warnings),
        )

    def feature_gates(self, gates: Sequence[Any]) -> None:
        """``name``, ``name=true`` or ``name=false``, as the router reads them; its names only."""
        for index, gate in enumerate(gates):
            at: list[str | int] = ["featureGates", index]
            if not isinstance(gate, str):
                self.error(at, f"featureGates[{index}]: expected a string, got {gate!r}")
                continue
            name, sep, text = gate.partition("=")
            value = True
            if sep:
                value = text.strip().lower() in ("1", "t", "true")
                if text.strip().lower() not in ("1", "t", "true", "0", "f", "false"):
                    self.error(at, f"featureGates: {gate!r}: expected {name}=true or {name}=false")
                    continue
            if name in REMOVED_GATES:
                self.error(at, f"featureGates: {name!r}: {REMOVED_GATES[name]}")
            elif name not in FEATURE_GATES:
                known = ", ".join(FEATURE_GATES)
                self.error(at, f"featureGates: unknown gate {name!r} (known: {known})")
            elif value != FEATURE_GATES[name][0]:
                self.warn(at, f"featureGates: {name}={str(value).lower()}: ignored: "
                          f"{FEATURE_GATES[name][1]}")  # fmt: skip

    def plugin(
        self, entry: Params, named: dict[str, str], needing: dict[str, list[str]]
    ) -> Configured | None:
        """One ``plugins`` entry, built (None: ignored with a warning, or not implemented)."""
        kind = entry.require("type", str)
        name = entry.get("name", str, kind)
        parameters = entry.get("parameters", object, None)
        entry.done()
        subject = f"plugin {name!r} ({kind})"
        if not kind or not name:
            raise entry.error("type" if not kind else "name", "must not be empty")
        if name in named:
            raise ConfigError(
                f"{subject}: name: duplicate (also {named[name]})", entry.path_of("name")
            )
        named[name] = entry.path
        at = _keys(entry.path_of("type"))
        if kind in FEATURE_OF:
            needing.setdefault(FEATURE_OF[kind], []).append(f"{kind} (line {self.line(at)})")
            return None
        if kind in IGNORED_TYPES:
            self.warn(at, f"{subject}: ignored: {IGNORED_TYPES[kind]}")
            return None
        if kind in DEPRECATED:
            self.warn(at, f"{subject}: type: deprecated: {DEPRECATED[kind]}")
        registry = {**self.registry, **{k: factory for k, (factory, _) in FOLDED.items()}}
        try:
            if kind in FOLDED:
                made = _make(FOLDED[kind][0], kind, name, parameters)
            else:
                made = build(ALIASES.get(kind, kind), name, parameters, registry, ROLES)
        except ConfigError as error:  # point at the field in the document: plugins[i].<field>
            raise ConfigError(str(error), entry.path_of(error.field or "type")) from None
        return Configured(name, kind, made.plugin, made.roles, entry.path)

    def sections(self, sections: Mapping[str, Any], named: Mapping[str, str]) -> None:
        """The top-level sections: known fields only; every plugin reference names a plugin."""
        for section, value in sections.items():
            if value is None:
                continue
            fields, why = SECTIONS[section]
            for unknown in sorted(set(value) - fields):
                known = ", ".join(sorted(fields))
                self.error(
                    [section, unknown], f"{section}: unknown field {unknown!r} (known: {known})"
                )
            for keys, ref in _plugin_refs(value, [section]):
                if ref not in named:
                    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)
                    self.error(keys, f"{where[1:]}: {ref!r} names no plugin")
            if section == "dataLayer" and set(value) <= {"injectDefaults", "sources"}:
                continue  # what the file says there, Switchyard does (``fold``, ``defaults``)
            self.warn([section], f"{section}: decoded and ignored: {why}")

    def fold(
        self,
        folded: Mapping[str, Configured],
        by_name: Mapping[str, Configured],
        data_layer: Mapping[str, Any] | None,
        skipped: set[str],
    ) -> None:
        """Hand each producer's and extractor's parameters to the built-in that does its work."""
        used: set[str] = set()
        for p in by_name.values():
            if not isinstance(p.plugin, PrefixCacheScorer):
                continue
            precise = by_name.get(p.plugin.producer)
            if precise is not None and isinstance(precise.plugin, PrecisePrefixCacheProducer):
                if p.plugin.own_settings:
                    self.error(
                        _keys(p.path),
                        f"plugin {p.name!r} ({p.type}): parameters: "
                        f"{', '.join(p.plugin.own_settings)} belong to an approximate index; "
                        f"{precise.name!r} indexes the engines' own blocks",
                    )
                p.plugin.use_precise(precise.plugin)
                continue
            producer = folded.get(p.plugin.producer)
            if producer is not None:
                if p.plugin.own_settings:
                    self.error(
                        _keys(p.path),
                        f"plugin {p.name!r} ({p.type}): parameters: "
                        f"{', '.join(p.plugin.own_settings)} belong to its producer "
                        f"{producer.name!r}: set them there only",
                    )
                assert isinstance(producer.plugin, ApproxPrefixCacheProducer)
                p.plugin.use(producer.plugin.settings)
                used.add(producer.name)
            elif p.plugin.producer not in skipped and p.plugin.producer != DEFAULT_PRODUCER:
                self.error(
                    _keys(f"{p.path}.parameters.prefixMatchInfoProducerName"),
                    f"plugin {p.name!r} ({p.type}): prefixMatchInfoProducerName: "
                    f"{p.plugin.producer!r} names no approx-prefix-cache-producer or "
                    "precise-prefix-cache-producer",
                )
        pairs = {
            str(e.get("pluginRef")): str(s.get("pluginRef"))
            for s in (data_layer or {}).get("sources") or []
            if isinstance(s, Mapping)
            for e in s.get("extractors") or []
            if isinstance(e, Mapping)
        }
        sources = [p for p in by_name.values() if isinstance(p.plugin, MetricsDataSource)]
        for extractor in folded.values():
            if not isinstance(extractor.plugin, CoreMetricsExtractor):
                continue
            source = by_name.get(pairs.get(extractor.name, ""))
            if source is None and len(sources) == 1:
                source = sources[0]
            if source is None or not isinstance(source.plugin, MetricsDataSource):
                continue  # no source to serve: ``defaults`` adds one and hands it these
            if source.plugin.own_settings:
                self.error(
                    _keys(source.path),
                    f"plugin {source.name!r} ({source.type}): parameters: "
                    f"{', '.join(source.plugin.own_settings)} belong to its extractor "
                    f"{extractor.name!r}: set them there only",
                )
            source.plugin.use(extractor.plugin.engines)
            used.add(extractor.name)
        for name, p in folded.items():
            if name not in used and isinstance(p.plugin, ApproxPrefixCacheProducer):
                self.warn(_keys(p.path), f"plugin {name!r} ({p.type}): no prefix-cache-scorer "
                          "names it: it does nothing")  # fmt: skip
        self._extractors = [e for n, e in folded.items() if n not in used]

    def profile(
        self,
        profiles: Sequence[Params],
        by_name: Mapping[str, Configured],
        skipped: set[str],
        unsupported: bool,
    ) -> tuple[str, list[Configured], dict[str, float]] | None:
        """The one profile: its name, its plugins in order, and the weights it gives."""
        if not profiles:  # as the router: a "default" profile of every plugin, in file order
            return "default", list(by_name.values()), {}
        if len(profiles) > 1:
            if unsupported:
                return None  # the profile handler that would choose among them is reported
            names = ", ".join(repr(p.get("name", object, None)) for p in profiles)
            self.error(
                ["schedulingProfiles", 1],
                f"schedulingProfiles: Switchyard runs exactly one scheduling profile; found "
                f"{len(profiles)} ({names}). The router chooses among several with a profile "
                "handler (e.g. prefill/decode disaggregation), which Switchyard does not implement",
            )
            return None
        listed: list[Configured] = []
        weights: dict[str, float] = {}
        try:
            spec = profiles[0]
            name = spec.require("name", str)
            entries = spec.entries("plugins")
            spec.done()
        except ConfigError as error:
            self.error(_keys(error.field or ""), str(error))
            return None
        for entry in entries:
            with self.checking():
                ref = entry.require("pluginRef", str)
                weight = entry.get("weight", float, 1.0, at_least=0)
                entry.done()
                if ref in skipped:
                    continue  # ignored with a warning, or reported as not implemented
                where = f"profile {name!r}, plugin {ref!r}: pluginRef"
                configured = by_name.get(ref)
                problem = (
                    f"names no plugin (plugins: {', '.join(by_name) or 'none'})"
                    if configured is None
                    else "listed twice"
                    if configured in listed
                    else "a data source runs on its own: list it under plugins only"
                    if configured.roles == (Role.SOURCE,)
                    else None
                )
                if configured is None or problem is not None:
                    raise ConfigError(f"{where}: {problem}", entry.path_of("pluginRef"))
                if "weight" in entry:
                    weights[ref] = weight
                    if Role.SCORE not in configured.roles:
                        at = _keys(entry.path_of("weight"))
                        self.warn(at, f"profile {name!r}, plugin {ref!r}: weight: not a scorer")
                listed.append(configured)
        return name, listed, weights

    def running(
        self, plugins: Sequence[Configured], profile: str, listed: Sequence[Configured]
    ) -> list[Configured]:
        """The profile's plugins, then every unlisted plugin that needs no listing to run."""
        running = list(listed)
        for p in plugins:
            if p in running:
                continue
            if PROFILED & {*p.roles}:
                subject = f"plugin {p.name!r} ({p.type})"
                self.warn(_keys(p.path), f"{subject}: not in profile {profile!r}: it does not run")
            else:
                running.append(p)
        if len(pickers := [p.name for p in running if Role.PICK in p.roles]) > 1:
            self.error(
                ["schedulingProfiles"],
                f"profile {profile!r}: more than one picker: {', '.join(pickers)}",
            )
        return running

    def defaults(
        self,
        plugins: list[Configured],
        running: list[Configured],
        folded: Mapping[str, Configured],
        data_layer: Mapping[str, Any] | None,
    ) -> None:
        """Add the metrics source the router would inject, when a running plugin needs it."""
        if (data_layer or {}).get("injectDefaults") is False:
            return
        produced = frozenset().union(
            *(p.plugin.produces for p in running if Role.SOURCE in p.roles)
        )
        wanted = frozenset().union(*(getattr(p.plugin, "reads", frozenset()) for p in running))
        missing = wanted - produced
        if not missing or not missing <= MetricsDataSource.produces:
            return
        name = "metrics-data-source"
        made = build(name, name, None, self.registry, ROLES)
        for extractor in self._extractors:
            assert isinstance(extractor.plugin, CoreMetricsExtractor)
            made.plugin.use(extractor.plugin.engines)
        added = Configured(name, name, made.plugin, made.roles, "dataLayer")
        plugins.append(added)
        running.append(added)
        readers = sorted(p.name for p in running if missing & getattr(p.plugin, "reads", set()))
        self.warn(
            ["dataLayer"],
            f"added {name}: {', '.join(readers)} read{'s' if len(readers) == 1 else ''} "
            f"{', '.join(sorted(missing))} (the router's default data source; "
            "dataLayer.injectDefaults: false refuses instead)",
        )

    def in_flight(self, plugins: list[Configured], running: list[Configured]) -> None:
        """Add the ``inflight-load-producer`` a running scorer reads, as the router's data
        graph does; a producer named in ``inFlightLoadProducerName`` must exist."""
        producers = {p.name for p in running if isinstance(p.plugin, InFlightLoadProducer)}
        for p in list(running):
            wanted = getattr(p.plugin, "in_flight_producer", None)
            if wanted is None or wanted in producers:
                continue
            if wanted != IN_FLIGHT:
                self.error(
                    _keys(f"{p.path}.parameters.inFlightLoadProducerName"),
                    f"plugin {p.name!r} ({p.type}): inFlightLoadProducerName: {wanted!r} "
                    "names no inflight-load-producer",
                )
                continue
            made = build(IN_FLIGHT, IN_FLIGHT, None, self.registry, ROLES)
            added = Configured(IN_FLIGHT, IN_FLIGHT, made.plugin, made.roles, p.path)
            plugins.append(added)
            running.append(added)
            producers.add(IN_FLIGHT)
            self.warn(_keys(p.path), f"added {IN_FLIGHT}: {p.name} reads its counts "
                      "(the router creates it for its consumers too)")  # fmt: skip

    def check_attributes(self, running: Sequence[Configured]) -> None:
        """Every attribute a running plugin reads must come from a configured data source."""
        produced = frozenset().union(
            *(p.plugin.produces for p in running if Role.SOURCE in p.roles)
        )
        for p in running:
            for attribute in sorted(getattr(p.plugin, "reads", frozenset()) - produced):
                makers = [
                    kind
                    for kind, factory in sorted(self.registry.items())
                    if attribute in getattr(factory, "produces", ())
                ]
                hint = f" (add one: {', '.join(makers)} produces it)" if makers else ""
                self.error(
                    _keys(p.path),
                    f"plugin {p.name!r} ({p.type}): reads {attribute!r}, which no configured "
                    f"data source produces{hint}",
                )


def _make(factory: Factory, kind: str, name: str, parameters: Any) -> Built:
    """A folded type's object, built as ``plugin_api.build`` builds plugins (strict parameters)."""
    where = f"plugin {name!r} ({kind})"
    params = Params(parameters, where)
    try:
        made = factory(name, params)
        params.done()
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"{where}: cannot be built: {type(error).__name__}: {error}") from error
    return Built(made, ())


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


# --- describing ------------------------------------------------------------------------


def _describe(config: PickerConfig) -> Iterator[str]:
    yield f"{config.path}: OK ({config.api_version}, profile {config.profile!r})"
    yield ""
    yield "plugins"
    labels = [p.name if p.name == p.type else f"{p.name} ({p.type})" for p in config.plugins]
    width = max(map(len, labels), default=0)
    for label, p in zip(labels, config.plugins, strict=True):
        details = [", ".join(role.label for role in p.roles)]
        reads: frozenset[str] = getattr(p.plugin, "reads", frozenset())
        if reads:
            details.append(f"reads {', '.join(sorted(reads))}")
        if Role.SOURCE in p.roles:
            details.append(f"produces {', '.join(sorted(p.plugin.produces))}")
        if needs_body(p.plugin):
            details.append("needs the body")
        yield f"  {label:<{width}}  {'; '.join(details)}"
    if not config.plugins:
        yield "  (none)"
    yield ""
    yield f"pipeline (profile {config.profile!r}), stage by stage"
    pipeline = config.pipeline()
    for role in ROLES:
        names = [p.name for p in pipeline.stages[role]]
        if role is Role.SCORE:
            names = [f"{s.name} ×{w:g}" for s, w in pipeline.scorers]
        elif role is Role.PICK and not any(Role.PICK in p.roles for p in config.plugins):
            names[0] += "  (default: the profile names no picker)"
        stage = "background" if role is Role.SOURCE else role.value
        yield f"  {stage:<17}  {', '.join(names) or '-'}"
    needing = [p.name for p in pipeline.plugins if needs_body(p)]
    body = f"held and parsed (needed by {', '.join(needing)})" if needing else "not parsed"
    yield f"  {'body':<17}  {body}"
    if config.warnings:
        yield ""
        yield "warnings"
        for warning in config.warnings:
            yield f"  {warning}"
