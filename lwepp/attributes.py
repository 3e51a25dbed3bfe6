"""Endpoint attributes: the store data sources write and picks read, and how sources run.

Data sources (metrics scrapers, model lists, a user's own) are plugins that
run in the background, each in its own task started by ``serving.server.serve``.
They write ``Measurement`` snapshots into one ``AttributeStore``; a pick reads
the store's ``snapshot`` once and builds its candidates from it. A pick never
waits for a source: it uses what was last measured, and each measurement
carries the time it was taken, so a plugin can tell fresh data from stale
(``Candidate.value(name, now, max_age)``).

No locks: every write builds new mappings and replaces the store's snapshot
reference in one step (copy-on-write), and a reader holds on to the snapshot
it took. Sources and picks share one event loop, so a write never runs in the
middle of a pick, and a pick's snapshot never changes under it either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import structlog

from lwepp.contracts import DataSource, Measurement
from pods.model import Endpoint

log = structlog.get_logger()

Snapshot = Mapping[str, Mapping[str, Measurement]]
"""Each endpoint's (``ip:port``) measurements by attribute name."""

NO_ATTRIBUTES: Final[Mapping[str, Measurement]] = MappingProxyType({})


class AttributeStore:
    """The latest measurement of each attribute of each endpoint (``hooks.AttributeWriter``).

    ``snapshot`` is read-only and never changes once taken: a write makes a
    new one. Writing one endpoint copies the top-level mapping (one entry per
    endpoint, tens to hundreds), which is cheap next to the scrape behind it.
    """

    __slots__ = ("_snapshot",)

    def __init__(self) -> None:
        self._snapshot: Snapshot = MappingProxyType({})

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def write(self, endpoint: str, values: Mapping[str, Measurement]) -> None:
        """Replace ``endpoint``'s measurements of the attributes in ``values``; keep the others."""
        if not values:
            return
        merged = MappingProxyType({**self._snapshot.get(endpoint, NO_ATTRIBUTES), **values})
        self._snapshot = MappingProxyType({**self._snapshot, endpoint: merged})

    def retain(self, endpoints: Collection[str]) -> None:
        """Forget every endpoint not in ``endpoints`` (those that left the pool)."""
        if any(endpoint not in endpoints for endpoint in self._snapshot):
            kept = {e: values for e, values in self._snapshot.items() if e in endpoints}
            self._snapshot = MappingProxyType(kept)

    def describe(self, now: float) -> dict[str, dict[str, Any]]:
        """Every measurement with its age in seconds, JSON-ready (``/debug/attributes``)."""
        return {
            endpoint: {
                name: {"value": plain(m.value), "age": round(now - m.at, 3)}
                for name, m in sorted(values.items())
            }
            for endpoint, values in sorted(self._snapshot.items())
        }


def plain(value: float | frozenset[str]) -> float | list[str]:
    """A measured value as JSON can carry it: numbers as they are, sets as sorted lists."""
    return sorted(value) if isinstance(value, frozenset) else value


OnError = Callable[[str, BaseException], None]
"""Told the source's name and its exception when a source fails (to count and log it)."""


async def keep_running(
    source: DataSource,
    endpoints: Callable[[], Sequence[Endpoint]],
    store: AttributeStore,
    clock: Callable[[], float],
    on_error: OnError,
    *,
    restart_delay: float = 1.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Run one data source until cancelled; when it fails, report it and start it again.

    A source that raises would otherwise end its task silently and its data
    would only grow stale. After ``restart_delay`` seconds it runs again; what
    it wrote before stays in the store, ageing, meanwhile. A source that
    returns has finished on purpose and is not restarted.
    """
    while True:
        try:
            await source.run(endpoints, store, clock)
        except Exception as error:
            on_error(source.name, error)
            await sleep(restart_delay)
        else:
            log.info("data source finished", source=source.name)
            return


async def forget_departed(
    store: AttributeStore,
    endpoints: Callable[[], Sequence[Endpoint]],
    interval: float = 10.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Every ``interval`` seconds, drop the attributes of endpoints no longer in the pool."""
    while True:
        await sleep(interval)
        store.retain({e.hostport for e in endpoints()})
