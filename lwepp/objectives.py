"""InferenceObjectives: a request's priority, named by a header and set by the workload's owner.

An InferenceObjective (``llm-d.ai/v1alpha2``, and the older
``inference.networking.x-k8s.io/v1alpha2`` the llm-d router still reads) is a
small namespaced object::

    apiVersion: llm-d.ai/v1alpha2
    kind: InferenceObjective
    metadata: {name: interactive}
    spec:
      priority: 10             # optional int32; unset means 0; negative means sheddable
      poolRef: {name: llama}   # required: the InferencePool it applies to

A request names one with ``x-llm-d-inference-objective`` (the deprecated
``x-gateway-inference-objective`` too): the value is the object's name. No
header, a name no objective of this pool has, or an objective without a
priority all give priority **0**, as the router's director does
(``defaultPriority``); an unknown name is not refused. The priority decides
flow control's band, and with the ``flowControl`` gate off whether a request
may be shed when the pool is saturated (``lwepp.flowcontrol``).

Where the objectives come from (``ObjectiveSource``, both replace their set
whole, so a request reads one snapshot without locks):

- **The Kubernetes API** (``ObjectiveWatch``), with the list/watch client the
  pod source uses (``pods.kubeapi``): the objectives in the pool's namespace
  whose ``poolRef`` names the pool. The router chooses the group by API
  discovery; here a list answered 404 means the CRD is not installed: the
  ``llm-d.ai`` group first, else the legacy one (with a deprecation warning);
  when both are installed the legacy objects are ignored, with a warning, as
  in the router. With neither, every request has priority 0 until one is
  installed (it is looked for again every minute).
- **A file** (``ObjectiveFile``, ``--inference-objectives FILE``), without
  Kubernetes: the same objects as YAML documents (several separated by
  ``---``, or one ``kind: List`` with ``items``), re-read when it changes; a
  broken edit is logged with its line and the last good set kept. The
  router loads no objectives without Kubernetes; this is Switchyard's. The
  file is the picker's own: every objective in it applies, whatever its
  ``poolRef`` names (required all the same, so the file also applies to a
  cluster as it is).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Protocol

import structlog

from plugin_api import ConfigError, Params
from plugin_api.document import ConfigErrors, Document, keys_of, read_utf8
from pods.file import WatchedFile
from pods.kubeapi import ApiError, Backoff, ClusterConfig, Held, KubeApi, Object, reflect

log = structlog.get_logger()

OBJECTIVE_HEADERS: Final = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
"""The header naming a request's objective, then its deprecated alias (the router's order)."""

GROUP: Final = "llm-d.ai"
LEGACY_GROUP: Final = "inference.networking.x-k8s.io"
VERSION: Final = "v1alpha2"
API_VERSIONS: Final = (f"{GROUP}/{VERSION}", f"{LEGACY_GROUP}/{VERSION}")
KIND: Final = "InferenceObjective"
POOL_GROUP: Final = "inference.networking.k8s.io"
"""``poolRef.group``'s default: the InferencePool's group."""
DEFAULT_PRIORITY: Final = 0
INT32: Final = (-(2**31), 2**31 - 1)
CRD_RETRY_SECONDS: Final = 60.0
"""How often to look again for an InferenceObjective CRD that was not installed."""
_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
"""A Kubernetes object name (RFC 1123 subdomain), what the header's value must match."""


@dataclass(frozen=True, slots=True)
class Objective:
    """One InferenceObjective: its name, priority (None: unset, read as 0) and pool."""

    name: str
    priority: int | None
    pool: str


Objectives = Mapping[str, Objective]
"""The objectives of one pool, by name."""

NONE: Final[Objectives] = MappingProxyType({})


class ObjectiveSource(Protocol):
    """Where a picker's objectives come from: ``objectives`` is replaced whole on a change."""

    @property
    def objectives(self) -> Objectives: ...

    async def run(self) -> None:
        """Keep ``objectives`` current until cancelled."""
        ...


def objective_name(headers: Sequence[tuple[str, str]]) -> str | None:
    """The objective a request names (the first of ``OBJECTIVE_HEADERS`` it carries)."""
    found: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in OBJECTIVE_HEADERS and key not in found:
            found[key] = value.strip()
    return next((found[h] for h in OBJECTIVE_HEADERS if found.get(h)), None)


