"""The pod list of one InferencePool, kept current by watching the Kubernetes API.

Follows GIE's lwepp (``pkg/lwepp/controller``, ``datastore``):

- The pool (``inference.networking.k8s.io/v1`` InferencePool) is watched by
  name, in its namespace. Its ``spec.selector.matchLabels`` says which pods
  belong to it, and ``spec.targetPorts[].number`` which ports of each pod
  serve: every target port of every ready pod is one endpoint.
- Pods are watched in the pool's namespace only, with the pool's selector as
  the server-side label selector. A changed selector starts a new pod watch
  (a fresh list, as GIE's resync); a changed port list applies at once to the
  pods already held.
- A pod is *ready* when it has no ``deletionTimestamp`` and its ``Ready``
  condition is ``True``; it also needs a ``status.podIP`` to be reachable. A
  pod that turns unready, is deleted or stops matching leaves the list at
  once.
- The annotation ``inference.networking.k8s.io/active-ports`` (comma
  separated), when present, limits a pod to those of the target ports; an
  empty value leaves it no endpoint.
- A deleted pool empties the list.

Without a pool (the llm-d router's ``--endpoint-selector`` with
``--endpoint-target-ports``), the same watch runs with a fixed label selector
(any selector syntax, ``pods.selector``) and fixed target ports:
``InferencePoolSource.without_pool``.

The list is published as a tuple of ``Pod`` (ready pods only, ports = active
target ports), replaced whole on every change.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from pods.kubeapi import Backoff, ClusterConfig, Held, KubeApi, Object, reflect
from pods.model import Pod, is_ip
from pods.selector import LabelSelector

log = structlog.get_logger()

DEFAULT_GROUP: Final = "inference.networking.k8s.io"
DEFAULT_VERSION: Final = "v1"
ACTIVE_PORTS: Final = "inference.networking.k8s.io/active-ports"


class PoolSpecError(ValueError):
    """An InferencePool whose spec cannot be used (the message names the field)."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the picker needs from an InferencePool."""

    selector: LabelSelector
    ports: tuple[int, ...]
    picker: str = ""
    """``endpointPickerRef`` as ``name:port`` (for logs: the gateway, not us, calls it)."""


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """Read ``spec.selector.matchLabels``, ``spec.targetPorts`` and ``spec.endpointPickerRef``."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        raise PoolSpecError("spec.selector.matchLabels: required, at least one label")
    ports: list[int] = []
    for i, entry in enumerate(spec.get("targetPorts") or []):
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise PoolSpecError(f"spec.targetPorts[{i}].number: expected a port, got {number!r}")
        if number not in ports:
            ports.append(number)
    if not ports:
        raise PoolSpecError("spec.targetPorts: required, at least one port")
    ref = spec.get("endpointPickerRef") or {}
    picker = f"{ref.get('name', '')}:{(ref.get('port') or {}).get('number', '')}" if ref else ""
    selector = LabelSelector.from_labels({str(k): str(v) for k, v in labels.items()})
    return PoolSpec(selector, tuple(ports), picker)


def is_ready(pod: Mapping[str, Any]) -> bool:
    """GIE's ``IsPodReady``: not being deleted, and the Ready condition is True."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


_LEADING_INT = re.compile(r"[+-]?\d+")


def active_ports(pod: Mapping[str, Any], target_ports: tuple[int, ...]) -> tuple[int, ...]:
    """The target ports this pod serves: all, unless the active-ports annotation limits them.

    As GIE's ``extractActivePorts``: each comma-separated item is read as a
    number (leading digits, like Go's ``Sscanf("%d")``); items that are not
    target ports are ignored; a present but empty annotation leaves none.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if ACTIVE_PORTS not in annotations:
        return target_ports
    listed: set[int] = set()
    for item in str(annotations[ACTIVE_PORTS]).split(","):
        number = _LEADING_INT.match(item.strip())
        if number:
            listed.add(int(number.group()))
    return tuple(port for port in target_ports if port in listed)


def to_pod(obj: Mapping[str, Any], spec: PoolSpec) -> Pod | None:
    """The pool's view of one Kubernetes pod, or None when it has no endpoint to offer."""
    metadata = obj.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    address = (obj.get("status") or {}).get("podIP")
    if not is_ready(obj) or not isinstance(address, str) or not is_ip(address):
        return None
    if not spec.selector.matches(labels):
        return None
    ports = active_ports(obj, spec.ports)
    if not ports:
        return None
    name, namespace = str(metadata.get("name")), str(metadata.get("namespace") or "")
    return Pod(name=name, address=address, ports=ports, labels=labels, namespace=namespace)


