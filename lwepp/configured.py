"""One plugin as a configuration file built it: what ``lwepp.config`` and the sections it decodes
(``lwepp.flowcontrol.config``) pass around."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugin_api import Role


@dataclass(frozen=True, slots=True)
class Configured:
    """One plugin as the file configures it, the roles it plays, and where (``plugins[i]``)."""

    name: str
    type: str
    plugin: Any
    roles: tuple[Role, ...]
    path: str

    @property
    def subject(self) -> str:
        return f"plugin {self.name!r} ({self.type})"


def provides(plugin: Any) -> frozenset[str]:
    """What a plugin (or a plugin class) provides to those that name it."""
    provided: frozenset[str] = getattr(plugin, "provides", frozenset())
    return provided
