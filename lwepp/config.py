"""The picker's configuration file: the llm-d router's ``EndpointPickerConfig``, decoded strictly.

A file written for the router carries over, for the plugins Switchyard has::

    apiVersion: llm-d.ai/v1alpha1      # (inference.networking.x-k8s.io/v1alpha1: deprecated)
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

**What runs.** A plugin plays every role whose method it has (``plugin``).
Filters, scorers and pickers run only where the scheduling profile lists
them (with no profile, one named ``default`` lists every plugin, as the
router does); every other plugin (data sources, plugins that are only hooks)
runs unlisted. Each stage runs its plugins in one order: the profile's, then
the unlisted ones in file order. A profile without a picker gets
``max-score-picker``. Data sources run in the background; the router's
``dataLayer`` wiring is not needed.

**User plugins.** A ``type`` with a dot is a dotted path, imported when the
file is loaded, and called as ``factory(name, params)`` (``plugin.Params``):
a class, a function, or a classmethod named in the path
(``pkg.module.Class.from_params``). ``examples/custom_scorer/`` shows one.

**Strict.** An unknown field, an unknown type, a parameter the plugin does
not read, a dangling ``pluginRef``, a duplicate name, a negative weight, a
second profile or picker, or an attribute a plugin reads that no configured
data source produces is an error naming the file and line, the plugin and the
field. Every error is reported, not just the first.

**Decoded but ignored, with a warning:** ``featureGates`` (only the
router's gate names), ``dataLayer``, ``flowControl``, ``saturationDetector``
and ``parser`` (each a mapping; any ``pluginRef`` in them must name a
configured plugin), and plugins of type ``single-profile-handler``. Refusing
them would stop router files from carrying over for features that do not
change where Switchyard sends a request; silently dropping them would hide
that they have no effect here.
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
from lwepp.plugins import REGISTRY
from plugin import ConfigError, Factory, Params, Role, build, needs_body

API_VERSION: Final = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha1"
KIND: Final = "EndpointPickerConfig"

FEATURE_GATES: Final = frozenset({"flowControl", "enableLegacyMetrics", "dataLayer"})
"""The router's registered gates; any other name is an error there, and here."""

IGNORED_SECTIONS: Final = {
    "featureGates": "Switchyard has no feature gates",
    "dataLayer": "data sources listed under plugins run without it",
    "flowControl": "Switchyard has no flow control (requests are never queued or shed)",
    "saturationDetector": "Switchyard has no saturation detector",
    "parser": "Switchyard parses OpenAI bodies itself",
}
IGNORED_TYPES: Final = {
    "single-profile-handler": "Switchyard runs its one scheduling profile directly",
}
HINTS: Final = {
    "core-metrics-extractor": "metrics-data-source extracts its own metrics: move "
    "defaultEngine and engineConfigs to its parameters",
    "approx-prefix-cache-producer": "prefix-cache-scorer keeps its own index: move the "
    "parameters to it",
}
"""Router plugin types Switchyard folds into others, and where their parameters go."""

PROFILED: Final = frozenset({Role.FILTER, Role.SCORE, Role.PICK})
"""The roles that run only where a scheduling profile lists the plugin."""