class _Pool:
    """The InferencePool collection, filtered to the one pool by name."""

    def __init__(self, owner: InferencePoolSource) -> None:
        self.owner = owner

    def replace(self, items: list[Object]) -> None:
        self.owner.set_pool(items[0] if items else None)

    def apply(self, kind: str, obj: Object) -> None:
        self.owner.set_pool(None if kind == "DELETED" else obj)


class InferencePoolSource:
    """A ``PodSource`` for one InferencePool: its ready pods, one ``Pod`` per pod.

    ``synced`` turns true once the pool has been read and its pods listed
    (GIE's readiness: the pool is known), and stays true.
    """

    def __init__(
        self,
        config: ClusterConfig,
        name: str,
        namespace: str,
        group: str = DEFAULT_GROUP,
        version: str = DEFAULT_VERSION,
        backoff: Callable[[], Backoff] = Backoff,
        watch_timeout: int = 300,
    ) -> None:
        self.config, self.name, self.namespace = config, name, namespace
        self.pool_path = f"/apis/{group}/{version}/namespaces/{namespace}/inferencepools"
        self.pods_path = f"/api/v1/namespaces/{namespace}/pods"
        self.spec: PoolSpec | None = None
        self._backoff = backoff
        self._watch_timeout = watch_timeout
        self.pods: tuple[Pod, ...] = ()
        """The pods as last read (``PodSource``): replaced whole, never changed in place."""
        self.synced = False
        """True once the pods were read (``PodSource``)."""
        self._held = Held(self.publish)
        self._rewatch = asyncio.Event()
        self._fixed = False

    @classmethod
    def without_pool(
        cls,
        config: ClusterConfig,
        namespace: str,
        selector: LabelSelector,
        ports: tuple[int, ...],
        **options: Any,
    ) -> InferencePoolSource:
        """The pods ``selector`` matches in ``namespace``, on ``ports``: no InferencePool read."""
        source = cls(config, "", namespace, **options)
        source._fixed = True
        source.set_pool(None, PoolSpec(selector, ports))
        return source

    def set_pool(self, obj: Object | None, spec: PoolSpec | None = None) -> None:
        """A new state of the pool (None: deleted or absent), or a ``spec`` given whole."""
        if obj is not None:
            try:
                spec = pool_spec(obj)
            except PoolSpecError as error:
                # The API server validates the CRD, so this is a pool written
                # under another schema; serve nothing rather than guess.
                log.error("inference pool rejected", pool=self.name, error=str(error))
        if spec == self.spec:
            return
        old, self.spec = self.spec, spec
        log.info(
            "inference pool",
            pool=self.name,
            namespace=self.namespace,
            selector=str(spec.selector) if spec else None,
            target_ports=list(spec.ports) if spec else None,
            endpoint_picker=spec.picker if spec else None,
        )
        if old is None or spec is None or old.selector != spec.selector:
            self._rewatch.set()  # the pod watch's label selector changed: start it again
        self.publish()

    def publish(self) -> None:
        """Rebuild the pod tuple from the pool and the pods held, and swap it in whole."""
        spec = self.spec
        if spec is None:
            pods: tuple[Pod, ...] = ()
        else:
            found = (to_pod(obj, spec) for obj in self._held.objects.values())
            pods = tuple(sorted((pod for pod in found if pod is not None), key=lambda p: p.name))
        if pods != self.pods:
            self.pods = pods
            log.info("pods", pool=self.name, ready=[f"{p.name}@{p.address}" for p in pods])
        if spec is not None and self._held.listed:
            self.synced = True

    async def run(self) -> None:
        """Watch the pool; (re)start the pod watch whenever the pool's selector changes."""
        async with KubeApi(self.config) as api, asyncio.TaskGroup() as tasks:
            pool_params = {"fieldSelector": f"metadata.name={self.name}"}
            if not self._fixed:
                tasks.create_task(
                    reflect(
                        api,
                        self.pool_path,
                        pool_params,
                        _Pool(self),
                        self._backoff(),
                        self._watch_timeout,
                    )
                )
            pod_task: asyncio.Task[None] | None = None
            while True:
                await self._rewatch.wait()
                self._rewatch.clear()
                if pod_task is not None:
                    pod_task.cancel()
                    await asyncio.gather(pod_task, return_exceptions=True)
                    pod_task = None
                # Pods of the previous selector stay until the new list
                # replaces them; ``publish`` already hides those that no
                # longer match.
                self._held = Held(self.publish) if self.spec is None else self._held
                self._held.listed = False
                if self.spec is not None:
                    selector = str(self.spec.selector)
                    pod_task = tasks.create_task(
                        reflect(
                            api,
                            self.pods_path,
                            {"labelSelector": selector},
                            self._held,
                            self._backoff(),
                            self._watch_timeout,
                        )
                    )
                self.publish()
