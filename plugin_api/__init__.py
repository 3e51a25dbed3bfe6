"""What a plugin is, for both services: its roles, its parameters, and how configuration builds it.

BBR and LWEPP both run plugins that configuration names by type (BBR:
``--plugin type:name:{json}``; LWEPP: an ``EndpointPickerConfig`` file), and
they share these words for them:

- **A plugin** is any object with a ``name`` (the configured instance name)
  and the methods of its roles. No base class, no registration.
- **Its class is its own factory**: ``Class(name, params)``. A built-in type
  is a key of the service's registry (one dict, written out by hand); any
  other type is a dotted path, ``package.module.Class``, imported when the
  configuration is loaded.
- **Its roles** are the methods it has (``Role``): a plugin with
  ``process_request`` joins BBR's request chain; one with ``filter`` and
  ``picked`` is both an LWEPP filter and a picked hook. Nothing else is
  consulted.
- **``needs_body``** (default False): the plugin reads the request body.
  Only then does a service parse it, once, for all its plugins.
- **``reads``** (LWEPP, default empty): the endpoint attributes it uses.
- **``provides``** (LWEPP, default empty): what it gives the plugins that
  name it (``lwepp.contracts.Want``); a plugin that only provides plays no
  role, and is still a plugin.
- **``params``** (``Params``) are decoded strictly: every field read with its
  type, and ``build`` refuses any field the plugin did not read, so a typo
  fails at start instead of being ignored.

Every problem is a ``ConfigError`` naming the plugin and the field.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which plugin and what is wrong.

    ``field`` is the path of the field at fault when there is one
    (``parameters.blockSizeTokens``, ``plugins[2].type``), so a file's
    decoder can point at its line.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Role(enum.Enum):
    """What a plugin can do; each role is one method, named by the member's value.

    The LWEPP members are the picker's stages, in the order one request meets
    them (data sources run beside requests, in the background).
    """

    REQUEST = "process_request"
    """BBR: a step of the request chain."""
    RESPONSE = "process_response"
    """BBR: a step of the response chain."""
    SOURCE = "run"
    """LWEPP: collects endpoint attributes in the background (``produces`` says which)."""
    PREPARE = "prepare"
    ADMIT = "admit_request"
    """LWEPP: may refuse the request before any filter runs (the router's Admitter)."""
    FILTER = "filter"
    SCORE = "score"
    PICK = "pick"
    PICKED = "picked"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE_CHUNK = "response_chunk"
    RESPONSE_COMPLETE = "response_complete"

    # Members are singletons compared by identity, so identity is their hash: Enum's own
    # hashes the name in Python, and the pipeline looks a role up on every plugin call.
    __hash__ = object.__hash__

    @property
    def label(self) -> str:
        """What a plugin in this role is called: ``scorer``, ``picked hook``, ``data source``..."""
        return _LABELS[self]


_LABELS: Final = {
    Role.REQUEST: "request step",
    Role.RESPONSE: "response step",
    Role.SOURCE: "data source",
    Role.PREPARE: "prepare hook",
    Role.ADMIT: "admitter",
    Role.FILTER: "filter",
    Role.SCORE: "scorer",
    Role.PICK: "picker",
    Role.PICKED: "picked hook",
    Role.RESPONSE_HEADERS: "response headers hook",
    Role.RESPONSE_CHUNK: "response chunk hook",
    Role.RESPONSE_COMPLETE: "response complete hook",
}


def roles_of(plugin: object, among: Collection[Role]) -> tuple[Role, ...]:
    """The roles in ``among`` whose method ``plugin`` has, in ``Role`` order."""
    return tuple(
        role for role in Role if role in among and callable(getattr(plugin, role.value, None))
    )


def needs_body(plugin: object) -> bool:
    """Whether ``plugin`` reads the request body (its ``needs_body``; absent means no)."""
    return getattr(plugin, "needs_body", False) is True


class Params:
    """A mapping from configuration, read field by field with type checks.

    ::

        def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
            self.block = params.get("blockSizeTokens", int, 16, at_least=1)

    Errors say what was read and where: ``subject`` (``plugin 'prefix'
    (prefix-cache-scorer)``), then the field's ``path`` in the document
    (``parameters.blockSizeTokens``), which ``ConfigError.field`` carries too.
    An object inside (a list entry, say) is read the same way through
    ``entry``. ``host`` is what the hosting service hands its plugins (BBR:
    its metrics); a plugin asks for it by type with ``service``.
    """

    __slots__ = ("_raw", "_used", "host", "path", "subject")

    def __init__(
        self,
        raw: Any = None,
        subject: str = "plugin",
        host: object = None,
        path: str = "parameters",
    ) -> None:
        self.subject, self.host, self.path = subject, host, path
        if raw is not None and not isinstance(raw, Mapping):
            raise self._error(path, f"expected a mapping, got {_kind(raw)}")
        self._raw: Mapping[str, Any] = raw or {}
        self._used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._raw

    def get(
        self,
        name: str,
        kind: type[T],
        default: T,
        *,
        above: float | None = None,
        at_least: float | None = None,
    ) -> T:
        """The field's value, or ``default`` when absent; a number may be bounded below."""
        if not self._raw:  # the common case; and NO_PARAMS, shared, is never written to
            return default
        self._used.add(name)
        if name not in self._raw:
            return default
        return self._check(name, kind, above, at_least)

    def require(self, name: str, kind: type[T]) -> T:
        """The field's value; absent is an error."""
        self._used.add(name)
        if name not in self._raw:
            raise self.error(name, "required")
        return self._check(name, kind, None, None)

    def entry(self, name: str, raw: Any) -> Params:
        """The fields of an object inside this one (``raw``), at ``<path>.<name>``."""
        return Params(raw, self.subject, self.host, self.path_of(name))

    def entries(self, name: str) -> list[Params]:
        """Each object of the list in field ``name`` (absent: none), as ``name[i]``."""
        return [self.entry(f"{name}[{i}]", raw) for i, raw in enumerate(self.get(name, list, []))]

    def _check(self, name: str, kind: type[T], above: float | None, at_least: float | None) -> T:
        given = value = self._raw[name]
        # YAML and JSON give ints where floats are meant ("weight: 2"); bools are not numbers.
        if kind is float and type(value) is int:
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise self.error(name, f"expected {kind.__name__}, got {_kind(value)}")
        number = cast(float, value)  # bounds are given for numbers only
        if above is not None and not number > above:
            raise self.error(name, f"must be > {above:g}, got {given}")
        if at_least is not None and not number >= at_least:
            raise self.error(name, f"must be >= {at_least:g}, got {given}")
        return value

    def error(self, name: str, message: str) -> ConfigError:
        """An error about field ``name`` (for checks beyond the type: ranges, formats)."""
        return self._error(self.path_of(name), message)

    def path_of(self, name: str) -> str:
        """Where field ``name`` is in the document: ``<path>.<name>``."""
        return f"{self.path}.{name}" if self.path else name

    def _error(self, field: str, message: str) -> ConfigError:
        text = f"{field}: {message}" if field else message
        return ConfigError(f"{self.subject}: {text}" if self.subject else text, field)

    def service(self, kind: type[T]) -> T:
        """What the hosting service provides, which must be a ``kind``."""
        if not isinstance(self.host, kind):
            raise ConfigError(f"{self.subject}: runs only where a {kind.__name__} is given")
        return self.host

    def done(self) -> None:
        """Refuse fields no one read: a typo must not be silently ignored."""
        if unknown := sorted(set(self._raw) - self._used):
            known = ", ".join(sorted(self._used)) or "none"
            message = f"unknown field {unknown[0]!r} (known: {known})"
            error = self._error(self.path, message)
            raise ConfigError(str(error), self.path_of(unknown[0]))


def _kind(value: Any) -> str:
    """What a decoded value is, for messages: ``str 'x'``, ``a list``..."""
    if isinstance(value, Mapping | list):
        return "a mapping" if isinstance(value, Mapping) else "a list"
    return f"{type(value).__name__} {value!r}"


NO_PARAMS: Final = Params()
"""No parameters: every field at its default (reading it records nothing)."""

Factory = Callable[[str, Params], Any]
"""Makes one plugin from its name and parameters: a plugin class, usually."""


@dataclass(frozen=True, slots=True)
class Built:
    """A plugin made from configuration, and the roles it plays."""

    plugin: Any
    roles: tuple[Role, ...]


def load(path: str) -> Factory:
    """The object at a dotted path: the longest importable module, then its attributes.

    Raises ``ConfigError``; a module that exists but fails to import names
    what it was missing.
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:split])
        try:
            target: Any = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module and not module.startswith(f"{error.name}."):
                raise ConfigError(f"cannot load {path!r}: {error}") from None
            continue
        try:
            for attribute in parts[split:]:
                target = getattr(target, attribute)
        except AttributeError as error:
            raise ConfigError(f"cannot load {path!r}: {error}") from None
        if not callable(target):
            raise ConfigError(f"cannot load {path!r}: not a class or function")
        factory: Factory = target
        return factory
    raise ConfigError(f"cannot load {path!r}: no module named {parts[0]!r}")


def build(
    kind: str,
    name: str,
    parameters: Any,
    registry: Mapping[str, Factory],
    roles: Collection[Role],
    host: object = None,
) -> Built:
    """Make plugin ``name`` of type ``kind`` and check it can play one of ``roles``.

    ``kind`` is a key of ``registry`` or a dotted path. Raises ``ConfigError``
    for an unknown type, a path that does not load, bad or unread parameters,
    a factory that fails, or an object that is no plugin here; its ``field``
    is ``type`` or ``parameters.<name>`` when one of them is at fault.
    """
    where = f"plugin {name!r} ({kind})"
    if "." in kind:
        try:
            factory = load(kind)
        except ConfigError as error:
            raise ConfigError(f"{where}: type: {error}", "type") from None
    elif kind in registry:
        factory = registry[kind]
    else:
        raise ConfigError(
            f"{where}: type: unknown (built-in: {', '.join(sorted(registry))}; "
            "or a dotted path package.module.Class to a plugin of your own)",
            "type",
        )
    params = Params(parameters, where, host)
    try:
        plugin = factory(name, params)
        params.done()  # whatever the factory did, an unread parameter is an error
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"{where}: cannot be built: {type(error).__name__}: {error}") from error
    played = roles_of(plugin, roles)
    problems = []
    if getattr(plugin, "name", None) != name:
        problems.append(f"its name is {getattr(plugin, 'name', None)!r}, not {name!r}")
    provides: object = getattr(plugin, "provides", frozenset())
    if not played and not provides:
        methods = ", ".join(role.value for role in Role if role in roles)
        problems.append(f"{type(plugin).__name__} is no plugin here: it has none of {methods}")
    if not isinstance(provides, frozenset):
        problems.append("provides: expected a frozenset of what it provides to other plugins")
    if not isinstance(getattr(plugin, "needs_body", False), bool):
        problems.append("needs_body: expected a bool")
    if not isinstance(getattr(plugin, "reads", frozenset()), frozenset):
        problems.append("reads: expected a frozenset of attribute names")
    if Role.SOURCE in played and not isinstance(getattr(plugin, "produces", None), frozenset):
        problems.append("produces: expected a frozenset of the attributes a data source writes")
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)}")
    return Built(plugin, played)
