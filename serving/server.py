"""Serving an ext_proc handler: the gRPC stream, health, metrics, logs and shutdown.

Both services run the same way: one ``grpc.aio`` server for the ext_proc
stream, a second gRPC server on its own port for the standard health service
(as GIE's endpoint picker does, so probes never queue behind traffic), and a
small HTTP server for Prometheus metrics. ``serve`` owns all three and the
background tasks a service needs, and takes them down in order on SIGTERM.

A service hands ``serve`` a ``Service`` (what it serves: its handler, health,
metrics, background work and debug pages) and the ``ServingOptions`` its
flags made (how: ports, TLS, shutdown...); ``serving.cli.run`` is the one
way every command line gets there. ``serving.workers`` runs N processes of a
service on one port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import grpc
import structlog
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from serving.metrics_auth import MetricsAuth
from serving.options import Ports, ServingOptions
from serving.workers import WORKER_ENV
from wire.stream import Handler, ext_proc_handler

log = structlog.get_logger()


MIN_PING_INTERVAL_MS: Final = 1_000
"""The shortest gap between two HTTP/2 PINGs a client may leave without being told off.

A gateway pings its ext_proc connections to notice a service that hangs
(Envoy's ``connection_keepalive``; the demo's Envoy pings every 5 s). gRPC
core's server counts a PING that comes sooner than
``grpc.http2.min_ping_interval_without_data_ms`` after the last one, while
it has sent nothing, as a *strike*; after ``grpc.http2.max_ping_strikes``
(2) it closes the connection with GOAWAY ``ENHANCE_YOUR_CALM``
"too_many_pings", and every request on it fails (Envoy: 503
``ext_proc_error``). Its default minimum is 5 minutes, and "sent nothing"
is exactly the state of a picker's stream while the model server works on a
non-streamed answer: the picker has answered the request and waits for the
response headers. So with the defaults a response-listening picker lost
every request whose answer took longer than about three of Envoy's pings.

One second admits any keepalive a gateway is configured with in practice
(gRFC A8 clients start at 10 s; Envoy's has no default, the demo's is 5 s
with 15% jitter) while still refusing a PING flood.
"""

PING_POLICY: Final = (
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),
)
"""The HTTP/2 PING policy of every gRPC server here (ext_proc and health).

