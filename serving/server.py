"""Serving an ext_proc handler: the gRPC stream, health, metrics, logs and shutdown.

Both services run the same way: one ``grpc.aio`` server for the ext_proc
stream, a second gRPC server on its own port for the standard health service
(as GIE's endpoint picker does, so probes never queue behind traffic), and a
small HTTP server for Prometheus metrics. ``serve`` owns all three and the
background tasks a service needs, and takes them down in order on SIGTERM.

One Python process serves one core: the event loop runs the handlers one at
a time. ``run_workers`` runs N copies of a service (``--workers N``) on the
same ext_proc and health ports, which Linux spreads over them by connection
(``SO_REUSEPORT``); each worker keeps its own state, and the supervisor serves
their metrics, summed, on the one metrics port (prometheus_client's
multiprocess mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.metadata
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TextIO

import grpc
import structlog
from aiohttp import web
from google.protobuf import text_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest, multiprocess, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from serving.metrics_auth import MetricsAuth
from serving.tls import ServerTLS
from wire.extproc import ProcessingRequest, ProcessingResponse

WORKER_ENV: Final = "SWITCHYARD_WORKER"
"""Set by ``run_workers`` in each worker's environment: ``<index>/<count>``."""

MULTIPROCESS_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's switch to multiprocess mode: where each process writes its samples."""

EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC service name Envoy calls; also a health service name the GIE protocol lists."""

log = structlog.get_logger()


class Call(Protocol):
    """The two methods of grpc.aio's servicer context a stream uses (grpcio ships no types)."""

    async def read(self) -> Any:
        """The next request, decoded (a ``ProcessingRequest``), or ``grpc.aio.EOF``."""
        ...

    async def write(self, message: ProcessingResponse) -> None:
        """Send one response, encoded by the method's serializer."""
        ...


class Stream:
    """One ext_proc exchange as seen by a handler: receive requests, send responses.

    A thin wrapper over the call's context: ``context.read()`` and
    ``context.write()`` cost measurably less per message than iterating the
    request stream in an async generator (``bench/codec.py``), and a plain
    ``while`` loop over ``recv()`` reads just as clearly.
    """

    __slots__ = ("_context",)

    def __init__(self, context: Call) -> None:
        self._context = context

    async def recv(self) -> ProcessingRequest | None:
        """The next message from Envoy, or None once Envoy has half-closed the stream."""
        message = await self._context.read()
        return None if message is grpc.aio.EOF else message

    async def send(self, response: ProcessingResponse) -> None:
        """Send one response; responses must follow the order of the requests."""
        await self._context.write(response)


class TracedStream(Stream):
    """A stream that also writes every message, both ways, to a trace file.

    For learning and debugging (``--trace-messages``): each message appears
    in protobuf text format under a line naming the stream, the direction
    and the phase. Never on in production: it costs far more than the work.
    """

    __slots__ = ("_number", "_trace")

    def __init__(self, context: Call, trace: TextIO, number: int) -> None:
        super().__init__(context)
        self._trace, self._number = trace, number

    def _write(self, arrow: str, message: ProcessingRequest | ProcessingResponse) -> None:
        phase: str | None = (
            message.WhichOneof("request")
            if isinstance(message, ProcessingRequest)
            else message.WhichOneof("response")
        )
        text = text_format.MessageToString(message, as_utf8=True)
        self._trace.write(f"## stream {self._number} {arrow} {phase}\n{text}\n")
        self._trace.flush()

    async def recv(self) -> ProcessingRequest | None:
        message = await super().recv()
        if message is not None:
            self._write("<-", message)
        return message

    async def send(self, response: ProcessingResponse) -> None:
        self._write("->", response)
        await super().send(response)


class Handler(Protocol):
    """What a service provides: the whole life of one ext_proc stream."""

    async def __call__(self, stream: Stream) -> None:
        """Read messages with ``stream.recv()`` until None, answering each phase.

        Returning ends the call with OK. Raising ``grpc.aio.AbortError`` (from
        ``abort``) ends it with that status; any other exception is logged and
        ends it with ``UNKNOWN``.
        """
        ...


def ext_proc_handler(handler: Handler, trace: TextIO | None = None) -> grpc.GenericRpcHandler:
    """Bind ``handler`` to ``ExternalProcessor/Process`` with xds-protos' codec.

    With ``trace``, every message of every stream is also written there.
    """
    numbers = itertools.count(1)

    async def process(_requests: object, context: Call) -> None:
        if trace is None:
            await handler(Stream(context))
        else:
            await handler(TracedStream(context, trace, next(numbers)))

    method = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method})


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


