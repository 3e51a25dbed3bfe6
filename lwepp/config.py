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

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from lwepp.pipeline import ROLES, Pipeline
from lwepp.plugins import REGISTRY
from plugin import ConfigError, Factory, Role, build, needs_body

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
    """One plugin as the file configures it, and the roles it plays."""

    name: str
    type: str
    plugin: Any
    roles: tuple[Role, ...]


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


@dataclass(slots=True)
class _Decoder:
    """Walks the parsed file, collecting errors (with line numbers from the YAML nodes)."""

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

    def fields(
        self, value: Any, keys: Keys, subject: str, known: Sequence[str]
    ) -> Mapping[str, Any] | None:
        """``value`` if it is a mapping with only ``known`` fields; else record an error."""
        if not isinstance(value, Mapping):
            self.error(keys, f"{subject}: expected a mapping, got {_kind(value)}")
            return None
        for name in value:
            if name not in known:
                self.error(
                    [*keys, name], f"{subject}: unknown field {name!r} (known: {', '.join(known)})"
                )
        return value

    # --- the document ---

    def decode(self, data: Any) -> PickerConfig | None:
        known = ["apiVersion", "kind", "plugins", "schedulingProfiles", *IGNORED_SECTIONS]
        top = self.fields({} if data is None else data, [], "config", known)
        if top is None:
            return None
        api_version = top.get("apiVersion")
        if api_version == DEPRECATED_API_VERSION:
            self.warn(["apiVersion"], f"apiVersion: deprecated: use {API_VERSION}")
        elif api_version != API_VERSION:
            self.error(["apiVersion"], f"apiVersion: expected {API_VERSION}, got {api_version!r}")
        if top.get("kind") != KIND:
            self.error(["kind"], f"kind: expected {KIND}, got {top.get('kind')!r}")
        plugins = self.plugins(top.get("plugins"))
        by_name = {p.name: p for p in plugins}
        self.ignored_sections(top, by_name)
        profile = self.profile(top.get("schedulingProfiles"), plugins, by_name)
        if profile is None:
            return None
        name, listed = profile
        running = self.running(plugins, name, [c for c, _ in listed])
        weights = {c.name: w for c, w in listed if w is not None}
        self.check_attributes(plugins, running)
        return PickerConfig(
            self.path,
            str(api_version),
            name,
            tuple(plugins),
            tuple(p.plugin for p in running),
            weights,
            tuple(self.warnings),
        )

    def plugins(self, entries: Any) -> list[Configured]:
        if entries is None:
            return []
        if not isinstance(entries, list):
            self.error(["plugins"], f"plugins: expected a list, got {_kind(entries)}")
            return []
        built: list[Configured] = []
        seen: dict[str, int] = {}
        for index, entry in enumerate(entries):
            keys: list[str | int] = ["plugins", index]
            spec = self.fields(entry, keys, f"plugins[{index}]", ["type", "name", "parameters"])
            if spec is None:
                continue
            kind, name = spec.get("type"), spec.get("name", spec.get("type"))
            if not isinstance(kind, str) or not kind:
                self.error([*keys, "type"], f"plugins[{index}]: type: required, a string")
                continue
            subject = f"plugin {name!r} ({kind})"
            if not isinstance(name, str) or not name:
                self.error([*keys, "name"], f"{subject}: name: must be a string")
                continue
            if name in seen:
                self.error(
                    [*keys, "name"], f"{subject}: name: duplicate (also plugins[{seen[name]}])"
                )
                continue
            seen[name] = index
            if kind in IGNORED_TYPES:
                self.warn([*keys, "type"], f"{subject}: ignored: {IGNORED_TYPES[kind]}")
                continue
            if kind in HINTS:
                self.error([*keys, "type"], f"{subject}: type: unknown ({HINTS[kind]})")
                continue
            try:
                made = build(kind, name, spec.get("parameters"), self.registry, ROLES)
            except ConfigError as error:
                # Point at the field at fault: "type", or "parameters.<name>[...]".
                at = re.split(r"[.\[]", error.field)[:2] if error.field else []
                self.error([*keys, *at], str(error))
                continue
            built.append(Configured(name, kind, made.plugin, made.roles))
        return built

    def ignored_sections(self, top: Mapping[str, Any], by_name: Mapping[str, Configured]) -> None:
        for section, why in IGNORED_SECTIONS.items():
            if section not in top:
                continue
            value = top[section]
            if section == "featureGates":
                if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
                    self.error(
                        [section], f"{section}: expected a list of names, got {_kind(value)}"
                    )
                    continue
                for gate in value:
                    if gate not in FEATURE_GATES:
                        known = ", ".join(sorted(FEATURE_GATES))
                        self.error([section], f"{section}: unknown gate {gate!r} (known: {known})")
            elif not isinstance(value, Mapping):
                self.error([section], f"{section}: expected a mapping, got {_kind(value)}")
                continue
            else:
                for keys, ref in _plugin_refs(value, [section]):
                    if ref not in by_name:
                        self.error(keys, f"{section}: pluginRef {ref!r} names no plugin")
            self.warn([section], f"{section}: decoded and ignored: {why}")

    def profile(
        self, profiles: Any, plugins: Sequence[Configured], by_name: Mapping[str, Configured]
    ) -> tuple[str, list[tuple[Configured, float | None]]] | None:
        """The one profile: its name and its plugins with their weights (None: not given)."""
        if profiles is None or profiles == []:
            # As the router: a "default" profile of every plugin, in file order.
            return "default", [(p, None) for p in plugins]
        if not isinstance(profiles, list):
            self.error(["schedulingProfiles"], "schedulingProfiles: expected a list")
            return None
        if len(profiles) > 1:
            names = ", ".join(
                repr(p.get("name")) if isinstance(p, Mapping) else "?" for p in profiles
            )
            self.error(
                ["schedulingProfiles", 1],
                "schedulingProfiles: Switchyard runs exactly one scheduling profile; found "
                f"{len(profiles)} ({names}). The router chooses among several with a profile "
                "handler (e.g. prefill/decode disaggregation), which Switchyard does not implement",
            )
            return None
        keys: list[str | int] = ["schedulingProfiles", 0]
        spec = self.fields(profiles[0], keys, "schedulingProfiles[0]", ["name", "plugins"])
        if spec is None:
            return None
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            self.error([*keys, "name"], "schedulingProfiles[0]: name: required, a string")
            name = "?"
        entries = spec.get("plugins") or []
        if not isinstance(entries, list):
            self.error([*keys, "plugins"], f"profile {name!r}: plugins: expected a list")
            return None
        chosen: list[tuple[Configured, float | None]] = []
        for index, entry in enumerate(entries):
            at = [*keys, "plugins", index]
            subject = f"profile {name!r} plugins[{index}]"
            ref = self.fields(entry, at, subject, ["pluginRef", "weight"])
            if ref is None:
                continue
            target, weight = ref.get("pluginRef"), ref.get("weight")
            if not isinstance(target, str):
                self.error(at, f"{subject}: pluginRef: required, a string")
                continue
            where = f"profile {name!r}, plugin {target!r}"
            configured = by_name.get(target)
            if configured is None:
                known = ", ".join(by_name) or "none"
                self.error(
                    [*at, "pluginRef"], f"{where}: pluginRef: names no plugin (plugins: {known})"
                )
            elif any(c is configured for c, _ in chosen):
                self.error([*at, "pluginRef"], f"{where}: pluginRef: listed twice")
            elif configured.roles == (Role.SOURCE,):
                self.error(
                    [*at, "pluginRef"],
                    f"{where}: pluginRef: a data source runs on its own; list it under plugins",
                )
            elif weight is None:
                chosen.append((configured, None))
            elif isinstance(weight, bool) or not isinstance(weight, int | float):
                self.error([*at, "weight"], f"{where}: weight: expected a number, got {weight!r}")
            elif weight < 0:
                self.error([*at, "weight"], f"{where}: weight: must not be negative, got {weight}")
            else:
                if Role.SCORE not in configured.roles:
                    self.warn([*at, "weight"], f"{where}: weight: ignored, the plugin is no scorer")
                chosen.append((configured, float(weight)))
        return name, chosen

    def running(
        self, plugins: Sequence[Configured], profile: str, listed: Sequence[Configured]
    ) -> list[Configured]:
        """The profile's plugins, then every unlisted plugin that needs no listing to run."""
        running = list(listed)
        for index, p in enumerate(plugins):
            if p in running:
                continue
            if PROFILED & {*p.roles}:
                subject = f"plugin {p.name!r} ({p.type})"
                self.warn(
                    ["plugins", index], f"{subject}: not in profile {profile!r}: it does not run"
                )
            else:
                running.append(p)
        pickers = [p.name for p in running if Role.PICK in p.roles]
        if len(pickers) > 1:
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
                    ["plugins", plugins.index(p)],
                    f"plugin {p.name!r} ({p.type}): reads {attribute!r}, which no configured "
                    f"data source produces{hint}",
                )


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), f"{type(value).__name__} {value!r}"
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
