"""BBR's configuration file: the payload processor's ``PayloadProcessorConfig``, decoded strictly.

The payload processor (llm-d-inference-payload-processor, BBR's successor)
reads its plugins from ``--config-file`` or ``--config-text``
(``apix/config/v1alpha1/payloadprocessorconfig_types.go``, ``docs/configuration.md``)::

    apiVersion: llm-d.ai/v1alpha1
    kind: PayloadProcessorConfig
    plugins:                             # every plugin, once; referenced by name
    - type: body-field-to-header         # built-in (bbr.plugins.PLUGINS), or pkg.module.Class
      name: model-extractor              # optional: defaults to the type
      parameters: {fieldName: model, headerName: X-Gateway-Model-Name}
    preProcessing:                       # optional: run first, for every request
      plugins: [{pluginRef: ...}]
    profilePicker: {pluginRef: ...}      # optional; only single-profile-picker here
    profiles:                            # exactly one here
    - name: default
      plugins:
        request: [{pluginRef: model-extractor}]
        response: []
    postProcessing:                      # optional: run last, on every response
      plugins: [{pluginRef: ...}]

BBR's request chain is ``preProcessing`` then the profile's ``request`` list;
its response chain the profile's ``response`` list then ``postProcessing``,
in order; a plugin runs where it is referenced, and must have the method of
that chain (``process_request``, ``process_response``). A plugin referenced
nowhere is built (its parameters checked) and reported, as it runs nowhere.

What Switchyard's BBR cannot do is refused, naming the field: several
profiles (and so a profile picker choosing among them), a ``weight`` (the
model selector's scorers take one), the model-selection and data-layer
plugins (``model-selector``, its filters, scorers and pickers,
``request-metadata-extractor``, ``model-config-datasource``,
``model-name-to-header``) and the ``datalayer`` section. Any unknown field, a
dangling or duplicate name, a wrong ``apiVersion`` or ``kind`` is an error
with the file and line; every error is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry

from bbr.plugins import CHAINS, PLUGINS, BBRMetrics, Chain, Step
from plugin_api import ConfigError, Factory, Params, Role, build, needs_body
from plugin_api.document import Document, keys_of, read_config
from wire.extproc import Phase

API_VERSION: Final = "llm-d.ai/v1alpha1"
KIND: Final = "PayloadProcessorConfig"
SINGLE_PROFILE_PICKER: Final = "single-profile-picker"
"""The payload processor's default profile picker: with one profile, the only one there is."""

NOT_IMPLEMENTED: Final = {
    "model-selector": "model selection",
    "model-group-name-filter": "model selection (a filter)",
    "cost-scorer": "model selection (a scorer)",
    "inflight-requests-scorer": "model selection (a scorer)",
    "max-score-picker": "model selection (a picker)",
    "random-picker": "model selection (a picker)",
    "weighted-random-picker": "model selection (a picker)",
    "model-name-to-header": "model selection (it reports the selected model)",
    "request-metadata-extractor": "the data layer (an extractor)",
    "model-config-datasource": "the data layer (a datasource)",
}
"""The payload processor's plugin types that Switchyard's BBR does not have, and what they are
part of (``docs/plugins.md``)."""


@dataclass(frozen=True, slots=True)
class Ref:
    """One ``pluginRef`` in a chain, with where it is in the document."""

    name: str
    path: str


