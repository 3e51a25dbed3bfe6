"""Poll every endpoint over HTTP, each on its own task: the loop both data sources share.

``HttpSource`` is the part of a data source that is the same for ``/metrics``
and ``/v1/models``: where and how often to ask, the request, the loop; a
source adds only how to read one answer.

One task per endpoint, not one round over all of them: a round would wait
for its slowest member, so one hung model server would hold up everyone's
next measurement. Here each endpoint is asked again ``interval`` seconds
after its previous answer (or failure), a request gives up after
``timeout`` seconds, and a pick never waits on any of it: picks read what the
store holds.

What a failure leaves behind is the point of the design: nothing is written,
so the endpoint's last measurements stay in the store with their old
timestamps and grow stale, and each plugin's ``max_age`` turns them into
"unknown". A dead endpoint is never reported as idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import ClassVar, Final

import aiohttp
import structlog

from lwepp.contracts import AttributeWriter, Clock, EndpointsNow, Measurement
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint

log = structlog.get_logger()

Values = Mapping[str, float | frozenset[str]]
"""Attribute → value, only those an endpoint reported."""

SCHEMES: Final = ("http", "https")


class HttpSource:
    """A data source that asks every endpoint ``<scheme>://<ip:port><path>``.

    A subclass names what it polls (``what``, for logs and task names), its
    default path and interval, and reads one 200 answer in ``answer``; asking
    (``fetch``) and the loop (``run``, the ``DataSource`` contract) are here.

    Parameters both sources share: ``scheme``, ``path`` and
    ``insecureSkipVerify`` are the llm-d router's (default ``http``, the
    subclass's path, true); ``refreshIntervalSeconds`` (the subclass's
    interval) and ``timeoutSeconds`` (1.0) are Switchyard's (the router sets
    them by flag).
    """

    what: ClassVar[str]
    default_path: ClassVar[str]
    default_interval: ClassVar[float]

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.scheme = params.get("scheme", str, "http")
        if self.scheme not in SCHEMES:
            raise params.error("scheme", f"expected one of {', '.join(SCHEMES)}")
        self.path = params.get("path", str, self.default_path)
        if not self.path.startswith("/"):
            raise params.error("path", f"must start with '/', got {self.path!r}")
        self.interval = params.get("refreshIntervalSeconds", float, self.default_interval, above=0)
        self.timeout = params.get("timeoutSeconds", float, 1.0, above=0)
        self.verify_tls = not params.get("insecureSkipVerify", bool, True)

    async def answer(self, endpoint: Endpoint, response: aiohttp.ClientResponse) -> Values:
        """The attributes one 200 answer of ``endpoint`` holds; raise if it holds none."""
        raise NotImplementedError

    async def fetch(self, session: aiohttp.ClientSession, endpoint: Endpoint) -> Values:
        """Ask one endpoint once; raises on a refused connection, a timeout, a non-200 or
        an answer ``answer`` rejects."""
        async with session.get(f"{self.scheme}://{endpoint.hostport}{self.path}") as response:
            response.raise_for_status()
            return await self.answer(endpoint, response)

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None:
        """Keep one polling task per current endpoint until cancelled.

        Every ``interval`` seconds the endpoint list is read again: a new
        endpoint gets a task at once (its first answer arrives without waiting
        a round), one that left has its task cancelled. An endpoint whose
        labels changed is a new endpoint (its engine may have changed).
        """
        tasks: dict[Endpoint, asyncio.Task[None]] = {}
        # One connection per endpoint at most (each task waits for its answer): no pool limit.
        connector = aiohttp.TCPConnector(limit=0, ssl=self.verify_tls)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            try:
                while True:
                    current = set(endpoints())
                    for gone in tasks.keys() - current:
                        tasks.pop(gone).cancel()
                    for endpoint in current - tasks.keys():
                        tasks[endpoint] = asyncio.create_task(
                            self.poll(session, endpoint, store, clock),
                            name=f"{self.what} {endpoint.hostport}",
                        )
                    await asyncio.sleep(self.interval)
            finally:
                for task in tasks.values():
                    task.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def poll(
        self,
        session: aiohttp.ClientSession,
        endpoint: Endpoint,
        store: AttributeWriter,
        clock: Callable[[], float],
    ) -> None:
        """Ask ``endpoint`` every ``interval`` seconds after its last answer, until cancelled."""
        failing = False
        while True:
            try:
                values = await self.fetch(session, endpoint)
            except Exception as error:  # a bad page or a bug must not end this endpoint's polling
                if not failing:  # log the change, not every failed round
                    log.warning(
                        f"{self.what} failed", endpoint=endpoint.hostport, error=repr(error)
                    )
                    failing = True
            else:
                if failing:
                    log.info(f"{self.what} recovered", endpoint=endpoint.hostport)
                    failing = False
                if values:
                    # Stamped when the answer arrived: that is when the values were true.
                    at = clock()
                    measured = {k: Measurement(v, at) for k, v in values.items()}
                    store.write(endpoint.hostport, measured)
            await asyncio.sleep(self.interval)
