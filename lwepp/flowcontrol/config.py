"""The ``flowControl`` section of an ``EndpointPickerConfig``, decoded strictly (router schema).

::

    featureGates: [flowControl]          # off by default, as in the router
    flowControl:
      maxRequests: 1000                  # global limits over every band (Quantity; 0/unset: none)
      maxBytes: 1G
      defaultRequestTTL: 60s             # queue-wait budget (0s: none); default 60s
      noEndpointRequestTTL: 30s          # the budget while the pool is empty (default: the above)
      defaultPriorityBand:               # the template for a priority no band names
        maxRequests: 5000                # a band's limits: default 5000 and 1G, always bounded
        maxBytes: 1G
        fairnessPolicyRef: global-strict-fairness-policy
        orderingPolicyRef: fcfs-ordering-policy
      defaultNegativePriorityBand: {...} # the template below priority 0 (default: the above)
      priorityBands:
      - {priority: 10, maxRequests: 100, fairnessPolicyRef: round-robin}
      usageLimitPolicyPluginRef: static-usage-limit-policy
      saturationDetector: {pluginRef: utilization-detector}
      enableEviction: false              # accepted; in-flight eviction is not implemented
    saturationDetector: {pluginRef: x}   # deprecated: flowControl.saturationDetector wins

Every reference names a plugin of the file's ``plugins`` that provides what
the field wants (``lwepp.flowcontrol.policies``, ``lwepp.plugins.saturation``);
the router's defaults (``global-strict-fairness-policy``,
``fcfs-ordering-policy``, ``static-usage-limit-policy`` and, with the gate
on, ``utilization-detector``) are made when named and not listed, as the
router registers them. A reference to a plugin the file lists but Switchyard
ignores (``program-aware-fairness``) falls back to the default, with a
warning.

With the gate off the section is still checked, and only its saturation
detector is used: a sheddable request (priority < 0) is refused while it
reads 1.0 or more (the router's legacy admission). The router always has a
detector (it adds ``utilization-detector``, with a metrics source); here one
is used only when named, so that a configuration without one never scrapes
for it. The other settings are ignored, with the router's warning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from lwepp.configured import Configured, provides
from lwepp.flowcontrol.controller import (
    BAND_MAX_BYTES,
    BAND_MAX_REQUESTS,
    DEFAULT_TTL,
    BandSpec,
    Settings,
)
from lwepp.flowcontrol.policies import FAIRNESS, ORDERING, USAGE_LIMIT
from lwepp.pipeline import ROLES
from lwepp.plugins.saturation import SATURATION, Watching, parse_duration
from plugin_api import ConfigError, Factory, Params, build
from plugin_api.document import Document, keys_of

GATE: Final = "flowControl"
SECTIONS: Final = ("flowControl", "saturationDetector")
"""The top-level fields this module decodes."""
DEFAULTS: Final = {
    FAIRNESS: "global-strict-fairness-policy",
    ORDERING: "fcfs-ordering-policy",
    USAGE_LIMIT: "static-usage-limit-policy",
    SATURATION: "utilization-detector",
}
"""What each reference is when unset: the router's defaults (made if not listed)."""