def priority_of(headers: Sequence[tuple[str, str]], objectives: Objectives) -> int:
    """The request's priority: its objective's, else 0 (no header, an unknown name, none set)."""
    return priority_named(objective_name(headers), objectives)


def priority_named(name: str | None, objectives: Objectives) -> int:
    """The priority of the objective ``name`` (the header's value), as ``priority_of``."""
    objective = objectives.get(name) if name else None
    if objective is None or objective.priority is None:
        return DEFAULT_PRIORITY
    return objective.priority


# --- decoding ------------------------------------------------------------------------


def decode(obj: Any, at: str, pool: str | None, *, strict: bool = True) -> Objective | None:
    """One object as an ``Objective`` (None: it names another pool); raises ``ConfigError``
    naming the field (``at``: where the object is, for the error's path).

    ``strict`` (a file): a field of ``spec`` or ``poolRef`` the CRD does not
    have is an error. What the API server returns it validated already, and
    a newer CRD may carry more: there, unknown fields are left alone.
    """
    params = Params(obj, "", path=at)
    api_version = params.require("apiVersion", str)
    kind = params.require("kind", str)
    metadata = params.entry("metadata", params.require("metadata", dict))
    spec = params.entry("spec", params.require("spec", dict))
    if api_version not in API_VERSIONS:
        expected = " or ".join(API_VERSIONS)
        raise params.error("apiVersion", f"expected {expected}, got {api_version!r}")
    if kind != KIND:
        raise params.error("kind", f"expected {KIND}, got {kind!r}")
    name = metadata.require("name", str)
    if not _NAME.fullmatch(name) or len(name) > 253:
        raise metadata.error("name", f"not a Kubernetes object name: {name!r}")
    priority = spec.get("priority", object, None)
    if priority is not None and (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not INT32[0] <= priority <= INT32[1]
    ):
        raise spec.error("priority", f"expected an int32, got {priority!r}")
    ref = spec.entry("poolRef", spec.require("poolRef", dict))
    pool_name = ref.require("name", str)
    group = ref.get("group", str, POOL_GROUP)
    ref.get("kind", str, "InferencePool")
    if strict:
        params.get("status", dict, {})  # no controller writes it; accepted as kubectl shows it
        params.done()
        spec.done()
        ref.done()
    if pool is not None and (pool_name != pool or group != POOL_GROUP):
        return None
    return Objective(name, priority, pool_name)


def parse(text: str, path: str, pool: str | None = None) -> dict[str, Objective]:
    """The objectives in ``text`` for ``pool`` (None: every one); raises ``ConfigErrors``
    naming the file and line of every problem."""
    found: dict[str, Objective] = {}
    errors: list[str] = []
    for document in Document.parse_all(text, path):
        data = document.data
        items = (
            [(f"items[{i}]", item) for i, item in enumerate(data.get("items") or [])]
            if isinstance(data, dict) and data.get("kind", "").endswith("List")
            else [("", data)]
        )
        for at, item in items:
            try:
                objective = decode(item, at, pool)
            except ConfigError as error:
                document.error(keys_of(error.field or at), str(error))
                continue
            if objective is not None:
                if objective.name in found:
                    where = keys_of(f"{at}.metadata.name" if at else "metadata.name")
                    document.error(where, f"{objective.name!r}: listed twice")
                found[objective.name] = objective
        errors += document.errors
    if errors:
        raise ConfigErrors(errors)
    return found


# --- from a file ---------------------------------------------------------------------


class ObjectiveFile:
    """Objectives from a YAML file, re-read when its modification time or size changes.

    A broken file keeps the last good set (``error`` says why, logged once per
    change), as the pod file source does (``pods.file.WatchedFile``).
    """

    def __init__(
        self, path: str | os.PathLike[str], pool: str | None = None, interval: float = 1.0
    ) -> None:
        self.path, self.pool = Path(path), pool
        self.objectives: Objectives = NONE
        rejected = "objectives file rejected; keeping the last good set"
        self._file = WatchedFile(path, self._load, self._take, rejected, interval)

    @property
    def error(self) -> str | None:
        """Why the file's current version was rejected (None: it was read)."""
        return self._file.error

    def reload(self) -> bool:
        """Read the file again if it changed; True when the set was replaced."""
        return self._file.reload()

    def _load(self, path: Path) -> dict[str, Objective]:
        return parse(read_utf8(path), str(path), self.pool)

    def _take(self, found: dict[str, Objective]) -> None:
        self.objectives = MappingProxyType(found)
        log.info("objectives loaded", path=str(self.path), objectives=describe(found))

    async def run(self) -> None:
        await self._file.run()


