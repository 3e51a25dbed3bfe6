"""Strict decoding of a plugin's ``parameters``: wrong types and unknown fields are errors.

Every error names the plugin and the field, so a bad configuration file is
fixed from the message alone::

    params = Params("prefix-cache-scorer/prefix", raw)
    block = params.get("blockSizeTokens", int, 16)
    params.done()          # raises if raw held a field nobody asked for
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration the picker cannot use; the message says where and why."""


class Params:
    """One plugin's parameters, read field by field with type checks."""

    def __init__(self, plugin: str, raw: Mapping[str, Any] | None) -> None:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"plugin {plugin}: parameters: expected a mapping")
        self.plugin = plugin
        self._raw: Mapping[str, Any] = raw or {}
        self._used: set[str] = set()

    def _check(self, name: str, value: Any, kind: type[T]) -> T:
        # YAML gives ints where floats are meant ("weight: 2"); bools are not numbers.
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # type: ignore[return-value]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(
                f"plugin {self.plugin}: parameters.{name}: expected {kind.__name__}, "
                f"got {type(value).__name__} {value!r}"
            )
        return value

    def get(self, name: str, kind: type[T], default: T) -> T:
        """The field's value, or ``default`` when absent."""
        self._used.add(name)
        return default if name not in self._raw else self._check(name, self._raw[name], kind)

    def require(self, name: str, kind: type[T]) -> T:
        """The field's value; absent is an error."""
        self._used.add(name)
        if name not in self._raw:
            raise ConfigError(f"plugin {self.plugin}: parameters.{name}: required")
        return self._check(name, self._raw[name], kind)

    def error(self, name: str, message: str) -> ConfigError:
        """An error about field ``name`` (for checks beyond the type: ranges, formats)."""
        return ConfigError(f"plugin {self.plugin}: parameters.{name}: {message}")

    def done(self) -> None:
        """Refuse fields no one read: a typo must not be silently ignored."""
        unknown = sorted(set(self._raw) - self._used)
        if unknown:
            raise ConfigError(f"plugin {self.plugin}: parameters: unknown field {unknown[0]!r}")
