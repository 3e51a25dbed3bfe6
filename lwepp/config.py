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

**Where each plugin runs.** Filters, scorers and the picker run where the
scheduling profile lists them, in its order (with no profile, one named
``default`` lists every filter, scorer and picker in file order, as the
router does); a profile without a picker gets ``max-score-picker``. A
plugin's prepare, picked and response hooks run, in file order, when the
plugin is in the profile or is only a hook (not a filter, scorer or picker).
Data sources run in the background, all of them: they are listed under
``plugins`` only (the router's ``dataLayer`` wiring is not needed).

**User plugins.** A ``type`` with a dot is a dotted path, imported when the
file is loaded. The object there is called as ``factory(name, params)``
(``params``: ``lwepp.plugins.params.Params``): a class whose ``__init__``
takes those two, a function, or a classmethod named in the path
(``pkg.module.Class.from_params``). ``examples/custom_scorer/`` shows one.

**Strict.** An unknown field, an unknown type, a parameter the plugin does
not read, a dangling ``pluginRef``, a duplicate name, a negative weight, a
second profile, or an attribute a plugin reads that no configured data
source produces is an error naming the file and line, the plugin and the
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

import importlib
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from lwepp.attributes import AttributeStore
from lwepp.hooks import DataSource, Filter, PickedHook, Picker, PrepareHook, ResponseHook
from lwepp.pipeline import Pipeline, PipelineMetrics, Weighted
from lwepp.plugins import REGISTRY, Factory
from lwepp.plugins.params import ConfigError, Params
from lwepp.plugins.pickers import MaxScorePicker

API_VERSION: Final = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha1"
KIND: Final = "EndpointPickerConfig"
DEFAULT_PICKER: Final = "max-score-picker"

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

ROLES: Final = ("data source", "prepare", "filter", "scorer", "picker", "picked", "response")


class ConfigErrors(ConfigError):
    """Every problem found in one configuration file, one per line."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True, slots=True)
class Configured:
    """One plugin as the file configures it, and the stages it can take part in."""

    name: str
    type: str
    plugin: Any
    roles: tuple[str, ...]
    line: int


@dataclass(frozen=True, slots=True)
class PickerConfig:
    """A configuration file, resolved: which plugin runs at which stage, with which weight."""

    path: str
    api_version: str
    profile: str
    plugins: tuple[Configured, ...]
    prepare: tuple[PrepareHook, ...]
    filters: tuple[Filter, ...]
    scorers: tuple[Weighted, ...]
    picker: Picker
    default_picker: bool
    picked: tuple[PickedHook, ...]
    responses: tuple[ResponseHook, ...]
    sources: tuple[DataSource, ...]
    warnings: tuple[str, ...] = ()

    def pipeline(
        self,
        store: AttributeStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: PipelineMetrics | None = None,
    ) -> Pipeline:
        return Pipeline(
            prepare=self.prepare,
            filters=self.filters,
            scorers=self.scorers,
            picker=self.picker,
            picked=self.picked,
            responses=self.responses,
            store=store,
            clock=clock,
            metrics=metrics,
        )

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


@dataclass(slots=True)
class _Decoder:
    """Walks the parsed file, collecting errors (with line numbers from the YAML nodes)."""

    path: str
    node: yaml.Node | None
    registry: Mapping[str, Factory]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    # --- messages ---

    def line(self, *keys: str | int) -> int:
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

    def at(self, keys: Sequence[str | int], subject: str, message: str) -> str:
        line = self.line(*keys)
        return (
            f"{self.path}:{line}: {subject}: {message}"
            if line
            else f"{self.path}: {subject}: {message}"
        )

    def error(self, keys: Sequence[str | int], subject: str, message: str) -> None:
        self.errors.append(self.at(keys, subject, message))

    def warn(self, keys: Sequence[str | int], subject: str, message: str) -> None:
        self.warnings.append(self.at(keys, subject, message))

    def fields(
        self, value: Any, keys: Sequence[str | int], subject: str, known: Sequence[str]
    ) -> Mapping[str, Any] | None:
        """``value`` if it is a mapping with only ``known`` fields; else record an error."""
        if not isinstance(value, Mapping):
            self.error(keys, subject, f"expected a mapping, got {_kind(value)}")
            return None
        for name in value:
            if name not in known:
                self.error(
                    [*keys, name], subject, f"unknown field {name!r} (known: {', '.join(known)})"
                )
        return value

    # --- the document ---

    def decode(self, data: Any) -> PickerConfig | None:
        top = self.fields(
            {} if data is None else data,
            [],
            "config",
            ["apiVersion", "kind", "plugins", "schedulingProfiles", *IGNORED_SECTIONS],
        )
        if top is None:
            return None
        api_version = top.get("apiVersion")
        if api_version == DEPRECATED_API_VERSION:
            self.warn(["apiVersion"], "apiVersion", f"deprecated: use {API_VERSION}")
        elif api_version != API_VERSION:
            self.error(["apiVersion"], "apiVersion", f"expected {API_VERSION}, got {api_version!r}")
        if top.get("kind") != KIND:
            self.error(["kind"], "kind", f"expected {KIND}, got {top.get('kind')!r}")
        plugins = self.plugins(top.get("plugins"))
        by_name = {p.name: p for p in plugins}
        self.ignored_sections(top, by_name)
        profile = self.profile(top.get("schedulingProfiles"), plugins, by_name)
        if profile is None:
            return None
        config = self.resolve(str(api_version), plugins, *profile)
        self.check_attributes(config)
        return PickerConfig(**config, warnings=tuple(self.warnings))

    def plugins(self, entries: Any) -> list[Configured]:
        if entries is None:
            return []
        if not isinstance(entries, list):
            self.error(["plugins"], "plugins", f"expected a list, got {_kind(entries)}")
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
                self.error([*keys, "type"], f"plugins[{index}]", "type: required, a string")
                continue
            if not isinstance(name, str) or not name:
                self.error([*keys, "name"], f"plugin of type {kind!r}", "name: must be a string")
                continue
            subject = f"plugin {name!r} ({kind})"
            if name in seen:
                self.error(
                    [*keys, "name"], subject, f"name: duplicate (also plugins[{seen[name]}])"
                )
                continue
            seen[name] = index
            if kind in IGNORED_TYPES:
                self.warn([*keys, "type"], subject, f"ignored: {IGNORED_TYPES[kind]}")
                continue
            plugin = self.build(kind, name, spec.get("parameters"), keys, subject)
            if plugin is not None:
                roles = self.roles(plugin, name, keys, subject)
                if roles:
                    built.append(Configured(name, kind, plugin, roles, self.line(*keys)))
        return built

    def build(
        self, kind: str, name: str, parameters: Any, keys: list[str | int], subject: str
    ) -> Any:
        factory = self.factory(kind, keys, subject)
        if factory is None:
            return None
        params = Params(f"{name!r} ({kind})", parameters)
        try:
            plugin = factory(name, params)
            params.done()  # whatever the factory did, an unread parameter is an error
        except ConfigError as error:
            field_name = re.search(r"parameters\.(\w+)", str(error))
            where = [*keys, "parameters", field_name[1]] if field_name else [*keys, "parameters"]
            self.error(where, subject, str(error).removeprefix(f"plugin {params.plugin}: "))
            return None
        except Exception as error:
            self.error(keys, subject, f"cannot be built: {type(error).__name__}: {error}")
            return None
        return plugin

    def factory(self, kind: str, keys: list[str | int], subject: str) -> Factory | None:
        if "." not in kind:
            if kind not in self.registry:
                hint = HINTS.get(kind) or (
                    f"built-in types: {', '.join(sorted(self.registry))}; "
                    "or a dotted path package.module.Class to a plugin of your own"
                )
                self.error([*keys, "type"], subject, f"type: unknown ({hint})")
                return None
            return self.registry[kind]
        try:
            return _import(kind)
        except (ImportError, AttributeError) as error:
            self.error([*keys, "type"], subject, f"type: cannot load {kind!r}: {error}")
            return None

    def roles(self, plugin: Any, name: str, keys: list[str | int], subject: str) -> tuple[str, ...]:
        """What ``plugin`` can do, by the methods it has; records an error if nothing."""
        has = {
            method: callable(getattr(plugin, method, None))
            for method in (
                "run",
                "prepare",
                "filter",
                "score",
                "pick",
                "picked",
                "response_headers",
                "response_chunk",
                "response_complete",
            )
        }
        problems = []
        if getattr(plugin, "name", None) != name:
            problems.append(
                f"its name is {getattr(plugin, 'name', None)!r}, not the configured one"
            )
        response = [
            m for m in ("response_headers", "response_chunk", "response_complete") if has[m]
        ]
        if response and len(response) < 3:
            problems.append(
                "a response hook has all of response_headers, response_chunk and "
                f"response_complete; it has only {', '.join(response)}"
            )
        roles = tuple(
            role
            for role, present in zip(
                ROLES,
                (
                    has["run"] and isinstance(getattr(plugin, "produces", None), frozenset),
                    has["prepare"],
                    has["filter"],
                    has["score"],
                    has["pick"],
                    has["picked"],
                    len(response) == 3,
                ),
                strict=True,
            )
            if present
        )
        if set(roles) - {"data source"}:
            if not isinstance(getattr(plugin, "reads", None), frozenset):
                problems.append("reads: expected a frozenset of attribute names (empty for none)")
            if not isinstance(getattr(plugin, "needs_body", None), bool):
                problems.append("needs_body: expected a bool")
        if not roles:
            problems.append(
                f"{type(plugin).__name__} is no plugin: it has none of run (with produces), "
                "prepare, filter, score, pick, picked, response_* (lwepp.hooks)"
            )
        for problem in problems:
            self.error(keys, subject, problem)
        return () if problems else roles

    def ignored_sections(self, top: Mapping[str, Any], by_name: Mapping[str, Configured]) -> None:
        for section, why in IGNORED_SECTIONS.items():
            if section not in top:
                continue
            value = top[section]
            if section == "featureGates":
                if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
                    self.error([section], section, f"expected a list of names, got {_kind(value)}")
                    continue
                for gate in value:
                    if gate not in FEATURE_GATES:
                        known = ", ".join(sorted(FEATURE_GATES))
                        self.error([section], section, f"unknown gate {gate!r} (known: {known})")
            elif not isinstance(value, Mapping):
                self.error([section], section, f"expected a mapping, got {_kind(value)}")
                continue
            else:
                for keys, ref in _plugin_refs(value, [section]):
                    if ref not in by_name:
                        self.error(keys, section, f"pluginRef {ref!r} names no plugin")
            self.warn([section], section, f"decoded and ignored: {why}")

    def profile(
        self, profiles: Any, plugins: Sequence[Configured], by_name: Mapping[str, Configured]
    ) -> tuple[str, list[tuple[Configured, float | None]]] | None:
        """The one profile: its name and its plugins with their weights (None: not given)."""
        if profiles is None or profiles == []:
            # As the router: a "default" profile of every filter, scorer and picker, in order.
            listed = [p for p in plugins if {"filter", "scorer", "picker"} & set(p.roles)]
            return "default", [(p, None) for p in listed]
        if not isinstance(profiles, list):
            self.error(["schedulingProfiles"], "schedulingProfiles", "expected a list")
            return None
        if len(profiles) > 1:
            names = ", ".join(
                repr(p.get("name")) if isinstance(p, Mapping) else "?" for p in profiles
            )
            self.error(
                ["schedulingProfiles", 1],
                "schedulingProfiles",
                f"Switchyard runs exactly one scheduling profile; found {len(profiles)} ({names}). "
                "The router chooses among several with a profile handler (e.g. "
                "prefill/decode disaggregation), which Switchyard does not implement",
            )
            return None
        keys: list[str | int] = ["schedulingProfiles", 0]
        spec = self.fields(profiles[0], keys, "schedulingProfiles[0]", ["name", "plugins"])
        if spec is None:
            return None
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            self.error([*keys, "name"], "schedulingProfiles[0]", "name: required, a string")
            name = "?"
        subject = f"profile {name!r}"
        entries = spec.get("plugins") or []
        if not isinstance(entries, list):
            self.error([*keys, "plugins"], subject, "plugins: expected a list")
            return None
        chosen: list[tuple[Configured, float | None]] = []
        for index, entry in enumerate(entries):
            at = [*keys, "plugins", index]
            ref = self.fields(entry, at, f"{subject} plugins[{index}]", ["pluginRef", "weight"])
            if ref is None:
                continue
            target, weight = ref.get("pluginRef"), ref.get("weight")
            if not isinstance(target, str):
                self.error(at, f"{subject} plugins[{index}]", "pluginRef: required, a string")
                continue
            where = f"{subject}, plugin {target!r}"
            configured = by_name.get(target)
            if configured is None:
                known = ", ".join(by_name) or "none"
                self.error(
                    [*at, "pluginRef"], where, f"pluginRef: names no plugin (plugins: {known})"
                )
                continue
            if any(c is configured for c, _ in chosen):
                self.error([*at, "pluginRef"], where, "pluginRef: listed twice")
                continue
            if not {"filter", "scorer", "picker", "prepare", "picked", "response"} & set(
                configured.roles
            ):
                self.error(
                    [*at, "pluginRef"],
                    where,
                    "pluginRef: a data source runs on its own; list it under plugins only",
                )
                continue
            if weight is not None:
                if isinstance(weight, bool) or not isinstance(weight, int | float):
                    self.error([*at, "weight"], where, f"weight: expected a number, got {weight!r}")
                    continue
                if weight < 0:
                    self.error(
                        [*at, "weight"], where, f"weight: must not be negative, got {weight}"
                    )
                    continue
                if "scorer" not in configured.roles:
                    self.warn([*at, "weight"], where, "weight: ignored, the plugin is no scorer")
            chosen.append((configured, None if weight is None else float(weight)))
        return name, chosen

    def resolve(
        self,
        api_version: str,
        plugins: Sequence[Configured],
        profile: str,
        chosen: Sequence[tuple[Configured, float | None]],
    ) -> dict[str, Any]:
        in_profile = {id(c) for c, _ in chosen}
        for p in plugins:
            if {"filter", "scorer", "picker"} & set(p.roles) and id(p) not in in_profile:
                self.warn(
                    ["plugins", plugins.index(p)],
                    f"plugin {p.name!r} ({p.type})",
                    f"not in profile {profile!r}: it does not run",
                )
        pickers = [c for c, _ in chosen if "picker" in c.roles]
        if len(pickers) > 1:
            self.error(
                ["schedulingProfiles"],
                f"profile {profile!r}",
                f"more than one picker: {', '.join(p.name for p in pickers)}",
            )
        picker: Picker = pickers[0].plugin if pickers else MaxScorePicker(DEFAULT_PICKER)
        # Hooks run for the plugins in the profile, and for plugins that are only hooks.
        hooked = [
            p
            for p in plugins
            if id(p) in in_profile
            or not {"filter", "scorer", "picker", "data source"} & set(p.roles)
        ]
        return {
            "path": self.path,
            "api_version": api_version,
            "profile": profile,
            "plugins": tuple(plugins),
            "prepare": tuple(p.plugin for p in hooked if "prepare" in p.roles),
            "filters": tuple(c.plugin for c, _ in chosen if "filter" in c.roles),
            "scorers": tuple(
                Weighted(c.plugin, 1.0 if w is None else w)
                for c, w in chosen
                if "scorer" in c.roles
            ),
            "picker": picker,
            "default_picker": not pickers,
            "picked": tuple(p.plugin for p in hooked if "picked" in p.roles),
            "responses": tuple(p.plugin for p in hooked if "response" in p.roles),
            "sources": tuple(p.plugin for p in plugins if "data source" in p.roles),
        }

    def check_attributes(self, config: Mapping[str, Any]) -> None:
        """Every attribute a running plugin reads must come from a configured data source."""
        produced = frozenset().union(*(s.produces for s in config["sources"]))
        running = {id(plugin) for plugin in _running(config)}
        for p in config["plugins"]:
            if id(p.plugin) not in running:
                continue
            for attribute in sorted(p.plugin.reads - produced):
                makers = [kind for kind, made in self.builtin_sources() if attribute in made]
                hint = f" (add one: {', '.join(makers)} produces it)" if makers else ""
                self.error(
                    ["plugins", config["plugins"].index(p)],
                    f"plugin {p.name!r} ({p.type})",
                    f"reads {attribute!r}, which no configured data source produces{hint}",
                )

    def builtin_sources(self) -> Iterator[tuple[str, frozenset[str]]]:
        """The registry's data source types and what each produces (for hints)."""
        for kind, factory in sorted(self.registry.items()):
            try:
                source = factory(kind, Params(kind, {}))
            except Exception:
                continue  # a hint only: types that need parameters are skipped
            produces = getattr(source, "produces", None)
            if callable(getattr(source, "run", None)) and isinstance(produces, frozenset):
                yield kind, produces


def _running(stages: Mapping[str, Any]) -> list[Any]:
    """Every plugin that takes part in a request (data sources run beside, not in, requests)."""
    return [
        *stages["prepare"],
        *stages["filters"],
        *(w.scorer for w in stages["scorers"]),
        stages["picker"],
        *stages["picked"],
        *stages["responses"],
    ]


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


def _import(path: str) -> Factory:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError as error:
            module = ".".join(parts[:split])
            if error.name != module and not module.startswith(f"{error.name}."):
                raise  # the module exists but imports something missing: say so
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        if not callable(target):
            raise AttributeError(f"{path} is not callable")
        factory: Factory = target
        return factory
    raise ImportError(f"no module named {parts[0]!r}")


# --- describing ------------------------------------------------------------------------


def _describe(config: PickerConfig) -> Iterator[str]:
    yield f"{config.path}: OK ({config.api_version}, profile {config.profile!r})"
    yield ""
    yield "plugins"
    labels = [p.name if p.name == p.type else f"{p.name} ({p.type})" for p in config.plugins]
    width = max(map(len, labels), default=0)
    for label, p in zip(labels, config.plugins, strict=True):
        details = [", ".join(p.roles)]
        reads: frozenset[str] = getattr(p.plugin, "reads", frozenset())
        if reads:
            details.append(f"reads {', '.join(sorted(reads))}")
        if "data source" in p.roles:
            details.append(f"produces {', '.join(sorted(p.plugin.produces))}")
        if getattr(p.plugin, "needs_body", False):
            details.append("needs the body")
        yield f"  {label:<{width}}  {'; '.join(details)}"
    if not config.plugins:
        yield "  (none)"
    yield ""
    yield f"pipeline (profile {config.profile!r})"

    def names(plugins: Sequence[Any]) -> str:
        return ", ".join(p.name for p in plugins) or "-"

    yield f"  1 prepare   {names(config.prepare)}"
    yield f"  2 filters   {names(config.filters)}"
    scorers = ", ".join(f"{w.scorer.name} ×{w.weight:g}" for w in config.scorers) or "-"
    yield f"  3 scorers   {scorers}"
    default = "  (default: the profile names no picker)" if config.default_picker else ""
    yield f"  4 picker    {config.picker.name}{default}"
    yield f"  5 picked    {names(config.picked)}"
    yield f"  6 response  {names(config.responses)}"
    yield f"  background  {names(config.sources)}"
    stages = {
        "prepare": config.prepare,
        "filters": config.filters,
        "scorers": config.scorers,
        "picker": config.picker,
        "picked": config.picked,
        "responses": config.responses,
    }
    needing = sorted({p.name for p in _running(stages) if p.needs_body})
    body = f"held and parsed (needed by {', '.join(needing)})" if needing else "not parsed"
    yield f"  body        {body}"
    if config.warnings:
        yield ""
        yield "warnings"
        for warning in config.warnings:
            yield f"  {warning}"
