"""Hand-written stand-ins shared by the tests."""

from __future__ import annotations

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
