"""A pod list read from a YAML file, reloaded when the file changes.

The file looks like this (``ports`` may list several ports for a
data-parallel pod; ``labels``, ``ready`` and ``namespace`` are optional)::

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

or the llm-d router's endpoints file (its ``file-discovery`` plugin's, and
``docs/discovery.md``'s no-Kubernetes guide), one endpoint an entry: ``name``
(required; unique within its namespace, the last entry wins as the router's
upserts do), ``namespace`` (default ``default``), ``address`` (an IPv4
address, as the router requires), ``port`` (a string holding 1–65535; a
YAML number is taken too) and ``labels``; at most 1 MiB, YAML or JSON::

    endpoints:
    - name: vllm-0
      address: "10.0.0.1"
      port: "8000"
      labels: {model: llama-3-8b}

A broken edit never empties the list: the last good pods stay in force, and
the error (naming the file and the field) is logged until the file is fixed.
An edit that drops a pod (or an endpoint) removes it; one that adds a pod
adds it (``FileSource``). The router skips a bad entry of a reloaded
endpoints file and applies the rest; here the whole edit waits for the fix.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import structlog
import yaml

from plugin_api.document import read_utf8
from pods.model import Pod, is_ip

log = structlog.get_logger()
T = TypeVar("T")

_POD_FIELDS: Final = {"name", "address", "ports", "labels", "ready", "namespace"}
_ENDPOINT_FIELDS: Final = {"name", "namespace", "address", "port", "labels"}
MAX_ENDPOINTS_FILE: Final = 1 << 20
"""The router's cap on an endpoints file (1 MiB)."""
_PARENT: Final = re.compile(r"(\.[^.\[]*|\[\d+\])$")
"""The last step of a field's path: ``.ports`` or ``[1]``."""


class PodFileError(ValueError):
    """A pod file that cannot be used; the message names the file and the field."""


def parse_pods(text: str, origin: str = "<pods>") -> tuple[Pod, ...]:
    """Decode a pod file strictly: unknown fields, bad types and duplicates are errors.

    Each error names the file, the line and the field: ``pods.yaml:7:
    pods[1].ports[0]: expected a port 1-65535, got 99999``.
    """
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise PodFileError(f"{origin}:{where} not valid YAML: {error}") from None
    try:
        return _decode(document)
    except _Invalid as invalid:
        lines, path = _lines(text), invalid.path
        while path not in lines and (shorter := _PARENT.sub("", path)) != path:
            path = shorter  # a missing field: the line of what holds it
        at = f"{origin}:{lines[path]}" if path in lines else origin
        raise PodFileError(f"{at}: {invalid.path}: {invalid.problem}") from None