@dataclass(slots=True)
class PayloadConfig:
    """A configuration whose structure has been checked; ``chains`` builds its plugins.

    Building needs what BBR hands its plugins (its metrics), so it happens when
    the router is made, reporting at the same lines.
    """

    document: Document
    plugins: dict[str, Params] = field(default_factory=dict)
    """Each plugin's entry (``plugins[i]``), by name."""
    request: list[Ref] = field(default_factory=list)
    response: list[Ref] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        return self.document.warnings

    def chains(
        self,
        metrics: BBRMetrics,
        made_plugins: list[object] | None = None,
        registry: Mapping[str, Factory] = PLUGINS,
    ) -> tuple[Chain, Chain]:
        """Build every plugin once and place it in the chains that reference it (and, given
        ``made_plugins``, append it there); raise ``ConfigErrors`` listing every problem."""
        request, response = self.document.done(self.build(metrics, registry, made_plugins))
        return request, response

    def build(
        self,
        metrics: BBRMetrics,
        registry: Mapping[str, Factory],
        made_plugins: list[object] | None = None,
    ) -> list[Chain]:
        """The two chains, every problem reported to the document."""
        built: dict[str, tuple[str, Any, tuple[Role, ...]]] = {}
        for name, entry in self.plugins.items():
            kind = entry.require("type", str)
            with self.document.checking():
                try:
                    made = build(
                        kind, name, entry.get("parameters", object, None), registry, CHAINS, metrics
                    )
                except ConfigError as error:
                    raise ConfigError(str(error), entry.path_of(error.field or "type")) from None
                built[name] = (kind, made.plugin, made.roles)
                if made_plugins is not None:
                    made_plugins.append(made.plugin)
        chains = []
        places: tuple[tuple[Role, Phase, list[Ref]], ...] = (
            (Role.REQUEST, "request", self.request),
            (Role.RESPONSE, "response", self.response),
        )
        for role, point, refs in places:
            steps = []
            for ref in refs:
                if ref.name not in built:
                    continue  # its own error is reported
                kind, plugin, roles = built[ref.name]
                if role not in roles:
                    self.document.error(
                        keys_of(ref.path),
                        f"{ref.path}: plugin {ref.name!r} ({kind}) has no {role.value}: "
                        f"it cannot run in the {point} chain",
                    )
                    continue
                duration = metrics.plugin_duration.labels(point, kind, ref.name)
                hook = getattr(plugin, role.value)
                steps.append(Step(kind, ref.name, needs_body(plugin), hook, duration))
            chains.append(Chain(point, steps))
        return chains


def load_config(path: str | Path) -> PayloadConfig:
    """Read and check the configuration in ``path``; raise ``ConfigErrors`` listing all."""
    return load_text(read_config(path), str(path))


def load_text(text: str, where: str = "--config-text") -> PayloadConfig:
    """Check the configuration ``text`` (messages name ``where``); as ``load_config``.

    Every plugin is built once here, with metrics nobody reads, so that its parameters'
    errors are reported with the rest.
    """
    document = Document.parse(text, where)
    config = _decode(PayloadConfig(document), document.data)
    if config is not None:
        config.build(BBRMetrics(CollectorRegistry()), PLUGINS)
    decoded: PayloadConfig = document.done(config)
    return decoded


def _decode(config: PayloadConfig, data: Any) -> PayloadConfig | None:
    document = config.document
    try:
        doc = Params(data, "", path="")
        api_version = doc.get("apiVersion", str, "")
        kind = doc.get("kind", str, "")
        entries = doc.entries("plugins")
        pre = _ref_list(doc, "preProcessing", document)
        picker = doc.get("profilePicker", dict, None)
        profiles = doc.entries("profiles")
        post = _ref_list(doc, "postProcessing", document)
        datalayer = doc.get("datalayer", dict, None)
        doc.done()
    except ConfigError as error:
        document.error(keys_of(error.field or ""), str(error))
        return None
    if api_version != API_VERSION:
        document.error(["apiVersion"], f"apiVersion: expected {API_VERSION}, got {api_version!r}")
    if kind != KIND:
        document.error(["kind"], f"kind: expected {KIND}, got {kind!r}")
    if not entries:
        document.error(["plugins"], "plugins: at least one plugin is required")
    pickers: set[str] = set()
    refused = {e.get("name", str, e.get("type", str, "")) for e in entries if _refused(e)}
    for entry in entries:
        with document.checking():
            _plugin(config, entry, pickers)
    if datalayer:
        first = sorted(datalayer)[0]
        document.error(
            ["datalayer", first],
            f"datalayer.{first}: the data layer (collectors, extractors, datasources) is not "
            "implemented by Switchyard's BBR",
        )
    with document.checking():
        if picker is not None:
            chosen = doc.entry("profilePicker", picker)
            name = chosen.require("pluginRef", str)
            chosen.done()
            if name not in pickers:
                raise chosen.error("pluginRef", f"{name!r} is no {SINGLE_PROFILE_PICKER} plugin")
    with document.checking():
        request, response = _profile(profiles, document)
        config.request = [*(pre or []), *request]
        config.response = [*response, *(post or [])]
    for ref in [*config.request, *config.response]:
        if ref.name in pickers:
            document.error(keys_of(ref.path), f"{ref.path}: {ref.name!r} is a profile picker")
        elif ref.name not in config.plugins and ref.name not in refused:
            document.error(keys_of(ref.path), f"{ref.path}: no plugin is named {ref.name!r}")
    used = {ref.name for ref in [*config.request, *config.response]}
    for name, entry in config.plugins.items():
        if name not in used:
            document.warn(
                keys_of(entry.path), f"plugin {name!r}: referenced nowhere: it never runs"
            )
    return config