@dataclass(frozen=True, slots=True)
class Ports:
    """Where a service listens; 0 asks the OS for a free port."""

    host: str = "127.0.0.1"
    grpc: int = 9002
    health: int = 9003
    metrics: int = 9090


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


def build_info() -> tuple[str, str]:
    """``(commit, build_ref)`` for the services' ``*_info`` metrics: the commit an image was
    built from (``SWITCHYARD_COMMIT``, which the image builds set) and the package version."""
    try:
        version = importlib.metadata.version("switchyard")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return os.environ.get("SWITCHYARD_COMMIT", "unknown"), version


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


async def serve(
    name: str,
    handler: Handler,
    ports: Ports,
    health_state: Health,
    registry: CollectorRegistry,
    *,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    grace: float = 10.0,
    trace: TextIO | None = None,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[Ports], Awaitable[None] | None] | None = None,
    json_routes: JsonRoutes | None = None,
    tls: ServerTLS | None = None,
    drain: float = 0.0,
    grpc_options: Sequence[tuple[str, Any]] = (),
    health_on_ext_proc: bool = False,
    metrics_auth: MetricsAuth | None = None,
    announce: Mapping[str, Any] | None = None,
) -> None:
    """Run a service until SIGTERM/SIGINT, or, when ``stop`` is given, until it is set.

    ``announce``: more fields for the ``listening`` log line, which is how a
    gateway that starts the service learns its ports (and, from LWEPP, whether
    it needs the response headers).

    ``json_routes`` serves debug pages beside ``/metrics`` (LWEPP's
    ``/debug/decisions``) with ``/debug/runtime`` (memory, file descriptors,
    asyncio tasks); None, the default, serves no debug page at all (they tell
    whoever reaches the port about the traffic: ``--enable-debug-pages``).
    ``metrics_auth``: every path of the metrics port answers only the callers
    the Kubernetes API allows (``--metrics-endpoint-auth``).
    ``tls``: serve the ext_proc port over TLS (``serving.tls``); the health port
    stays plaintext, for kubelet's probes. ``grpc_options`` go to the ext_proc
    server (message size limits). ``health_on_ext_proc`` also answers the
    health service on the ext_proc port (GIE's ``--health-checking``).

    Order of shutdown: health goes NOT_SERVING (the ``live`` names stay
    SERVING), the ext_proc server keeps accepting streams for ``drain``
    seconds while load balancers take the replica out (the llm-d router's
    ``--drain-timeout``; a second signal, or ``stop`` set again, ends the
    drain early), then stops accepting new streams and gives in-flight
    streams ``grace`` seconds to finish; then background tasks are cancelled
    and the side servers close.
    """
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    # SO_REUSEPORT (grpc's default on Linux, spelled out): the workers of
    # ``run_workers`` bind the same ext_proc and health ports. PING_POLICY: a
    # gateway's keepalive on a quiet stream is no abuse.
    options = [("grpc.so_reuseport", 1), *PING_POLICY]
    server = grpc.aio.server(options=[*options, *EXT_PROC_OPTIONS, *grpc_options])
    server.add_generic_rpc_handlers((ext_proc_handler(handler, trace),))
    address = f"{ports.host}:{ports.grpc}"
    if tls is None:
        grpc_port = server.add_insecure_port(address)
    else:
        grpc_port = server.add_secure_port(address, tls.credentials())
    if health_on_ext_proc:
        health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)

    health_server = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, health_server)
    health_port = health_server.add_insecure_port(f"{ports.host}:{ports.health}")
    await health_state.set_all(False)

    metrics = await _metrics_app(registry, ports.host, ports.metrics, json_routes, metrics_auth)
    await health_server.start()
    await server.start()
    tasks = [asyncio.create_task(job()) for job in background]
    watcher = asyncio.create_task(health_state.watch_ready())
    tasks.append(watcher)

    bound = Ports(ports.host, grpc_port, health_port, _bound_port(metrics))
    worker = os.environ.get(WORKER_ENV)
    log.info(
        "listening",
        service=name,
        host=bound.host,
        grpc_port=bound.grpc,
        health_port=bound.health,
        metrics_port=bound.metrics,
        tls=tls is not None,
        pid=os.getpid(),
        **({"worker": worker} if worker else {}),
        **(announce or {}),
    )
    if on_listening is not None:
        result = on_listening(bound)
        if result is not None:
            await result
    try:
        await stop.wait()
        if drain > 0:
            log.info("draining", service=name, drain_seconds=drain)
            watcher.cancel()  # readiness no longer follows ready(): it is over
            await health_state.set_all(False, health_state.names)
            stop.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), drain)
    finally:
        log.info("stopping", service=name, grace_seconds=grace)
        await health_state.set_all(False)
        await server.stop(grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await health_server.stop(0)
        await metrics.cleanup()
        log.info("stopped", service=name)


# --- several processes on one port ------------------------------------------------


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, never listening.

    It holds the port (``0``: a free one, chosen once for every worker) while
    the workers bind it too: Linux hands connections only to listening sockets,
    so this one takes no traffic, and no unrelated process can take the port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, port))
    return holder


