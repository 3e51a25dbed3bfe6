"""Where a picker's InferenceModelRewrites come from: a file, or the Kubernetes API.

Both keep a ``RewriteTable`` (``lwepp.rewrites``) current and replace it whole
on every change, so a request reads one consistent table without a lock
(``FixedRewrites``, a set given once, is for code and tests).

``RewriteFile``
    A YAML file of InferenceModelRewrite objects, as ``kubectl apply -f``
    takes them (documents separated by ``---``, or one ``List``), re-read when
    it changes. A broken edit never empties the table: the last good set stays,
    and the error, naming the file, line and field, is logged until the file is
    fixed. Without Kubernetes, this is how an operator moves a canary's weights.
``RewriteWatch``
    The llm-d router's reconciler, as list/watch (``pods.kubeapi.reflect``):
    the InferenceModelRewrites in the pool's namespace whose ``poolRef`` names
    the pool. The group is chosen by API discovery, as the router chooses it:
    ``llm-d.ai/v1alpha2`` when that CRD is installed (the older group's objects
    are then ignored, with a warning), else ``inference.networking.x-k8s.io/v1alpha2``
    (with a deprecation warning); neither installed, it asks again with
    backoff. An object that does not decode keeps its last good version (logged,
    naming it and the field); a deleted one leaves at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp
import structlog

from lwepp.rewrites import (
    API_VERSIONS,
    KIND,
    POOL_GROUP,
    ModelRewrite,
    RewriteError,
    RewriteTable,
    decode,
    for_pool,
)
from plugin_api.document import ConfigErrors, Document, keys_of, read_utf8
from pods.file import WatchedFile
from pods.kubeapi import ApiError, Backoff, ClusterConfig, KubeApi, Object, reflect

log = structlog.get_logger()

RESOURCE: Final = "inferencemodelrewrites"


class FixedRewrites:
    """A set given once and never changed (benchmarks and tests; a picker built in code)."""

    def __init__(self, rewrites: Iterable[ModelRewrite] = ()) -> None:
        self.table = RewriteTable(rewrites)

    async def run(self) -> None:
        """Nothing to keep current."""


# --- a file ------------------------------------------------------------------------------


def parse_rewrites(text: str, origin: str) -> tuple[list[ModelRewrite], list[str]]:
    """Every InferenceModelRewrite of a YAML text, and the warnings; raises ``ConfigErrors``
    listing every problem, each at its file and line."""
    rewrites: list[ModelRewrite] = []
    documents = Document.parse_all(text, origin)  # empty documents (a trailing ---) left out
    for document in documents:
        data = document.data
        if isinstance(data, dict) and data.get("kind") in ("List", f"{KIND}List"):
            items = data.get("items") or []
            for i, item in enumerate(items if isinstance(items, list) else []):
                rewrites += _decoded(document, item, ["items", i])
        else:
            rewrites += _decoded(document, data, [])
    errors = [e for d in documents for e in d.errors]
    seen: set[tuple[str, str]] = set()
    for rewrite in rewrites:
        if (rewrite.namespace, rewrite.name) in seen:
            errors.append(f"{origin}: two rewrites named {rewrite.namespace}/{rewrite.name}")
        seen.add((rewrite.namespace, rewrite.name))
    if errors:
        raise ConfigErrors(errors)
    return rewrites, [w for d in documents for w in d.warnings]


def _decoded(document: Document, raw: Any, at: list[str | int]) -> list[ModelRewrite]:
    warnings: list[str] = []
    try:
        rewrite = decode(raw, warnings)
    except RewriteError as error:
        document.error([*at, *keys_of(error.field or "")], f"{KIND}: {error}")
        return []
    for warning in warnings:
        document.warn([*at, *keys_of(warning.partition(":")[0])], f"{rewrite.name}: {warning}")
    return [rewrite]


def load_rewrites(path: str | os.PathLike[str]) -> tuple[list[ModelRewrite], list[str]]:
    """Read and decode a rewrite file; raises ``ConfigErrors``."""
    try:
        text = read_utf8(path)
    except OSError as error:
        raise ConfigErrors([f"{path}: cannot read: {error.strerror}"]) from None
    except ValueError as error:
        raise ConfigErrors([str(error)]) from None
    return parse_rewrites(text, str(path))


class RewriteFile:
    """A rewrite file's InferenceModelRewrites for one pool, re-read when it changes.

    ``pool``: the rewrites whose ``poolRef`` names it apply (None: all of them).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pool: str | None = None,
        group: str = POOL_GROUP,
        interval: float = 1.0,
    ) -> None:
        self.path, self.pool, self.group = Path(path), pool, group
        self.table = RewriteTable()
        """The rewrites as last read: replaced whole, never changed in place."""
        rejected = "model rewrite file rejected; keeping the last good set"
        self._file = WatchedFile(path, load_rewrites, self._take, rejected, interval)

    @property
    def error(self) -> str | None:
        """Why the file as it is now is not in force (None: it is)."""
        return self._file.error

    def reload(self) -> bool:
        """Re-read the file if it changed; True when the table was replaced."""
        return self._file.reload()

    def _take(self, loaded: tuple[list[ModelRewrite], list[str]]) -> None:
        rewrites, warnings = loaded
        mine = for_pool(rewrites, self.pool, self.group)
        self.table = RewriteTable(mine)
        log.info(
            "model rewrites loaded",
            path=str(self.path),
            pool=self.pool,
            rewrites=[r.name for r in mine],
            warnings=warnings or None,
        )

    async def run(self) -> None:
        await self._file.run()


