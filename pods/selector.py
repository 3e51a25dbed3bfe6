"""Kubernetes label selectors in their string form: ``app=vllm,tier in (a,b),!canary``.

What ``kubectl get -l`` and apimachinery's ``labels.Parse`` read, and what the
llm-d router's ``--endpoint-selector`` takes. Requirements are separated by
commas (a comma inside parentheses belongs to the value set) and all must
hold:

==================  ==========================================================
``key=v``, ``key==v``   the label is present and equals ``v``
``key!=v``              absent, or present with another value
``key in (a,b)``        present, with one of the values
``key notin (a,b)``     absent, or present with none of them
``key``                 present, any value
``!key``                absent
``key>5``, ``key<5``    present, an integer, greater (less) than the number
==================  ==========================================================

The empty selector selects everything. Keys and values follow Kubernetes'
syntax (a key is ``[prefix/]name``, names at most 63 characters of letters,
digits, ``-``, ``_`` and ``.``, starting and ending with a letter or digit);
anything else is refused with a message naming the requirement.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

_NAME: Final = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY: Final = re.compile(rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}")
_VALUE: Final = re.compile(rf"(?:{_NAME})?")
_TOKEN: Final = r"[^\s=!<>(),]+"
_FORMS: Final = (
    ("!", re.compile(rf"!\s*(?P<key>{_TOKEN})")),
    ("set", re.compile(rf"(?P<key>{_TOKEN})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)")),
    ("compare", re.compile(rf"(?P<key>{_TOKEN})\s*(?P<op>==|=|!=|>|<)\s*(?P<value>{_TOKEN}|)")),
    ("exists", re.compile(rf"(?P<key>{_TOKEN})")),
)


class SelectorError(ValueError):
    """A selector that does not parse; the message names the requirement at fault."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement: ``key``, an operator (``in``, ``notin``, ``exists``, ``!``, ``gt``,
    ``lt``; ``=`` and ``!=`` are ``in`` and ``notin`` of one value) and its values."""

    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.operator:
            case "in":
                return value in self.values
            case "notin":
                return value not in self.values
            case "exists":
                return value is not None
            case "!":
                return value is None
        if value is None or not re.fullmatch(r"-?\d+", value):
            return False
        bound = int(self.values[0])
        return int(value) > bound if self.operator == "gt" else int(value) < bound

    def __str__(self) -> str:
        match self.operator:
            case "exists":
                return self.key
            case "!":
                return f"!{self.key}"
            case "gt" | "lt":
                return f"{self.key}{'>' if self.operator == 'gt' else '<'}{self.values[0]}"
            case "in" | "notin" if len(self.values) == 1:
                return f"{self.key}{'=' if self.operator == 'in' else '!='}{self.values[0]}"
        return f"{self.key} {self.operator} ({','.join(self.values)})"


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """Requirements that must all hold; ``str()`` is the form the API server takes."""

    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> LabelSelector:
        """``matchLabels``: each ``key: value`` must be among the labels."""
        return cls(tuple(Requirement(k, "in", (v,)) for k, v in sorted(labels.items())))

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Read the string form; raise ``SelectorError`` naming the requirement at fault."""
        return cls(tuple(_requirement(part) for part in _split(text)))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)

    def __str__(self) -> str:
        return ",".join(map(str, self.requirements))

    def __bool__(self) -> bool:
        return bool(self.requirements)


def _split(text: str) -> list[str]:
    """The requirements: split on commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if len(parts) == 1 and not parts[0].strip():
        return []
    return [part.strip() for part in parts]


def _requirement(text: str) -> Requirement:
    for form, pattern in _FORMS:
        found = pattern.fullmatch(text)
        if found is None:
            continue
        key = found["key"]
        if not _KEY.fullmatch(key):
            raise SelectorError(f"{text!r}: {key!r} is not a label key")
        match form:
            case "!":
                return Requirement(key, "!")
            case "exists":
                return Requirement(key, "exists")
            case "set":
                values = tuple(v.strip() for v in found["values"].split(","))
                if values == ("",):
                    raise SelectorError(f"{text!r}: {found['op']} needs at least one value")
                _check_values(text, values)
                return Requirement(key, found["op"], values)
        operator, value = found["op"], found["value"]
        if operator in (">", "<"):
            if not re.fullmatch(r"-?\d+", value):
                raise SelectorError(f"{text!r}: {operator} needs an integer")
            return Requirement(key, "gt" if operator == ">" else "lt", (value,))
        _check_values(text, (value,))
        return Requirement(key, "notin" if operator == "!=" else "in", (value,))
    raise SelectorError(f"{text!r}: not a requirement (key=value, key in (a,b), !key, ...)")


def _check_values(text: str, values: tuple[str, ...]) -> None:
    for value in values:
        if not _VALUE.fullmatch(value):
            raise SelectorError(f"{text!r}: {value!r} is not a label value")
