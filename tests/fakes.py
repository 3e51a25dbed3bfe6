"""Hand-written stand-ins shared by the tests."""

from __future__ import annotations

from pods.model import Pod


class StaticPods:
    """A pod source whose list the test sets directly."""

    def __init__(self, *pods: Pod, synced: bool = True) -> None:
        self._pods = tuple(pods)
        self._synced = synced

    @property
    def pods(self) -> tuple[Pod, ...]:
        return self._pods

    @property
    def synced(self) -> bool:
        return self._synced

    def replace(self, *pods: Pod) -> None:
        self._pods = tuple(pods)
        self._synced = True

    async def run(self) -> None:
        return None


def pod(name: str, address: str, *ports: int, ready: bool = True, **labels: str) -> Pod:
    return Pod(name=name, address=address, ports=ports, labels=labels, ready=ready)
