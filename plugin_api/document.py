"""A configuration document: YAML read once, and every problem reported at its line.

Both services read configuration files written for the originals (LWEPP the
llm-d router's ``EndpointPickerConfig``). A decoder walks the parsed data
with ``Params`` and reports to the ``Document``: each error and warning is
kept with the file and line of the field at fault (``plugins[2].type`` →
``picker.yaml:9``), so that all of them can be shown at once
(``ConfigErrors``), not just the first.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from plugin_api import ConfigError

Keys = Sequence[str | int]
"""A path into the document: mapping keys and list indexes."""


class ConfigErrors(ConfigError):
    """Every problem found in one configuration, one per line."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


def keys_of(field: str) -> list[str | int]:
    """A field's path as ``Params`` reports it (``plugins[0].parameters.x``) → document keys."""
    return [
        int(index) if index else key for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", field)
    ]


@dataclass(slots=True)
class Document:
    """One configuration's parsed ``data``, its YAML nodes (for lines), and what was found."""

    path: str
    data: Any
    node: yaml.Node | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, path: str) -> Document:
        """``text`` as YAML; raises ``ConfigErrors`` (with the line) when it is not."""
        with not_yaml(path):
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            data = yaml.safe_load(text)
        refuse_repeated_keys(path, [node])
        return cls(path, data, node)

    @classmethod
    def parse_all(cls, text: str, path: str) -> list[Document]:
        """Every non-empty document of a multi-document YAML text (``---`` between them, as
        ``kubectl get -o yaml`` and hand-written manifests put them); raises ``ConfigErrors``
        (with the line) when the text is not YAML."""
        with not_yaml(path):
            nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
            datas = list(yaml.safe_load_all(text))
        refuse_repeated_keys(path, nodes)
        return [cls(path, d, n) for n, d in zip(nodes, datas, strict=True) if d is not None]

    def line(self, keys: Keys) -> int:
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

    def at(self, keys: Keys, message: str) -> str:
        """``message`` prefixed with the file and, when found, the line of ``keys``."""
        line = self.line(keys)
        return f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}"

    def error(self, keys: Keys, message: str) -> None:
        self.errors.append(self.at(keys, message))

    def warn(self, keys: Keys, message: str) -> None:
        self.warnings.append(self.at(keys, message))

    def report(self, problems: Iterable[tuple[Keys, bool, str]]) -> None:
        """Each (where, is it an error, message): an error, or else a warning."""
        for keys, is_error, message in problems:
            (self.error if is_error else self.warn)(keys, message)

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Record a ``ConfigError`` raised inside, at its field's line, and go on."""
        try:
            yield
        except ConfigError as error:
            self.error(keys_of(error.field or ""), str(error))

    def done(self, result: Any) -> Any:
        """``result``, unless an error was found: then ``ConfigErrors`` listing them all."""
        if self.errors or result is None:
            raise ConfigErrors(self.errors or [f"{self.path}: no configuration"])
        return result


@contextlib.contextmanager
def not_yaml(path: str) -> Iterator[None]:
    """Turn a YAML syntax error raised inside into ``ConfigErrors`` naming the file and line."""
    try:
        yield
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigErrors([f"{path}{line}: not YAML: {error.problem}"]) from None
    except yaml.YAMLError as error:
        raise ConfigErrors([f"{path}: not YAML: {error}"]) from None


def refuse_repeated_keys(path: str, nodes: Iterable[yaml.Node | None]) -> None:
    """Raise ``ConfigErrors`` naming every key written twice in one mapping, at both lines.

    The YAML spec requires a mapping's keys to be unique, but PyYAML keeps the
    last value and says nothing: two ``parameters:`` under one plugin would
    drop the first set without a word.
    """
    errors: list[tuple[int, str]] = []
    pending = [node for node in nodes if node is not None]
    while pending:
        node = pending.pop()
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                pending.append(value)
                if not isinstance(key, yaml.ScalarNode) or key.value == "<<":
                    continue
                line = key.start_mark.line + 1
                if key.value in first:
                    message = f"key {key.value!r} repeated (first at line {first[key.value]})"
                    errors.append((line, f"{path}:{line}: {message}; YAML allows a key once"))
                else:
                    first[key.value] = line
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)
    if errors:
        raise ConfigErrors([message for _, message in sorted(errors)])


def read_utf8(path: str | os.PathLike[str]) -> str:
    """A text file's contents, which must be UTF-8 (YAML's encoding, whatever the locale).

    Raises ``OSError`` if it cannot be read, and ``ValueError`` naming the line and
    column of the first byte that is not UTF-8 (a Latin-1 comment, a binary file).
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - data.rfind(b"\n", 0, error.start)
        byte = data[error.start]
        raise ValueError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{byte:02x})") from None


def read_config(path: str | os.PathLike[str]) -> str:
    """A configuration file's text; ``ConfigErrors`` naming the file when it cannot be read
    or is not UTF-8."""
    try:
        return read_utf8(path)
    except OSError as error:
        raise ConfigErrors([f"{path}: cannot read: {error.strerror or error}"]) from None
    except ValueError as error:
        raise ConfigErrors([str(error)]) from None
