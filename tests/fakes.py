"""Hand-written stand-ins shared by the tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from lwepp.contracts import Measurement
from pods.model import Pod, StaticSource


class StaticPods(StaticSource):
    """A fixed pod source that can also pretend not to have synced yet."""

    def __init__(self, *pods: Pod, synced: bool = True) -> None:
        super().__init__(*pods)
        self._synced = synced

    @property
    def synced(self) -> bool:
        return self._synced

    def replace(self, *pods: Pod) -> None:
        super().replace(*pods)
        self._synced = True


def pod(name: str, address: str, *ports: int, ready: bool = True, **labels: str) -> Pod:
    return Pod(name=name, address=address, ports=ports, labels=labels, ready=ready)


class RecordingStore:
    """An ``AttributeWriter`` that merges writes per endpoint, counts them, and wakes waiters."""

    def __init__(self) -> None:
        self.attributes: dict[str, dict[str, Measurement]] = {}
        self.writes: dict[str, int] = {}
        self._changed = asyncio.Event()

    def write(self, endpoint: str, values: Mapping[str, Measurement]) -> None:
        self.attributes.setdefault(endpoint, {}).update(values)
        self.writes[endpoint] = self.writes.get(endpoint, 0) + 1
        self._changed.set()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait (no timeout of its own: the test's bound applies) until ``predicate()`` holds."""
        while not predicate():
            self._changed.clear()
            await self._changed.wait()