_QUANTITY: Final = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SCALE: Final = {
    None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """The section, decoded: the gate, the detector, and (gate on) the controller's settings.

    ``uses``: the plugins the section names (they run where it says, not idle).
    """

    gate: bool = False
    detector: Any | None = None
    settings: Settings | None = None
    uses: frozenset[str] = frozenset()


OFF: Final = FlowConfig()
"""No section, the gate off."""


def gate_on(gates: Sequence[Any]) -> bool:
    """Whether ``featureGates`` turns ``flowControl`` on (``name``, ``name=true``; the last wins;
    ``lwepp.router_compat`` reports malformed entries)."""
    on = False
    for gate in gates:
        if isinstance(gate, str):
            name, sep, value = gate.partition("=")
            if name.strip() == GATE:
                on = not sep or value.strip().lower() in ("1", "t", "true")
    return on


def quantity(params: Params, name: str) -> int:
    """A Kubernetes quantity (``5000``, ``1G``, ``512Mi``) as a whole number; 0 when unset."""
    value = params.get(name, object, 0)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise params.error(name, f"expected a quantity (5000, 1G, 512Mi), got {value!r}")
    return int(float(match.group(1)) * _SCALE[match.group(2)])


def ttl(params: Params, name: str, default: float) -> float:
    """A Go duration (``60s``, ``1m30s``; ``0s`` for none) in seconds."""
    text = params.get(name, str, "")
    if not text:
        return default
    seconds = parse_duration(text)
    if seconds is None:
        raise params.error(name, f"expected a duration (60s, 1m30s, 0s), got {text!r}")
    return seconds


class _Section:
    """Decodes the section against the file's plugins, adding the defaults it names."""

    def __init__(
        self,
        document: Document,
        plugins: list[Configured],
        named: Mapping[str, str],
        registry: Mapping[str, Factory],
        *,
        adding: bool,
    ) -> None:
        self.document, self.plugins, self.named, self.registry = document, plugins, named, registry
        self.adding = adding
        """Whether a default made is added to the file's plugins (only when it will run)."""
        self.uses: set[str] = set()

    def resolve(self, params: Params, field: str, word: str) -> Any:
        """The plugin ``params[field]`` names, which must provide ``word`` (unset: the default)."""
        ref = params.get(field, str, "") or DEFAULTS[word]
        where = params.path_of(field)
        found = self.find(ref)
        if found is None and ref in self.named:  # listed, but Switchyard ignores its type
            self.document.warn(
                keys_of(where), f"{where}: {ref!r} is ignored here: {DEFAULTS[word]}"
            )
            ref = DEFAULTS[word]
            found = self.find(ref)
        if found is None and ref != DEFAULTS[word]:
            raise params.error(field, f"{ref!r} names no plugin")
        found = found or self.default(word)
        if word not in provides(found.plugin):
            raise params.error(field, f"{ref!r} is a {found.type}, which is no {word}")
        self.uses.add(found.name)
        return found.plugin

    def find(self, name: str) -> Configured | None:
        return next((p for p in self.plugins if p.name == name), None)

    def default(self, word: str) -> Configured:
        """The router's default for ``word``: the file's plugin of that name, else one made."""
        kind = DEFAULTS[word]
        found = self.find(kind)
        if found is None:
            made = build(kind, kind, None, self.registry, ROLES)
            found = Configured(kind, kind, made.plugin, made.roles, "flowControl")
            if self.adding:
                self.plugins.append(found)
                self.uses.add(kind)
        return found

    def band(self, params: Params, *, template: bool = False) -> BandSpec:
        priority = params.get("priority", int, 0) if template else params.require("priority", int)
        spec = BandSpec(
            priority,
            self.resolve(params, "fairnessPolicyRef", FAIRNESS),
            self.resolve(params, "orderingPolicyRef", ORDERING),
            quantity(params, "maxRequests") or BAND_MAX_REQUESTS,
            quantity(params, "maxBytes") or BAND_MAX_BYTES,
        )
        params.done()
        return spec

    def detector(self, flow: Params, legacy: Params | None, gate: bool) -> Any | None:
        """``flowControl.saturationDetector``, else the deprecated top-level one, else (gate
        on) the default."""
        if "saturationDetector" in flow:
            return self.detector_at(_entry(flow, "saturationDetector"))
        if legacy is not None:
            self.document.warn(
                ["saturationDetector"],
                "saturationDetector: deprecated: use flowControl.saturationDetector",
            )
            return self.detector_at(legacy)
        return self.default(SATURATION).plugin if gate else None

    def detector_at(self, params: Params) -> Any:
        found = self.resolve(params, "pluginRef", SATURATION)
        params.done()
        return found


def decode(
    document: Document,
    sections: Mapping[str, Any],
    gates: Sequence[Any],
    plugins: list[Configured],
    named: Mapping[str, str],
    registry: Mapping[str, Factory],
) -> FlowConfig:
    """The section in ``sections`` (the top-level fields ``SECTIONS`` names), checked against
    ``plugins`` (to which the defaults it names are added) and ``named`` (every plugin name
    of the file, built or not); problems go to ``document``."""
    raw, legacy_raw = sections.get("flowControl"), sections.get("saturationDetector")
    gate = gate_on(gates)
    section = _Section(document, plugins, named, registry, adding=gate)
    try:
        flow = Params(raw or {}, "", path="flowControl")
        legacy = Params(legacy_raw, "", path="saturationDetector") if legacy_raw else None
        detector = section.detector(flow, legacy, gate)
        default_ttl = ttl(flow, "defaultRequestTTL", DEFAULT_TTL)
        settings = Settings(
            detector=detector,
            template=section.band(_entry(flow, "defaultPriorityBand"), template=True),
            negative=(
                section.band(_entry(flow, "defaultNegativePriorityBand"), template=True)
                if "defaultNegativePriorityBand" in flow
                else None
            ),
            bands=tuple(section.band(entry) for entry in flow.entries("priorityBands")),
            usage_limit=section.resolve(flow, "usageLimitPolicyPluginRef", USAGE_LIMIT),
            max_requests=quantity(flow, "maxRequests"),
            max_bytes=quantity(flow, "maxBytes"),
            ttl=default_ttl,
            no_endpoint_ttl=ttl(flow, "noEndpointRequestTTL", default_ttl),
        )
        if flow.get("enableEviction", bool, False):
            document.warn(
                ["flowControl", "enableEviction"],
                "flowControl.enableEviction: ignored: in-flight eviction is not implemented",
            )
        flow.done()
        priorities = [band.priority for band in settings.bands]
        if repeated := sorted({p for p in priorities if priorities.count(p) > 1}):
            raise ConfigError(
                f"flowControl.priorityBands: priority {repeated[0]} is configured twice",
                "flowControl.priorityBands",
            )
    except ConfigError as error:
        document.error(keys_of(error.field or "flowControl"), str(error))
        return FlowConfig(gate)
    if not gate and set(raw or {}) - {"saturationDetector"}:
        document.warn(
            ["flowControl"],
            "flowControl: the flowControl feature gate is off: its settings but "
            "saturationDetector are ignored (featureGates: [flowControl] turns it on)",
        )
    return FlowConfig(gate, detector, settings if gate else None, frozenset(section.uses))


def _entry(params: Params, name: str) -> Params:
    return params.entry(name, params.get(name, dict, {}))


def watching(flow: FlowConfig, running: Sequence[Configured]) -> list[Configured]:
    """The detector, when the profile does not list it, as the pipeline must still see it: no
    filter, but what it reads measured and its body parsed (``Watching``)."""
    detector = flow.detector
    if detector is None or any(p.plugin is detector for p in running):
        return []
    return [Configured(detector.name, "", Watching(detector), (), "flowControl")]


def describe(flow: FlowConfig) -> list[str]:
    """The section as ``--check-config`` prints it."""
    detector = getattr(flow.detector, "name", None)
    if flow.settings is None:
        rule = (
            "sheddable requests refused while it reads 1.0"
            if detector
            else "flow control refuses nothing (the admit_request stage may)"
        )
        return [f"  gate off: {rule}" + (f" (detector {detector})" if detector else "")]
    s = flow.settings
    limits = (
        f"at most {s.max_requests} requests" if s.max_requests else "no request limit",
        f"{s.max_bytes} bytes" if s.max_bytes else "no byte limit",
    )
    budget = f"{s.ttl:g} s ({s.no_endpoint_ttl:g} s with no endpoint)"
    lines = [
        f"  gate on: detector {detector}, usage limit {s.usage_limit.name}",
        f"  in all: {limits[0]}, {limits[1]}; queue-wait budget {budget}",
    ]
    for label, band in [
        *((f"band {b.priority}", b) for b in s.bands),
        ("other priorities", s.template),
        *([("other negative", s.negative)] if s.negative is not None else []),
    ]:
        lines.append(
            f"  {label}: {band.max_requests} requests, {band.max_bytes} bytes; "
            f"{band.fairness.name}, {band.ordering.name}"
        )
    return lines
