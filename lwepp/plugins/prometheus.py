"""The Prometheus text format (0.0.4), read for a few metric names, and exact-match selectors.

A model server's ``/metrics`` page is mostly histograms nobody routes on; an
endpoint picker needs a handful of gauges. ``parse`` therefore takes the
names it wants and skips every other line with one ``str.startswith`` call,
so the cost follows the lines kept, not the size of the page.

The subset read (the format is documented in Prometheus'
``docs/instrumenting/exposition_formats.md``)::

    # HELP ... / # TYPE ... / any comment      ignored
    name value [timestamp]
    name{label="value",other="va\\"lue"} value [timestamp]

- Label values may hold ``\\\\``, ``\\"`` and ``\\n`` escapes; a trailing comma
  before ``}`` is allowed.
- Values are Go floats: ``NaN``, ``+Inf`` and ``-Inf`` included.
- A line that does not follow the format is skipped, not fatal: one bad
  line must not hide the gauges next to it.

Selectors are the PromQL instant-vector form the llm-d router's engine
configurations use (``my_queue{state="waiting"}``); only exact matches
(``=``), with the value quoted or not, as that router accepts.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

Sample = tuple[Mapping[str, str], float]
"""One series: its labels and its value."""

Families = Mapping[str, list[Sample]]
"""Metric name → its series, in page order."""

_NAME: Final = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')
_ESCAPE: Final = re.compile(r"\\(.)")
_UNESCAPED: Final = {"n": "\n"}
_NO_LABELS: Final[Mapping[str, str]] = MappingProxyType({})


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE.sub(lambda m: _UNESCAPED.get(m[1], m[1]), value)


def _labels(line: str, start: int) -> tuple[dict[str, str], int] | None:
    """The labels from just after ``{`` and where the value starts; None if malformed."""
    labels: dict[str, str] = {}
    pos = start
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL.match(line, pos)
        if match is None:
            return None
        labels[match[1]] = _unescape(match[2])
        pos = match.end()
        if not match[3]:  # no comma: the closing brace must follow
            if pos < len(line) and line[pos] == "}":
                return labels, pos + 1
            return None


def parse(text: str, names: Collection[str]) -> dict[str, list[Sample]]:
    """The series of each metric in ``names`` found in ``text``; names absent have no key."""
    wanted = tuple(names)
    families: dict[str, list[Sample]] = {}
    for line in text.split("\n"):  # not splitlines(): a label value may hold a raw \r
        # One C-level check rejects comments, HELP/TYPE and every other metric.
        if not line.startswith(wanted):
            continue
        end = 0
        while end < len(line) and line[end] not in "{ \t":
            end += 1
        name = line[:end]
        if name not in names:  # a longer name that only starts like a wanted one
            continue
        labels: Mapping[str, str] = _NO_LABELS
        rest = end
        while rest < len(line) and line[rest] in " \t":
            rest += 1
        if rest < len(line) and line[rest] == "{":
            found = _labels(line, rest + 1)
            if found is None:
                continue
            labels, rest = found
        fields = line[rest:].split()
        if not fields or len(fields) > 2:
            continue
        try:
            value = float(fields[0])  # "NaN", "+Inf", "-Inf" included
        except ValueError:
            continue
        families.setdefault(name, []).append((labels, value))
    return families


@dataclass(frozen=True, slots=True)
class Selector:
    """A metric name and the labels a series must carry (exact matches)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.labels.items())

    def select(self, families: Families) -> list[Sample]:
        """The series of ``families`` this selector picks, in page order."""
        return [s for s in families.get(self.name, ()) if self.matches(s[0])]

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        pairs = ",".join(f'{key}="{value}"' for key, value in self.labels.items())
        return f"{self.name}{{{pairs}}}"


_SELECTOR: Final = re.compile(rf"\s*({_NAME})\s*(?:\{{(.*)\}})?\s*", re.DOTALL)
_MATCHER: Final = re.compile(
    r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*("(?:[^"\\]|\\.)*"|[^",}\s]+)\s*(?:,|$)'
)


def parse_selector(text: str) -> Selector:
    """``name{label="value",other=value}`` → a ``Selector``; ValueError says what is wrong."""
    whole = _SELECTOR.fullmatch(text)
    if whole is None:
        raise ValueError(f"not a metric selector: {text!r}")
    labels: dict[str, str] = {}
    body, pos = whole[2] or "", 0
    while body[pos:].strip():
        matcher = _MATCHER.match(body, pos)
        if matcher is None:
            raise ValueError(f"bad label matcher in {text!r}")
        key, op, value = matcher.groups()
        if op != "=":
            raise ValueError(f"only exact-match (=) label matchers are supported: {text!r}")
        labels[key] = _unescape(value[1:-1]) if value.startswith('"') else value
        pos = matcher.end()
    return Selector(whole[1], MappingProxyType(labels))