def describe(objectives: Objectives) -> dict[str, int | None]:
    """Each objective's priority, by name (for logs)."""
    return {name: o.priority for name, o in sorted(objectives.items())}


def load(path: str | os.PathLike[str], pool: str | None = None) -> ObjectiveFile:
    """A file source, read once now: a broken file at start is an error (``ConfigErrors``)."""
    source = ObjectiveFile(path, pool)
    try:
        text = read_utf8(path)
    except OSError as error:
        raise ConfigErrors([f"{path}: cannot read: {error.strerror}"]) from None
    except ValueError as error:
        raise ConfigErrors([str(error)]) from None
    parse(text, str(path), pool)
    source.reload()
    return source


# --- from the Kubernetes API -----------------------------------------------------------


class ObjectiveWatch:
    """The pool's InferenceObjectives, read from the Kubernetes API (module docstring).

    ``objectives`` holds those whose ``poolRef`` names ``pool``; an object the
    API server holds under another schema is skipped, logged with why.
    """

    def __init__(
        self,
        config: ClusterConfig,
        pool: str,
        namespace: str,
        *,
        backoff: Callable[[], Backoff] = Backoff,
        watch_timeout: int = 300,
        retry: float = CRD_RETRY_SECONDS,
    ) -> None:
        self.config, self.pool, self.namespace = config, pool, namespace
        self.objectives: Objectives = NONE
        self.group: str | None = None
        """The group read (None until one is found)."""
        self._backoff, self._watch_timeout, self._retry = backoff, watch_timeout, retry

    def path(self, group: str) -> str:
        return f"/apis/{group}/{VERSION}/namespaces/{self.namespace}/inferenceobjectives"

    def publish(self, objects: Mapping[str, Object]) -> None:
        """Decode what the API holds into the pool's objectives, and swap them in whole."""
        found: dict[str, Objective] = {}
        for name, obj in objects.items():
            try:
                objective = decode(obj, "", self.pool, strict=False)
            except ConfigError as error:
                log.warning("inference objective skipped", objective=name, error=str(error))
                continue
            if objective is not None:
                found[name] = objective
        if found != dict(self.objectives):
            self.objectives = MappingProxyType(found)
            log.info("objectives", pool=self.pool, group=self.group, objectives=describe(found))

    async def installed(self, api: KubeApi, group: str) -> bool | None:
        """Whether the group's collection exists (a 404 means its CRD is not installed);
        None when the API server could not say (it failed, or was unreachable)."""
        try:
            await api.list(self.path(group))
        except ApiError as error:
            if error.code == 404:
                return False
            log.warning("kubernetes api error", path=self.path(group), error=str(error))
            return None
        except (OSError, TimeoutError) as error:
            log.warning("kubernetes api unreachable", path=self.path(group), error=repr(error))
            return None
        return True

    async def run(self) -> None:
        async with KubeApi(self.config) as api:
            said = False
            while True:
                current = await self.installed(api, GROUP)
                legacy = await self.installed(api, LEGACY_GROUP) if current is not None else None
                if current or legacy:
                    break
                if current is False and legacy is False and not said:
                    said = True
                    log.warning(
                        "no InferenceObjective CRD installed: every request has priority 0",
                        groups=[GROUP, LEGACY_GROUP],
                    )
                await asyncio.sleep(self._retry if current is False else 1.0)
            self.group = GROUP if current else LEGACY_GROUP
            if current and legacy:
                log.warning(
                    "both InferenceObjective CRDs installed: the legacy objects are ignored",
                    read=GROUP,
                    ignored=LEGACY_GROUP,
                )
            elif legacy:
                log.warning("InferenceObjective: reading the deprecated group", group=LEGACY_GROUP)
            held = Held(lambda: self.publish(held.objects))
            await reflect(
                api, self.path(self.group), {}, held, self._backoff(), self._watch_timeout
            )