class _Invalid(Exception):
    """A field that does not decode: where it is (``pods[1].ports[0]``) and what is wrong."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def _lines(text: str) -> dict[str, int]:
    """The line (1-based) of every field of a YAML document, by its path (``pods[1].ports``)."""
    found: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                field = f"{path}.{key.value}" if path else str(key.value)
                found[field] = key.start_mark.line + 1
                walk(value, field)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found[f"{path}[{i}]"] = item.start_mark.line + 1
                walk(item, f"{path}[{i}]")

    if (root := yaml.compose(text, Loader=yaml.SafeLoader)) is not None:
        walk(root, "")
    return found


def _decode(document: Any) -> tuple[Pod, ...]:
    if isinstance(document, Mapping) and set(document) == {"endpoints"}:
        return _endpoints(document["endpoints"])
    if not isinstance(document, Mapping) or set(document) != {"pods"}:
        raise _Invalid("pods", "expected a mapping with the single key 'pods' (or 'endpoints')")
    entries = document["pods"] or []
    if not isinstance(entries, list):
        raise _Invalid("pods", "expected a list")
    pods = tuple(_pod(entry, f"pods[{i}]") for i, entry in enumerate(entries))
    first: dict[tuple[str, int], int] = {}
    names: dict[str, int] = {}
    for i, pod in enumerate(pods):
        if pod.name in names:
            problem = f"duplicate pod name {pod.name!r} (first: pods[{names[pod.name]}])"
            raise _Invalid(f"pods[{i}].name", problem)
        names[pod.name] = i
        for port in pod.ports:
            if (pod.address, port) in first:
                where = f"first: pods[{first[(pod.address, port)]}]"
                raise _Invalid(
                    f"pods[{i}].ports", f"{pod.address}:{port} is listed twice ({where})"
                )
            first[(pod.address, port)] = i
    return pods


def _pod(entry: Any, where: str) -> Pod:
    _fields(entry, where, _POD_FIELDS, ("name", "address", "ports"))
    name, address, ports = entry["name"], entry["address"], entry["ports"]
    if not isinstance(name, str) or not name:
        raise _Invalid(f"{where}.name", "expected a non-empty string")
    if not isinstance(address, str) or not is_ip(address):
        raise _Invalid(f"{where}.address", f"expected an IP address, got {address!r}")
    if isinstance(ports, int):
        ports = [ports]
    if not isinstance(ports, list) or not ports:
        raise _Invalid(f"{where}.ports", "expected a non-empty list of ports")
    for j, port in enumerate(ports):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise _Invalid(f"{where}.ports[{j}]", f"expected a port 1-65535, got {port!r}")
    if len(set(ports)) != len(ports):
        raise _Invalid(f"{where}.ports", "duplicate port")
    ready = entry.get("ready", True)
    if not isinstance(ready, bool):
        raise _Invalid(f"{where}.ready", "expected true or false")
    return Pod(
        name=name,
        address=address,
        ports=tuple(ports),
        labels=_labels(entry, where),
        ready=ready,
        namespace=_namespace(entry, where, ""),
    )


def _fields(entry: Any, where: str, known: set[str], required: tuple[str, ...]) -> None:
    """An entry of either list is a mapping of ``known`` fields with the ``required`` ones."""
    if not isinstance(entry, Mapping):
        raise _Invalid(where, "expected a mapping")
    if unknown := sorted(set(entry) - known):
        raise _Invalid(f"{where}.{unknown[0]}", f"unknown field {unknown[0]!r}")
    for field in required:
        if field not in entry:
            raise _Invalid(f"{where}.{field}", "required")


def _labels(entry: Mapping[str, Any], where: str) -> dict[str, str]:
    labels = entry.get("labels") or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in labels.items()
    ):
        raise _Invalid(f"{where}.labels", "expected a mapping of names to strings")
    return {k: str(v) for k, v in labels.items()}


def _namespace(entry: Mapping[str, Any], where: str, default: str) -> str:
    namespace = entry.get("namespace", default)
    if not isinstance(namespace, str) or (not namespace and default):
        raise _Invalid(f"{where}.namespace", "expected a non-empty string")
    return namespace


def _endpoints(entries: Any) -> tuple[Pod, ...]:
    """The router's ``endpoints:`` list: one single-port pod an entry, by namespace/name."""
    if not isinstance(entries, list):
        raise _Invalid("endpoints", "expected a list")
    by_id: dict[tuple[str, str], Pod] = {}
    where_of: dict[tuple[str, int], str] = {}
    for i, entry in enumerate(entries):
        where = f"endpoints[{i}]"
        _fields(entry, where, _ENDPOINT_FIELDS, ("name", "address", "port"))
        name, address, port = entry["name"], entry["address"], entry["port"]
        if not isinstance(name, str) or not name:
            raise _Invalid(f"{where}.name", "expected a non-empty string")
        if not isinstance(address, str) or not _is_ipv4(address):
            raise _Invalid(f"{where}.address", f"expected an IPv4 address, got {address!r}")
        number = int(port) if isinstance(port, str) and port.strip().isdigit() else port
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise _Invalid(f"{where}.port", f"expected a port 1-65535 (as a string), got {port!r}")
        pod = Pod(name, address, (number,), _labels(entry, where), True,
                  _namespace(entry, where, "default"))  # fmt: skip
        if (address, number) in where_of and by_id.get((pod.namespace, name)) is None:
            problem = f"{address}:{number} is listed twice (first: {where_of[(address, number)]})"
            raise _Invalid(f"{where}.port", problem)
        where_of[(address, number)] = where
        by_id.pop((pod.namespace, name), None)  # the router upserts: the last entry wins
        by_id[(pod.namespace, name)] = pod
    return tuple(by_id.values())


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def dump_pods(pods: Iterable[Pod]) -> str:
    """The pod file for ``pods``: the inverse of ``parse_pods`` (``ready`` only when false)."""
    entries = []
    for pod in pods:
        entry: dict[str, Any] = {"name": pod.name, "address": pod.address, "ports": list(pod.ports)}
        if pod.labels:
            entry["labels"] = dict(pod.labels)
        if not pod.ready:
            entry["ready"] = False
        if pod.namespace:
            entry["namespace"] = pod.namespace
        entries.append(entry)
    return yaml.safe_dump({"pods": entries}, sort_keys=False)


