"""Each LoRA adapter's base model, fed live from ConfigMaps as in the payload processor.

``base-model-to-header`` (``bbr.plugins.BaseModelToHeader``) names the base
model behind a request's ``model``. The payload processor learns the mapping
from ConfigMaps labelled ``inference.llm-d.ai/ipp-managed: "true"``
(``pkg/plugins/basemodelextractor`` at a3af1b0)::

    apiVersion: v1
    kind: ConfigMap
    metadata:
      name: llama-3-adapters
      labels: {inference.llm-d.ai/ipp-managed: "true"}
    data:
      baseModel: llama-3-8b          # required, not blank
      adapters: |                    # optional: a YAML list of names
        - sql-lora
        - chat-lora

Several ConfigMaps may name one base model (an adapter list too long for one
object is split across several). Here, as there, entries are trimmed and
blank ones skipped; a ConfigMap with no ``baseModel`` is rejected. Where the
original keeps stale entries, this map does not: it is computed whole from
the ConfigMaps held after every change (``base_map``), so a deleted
ConfigMap, an adapter dropped from a list, or a ConfigMap whose ``baseModel``
changed leaves nothing behind. One that turns unreadable keeps its last good
contents (logged, naming it and the field); an adapter two ConfigMaps give
to different base models goes with the first by namespace and name (logged).

The ConfigMaps come from the Kubernetes API (``ConfigMapWatch``, list/watch
in BBR's namespace) or, without a cluster, from a file of the same objects
(``ConfigMapFile``, re-read when it changes, keeping the last good set);
``feed`` gives a plugin the one its parameters call for, and BBR's assembly
runs it in the background. Neither the plugin nor BBR's stream handler
imports this module: the core stays free of Kubernetes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import structlog
import yaml

from bbr.plugins import BaseModelToHeader
from plugin_api import ConfigError
from plugin_api.document import read_utf8
from pods.file import WatchedFile
from pods.kubeapi import (
    Backoff,
    ClusterConfig,
    KubeApi,
    KubeconfigError,
    Object,
    load_kubeconfig,
    reflect,
)

log = structlog.get_logger()

LABEL: Final = "inference.llm-d.ai/ipp-managed"
"""The label (value ``"true"``) of the ConfigMaps the payload processor reads (before 2026-05:
``inference.llm-d.io/ipp-managed``; GIE's BBR: ``inference.networking.k8s.io/bbr-managed``)."""


class ConfigMapError(ValueError):
    """A ConfigMap that cannot be read as a base model's adapters (the message names the field)."""


@dataclass(frozen=True, slots=True)
class AdapterSet:
    """One ConfigMap, read: who it is (``namespace/name``), its base model and its adapters."""

    key: str
    base: str
    adapters: tuple[str, ...] = ()


def decode_configmap(obj: Mapping[str, Any]) -> AdapterSet:
    """A ConfigMap's ``data.baseModel`` and ``data.adapters``; raises ``ConfigMapError``."""
    metadata = obj.get("metadata") or {}
    key = f"{metadata.get('namespace', 'default')}/{metadata.get('name', '')}"
    data = obj.get("data") or {}
    if not isinstance(data, Mapping):
        raise ConfigMapError(f"ConfigMap {key}: data: expected a mapping")
    base = data.get("baseModel")
    if not isinstance(base, str) or not base.strip():
        raise ConfigMapError(f"ConfigMap {key}: data.baseModel: required, not blank")
    raw = data.get("adapters")
    adapters: list[str] = []
    if isinstance(raw, str) and raw.strip():
        try:
            listed = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ConfigMapError(f"ConfigMap {key}: data.adapters: not YAML: {error}") from None
        # An empty item ("- ") is null in YAML, and "" in the original's []string: skipped.
        if not isinstance(listed, list) or not all(isinstance(a, str | None) for a in listed):
            raise ConfigMapError(f"ConfigMap {key}: data.adapters: expected a list of names")
        adapters = [a.strip() for a in listed if a and a.strip()]
    elif raw is not None and not isinstance(raw, str):
        raise ConfigMapError(f"ConfigMap {key}: data.adapters: expected a YAML list in a string")
    return AdapterSet(key, base.strip(), tuple(dict.fromkeys(adapters)))


def base_map(sets: Iterable[AdapterSet]) -> tuple[dict[str, str], list[str]]:
    """Every model name → its base model (a base model → itself), and the conflicts found.

    Computed whole from ``sets``, in order of their keys: an adapter that two
    ConfigMaps give to different base models stays with the first.
    """
    base_of: dict[str, str] = {}
    conflicts: list[str] = []
    ordered = sorted(sets, key=lambda s: s.key)
    for adapter_set in ordered:
        base_of[adapter_set.base] = adapter_set.base
    for adapter_set in ordered:
        for adapter in adapter_set.adapters:
            first = base_of.setdefault(adapter, adapter_set.base)
            if first != adapter_set.base:
                conflicts.append(
                    f"{adapter!r} is an adapter of {first!r} and, in ConfigMap "
                    f"{adapter_set.key}, of {adapter_set.base!r}: {first!r} kept"
                )
    return base_of, conflicts


class BaseModels:
    """Where a source writes: a plugin's map (``BaseModelToHeader.base_of``), replaced whole
    on every change, so a request reads one consistent map without a lock."""

    def __init__(self, plugin: BaseModelToHeader) -> None:
        self.plugin = plugin

    @property
    def base_of(self) -> Mapping[str, str]:
        return self.plugin.base_of

    def replace(self, sets: Iterable[AdapterSet], origin: str) -> None:
        base_of, conflicts = base_map(sets)
        for conflict in conflicts:
            log.warning("base models", origin=origin, detail=conflict)
        if base_of != self.plugin.base_of:
            self.plugin.base_of = MappingProxyType(base_of)
            log.info("base models", plugin=self.plugin.name, origin=origin, models=len(base_of))


Job = Callable[[], Coroutine[Any, Any, None]]


def feed(plugin: BaseModelToHeader, cluster: KubeAccess) -> tuple[Job | None, str | None]:
    """What keeps ``plugin``'s map current (a job to run beside BBR), or why nothing does.

    ``baseModels``: nothing to do. ``configMapFile``: that file, read now (a
    broken one raises ``ConfigError`` naming the plugin, the file and the
    field). Neither: the labelled ConfigMaps of BBR's namespace, if BBR can
    reach the Kubernetes API (``cluster``); if it cannot, no job, and a
    warning naming what is missing: every request would get an empty header.
    """
    if plugin.fixed:
        return None, None
    store = BaseModels(plugin)
    if plugin.config_map_file:
        source = ConfigMapFile(plugin.config_map_file, store)
        if not source.reload():
            where = f"plugin {plugin.name!r} (base-model-to-header): parameters.configMapFile"
            raise ConfigError(f"{where}: {source.error}", "parameters.configMapFile")
        return source.run, None
    try:
        config = cluster.config()
    except KubeconfigError as error:
        return None, (
            f"--plugin base-model-to-header:{plugin.name}: no mapping: neither parameter "
            f"baseModels nor configMapFile, and no Kubernetes API to read the ConfigMaps "
            f"labelled {LABEL}=true from ({error}); X-Gateway-Base-Model-Name will be empty "
            "for every model"
        )
    return ConfigMapWatch(config, namespace_of(config), store).run, None


# --- the Kubernetes API ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KubeAccess:
    """How BBR would reach the Kubernetes API: ``--kubeconfig``, else ``$KUBECONFIG``, else
    the pod's service account (``pods.kubeapi.load_kubeconfig``); what it hands its plugins."""

    kubeconfig: str | None = None

    def config(self) -> ClusterConfig:
        """The connection; raises ``pods.kubeapi.KubeconfigError`` outside a cluster."""
        return load_kubeconfig(self.kubeconfig)


class _Held:
    """The labelled ConfigMaps as a reflector keeps them (``pods.kubeapi.Reflector``)."""

    def __init__(self, owner: ConfigMapWatch) -> None:
        self.owner = owner
        self.sets: dict[str, AdapterSet] = {}

    def replace(self, items: list[Object]) -> None:
        keys = {_key(item) for item in items}
        self.sets = {key: s for key, s in self.sets.items() if key in keys}
        for item in items:
            self._take(item)
        self.owner.publish()

    def apply(self, kind: str, obj: Object) -> None:
        if kind == "DELETED":
            self.sets.pop(_key(obj), None)
        else:
            self._take(obj)
        self.owner.publish()

    def _take(self, obj: Object) -> None:
        try:
            self.sets[_key(obj)] = decode_configmap(obj)
        except ConfigMapError as error:
            kept = _key(obj) in self.sets
            log.error(
                "configmap rejected; keeping its last good contents", error=str(error), kept=kept
            )


def _key(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return f"{metadata.get('namespace', 'default')}/{metadata.get('name', '')}"


class ConfigMapWatch:
    """The labelled ConfigMaps of one namespace, list/watch, into ``store``.

    The payload processor reads ``$NAMESPACE``'s, or every namespace's
    when it is unset; here the namespace is ``$NAMESPACE``, else the
    service account's (or the kubeconfig context's): one namespace, whose
    ConfigMaps a Role can grant.
    """

    def __init__(
        self,
        config: ClusterConfig,
        namespace: str,
        store: BaseModels,
        backoff: Callable[[], Backoff] = Backoff,
        watch_timeout: int = 300,
    ) -> None:
        self.config, self.namespace, self.store = config, namespace, store
        self.path = f"/api/v1/namespaces/{namespace}/configmaps"
        self._held = _Held(self)
        self._backoff = backoff
        self._watch_timeout = watch_timeout

    def publish(self) -> None:
        self.store.replace(self._held.sets.values(), f"configmaps in {self.namespace}")

    async def run(self) -> None:
        async with KubeApi(self.config) as api:
            params = {"labelSelector": f"{LABEL}=true"}
            await reflect(api, self.path, params, self._held, self._backoff(), self._watch_timeout)


def namespace_of(config: ClusterConfig, environ: Mapping[str, str] = os.environ) -> str:
    """``$NAMESPACE`` (the payload processor's chart sets it from the pod), else the config's."""
    return environ.get("NAMESPACE") or config.namespace


# --- a file -----------------------------------------------------------------------------------


def load_configmaps(path: str | os.PathLike[str]) -> list[AdapterSet]:
    """The ConfigMaps of a YAML file (``---``-separated, or a ``List``), every one read;
    raises ``ConfigMapError`` naming the file and what is wrong."""
    try:
        documents = [d for d in yaml.safe_load_all(read_utf8(path)) if d is not None]
    except OSError as error:
        raise ConfigMapError(f"{path}: cannot read: {error.strerror}") from None
    except (ValueError, yaml.YAMLError) as error:
        raise ConfigMapError(f"{path}: {error}") from None
    objects: list[Any] = []
    for document in documents:
        is_list = isinstance(document, Mapping) and document.get("kind") == "List"
        objects += (document.get("items") or []) if is_list else [document]
    found = []
    for obj in objects:
        if not isinstance(obj, Mapping) or obj.get("kind") != "ConfigMap":
            raise ConfigMapError(f"{path}: expected ConfigMap objects, got {obj!r:.60}")
        try:
            found.append(decode_configmap(obj))
        except ConfigMapError as error:
            raise ConfigMapError(f"{path}: {error}") from None
    return found


class ConfigMapFile:
    """A file of ConfigMaps, re-read when it changes into ``store``; a broken edit keeps the
    last good map (``pods.file.WatchedFile``)."""

    def __init__(
        self, path: str | os.PathLike[str], store: BaseModels, interval: float = 1.0
    ) -> None:
        self.path, self.store = Path(path), store
        rejected = "configmap file rejected; keeping the last good map"
        self._file = WatchedFile(path, load_configmaps, self._take, rejected, interval)

    @property
    def error(self) -> str | None:
        """Why the file as it is now is not in force (None: it is)."""
        return self._file.error

    def reload(self) -> bool:
        """Re-read the file if it changed; True when the map was read anew."""
        return self._file.reload()

    def _take(self, sets: list[AdapterSet]) -> None:
        self.store.replace(sets, str(self.path))

    async def run(self) -> None:
        await self._file.run()
