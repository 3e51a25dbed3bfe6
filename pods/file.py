"""A pod list read from a YAML file, reloaded when the file changes.

The file looks like this (``ports`` may list several ports for a
data-parallel pod; ``labels`` and ``ready`` are optional)::

    pods:
    - name: llama-0
      address: 127.0.0.1
      ports: [8101]
      labels: {pool: llama, model: llama-3-8b}
    - name: llama-1
      address: 127.0.0.1
      ports: [8102, 8103]
      labels: {pool: llama, model: llama-3-8b}
      ready: false

A broken edit never empties the list: the last good pods stay in force, and
the error (naming the file, the line and the field) is logged until the file
is fixed.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import structlog
import yaml

from pods.model import Pod, is_ip

log = structlog.get_logger()

_POD_FIELDS: Final = {"name", "address", "ports", "labels", "ready"}


class PodFileError(ValueError):
    """A pod file that cannot be used; the message names the file and the field."""


def parse_pods(text: str, origin: str = "<pods>") -> tuple[Pod, ...]:
    """Decode a pod file strictly: unknown fields, bad types and duplicates are errors,
    each naming the file, the line and the field."""
    try:
        document = yaml.safe_load(text)
        lines = _entry_lines(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise PodFileError(f"{origin}:{where} not valid YAML: {error}") from None
    if not isinstance(document, Mapping) or set(document) != {"pods"}:
        raise PodFileError(f"{origin}: expected a mapping with the single key 'pods'")
    entries = document["pods"] or []
    if not isinstance(entries, list):
        raise PodFileError(f"{origin}: pods: expected a list")

    def at(i: int, field: str = "") -> str:
        """``<file> line N: pods[i].field``: N is the field's line, else the entry's."""
        entry, fields = lines[i] if i < len(lines) else (0, {})
        line = fields.get(field.partition("[")[0], entry)
        return f"{origin}{f' line {line}' if line else ''}: pods[{i}]{'.' if field else ''}{field}"

    pods = tuple(_pod(entry, functools.partial(at, i)) for i, entry in enumerate(entries))
    first: dict[tuple[str, int], int] = {}
    names: dict[str, int] = {}
    for i, pod in enumerate(pods):
        if pod.name in names:
            raise PodFileError(
                f"{at(i, 'name')}: duplicate pod name {pod.name!r} (first: pods[{names[pod.name]}])"
            )
        names[pod.name] = i
        for port in pod.ports:
            if (pod.address, port) in first:
                raise PodFileError(
                    f"{at(i, 'ports')}: {pod.address}:{port} is listed twice "
                    f"(first: pods[{first[(pod.address, port)]}])"
                )
            first[(pod.address, port)] = i
    return pods


def _entry_lines(node: yaml.Node | None) -> list[tuple[int, dict[str, int]]]:
    """Each pod entry's line (1-based) and its fields' lines, read from the YAML node tree.

    ``yaml.safe_load`` keeps no positions; the composed nodes do. An entry that is
    not a mapping has only its own line.
    """
    if not isinstance(node, yaml.MappingNode):
        return []
    found = [value for key, value in node.value if getattr(key, "value", None) == "pods"]
    if not found or not isinstance(found[0], yaml.SequenceNode):
        return []
    result = []
    for item in found[0].value:
        fields: dict[str, int] = {}
        if isinstance(item, yaml.MappingNode):
            fields = {str(key.value): key.start_mark.line + 1 for key, _ in item.value}
        result.append((item.start_mark.line + 1, fields))
    return result


def _pod(entry: Any, at: Callable[[str], str]) -> Pod:
    """One entry; ``at(field)`` says where a field is, for the error messages."""
    if not isinstance(entry, Mapping):
        raise PodFileError(f"{at('')}: expected a mapping")
    unknown = set(entry) - _POD_FIELDS
    if unknown:
        field = sorted(unknown)[0]
        raise PodFileError(f"{at(field)}: unknown field {field!r}")
    for required in ("name", "address", "ports"):
        if required not in entry:
            raise PodFileError(f"{at(required)}: required")
    name, address, ports = entry["name"], entry["address"], entry["ports"]
    if not isinstance(name, str) or not name:
        raise PodFileError(f"{at('name')}: expected a non-empty string")
    if not isinstance(address, str) or not is_ip(address):
        raise PodFileError(f"{at('address')}: expected an IP address, got {address!r}")
    if isinstance(ports, int):
        ports = [ports]
    if not isinstance(ports, list) or not ports:
        raise PodFileError(f"{at('ports')}: expected a non-empty list of ports")
    for j, port in enumerate(ports):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise PodFileError(f"{at(f'ports[{j}]')}: expected a port 1-65535, got {port!r}")
    if len(set(ports)) != len(ports):
        raise PodFileError(f"{at('ports')}: duplicate port")
    labels = entry.get("labels") or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in labels.items()
    ):
        raise PodFileError(f"{at('labels')}: expected a mapping of names to strings")
    ready = entry.get("ready", True)
    if not isinstance(ready, bool):
        raise PodFileError(f"{at('ready')}: expected true or false")
    return Pod(
        name=name,
        address=address,
        ports=tuple(ports),
        labels={k: str(v) for k, v in labels.items()},
        ready=ready,
    )


def dump_pods(pods: Iterable[Pod]) -> str:
    """The pod file for ``pods``: the inverse of ``parse_pods`` (``ready`` only when false)."""
    entries = []
    for pod in pods:
        entry: dict[str, Any] = {"name": pod.name, "address": pod.address, "ports": list(pod.ports)}
        if pod.labels:
            entry["labels"] = dict(pod.labels)
        if not pod.ready:
            entry["ready"] = False
        entries.append(entry)
    return yaml.safe_dump({"pods": entries}, sort_keys=False)


def load_pods(path: str | os.PathLike[str]) -> tuple[Pod, ...]:
    """Read and decode a pod file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PodFileError(f"{path}: cannot read: {error.strerror}") from None
    return parse_pods(text, str(path))


class FileSource:
    """Pods from a YAML file, re-read whenever its modification time or size changes."""

    def __init__(self, path: str | os.PathLike[str], interval: float = 1.0) -> None:
        self.path = Path(path)
        self.interval = interval
        self.error: str | None = None
        self._pods: tuple[Pod, ...] = ()
        self._synced = False
        self._stamp: tuple[int, int] | None = None

    @property
    def pods(self) -> tuple[Pod, ...]:
        return self._pods

    @property
    def synced(self) -> bool:
        return self._synced

    def reload(self) -> bool:
        """Re-read the file if it changed; True when the pod list was replaced.

        On a broken file the previous pods stay, ``error`` holds the message
        and it is logged once per change of the file.
        """
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
        except OSError as error:
            stamp = None
            message = f"{self.path}: cannot read: {error.strerror}"
        else:
            if stamp == self._stamp:
                return False
            try:
                pods = load_pods(self.path)
            except PodFileError as error:
                message = str(error)
            else:
                self._stamp, self._pods, self._synced, self.error = stamp, pods, True, None
                log.info("pods loaded", path=str(self.path), pods=len(pods))
                return True
        if message != self.error:
            log.error("pod file rejected; keeping the last good list", error=message)
        self._stamp, self.error = stamp, message
        return False

    async def run(self) -> None:
        while True:
            self.reload()
            await asyncio.sleep(self.interval)