def die_with_parent() -> None:
    """In a child, before it runs: SIGTERM when its parent dies (``PR_SET_PDEATHSIG``).

    A supervisor killed outright (SIGKILL, an OOM kill) cannot forward the
    signal itself; without this, its workers would go on serving the port.
    Linux ties the signal to the thread that started the child: start it from
    a thread that lives as long as the parent (the main one).
    """
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def worker_argv(args: Sequence[str], ports: Ports) -> list[str]:
    """A worker's flags: the supervisor's, then its ports and ``--workers 1`` (the last wins).

    The ext_proc and health ports are the shared ones. Each worker serves its
    own metrics page on a free port (its debug pages are there too); the
    supervisor serves all their samples together on ``--metrics-port``.
    """
    return [
        *args,
        *("--grpc-port", str(ports.grpc), "--grpc-health-port", str(ports.health)),
        *("--metrics-port", "0", "--workers", "1"),
    ]


def serve_worker_metrics(directory: str, ports: Ports) -> Any:
    """The one metrics page of N workers: every worker's samples, read from ``directory``.

    Workers started with ``PROMETHEUS_MULTIPROC_DIR`` write each sample to a
    file there; counters and histograms are summed over the workers, gauges
    declare how to combine (``multiprocess_mode``, e.g. the largest of the live
    workers). Served from a thread of the supervisor, which otherwise only
    waits for its workers. Returns the HTTP server (``shutdown()`` stops it).
    """
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    server, _thread = start_http_server(ports.metrics, ports.host, registry)
    log.info("serving metrics", metrics_port=server.server_port, pid=os.getpid())
    return server


def run_workers(
    module: str,
    args: Sequence[str],
    workers: int,
    ports: Ports,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``python -m module`` ``workers`` times on the same ports; return an exit status.

    The workers share the ext_proc port and the gRPC health port (any worker
    can answer a probe: each reports its own state, and they start and stop
    together), and one metrics page (``serve_worker_metrics``); ``environ``
    is added to their environment. SIGTERM or SIGINT here is passed to every
    worker, which drains as a single process does; the supervisor returns
    once all have exited. Should one worker exit by itself, the others are
    stopped too and the status is 1: a replica serving on fewer cores than
    asked should be restarted whole (by Kubernetes, say), not limp on.
    """
    holders = [_reserve(ports.host, ports.grpc), _reserve(ports.host, ports.health)]
    shared = Ports(
        ports.host, holders[0].getsockname()[1], holders[1].getsockname()[1], ports.metrics
    )
    samples = tempfile.mkdtemp(prefix="switchyard-metrics-")
    metrics_server = serve_worker_metrics(samples, shared)
    stopping = False
    running: dict[int, subprocess.Popen[bytes]] = {}

    def stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in running:
            os.kill(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(workers):
            child = subprocess.Popen(
                [sys.executable, "-m", module, *worker_argv(args, shared)],
                env={
                    **os.environ,
                    **(environ or {}),
                    WORKER_ENV: f"{index}/{workers}",
                    MULTIPROCESS_ENV: samples,
                },
                preexec_fn=die_with_parent,
            )
            running[child.pid] = child
        status = 0
        while running:
            pid, code = os.wait()  # children are reaped here only, never by Popen.poll
            if pid not in running:
                continue
            child = running.pop(pid)
            child.returncode = os.waitstatus_to_exitcode(code)
            multiprocess.mark_process_dead(pid, samples)  # type: ignore[no-untyped-call]
            if not stopping:
                log.error("worker exited", pid=pid, status=child.returncode)
                status = 1
                stop(signal.SIGTERM, None)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in running.values():
            child.kill()
            child.wait()
        for holder in holders:
            holder.close()
        metrics_server.shutdown()
        metrics_server.server_close()
        shutil.rmtree(samples, ignore_errors=True)
