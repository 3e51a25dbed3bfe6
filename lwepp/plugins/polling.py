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

import argparse
import asyncio
import ssl
from collections.abc import Callable, Mapping
from typing import ClassVar, Final

import aiohttp
import structlog

from lwepp.contracts import AttributeWriter, Clock, EndpointsNow, Measurement
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint, join_host_port
from serving.cli import duration

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
    subclass's path, true); so are v0.10's ``port`` (ask every endpoint on this
    port instead of its own: an engine serving metrics apart), ``interval`` (a
    Go duration, ``1s``) and, with ``https``, ``caCertPath`` (a PEM bundle the
    engine's certificate must chain to, read only when ``insecureSkipVerify``
    is false, as the router reads it) and ``clientCertPath`` with
    ``clientKeyPath`` (a client certificate: mutual TLS, so the engine can
    require it). Every file is read when the configuration is loaded: a
    missing or unreadable one is refused there, naming the field.
    ``refreshIntervalSeconds`` (the subclass's interval; ``interval`` overrides
    it) and ``timeoutSeconds`` (1.0) are Switchyard's (the router sets them by
    flag).
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
        if every := params.get("interval", str, ""):
            try:
                self.interval = duration(every)
            except argparse.ArgumentTypeError as error:
                raise params.error("interval", str(error)) from None
            if self.interval <= 0:
                raise params.error("interval", f"must be > 0, got {every!r}")
        self.port = params.get("port", int, 0)
        if "port" in params and not 1 <= self.port <= 65535:
            raise params.error("port", f"expected a port 1-65535, got {self.port}")
        self.timeout = params.get("timeoutSeconds", float, 1.0, above=0)
        self.verify_tls = not params.get("insecureSkipVerify", bool, True)
        self.ssl = _tls(params, self.verify_tls)
        """What the connections verify and present: False (nothing verified), or a context."""
        self.problems: dict[str, str] = {}
        """Endpoints (``ip:port``) whose last answer gave nothing usable, and why (``note``):
        the pipeline counts them in ``llm_d_epp_data_source_unusable_endpoints``."""

    def unusable(self, endpoint: Endpoint, values: Values) -> str | None:
        """Why an answer of ``endpoint`` gave nothing a picker can use, or None if it did."""
        return None if values else "the answer held no attribute"

    def note(self, endpoint: Endpoint, problem: str | None) -> None:
        """Keep ``problem`` as ``endpoint``'s (None: it reads fine now), logged when it changes:
        a source that reads nothing usable says so from its first round, naming the endpoint."""
        key = endpoint.hostport
        if problem == self.problems.get(key):
            return
        if problem is None:
            del self.problems[key]
            log.info(f"{self.what} usable again", source=self.name, endpoint=key)
        else:
            self.problems[key] = problem
            log.warning(
                f"{self.what} reads nothing usable", source=self.name, endpoint=key, problem=problem
            )

    async def answer(self, endpoint: Endpoint, response: aiohttp.ClientResponse) -> Values:
        """The attributes one 200 answer of ``endpoint`` holds; raise if it holds none."""
        raise NotImplementedError

    async def fetch(self, session: aiohttp.ClientSession, endpoint: Endpoint) -> Values:
        """Ask one endpoint once; raises on a refused connection, a timeout, a non-200 or
        an answer ``answer`` rejects."""
        where = join_host_port(endpoint.address, self.port) if self.port else endpoint.hostport
        async with session.get(f"{self.scheme}://{where}{self.path}") as response:
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
        connector = aiohttp.TCPConnector(limit=0, ssl=self.ssl)
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
        while True:
            try:
                values = await self.fetch(session, endpoint)
            except Exception as error:  # a bad page or a bug must not end this endpoint's polling
                self.note(endpoint, f"{self.what} failed: {error!r}")
            else:
                self.note(endpoint, self.unusable(endpoint, values))
                if values:
                    # Stamped when the answer arrived: that is when the values were true.
                    at = clock()
                    measured = {k: Measurement(v, at) for k, v in values.items()}
                    store.write(endpoint.hostport, measured)
            await asyncio.sleep(self.interval)


def _tls(params: Params, verify: bool) -> ssl.SSLContext | bool:
    """The TLS the scrapes use (``https``): the router's rules, files read now."""
    ca = params.get("caCertPath", str, "")
    cert, key = params.get("clientCertPath", str, ""), params.get("clientKeyPath", str, "")
    if bool(cert) != bool(key):
        raise params.error("clientCertPath", "set clientCertPath and clientKeyPath together")
    if not (verify or cert):
        return False
    context = ssl.create_default_context()
    if not verify:  # a client certificate, and no verification of the engine's
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        if verify and ca:
            field = "caCertPath"
            context.load_verify_locations(cafile=ca)
        if cert:
            field = "clientCertPath"
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise params.error(field, f"cannot load: {error}") from None
    return context