``keepalive_permit_without_calls``: a connection with no stream open is held
to the same minimum (gRPC's default holds it to 2 hours): a gateway keeps
its connection to the picker between requests, and pings it all the same.
"""

EXT_PROC_OPTIONS: Final = (
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
)
"""How many new streams the ext_proc server may hold before the event loop takes them.

gRPC's defaults (1,000, and 3,000 at most) make it reset some streams of a
burst past 1,000 (``RST_STREAM``), and Envoy answers those requests 503: each
request in flight is one Envoy stream to each service. A held stream is a
request the gateway accepted; it is served once the loop gets to it.
"""


@dataclass(slots=True)
class Health:
    """The health services a replica reports, and whether it is ready to serve.

    ``names`` are SERVING while ``ready()`` returns true (GIE's picker waits
    for its endpoint list the same way; a standby replica under leader
    election is not ready) and NOT_SERVING when shutdown starts, so a load
    balancer stops sending new streams before the server stops accepting them.
    ``live`` names are SERVING from start to shutdown whatever ``ready()``
    says: a liveness probe on them does not restart a healthy standby.
    ``interval`` is how often ``ready()`` is polled (seconds). To wait for a
    change, watch it (the health service's ``Watch`` streams every change)
    rather than polling ``Check``.
    """

    names: Sequence[str]
    ready: Callable[[], bool] = lambda: True
    servicer: Any = field(default_factory=health.aio.HealthServicer)
    live: Sequence[str] = ()
    interval: float = 0.1

    async def set_all(self, serving: bool, names: Sequence[str] | None = None) -> None:
        """Set ``names`` (default: all, live ones included) to SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (*self.names, *self.live) if names is None else names:
            await self.servicer.set(name, status)

    async def watch_ready(self) -> None:
        """Follow ``ready()``: SERVING while it holds, NOT_SERVING while it does not.

        Polled every ``interval``, as GIE's picker polls its datastore every
        100 ms: readiness is a property of the pod source (and the lease),
        which have no event to wait on.
        """
        await self.set_all(True, self.live)
        serving = False
        while True:
            if self.ready() != serving:
                serving = not serving
                await self.set_all(serving, self.names)
            await asyncio.sleep(self.interval)


JsonRoutes = Mapping[str, Callable[[], bytes]]
"""Extra GET paths on the metrics port, each answering the JSON its function returns."""


def runtime() -> bytes:
    """``GET /debug/runtime``: what the process holds now, to see leaks in a long run.

    Resident memory, open file descriptors and asyncio tasks (each stream of
    the grpc.aio server is one) as JSON. Read from ``/proc``: Linux only, as
    the services' images are.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * page
    state = {
        "pid": os.getpid(),
        "rss_bytes": resident,
        "open_fds": len(os.listdir("/proc/self/fd")),
        "asyncio_tasks": len(asyncio.all_tasks()),
        "threads": threading.active_count(),
    }
    return json.dumps(state).encode()


def _json_page(render: Callable[[], bytes]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def page(_request: web.Request) -> web.Response:
        return web.Response(body=render(), content_type="application/json")

    return page


def _guard(auth: MetricsAuth) -> Any:
    """Middleware: every path of the metrics port answers only a caller ``auth`` allows."""

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        authorization = request.headers.get("Authorization", "")
        denial = await auth.check(authorization, request.method, request.path)
        if denial is not None:
            return web.Response(status=denial.status, text=denial.message + "\n")
        return await handler(request)

    return guard


async def _metrics_app(
    registry: CollectorRegistry,
    host: str,
    port: int,
    json_routes: JsonRoutes | None,
    auth: MetricsAuth | None,
) -> web.AppRunner:
    async def metrics(_request: web.Request) -> web.Response:
        # As a header: aiohttp refuses a content_type argument with a charset in it.
        headers = {"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        return web.Response(body=generate_latest(registry), headers=headers)

    app = web.Application(middlewares=[_guard(auth)] if auth is not None else [])
    app.router.add_get("/metrics", metrics)
    if json_routes is not None:
        app.router.add_get("/debug/runtime", _json_page(runtime))
        for path, render in json_routes.items():
            app.router.add_get(path, _json_page(render))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    raise RuntimeError("metrics server is not listening")


@dataclass(frozen=True, slots=True)
class Service:
    """What one service hands ``serve``: what it serves, as its flags and config made it.

    ``name``: in the logs. ``handler``: one call per ext_proc stream.
    ``health``: the names it reports, and when it is ready. ``registry``: its
    Prometheus metrics. ``background``: tasks that run while it serves (pod
    watching, scraping...), cancelled at shutdown. ``debug_pages``: GET paths
    beside ``/metrics``, each answering JSON (served only with
    ``ServingOptions.debug_pages``: they tell whoever reaches the port about
    the traffic). ``stopping``: called when the service stops taking new
    work, before it waits for open streams (a picker's flow control then
    answers every request it holds). ``announce``: more fields for the ``listening`` log line,
    which is how a gateway that starts the service learns its ports (and
    whether it needs the response: LWEPP's ``response_headers``, BBR's
    ``response``).
    """

    name: str
    handler: Handler
    health: Health
    registry: CollectorRegistry
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()
    debug_pages: JsonRoutes = field(default_factory=dict)
    announce: Mapping[str, Any] = field(default_factory=dict)
    stopping: Sequence[Callable[[], None]] = ()


async def serve(
    service: Service,
    options: ServingOptions,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[Ports], Awaitable[None] | None] | None = None,
) -> None:
    """Serve ``service`` as ``options`` say until SIGTERM/SIGINT, or, given ``stop``, until set.

    ``on_listening`` hears the ports once all three servers listen (0s in
    ``options.ports`` resolved). The ext_proc port serves TLS when
    ``options.tls`` is set (``serving.tls``); the health port stays
    plaintext, for kubelet's probes; the metrics port answers only the
    callers the Kubernetes API allows when ``options.metrics_auth`` is set.

    Order of shutdown: health goes NOT_SERVING (the ``live`` names stay
    SERVING), the ext_proc server keeps accepting streams for
    ``options.drain`` seconds while load balancers take the replica out (the
    llm-d router's ``--drain-timeout``; a second signal, or ``stop`` set
    again, ends the drain early), then calls ``service.stopping``, stops
    accepting new streams and gives in-flight streams ``options.grace``
    seconds to finish; then background tasks are cancelled and the side
    servers close.
    """
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    with _trace_file(options.trace_messages) as trace:
        await _serve(service, options, stop, on_listening, trace)


def _trace_file(path: str | None) -> contextlib.AbstractContextManager[TextIO | None]:
    """``--trace-messages``'s file, opened to append (nothing without one)."""
    return open(path, "a") if path else contextlib.nullcontext()


async def _serve(
    service: Service,
    options: ServingOptions,
    stop: asyncio.Event,
    on_listening: Callable[[Ports], Awaitable[None] | None] | None,
    trace: TextIO | None,
) -> None:
    ports, health_state = options.ports, service.health
    # SO_REUSEPORT (grpc's default on Linux, spelled out): the workers of
    # ``serving.workers`` bind the same ext_proc and health ports. PING_POLICY: a
    # gateway's keepalive on a quiet stream is no abuse.
    shared = [("grpc.so_reuseport", 1), *PING_POLICY]
    server = grpc.aio.server(options=[*shared, *EXT_PROC_OPTIONS, *options.grpc_options])
    server.add_generic_rpc_handlers((ext_proc_handler(service.handler, trace),))
    address = f"{ports.host}:{ports.grpc}"
    if options.tls is None:
        grpc_port = server.add_insecure_port(address)
    else:
        grpc_port = server.add_secure_port(address, options.tls.credentials())
    if options.health_on_ext_proc:
        health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)

    health_server = grpc.aio.server(options=shared)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, health_server)
    health_port = health_server.add_insecure_port(f"{ports.host}:{ports.health}")
    await health_state.set_all(False)

    pages = service.debug_pages if options.debug_pages else None
    metrics = await _metrics_app(
        service.registry, ports.host, ports.metrics, pages, options.metrics_auth
    )
    await health_server.start()
    await server.start()
    tasks = [asyncio.create_task(job()) for job in service.background]
    watcher = asyncio.create_task(health_state.watch_ready())
    tasks.append(watcher)

    bound = Ports(ports.host, grpc_port, health_port, _bound_port(metrics))
    worker = os.environ.get(WORKER_ENV)
    log.info(
        "listening",
        service=service.name,
        host=bound.host,
        grpc_port=bound.grpc,
        health_port=bound.health,
        metrics_port=bound.metrics,
        tls=options.tls is not None,
        pid=os.getpid(),
        **({"worker": worker} if worker else {}),
        **service.announce,
    )
    if on_listening is not None:
        result = on_listening(bound)
        if result is not None:
            await result
    try:
        await stop.wait()
        if options.drain > 0:
            log.info("draining", service=service.name, drain_seconds=options.drain)
            watcher.cancel()  # readiness no longer follows ready(): it is over
            await health_state.set_all(False, health_state.names)
            stop.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), options.drain)
    finally:
        log.info("stopping", service=service.name, grace_seconds=options.grace)
        await health_state.set_all(False)
        for hook in service.stopping:
            hook()
        await server.stop(options.grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await health_server.stop(0)
        await metrics.cleanup()
        log.info("stopped", service=service.name)