def load_pods(path: str | os.PathLike[str]) -> tuple[Pod, ...]:
    """Read and decode a pod file."""
    try:
        if os.path.getsize(path) > MAX_ENDPOINTS_FILE:
            raise PodFileError(f"{path}: larger than 1 MiB (the llm-d router's cap)")
        text = read_utf8(path)
    except OSError as error:
        raise PodFileError(f"{path}: cannot read: {error.strerror}") from None
    except ValueError as error:
        raise PodFileError(str(error)) from None
    return parse_pods(text, str(path))


class WatchedFile(Generic[T]):
    """A file re-read whenever its modification time or size changes, its contents handed on.

    ``load(path)`` reads and decodes it, raising ``ValueError`` (its message
    naming the file, and the line and field at fault); ``take`` gets each new
    good result. A broken edit never takes effect: the last good contents stay
    in force, ``error`` holds the message, and it is logged once per change of
    the file, as ``rejected`` says (the pod file, the model rewrites and BBR's
    ConfigMaps are read this way).

    Watching by polling the file's ``stat`` every ``interval`` seconds follows
    what the router's ``fsnotify`` watch follows: writes in place, an atomic
    rename over the file, and a ConfigMap's symlink swap (``stat`` follows the
    link). With ``watch`` false the file is read once, as the router's
    ``file-discovery`` does unless ``watchFile`` is set.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        load: Callable[[Path], T],
        take: Callable[[T], None],
        rejected: str,
        interval: float = 1.0,
        *,
        watch: bool = True,
    ) -> None:
        self.path, self.interval, self.watch = Path(path), interval, watch
        self._load, self._take, self._rejected = load, take, rejected
        self.error: str | None = None
        self._stamp: tuple[int, int] | None = None

    def reload(self) -> bool:
        """Re-read the file if it changed; True when its contents were taken."""
        try:
            stat = self.path.stat()
            stamp: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except OSError as error:
            stamp, message = None, f"{self.path}: cannot read: {error.strerror}"
        else:
            if stamp == self._stamp:
                return False
            try:
                loaded = self._load(self.path)
            except ValueError as error:
                message = str(error)
            else:
                self._stamp, self.error = stamp, None
                self._take(loaded)
                return True
        if message != self.error:
            log.error(self._rejected, error=message)
        self._stamp, self.error = stamp, message
        return False

    async def run(self) -> None:
        self.reload()
        while self.watch:
            await asyncio.sleep(self.interval)
            self.reload()
        await asyncio.Event().wait()  # read once: nothing more to do until cancelled


class FileSource:
    """Pods from a YAML file, re-read whenever its modification time or size changes."""

    def __init__(
        self, path: str | os.PathLike[str], interval: float = 1.0, *, watch: bool = True
    ) -> None:
        self.path, self.watch = Path(path), watch
        """``watch``: re-read on change (False: read once, as ``file-discovery`` without
        ``watchFile``)."""
        self.pods: tuple[Pod, ...] = ()
        """The pods as last read (``PodSource``): replaced whole, never changed in place."""
        self.synced = False
        """True once the pods were read (``PodSource``)."""
        rejected = "pod file rejected; keeping the last good list"
        self._file = WatchedFile(path, load_pods, self._take, rejected, interval, watch=watch)

    @property
    def error(self) -> str | None:
        """Why the file as it is now is not in force (None: it is)."""
        return self._file.error

    def reload(self) -> bool:
        """Re-read the file if it changed; True when the pod list was replaced (a broken file
        keeps the previous pods: ``WatchedFile``)."""
        return self._file.reload()

    def _take(self, pods: tuple[Pod, ...]) -> None:
        self.pods, self.synced = pods, True
        log.info("pods loaded", path=str(self.path), pods=len(pods))

    async def run(self) -> None:
        await self._file.run()
