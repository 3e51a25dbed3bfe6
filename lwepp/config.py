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
them (no profile: one named ``default`` lists every plugin, as the router
does); other plugins run unlisted, after the profile's, in file order. A
profile without a picker gets ``max-score-picker``.

**Plugins that name plugins** (``lwepp.contracts.Want``: a prefix scorer its
producer, a load scorer its in-flight producer, a metrics source its
extractor) are handed them, and the loader adds what the router adds: the
named default producer, and a ``metrics-data-source`` when a running plugin
reads what only it produces (unless ``dataLayer.injectDefaults: false``). A
plugin that only provides runs nowhere, and is reported when nothing names it.

**Strict.** An unknown field or type, a parameter the plugin does not read, a
dangling ``pluginRef``, a duplicate name, a negative weight, a second profile
or picker, or an attribute nothing produces is an error naming the file and
line, the plugin and the field; every error is reported. A ``type`` with a
dot is a user's plugin, imported by dotted path (``examples/custom_scorer/``).
The router's other spellings (sections, feature gates, deprecated names, the
features Switchyard does not implement) are ``lwepp.router_compat``'s, the
layer in front of this decoder; the ``flowControl`` section (and the
deprecated ``saturationDetector``) is ``lwepp.flowcontrol.config``'s, whose
detector and policies are plugins of this file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from lwepp import router_compat as compat
from lwepp.configured import Configured, provides
from lwepp.contracts import Want
from lwepp.flowcontrol import config as flow_config
from lwepp.pipeline import ROLES, Pipeline
from lwepp.plugins import REGISTRY
from plugin_api import ConfigError, Factory, Params, Role, build
from plugin_api.document import ConfigErrors as ConfigErrors  # what callers catch
from plugin_api.document import Document, keys_of, read_config

DEFAULT_SOURCE: Final = "metrics-data-source"
"""The data source the router adds when a running plugin reads what only it produces."""

PROFILED: Final = frozenset({Role.FILTER, Role.SCORE, Role.PICK})
"""The roles that run only where a scheduling profile lists the plugin."""

LEARNING: Final = frozenset(ROLES[ROLES.index(Role.PICKED) :])
"""The roles that learn from the requests served (picked and response hooks)."""


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
    flow: flow_config.FlowConfig = flow_config.OFF
    """The ``flowControl`` section: the gate, the saturation detector, the queues' settings."""
    discovery: Any = None
    """The plugin ``dataLayer.discovery`` names: where the pods come from (``pod_source``)."""

    def pipeline(self, **options: Any) -> Pipeline:
        """The pipeline this file describes (``options``: ``Pipeline``'s keyword arguments)."""
        types = {p.name: p.type for p in self.plugins}
        return Pipeline(self.running, weights=self.weights, types=types, **options)

    @property
    def learning(self) -> list[str]:
        """The running plugins that learn from the requests served (picked or response hooks)."""
        running = {id(p) for p in self.running}
        return [p.name for p in self.plugins if id(p.plugin) in running and LEARNING & {*p.roles}]


# --- loading -------------------------------------------------------------------------


def load_config(path: str | Path, registry: Mapping[str, Factory] = REGISTRY) -> PickerConfig:
    """Read, check and build the configuration in ``path``; raise ``ConfigErrors`` listing all."""
    return load_text(read_config(path), str(path), registry)


def load_text(
    text: str, where: str = "--config-text", registry: Mapping[str, Factory] = REGISTRY
) -> PickerConfig:
    """Check and build the configuration ``text`` (messages name ``where``); as ``load_config``."""
    document = Document.parse(text, where)
    decoder = _Decoder(document, registry)
    config: PickerConfig = document.done(decoder.decode(document.data))
    return config


