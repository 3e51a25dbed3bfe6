"""Pods, endpoints and the snapshot both services read.

A *pod* is one model-server replica: an address, the ports it serves on and
its labels. An *endpoint* is one ``address:port`` an endpoint picker can name;
a data-parallel pod that runs one engine per port is several endpoints, the
same rule as GIE's InferencePool (each target port of each ready pod).

Snapshots are tuples of frozen dataclasses, replaced whole when the source
changes, so a request reads one consistent list without any lock.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from pods.selector import LabelSelector


def _frozen(labels: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(labels))


@dataclass(frozen=True, slots=True)
class Pod:
    """One model-server replica as a pod source reports it.

    ``namespace`` is the pod's Kubernetes namespace when its source knows one
    (the InferencePool's, an llm-d endpoints file's entry), else empty; with
    ``name`` it is the pod's identity in the llm-d router's session tokens.
    """

    name: str
    address: str
    ports: tuple[int, ...]
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    ready: bool = True
    namespace: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))

    def matches(self, selector: Mapping[str, str] | LabelSelector) -> bool:
        """True when the labels satisfy ``selector``: a ``LabelSelector``, or ``key: value``
        pairs that must all be among the labels."""
        if isinstance(selector, LabelSelector):
            return selector.matches(self.labels)
        return all(self.labels.get(key) == value for key, value in selector.items())


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ``address:port`` that can serve a request (of ``pod``, in ``namespace`` if known)."""

    pod: str
    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    namespace: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))
        object.__setattr__(self, "hostport", join_host_port(self.address, self.port))

    # Computed once: it is what goes on the wire for every pick.
    hostport: str = field(init=False, default="", compare=False)


def join_host_port(address: str, port: int | str) -> str:
    """``ip:port``, with brackets around an IPv6 address (as Go's ``JoinHostPort``)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def endpoints_of(
    pods: tuple[Pod, ...], selector: Mapping[str, str] | LabelSelector
) -> tuple[Endpoint, ...]:
    """Every port of every ready pod whose labels match ``selector``, in file order."""
    return tuple(
        Endpoint(pod.name, pod.address, port, pod.labels, pod.namespace)
        for pod in pods
        if pod.ready and pod.matches(selector)
        for port in pod.ports
    )


def parse_selector(text: str) -> dict[str, str]:
    """``pool=a,tier=gold`` → ``{"pool": "a", "tier": "gold"}``; empty text selects every pod."""
    selector: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got {item!r}")
        selector[key.strip()] = value.strip()
    return selector


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class PodSource(Protocol):
    """Where the pod list comes from: a YAML file (``pods.file``) or an InferencePool.

    A source keeps ``pods`` current by replacing the tuple whole; readers take
    the attribute once per request and never see a half-applied change.
    """

    @property
    def pods(self) -> tuple[Pod, ...]:
        """The pods as last read; empty until the first successful read."""
        ...

    @property
    def synced(self) -> bool:
        """True once the source has read its pods at least once."""
        ...

    async def run(self) -> None:
        """Keep ``pods`` current until cancelled."""
        ...


class StaticSource:
    """A fixed pod list (tests, benchmarks, or pods given on the command line)."""

    def __init__(self, *pods: Pod) -> None:
        self._pods = pods

    @property
    def pods(self) -> tuple[Pod, ...]:
        return self._pods

    @property
    def synced(self) -> bool:
        return True

    def replace(self, *pods: Pod) -> None:
        """Swap the whole list, as a watching source would on a change."""
        self._pods = pods

    async def run(self) -> None:
        return None