def _refused(entry: Params) -> bool:
    """Whether the entry's type is one Switchyard's BBR does not implement (its own error)."""
    try:
        return entry.get("type", str, "") in NOT_IMPLEMENTED
    except ConfigError:
        return False


def _plugin(config: PayloadConfig, entry: Params, pickers: set[str]) -> None:
    """One ``plugins`` entry: its name, and its type checked against what BBR has."""
    kind = entry.require("type", str)
    name = entry.get("name", str, kind)
    entry.get("parameters", object, None)
    entry.done()
    if not kind or not name:
        raise entry.error("type" if not kind else "name", "must not be empty")
    if name in config.plugins or name in pickers:
        raise ConfigError(f"plugin {name!r}: name: duplicate", entry.path_of("name"))
    if kind in NOT_IMPLEMENTED:
        raise entry.error(
            "type",
            f"{kind!r} is the payload processor's {NOT_IMPLEMENTED[kind]}, which Switchyard's "
            "BBR does not implement",
        )
    if kind == SINGLE_PROFILE_PICKER:
        pickers.add(name)
        return
    config.plugins[name] = entry


def _ref_list(doc: Params, section: str, document: Document) -> list[Ref] | None:
    """``preProcessing``/``postProcessing``: ``{plugins: [{pluginRef: ...}]}``, or None."""
    raw = doc.get(section, dict, None)
    if raw is None:
        return None
    listing = doc.entry(section, raw)
    refs = _refs(listing, "plugins", document)
    listing.done()
    return refs


def _refs(params: Params, name: str, document: Document) -> list[Ref]:
    """A list of ``{pluginRef}``; a ``weight`` is refused (only scorers take one), reported
    to ``document`` with the list's other problems."""
    refs = []
    for ref in params.entries(name):
        with document.checking():
            if "weight" in ref:
                ref.get("weight", object, None)
                document.error(
                    keys_of(ref.path_of("weight")),
                    f"{ref.path_of('weight')}: only the model selector's scorers take a "
                    "weight; BBR has none",
                )
            refs.append(Ref(ref.require("pluginRef", str), ref.path_of("pluginRef")))
            ref.done()
    return refs


def _profile(profiles: list[Params], document: Document) -> tuple[list[Ref], list[Ref]]:
    """The one profile's request and response references."""
    if not profiles:
        raise ConfigError("profiles: at least one profile is required", "profiles")
    if len(profiles) > 1:
        raise profiles[1].error(
            "name",
            "Switchyard's BBR runs one profile: choosing among several (a profile picker) "
            "is not implemented",
        )
    profile = profiles[0]
    name = profile.require("name", str)
    plugins = profile.entry("plugins", profile.require("plugins", dict))
    profile.done()
    if not name:
        raise profile.error("name", "must not be empty")
    request, response = _refs(plugins, "request", document), _refs(plugins, "response", document)
    plugins.done()
    if not request and not response:
        raise plugins.error("request", "a profile needs a request or a response list")
    return request, response