@dataclass(slots=True)
class _Decoder:
    """Walks the parsed file with ``plugin_api.Params``, reporting every problem to it."""

    document: Document
    registry: Mapping[str, Factory]
    given: set[str] = field(default_factory=set)
    """The plugins handed to another (``Want``)."""

    # --- the document ---

    def decode(self, data: Any) -> PickerConfig | None:
        try:
            doc = Params(data, "", path="")
            api_version = doc.get("apiVersion", str, "")
            kind = doc.get("kind", str, "")
            gates = doc.get("featureGates", list, [])
            entries, profiles = doc.entries("plugins"), doc.entries("schedulingProfiles")
            sections = {
                n: doc.get(n, dict, None) for n in (*compat.SECTIONS, *flow_config.SECTIONS)
            }
            doc.done()
        except ConfigError as error:
            self.document.error(keys_of(error.field or ""), str(error))
            return None
        if api_version == compat.DEPRECATED_API_VERSION:
            self.document.warn(
                ["apiVersion"], f"apiVersion: deprecated: use {compat.API_VERSIONS[-1]}"
            )
        elif api_version not in compat.API_VERSIONS:
            expected = " or ".join(compat.API_VERSIONS)
            self.document.error(
                ["apiVersion"], f"apiVersion: expected {expected}, got {api_version!r}"
            )
        if kind != compat.KIND:
            self.document.error(["kind"], f"kind: expected {compat.KIND}, got {kind!r}")
        self.document.report(compat.gate_problems(gates))
        plugins: list[Configured] = []
        named: dict[str, str] = {}  # every plugin name in the file → its path
        needing: dict[str, list[str]] = {}  # unsupported feature → "type (line n)"
        for entry in entries:
            with self.document.checking():
                if (made := self.plugin(entry, named, needing)) is not None:
                    plugins.append(made)
        skipped = {n for n in named if n not in {c.name for c in plugins}}
        if needing:
            features = "; ".join(f"{f} ({', '.join(kinds)})" for f, kinds in needing.items())
            self.document.error([], f"needs what Switchyard does not implement: {features}")
        self.document.report(compat.section_problems(sections, named))
        data_layer = sections.get("dataLayer")
        pairs = compat.extractor_pairs(data_layer)
        profile = self.profile(profiles, {p.name: p for p in plugins}, skipped, bool(needing))
        if profile is None:
            return None
        name, listed, weights = profile
        flowing = flow_config.decode(self.document, sections, gates, plugins, named, self.registry)
        self.given |= flowing.uses  # the detector and policies: used, though not in the profile
        running = self.running(plugins, name, listed)
        running += flow_config.watching(flowing, running)
        self.link(plugins, running, pairs, skipped)
        if (data_layer or {}).get("injectDefaults") is not False:
            self.add_source(plugins, running, pairs)
        discovery = next((p for p in plugins if p.name == compat.discovery_ref(data_layer)), None)
        self.given |= {discovery.name} if discovery else set()
        self.unnamed(plugins)
        self.check_attributes(running)
        return PickerConfig(
            self.document.path,
            api_version,
            name,
            tuple(plugins),
            tuple(p.plugin for p in running),
            weights,
            tuple(self.document.warnings),
            flowing,
            discovery and discovery.plugin,
        )

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
        at = keys_of(entry.path_of("type"))
        verdict = compat.verdict(kind, parameters)
        if verdict.unsupported is not None:
            line = self.document.line(at)
            needing.setdefault(verdict.unsupported, []).append(f"{kind} (line {line})")
            return None
        if verdict.ignored is not None:
            self.document.warn(at, f"{subject}: ignored: {verdict.ignored}")
            return None
        if verdict.deprecated is not None:
            self.document.warn(at, f"{subject}: type: deprecated: {verdict.deprecated}")
        for key, note in compat.parameter_notes(kind, parameters):
            self.document.warn(
                keys_of(f"{entry.path}.parameters.{key}"), f"{subject}: {key}: {note}"
            )
        try:
            made = build(verdict.builtin, name, parameters, self.registry, ROLES)
        except ConfigError as error:  # point at the field in the document: plugins[i].<field>
            raise ConfigError(str(error), entry.path_of(error.field or "type")) from None
        return Configured(name, kind, made.plugin, made.roles, entry.path)

    # --- plugins that name plugins ---

    def link(
        self,
        plugins: list[Configured],
        running: list[Configured],
        pairs: Mapping[str, str],
        skipped: Set[str] = frozenset(),
        wanting: Sequence[Configured] | None = None,
    ) -> None:
        """Hand each plugin (of ``wanting``, default all, those added included) the plugins it
        wants (``Want``): first the wants that add a default, then the others."""
        scope, met = (plugins if wanting is None else list(wanting)), set[int]()
        for adding in (True, False):
            while need := next(((p, w) for p in scope for w in getattr(p.plugin, "wants", ())
                                if w.add is adding and id(w) not in met), None):  # fmt: skip
                met.add(id(need[1]))
                with self.document.checking():
                    self.give(*need, plugins, running, pairs, skipped)

    def give(
        self,
        p: Configured,
        want: Want,
        plugins: list[Configured],
        running: list[Configured],
        pairs: Mapping[str, str],
        skipped: Set[str],
    ) -> None:
        """Find what ``want`` names for ``p`` and hand it over; raise ``ConfigError`` if none."""
        by_name = {c.name: c for c in plugins}
        name = want.name
        if name is None:  # the one the data layer pairs with it, or the only one there is
            providers = [c.name for c in plugins if want.provides in provides(c.plugin)]
            paired, only = pairs.get(p.name), providers[0] if len(providers) == 1 else None
            name = paired if paired in providers else only or want.default
            if name is None:
                return
        other = by_name.get(name)
        if other is None and name == want.default and want.add:
            why = f"{p.name} names it in {want.field}; the router creates it for its consumers too"
            why = f"{p.name} needs it: {want.note}" if want.note else why
            other = self.add(want.default, "" if want.quiet else why, p.path)
            plugins.append(other)
            running.append(other)
        if other is None:
            if name == want.default or name in skipped:
                return  # left at its default, or ignored or reported already
            makers = [kind for kind, f in self.registry.items() if want.provides in provides(f)]
            raise ConfigError(
                f"{p.subject}: {want.field}: {name!r} names no {' or '.join(makers)}",
                f"{p.path}.parameters.{want.field}",
            )
        if want.provides not in provides(other.plugin):
            raise ConfigError(
                f"{p.subject}: {want.field}: {name!r} is a {other.type}, which provides no "
                f"{want.provides}",
                f"{p.path}.parameters.{want.field}",
            )
        try:
            want.give(other.plugin)
        except ConfigError as error:
            raise ConfigError(f"{p.subject}: {error}", p.path) from None
        self.given.add(other.name)

    def add(self, kind: str, why: str, path: str) -> Configured:
        """A plugin the router would add (named as its type), with a warning saying why."""
        made = build(kind, kind, None, self.registry, ROLES)
        if why:
            self.document.warn(keys_of(path), f"added {kind}: {why}")
        return Configured(kind, kind, made.plugin, made.roles, path)

    def add_source(
        self, plugins: list[Configured], running: list[Configured], pairs: Mapping[str, str]
    ) -> None:
        """Add the metrics source the router would inject, when a running plugin needs it."""
        produced = frozenset().union(
            *(p.plugin.produces for p in running if Role.SOURCE in p.roles)
        )
        wanted = frozenset().union(*(getattr(p.plugin, "reads", frozenset()) for p in running))
        missing = wanted - produced
        source = self.registry.get(DEFAULT_SOURCE)
        if not missing or source is None or not missing <= getattr(source, "produces", set()):
            return
        readers = sorted(p.name for p in running if missing & getattr(p.plugin, "reads", set()))
        verb = "reads" if len(readers) == 1 else "read"
        why = (
            f"{', '.join(readers)} {verb} {', '.join(sorted(missing))} (the router's default "
            "data source; dataLayer.injectDefaults: false refuses instead)"
        )
        added = self.add(DEFAULT_SOURCE, why, "dataLayer")
        plugins.append(added)
        running.append(added)
        self.link(plugins, running, pairs, wanting=[added])

    def unnamed(self, plugins: Sequence[Configured]) -> None:
        """A plugin that only provides, and that nothing took, does nothing: say so."""
        for p in plugins:
            if not p.roles and p.name not in self.given:
                self.document.warn(
                    keys_of(p.path), f"{p.subject}: no plugin names it: it does nothing"
                )

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
            self.document.error(
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
            self.document.error(keys_of(error.field or ""), str(error))
            return None
        for entry in entries:
            with self.document.checking():
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
                        at = keys_of(entry.path_of("weight"))
                        self.document.warn(
                            at, f"profile {name!r}, plugin {ref!r}: weight: not a scorer"
                        )
                listed.append(configured)
        return name, listed, weights

    def running(
        self, plugins: Sequence[Configured], profile: str, listed: Sequence[Configured]
    ) -> list[Configured]:
        """The profile's plugins, then every unlisted plugin that needs no listing to run."""
        running = list(listed)
        for p in plugins:
            if p in running or not p.roles:  # one that only provides runs nowhere
                continue
            if not PROFILED & {*p.roles}:
                running.append(p)
            elif p.name not in self.given:  # a detector flow control reads is not idle
                self.document.warn(
                    keys_of(p.path), f"{p.subject}: not in profile {profile!r}: it does not run"
                )
        if len(pickers := [p.name for p in running if Role.PICK in p.roles]) > 1:
            self.document.error(
                ["schedulingProfiles"],
                f"profile {profile!r}: more than one picker: {', '.join(pickers)}",
            )
        return running

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
                self.document.error(
                    keys_of(p.path),
                    f"{p.subject}: reads {attribute!r}, which no configured "
                    f"data source produces{hint}",
                )
