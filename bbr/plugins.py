"""Plugins: the request and response contracts, the chain that runs them, and the built-ins.

BBR's plugins follow the vocabulary both services share (``plugin_api``): a
plugin is any object with a ``name`` and ``process_request`` (it joins the
request chain), ``process_response`` (the response chain), or both; its class
is its own factory, ``Class(name, params)``; ``needs_body = True`` says it
reads the parsed body. ``PLUGINS`` maps the built-in types to their classes;
a type with a dot in it, ``package.module.Class``, is imported from that path.
Nothing registers itself on import. What BBR gives its plugins (GIE's
factories take a ``Handle`` for the same reason) is its metrics:
``params.service(BBRMetrics)``.

Default chain (no ``--plugin``): ``body-field-to-header/model-extractor``
(body ``model`` → ``X-Gateway-Model-Name``) only. The payload processor also
runs ``base-model-to-header`` by default, fed by the ConfigMaps it watches;
here it runs when configured, fed by a parameter, or by ConfigMaps
(``bbr.base_models``, which the assembly attaches: the core stays free of
Kubernetes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final, Protocol, final

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bbr.message import Message, check_name
from plugin_api import NO_PARAMS, ConfigError, Factory, Params, Role, build, needs_body
from serving.build import build_info
from wire.exchange import Refusal
from wire.extproc import Phase

MODEL_HEADER: Final = "X-Gateway-Model-Name"
BASE_MODEL_HEADER: Final = "X-Gateway-Base-Model-Name"


# --- the contracts ---------------------------------------------------------------


class RequestPlugin(Protocol):
    """A step of the request chain (GIE's ``RequestProcessor``).

    ``needs_body = True`` (optional, default False) says ``process_request``
    reads ``message.body``: if any plugin of a chain says so, BBR parses the
    body once, before the chain runs, and answers 400 when it is not a JSON
    object. If none does, the body is never parsed.
    """

    name: str

    def process_request(self, message: Message) -> bytes | None:
        """Look at one request; record header changes; maybe replace the body.

        Called once per request, when the whole body has arrived, in chain
        order, synchronously: do no I/O here.

        Args:
            message: the request. ``message.headers`` are the client's,
                ``message.body`` the parsed JSON object shared by every plugin:
                both read-only (a change raises ``TypeError``).
                ``message.set_header``/``remove_header`` record header changes.

        Returns:
            None to leave the body alone, or the complete new body, for
            instance ``orjson.dumps(changed)`` where ``changed`` started as
            ``message.body_copy()``. Later plugins see the new body; Envoy
            receives it with a matching Content-Length.

        Raises:
            wire.exchange.Refusal: stop the chain and answer the client with
                its status and text instead of forwarding the request.
            Exception: any other error is a bug: it is logged with the request
                id and answered 500; the stream still ends cleanly.
        """
        ...


class ResponsePlugin(Protocol):
    """A step of the response chain (GIE's ``ResponseProcessor``).

    ``needs_body`` as for ``RequestPlugin``, but a response that is not a JSON
    object is no error: the chain is skipped and the response passes unchanged
    (SSE streams, for one).
    """

    name: str

    def process_response(self, message: Message) -> bytes | None:
        """Look at one response; record header changes; maybe replace the body.

        Called once per response, when its whole body has arrived, and only
        if the body is a JSON object (when the chain parses it).

        Args:
            message: the response, as for ``RequestPlugin.process_request``;
                ``message.headers`` are the response headers.

        Returns:
            None, or the complete new response body.

        Raises:
            wire.exchange.Refusal: answer the client with that status instead.
            Exception: logged with the request id and answered 500.
        """
        ...


# --- metrics ---------------------------------------------------------------------


class Twins:
    """One family recorded under two names (or one of its children): the payload processor
    renamed its ``bbr_*`` series ``ipp_*`` (``pkg/metrics/metrics.go``, subsystem ``ipp``), and
    dashboards of either kind read BBR's until the old names are gone everywhere."""

    __slots__ = ("both",)

    def __init__(self, *both: Any) -> None:
        self.both = both

    def labels(self, *values: str, **named: str) -> Twins:
        return Twins(*(family.labels(*values, **named) for family in self.both))

    def inc(self) -> None:
        for series in self.both:
            series.inc()

    def observe(self, value: float) -> None:
        for series in self.both:
            series.observe(value)


@final
class BBRMetrics:
    """BBR's Prometheus metrics, on the registry the caller passes, under the payload
    processor's names, old and new: ``bbr_success_total`` and ``ipp_success_total``,
    ``{bbr,ipp}_body_field_not_found_total{field}``, ``{bbr,ipp}_body_field_empty_total{field}``,
    ``{bbr,ipp}_plugin_duration_seconds{extension_point,plugin_type,plugin_name}``,
    ``{bbr,ipp}_info{commit,build_ref}``; and Switchyard's ``bbr_requests_total`` and
    ``bbr_errors_total{reason}``. (The payload processor's model-selection series,
    ``ipp_model_selector_*``, ``ipp_request_ttft_seconds`` and ``ipp_model_avg_*``, have
    nothing to count here: BBR selects no model.)"""

    DURATION_BUCKETS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
    PREFIXES: Final = ("bbr", "ipp")

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry)

        def twins(name: str, documentation: str, *labels: str) -> Twins:
            return Twins(*(counter(f"{p}_{name}", documentation, *labels) for p in self.PREFIXES))

        self.registry: Final = registry
        self.requests: Final = counter("bbr_requests", "ext_proc streams")
        self.success: Final = twins("success", "request bodies through the whole chain")
        self.errors: Final = counter("bbr_errors", "requests refused, by code", "reason")
        self.body_field_not_found: Final = twins(
            "body_field_not_found", "bodies without the field", "field"
        )
        self.body_field_empty: Final = twins(
            "body_field_empty", "bodies whose field renders empty", "field"
        )
        self.plugin_duration: Final = Twins(
            *(
                Histogram(
                    f"{prefix}_plugin_duration_seconds",
                    "time spent in each plugin",
                    ["extension_point", "plugin_type", "plugin_name"],
                    buckets=self.DURATION_BUCKETS,
                    registry=registry,
                )
                for prefix in self.PREFIXES
            )
        )
        # The build gauge; with --workers, one series however many run.
        for prefix in self.PREFIXES:
            Gauge(
                f"{prefix}_info",
                "General information of the current build of BBR.",
                ["commit", "build_ref"],
                registry=registry,
                multiprocess_mode="livemax",
            ).labels(*build_info()).set(1)


# --- the chain -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One configured plugin in a chain: its hook, and where its time is recorded."""

    type: str
    name: str
    needs_body: bool
    hook: Callable[[Message], bytes | None]
    duration: Any  # the plugin's child of bbr_plugin_duration_seconds

    def __str__(self) -> str:
        return f"{self.name!r} (type {self.type})"


@final
class Chain:
    """The plugins of one extension point, run in list order."""

    __slots__ = ("needs_body", "point", "steps")

    def __init__(self, point: Phase, steps: Sequence[Step] = ()) -> None:
        self.point: Final = point
        self.steps: Final = tuple(steps)
        self.needs_body: Final = any(step.needs_body for step in self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def run(self, message: Message) -> None:
        """Run every plugin on ``message``; a new body replaces the old for the next ones.

        An exception leaves the chain at once (GIE: the first error aborts);
        it gains a note naming the plugin, for the log and the 500 answer.
        """
        for step in self.steps:
            started = time.perf_counter()
            try:
                new_body = step.hook(message)
            except Exception as error:
                error.add_note(f"{type(error).__name__} in {self.point} plugin {step}")
                raise
            finally:
                step.duration.observe(time.perf_counter() - started)
            if new_body is not None:
                message.replace_body(new_body)


# --- configuration ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One ``--plugin type:name[:json]``: what to make, what to call it, its parameters."""

    type: str
    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_flag(cls, flag: str) -> PluginSpec:
        """Parse ``type:name[:json]``: split on the first two colons, as GIE does."""
        parts = flag.split(":", 2)
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise ConfigError(f"{flag!r}: expected type:name[:json], both non-empty")
        parameters: Any = {}
        if len(parts) == 3:
            try:
                parameters = orjson.loads(parts[2])
            except orjson.JSONDecodeError as error:
                raise ConfigError(f"{flag!r}: parameters are not JSON: {error}") from None
            if not isinstance(parameters, dict):
                raise ConfigError(f"{flag!r}: parameters must be a JSON object")
        return cls(parts[0], parts[1], parameters)


DEFAULT_PLUGINS: Final = (
    PluginSpec(
        "body-field-to-header",
        "model-extractor",
        {"fieldName": "model", "headerName": MODEL_HEADER},
    ),
)


CHAINS: Final = (Role.REQUEST, Role.RESPONSE)

Chains = Callable[[BBRMetrics, list[object]], tuple[Chain, Chain]]
"""Makes the two chains, given what BBR hands its plugins and a list to append each plugin
made to (``bbr.config.PayloadConfig.chains``)."""


def build_chains(
    specs: Sequence[PluginSpec],
    metrics: BBRMetrics,
    registry: Mapping[str, Factory] | None = None,
    made_plugins: list[object] | None = None,
) -> tuple[Chain, Chain]:
    """Make each configured plugin and place it in the request chain, the response chain, or both
    (and, given ``made_plugins``, append it there).

    Raises ``ConfigError`` naming the plugin for an unknown type, a path that
    does not import, bad parameters, or an object that is no plugin.
    """
    steps: dict[Role, list[Step]] = {role: [] for role in CHAINS}
    for spec in specs:
        made = build(spec.type, spec.name, spec.parameters, registry or PLUGINS, CHAINS, metrics)
        if made_plugins is not None:
            made_plugins.append(made.plugin)
        for role in made.roles:
            point: Phase = "request" if role is Role.REQUEST else "response"
            duration = metrics.plugin_duration.labels(point, spec.type, spec.name)
            hook = getattr(made.plugin, role.value)
            steps[role].append(Step(spec.type, spec.name, needs_body(made.plugin), hook, duration))
    return Chain("request", steps[Role.REQUEST]), Chain("response", steps[Role.RESPONSE])


# --- built-in plugins ------------------------------------------------------------


def go_format(value: Any) -> str:
    """``value`` from a JSON parse as Go's ``fmt.Sprintf("%v", value)`` prints it.

    GIE decodes the body into ``map[string]any``, where every JSON number is a
    float64, and renders a field with ``%v``: ``7`` → ``"7"``, ``1e6`` →
    ``"1e+06"``, ``true`` → ``"true"``, ``null`` → ``"<nil>"``, arrays as
    ``[a b]``, objects as ``map[k:v]`` with sorted keys.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<nil>"
    if isinstance(value, int | float):
        return _go_float(float(value))
    if isinstance(value, Mapping):
        return "map[" + " ".join(f"{k}:{go_format(value[k])}" for k in sorted(value)) + "]"
    return "[" + " ".join(go_format(item) for item in value) + "]"


def _go_float(number: float) -> str:
    """Go's ``strconv.FormatFloat(number, 'g', -1, 64)``: shortest digits, then %e or %f.

    The shortest digits that read back as the same float are the same in
    Python's ``repr`` and Go. Go then prints ``d.ddde±XX`` when the decimal
    exponent is below -4 or at least 6 (the precision it assumes for the
    shortest form), and plain decimals otherwise.
    """
    if number == 0:
        return "-0" if math.copysign(1.0, number) < 0 else "0"
    shortest = Decimal(repr(number)).normalize()
    sign, digits, exponent = shortest.as_tuple()
    point = len(digits) + int(exponent) - 1  # the first digit's power of ten (finite: JSON)
    if point < -4 or point >= 6:
        text = "".join(map(str, digits))
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{'-' if point < 0 else '+'}{abs(point):02d}"
    return f"{shortest:f}"


@final
class BodyFieldToHeader:
    """Copy one top-level body field into a request header (GIE's ``body-field-to-header``).

    Parameters: ``fieldName`` and ``headerName``, both required, non-empty.
    The value is rendered like Go's ``%v``. An absent field is counted in
    ``bbr_body_field_not_found_total`` and one that renders empty in
    ``bbr_body_field_empty_total``; either way the header is left alone and
    the request goes on. A value no header can carry (CR, LF, too long) is
    the client's mistake: 400, naming the field.
    """

    needs_body = True

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.field: Final = params.require("fieldName", str)
        self.header: Final = params.require("headerName", str)
        for key, value in (("fieldName", self.field), ("headerName", self.header)):
            if not value:
                raise params.error(key, "must not be empty")
        try:
            check_name(self.header)
        except ValueError as error:
            raise params.error("headerName", str(error)) from None
        metrics = params.service(BBRMetrics)
        self._not_found = metrics.body_field_not_found.labels(field=self.field)
        self._empty = metrics.body_field_empty.labels(field=self.field)

    def process_request(self, message: Message) -> None:
        body = message.body
        if self.field not in body:
            self._not_found.inc()
            return
        value = go_format(body[self.field])
        if not value:
            self._empty.inc()
            return
        try:
            message.set_header(self.header, value)
        except Refusal as refusal:
            raise Refusal(refusal.status, f"body field {self.field!r}: {refusal.message}") from None


@final
class BaseModelToHeader:
    """Name the base model behind the requested one (GIE's ``base-model-to-header``).

    Reads the body's ``model`` (rendered like Go's ``%v``, trimmed) and sets
    ``X-Gateway-Base-Model-Name``: the adapter's base model, the model itself
    if it is a base model, else ``""`` — always set when ``model`` is present,
    so routes can match the base model exactly. Without ``model`` it does
    nothing.

    The mapping, ``base_of``, is replaced whole when it changes. It is the
    parameter ``baseModels``, fixed at start::

        {"baseModels": {"llama-3": ["llama-3-sql-lora", "llama-3-chat-lora"]}}

    or, as the payload processor learns it, ConfigMaps (keys ``baseModel`` and
    ``adapters``): those of the parameter ``configMapFile``, re-read when the
    file changes, or, with neither parameter, those labelled
    ``inference.llm-d.ai/ipp-managed: "true"`` in the cluster, watched live
    (``bbr.base_models.feed``).
    """

    needs_body = True

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.config_map_file: Final = params.get("configMapFile", str, "")
        """The file of ConfigMaps to read the mapping from ("": none)."""
        self.fixed: Final = "baseModels" in params
        """Whether the mapping is the ``baseModels`` parameter."""
        if self.fixed and self.config_map_file:
            raise params.error("configMapFile", "give baseModels or configMapFile, not both")
        fixed: dict[str, str] = {}
        for base, adapters in params.get("baseModels", dict, {}).items():
            if not base.strip():
                raise params.error("baseModels", "has an empty base model")
            if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
                raise params.error(f"baseModels.{base}", "must be a list of strings")
            fixed.setdefault(base.strip(), base.strip())
            for adapter in filter(None, (a.strip() for a in adapters)):
                if fixed.setdefault(adapter, base.strip()) != base.strip():
                    raise params.error("baseModels", f"adapter {adapter!r} has two base models")
        self.base_of: Mapping[str, str] = fixed

    def process_request(self, message: Message) -> None:
        if "model" in message.body:
            model = go_format(message.body["model"]).strip()
            message.set_header(BASE_MODEL_HEADER, self.base_of.get(model, ""))


PLUGINS: Final[Mapping[str, Factory]] = {
    "body-field-to-header": BodyFieldToHeader,
    "base-model-to-header": BaseModelToHeader,
}
"""The built-in plugin types and their factories; the only registry."""