# --- the Kubernetes API ------------------------------------------------------------------


class _Held:
    """The InferenceModelRewrite collection as a reflector keeps it (``pods.kubeapi.Reflector``)."""

    def __init__(self, owner: RewriteWatch) -> None:
        self.owner = owner
        self.decoded: dict[str, ModelRewrite] = {}

    def replace(self, items: list[Object]) -> None:
        names = {str(item.get("metadata", {}).get("name")) for item in items}
        self.decoded = {name: r for name, r in self.decoded.items() if name in names}
        for item in items:
            self._take(item)
        self.owner.publish()

    def apply(self, kind: str, obj: Object) -> None:
        if kind == "DELETED":
            self.decoded.pop(str(obj.get("metadata", {}).get("name")), None)
        else:
            self._take(obj)
        self.owner.publish()

    def _take(self, obj: Object) -> None:
        name = str(obj.get("metadata", {}).get("name"))
        if obj.get("apiVersion") != self.owner.api_version:  # a watch omits it: set as served
            obj = {**obj, "apiVersion": self.owner.api_version, "kind": KIND}
        warnings: list[str] = []
        try:
            self.decoded[name] = decode(obj, warnings)
        except RewriteError as error:
            log.error(
                "model rewrite rejected; keeping its last good version",
                rewrite=name,
                kept=name in self.decoded,
                error=str(error),
            )
            return
        for warning in warnings:
            log.warning("model rewrite", rewrite=name, detail=warning)


class RewriteWatch:
    """The InferenceModelRewrites of one pool, read from the Kubernetes API (module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        namespace: str,
        pool: str,
        group: str = POOL_GROUP,
        backoff: Callable[[], Backoff] = Backoff,
        watch_timeout: int = 300,
    ) -> None:
        self.config, self.namespace, self.pool, self.group = config, namespace, pool, group
        self.table = RewriteTable()
        """The pool's rewrites as last read: replaced whole, never changed in place."""
        self.api_version: str | None = None
        """The group/version read, once discovery has found one."""
        self._held = _Held(self)
        self._backoff = backoff
        self._watch_timeout = watch_timeout

    def publish(self) -> None:
        """Rebuild the table from the objects held (by name: the order the API gives)."""
        held = [self._held.decoded[name] for name in sorted(self._held.decoded)]
        mine = for_pool(held, self.pool, self.group)
        if mine != list(self.table.rewrites):
            self.table = RewriteTable(mine)
            log.info("model rewrites", pool=self.pool, rewrites=[r.name for r in mine])

    async def discover(self, api: KubeApi) -> str | None:
        """The group/version to read: the first of ``API_VERSIONS`` whose CRD is installed."""
        served = [version for version in API_VERSIONS if await _serves(api, version)]
        if not served:
            return None
        if len(served) > 1:
            log.warning(
                "both InferenceModelRewrite CRDs are installed: reading one, ignoring the other",
                read=served[0],
                ignored=served[1],
            )
        elif served[0] != API_VERSIONS[0]:
            log.warning("InferenceModelRewrite: reading a deprecated group", read=served[0])
        return served[0]

    async def run(self) -> None:
        async with KubeApi(self.config) as api:
            backoff, said = self._backoff(), False
            while (version := await self.discover(api)) is None:
                if not said:  # once: a cluster without the CRD is a normal cluster
                    log.warning(
                        "no InferenceModelRewrite CRD is installed; no rewrites until one is",
                        looked_for=list(API_VERSIONS),
                    )
                said = True
                await backoff.wait()
            self.api_version = version
            path = f"/apis/{version}/namespaces/{self.namespace}/{RESOURCE}"
            await reflect(api, path, {}, self._held, self._backoff(), self._watch_timeout)


async def _serves(api: KubeApi, version: str) -> bool:
    """Whether the API server's discovery lists the rewrite resource under ``version``."""
    try:
        found = await api.request("GET", f"/apis/{version}")
    except ApiError as error:
        if error.code != 404:
            log.warning("kubernetes api discovery failed", version=version, error=str(error))
        return False
    except (aiohttp.ClientError, OSError, TimeoutError) as error:
        log.warning("kubernetes api unreachable", version=version, error=repr(error))
        return False
    resources: Sequence[Any] = found.get("resources") or []
    return any(isinstance(r, dict) and r.get("name") == RESOURCE for r in resources)