LEARNING: Final = frozenset(ROLES[ROLES.index(Role.PICKED) :])
"""The roles that learn from the requests served (picked and response hooks)."""


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
        return Pipeline(self.running, weights=self.weights, **options)

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
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigErrors([f"{where}: cannot read: {error.strerror or error}"]) from None
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
    """Walks the parsed file with ``plugin.Params``, collecting every error with its line."""

    path: str
    node: yaml.Node | None
    registry: Mapping[str, Factory]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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
            entries, profiles = doc.entries("plugins"), doc.entries("schedulingProfiles")
            sections = {name: doc.get(name, object, None) for name in IGNORED_SECTIONS}
            doc.done()
        except ConfigError as error:
            self.error(_keys(error.field or ""), str(error))
            return None
        if api_version == DEPRECATED_API_VERSION:
            self.warn(["apiVersion"], f"apiVersion: deprecated: use {API_VERSION}")
        elif api_version != API_VERSION:
            self.error(["apiVersion"], f"apiVersion: expected {API_VERSION}, got {api_version!r}")
        if kind != KIND:
            self.error(["kind"], f"kind: expected {KIND}, got {kind!r}")
        plugins: list[Configured] = []
        for entry in entries:
            with self.checking():
                if (plugin := self.plugin(entry, plugins)) is not None:
                    plugins.append(plugin)
        by_name = {p.name: p for p in plugins}
        self.ignored_sections(sections, by_name)
        profile = self.profile(profiles, by_name)
        if profile is None:
            return None
        name, listed, weights = profile
        running = self.running(plugins, name, listed)
        self.check_attributes(plugins, running)
        return PickerConfig(
            self.path,
            api_version,
            name,
            tuple(plugins),
            tuple(p.plugin for p in running),
            weights,
            tuple(self.warnings),
        )

    def plugin(self, entry: Params, built: Sequence[Configured]) -> Configured | None:
        """One ``plugins`` entry, built (None: ignored, with a warning)."""
        kind = entry.require("type", str)
        name = entry.get("name", str, kind)
        parameters = entry.get("parameters", object, None)
        entry.done()
        subject = f"plugin {name!r} ({kind})"
        if not kind or not name:
            raise entry.error("type" if not kind else "name", "must not be empty")
        if same := [p for p in built if p.name == name]:
            raise ConfigError(
                f"{subject}: name: duplicate (also {same[0].path})", entry.path_of("name")
            )
        if kind in IGNORED_TYPES:
            self.warn(_keys(entry.path_of("type")), f"{subject}: ignored: {IGNORED_TYPES[kind]}")
            return None
        if kind in HINTS:
            raise ConfigError(f"{subject}: type: unknown ({HINTS[kind]})", entry.path_of("type"))
        try:
            made = build(kind, name, parameters, self.registry, ROLES)
        except ConfigError as error:  # point at the field in the document: plugins[i].<field>
            raise ConfigError(str(error), entry.path_of(error.field or "type")) from None
        return Configured(name, kind, made.plugin, made.roles, entry.path)

    def ignored_sections(self, sections: Mapping[str, Any], by_name: Mapping[str, Any]) -> None:
        for section, value in sections.items():
            if value is None:
                continue
            if section == "featureGates":
                if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
                    self.error([section], f"{section}: expected a list of names")
                    continue
                for gate in sorted(set(value) - FEATURE_GATES):
                    known = ", ".join(sorted(FEATURE_GATES))
                    self.error([section], f"{section}: unknown gate {gate!r} (known: {known})")
            elif not isinstance(value, Mapping):
                self.error([section], f"{section}: expected a mapping")
                continue
            for keys, ref in _plugin_refs(value, [section]):
                if ref not in by_name:
                    self.error(keys, f"{section}: pluginRef {ref!r} names no plugin")
            self.warn([section], f"{section}: decoded and ignored: {IGNORED_SECTIONS[section]}")

    def profile(
        self, profiles: Sequence[Params], by_name: Mapping[str, Configured]
    ) -> tuple[str, list[Configured], dict[str, float]] | None:
        """The one profile: its name, its plugins in order, and the weights it gives."""
        if not profiles:  # as the router: a "default" profile of every plugin, in file order
            return "default", list(by_name.values()), {}
        if len(profiles) > 1:
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

    def check_attributes(
        self, plugins: Sequence[Configured], running: Sequence[Configured]
    ) -> None:
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


def _plugin_refs(value: Any, keys: list[str | int]) -> Iterator[tuple[list[str | int], Any]]:
    """Every ``pluginRef`` in a nested section, with its path."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key == "pluginRef":
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
