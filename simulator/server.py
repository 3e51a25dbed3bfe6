"""One aiohttp server per pod port: the OpenAI API, /metrics, /health and the conformance echo.

Every port of every pod becomes a ``Replica``: its own listening socket, its
own ``Engine`` (queue, batch, KV cache; ``simulator.engine``) driven in real
time by a ``RealTimeEngine`` (``simulator.clocks``), so a
data-parallel pod with three ports behaves like three engines, as GIE's
InferencePool counts it (one endpoint per target port). All replicas share
one event loop; ``serve_pods`` starts them together and stops them together.

Every response, errors and streams included, is stamped in one place
(``Replica.stamp``, an ``on_response_prepare`` hook, which runs just before
the status line is written) with headers that let an end-to-end test see what
reached which replica:

- ``x-sim-pod: <pod name>`` and ``x-sim-endpoint: <ip:port>``;
- ``x-sim-served-model: <model>`` on the OpenAI endpoints' answers: the
  ``model`` the request body named, as it reached the replica (after any
  rewrite on the way: a canary's adapter, say);
- ``x-sim-received-<name>: <value>`` for each request header ``x-gateway-*`` or
  ``x-conformance-*``
  (the model and destination headers a gateway adds);
- the headers asked for by ``X-Echo-Set-Header: name:value,name:value``, as
  the Gateway API conformance echo server does.

Faults (``simulator.engine.Faults``) show here as a client sees them: an
injected error is a 500 (or, once a stream has started, an error event
before ``[DONE]``), dead metrics are a 503 on ``/metrics``, and a crashed
replica stops listening and drops every connection, as a dead process would.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Coroutine, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Final

import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from blockhash.vllm import BlockHasher
from pods.model import Pod, join_host_port
from simulator import metrics, openai
from simulator.clocks import EngineError, RealTimeEngine, Sleep
from simulator.echo import ECHO_HTTP_PORT, EchoBasic
from simulator.engine import Engine, Request, Settings
from simulator.h2c import serve_h2c_echo
from simulator.kv_events import KVEventLog, KVEventsConfig, ZmqPublisher
from simulator.openai import Api, ApiError
from simulator.tokenizer import output_token

log = structlog.get_logger()

SERVED_MODEL: Final = web.RequestKey("served_model", str)
"""Where a request keeps the model its body named, for its response's stamp."""

DEFAULT_MODEL: Final = "sim-model"
"""The model of a pod without a ``model`` label."""

_METRICS_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(error: ApiError) -> web.Response:
    return _json(error.body(), error.status)


@web.middleware
async def _never_crash(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer an unexpected exception with a 500 error body instead of a bare one, and log it."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as error:
        log.exception("request failed", path=request.path)
        return _error(ApiError(500, "InternalServerError", f"simulator error: {error!r}"))


class Replica:
    """One port of one pod: an independent engine behind its own HTTP server."""

    __slots__ = (
        "_clock",
        "adapters",
        "dialect",
        "driver",
        "echo_basic",
        "endpoint",
        "engine",
        "kv_events_endpoint",
        "model",
        "pod",
        "port",
        "prompt_tokens_details",
        "stop_listening",
    )

    def __init__(
        self,
        pod: Pod,
        port: int,
        engine: Engine,
        clock: Callable[[], float] = time.time,
        *,
        dialect: str = "vllm",
        namespace: str = "",
        time_scale: float = 1.0,
        sleep: Sleep = asyncio.sleep,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.pod = pod
        self.port = port
        self.dialect = dialect
        """Whose metric names ``/metrics`` uses (``simulator.metrics.ENGINES``)."""
        self.prompt_tokens_details = prompt_tokens_details
        """Whether usage carries ``prompt_tokens_details.cached_tokens`` (vLLM's flag)."""
        self.endpoint = join_host_port(pod.address, port)
        self.echo_basic = EchoBasic(pod, port, namespace)
        """The conformance echo's answers (``namespace``: the pod's namespace it reports)."""
        self.engine = engine
        self.driver = RealTimeEngine(engine, time_scale=time_scale, sleep=sleep)
        """Steps ``engine`` in real time (``time_scale`` times each step's duration)."""
        self.stop_listening: Callable[[], Coroutine[Any, Any, None]] | None = None
        """Closes this replica's listener (set by ``serve_pods``); a crash calls it."""
        self.kv_events_endpoint: str | None = None
        """Where it publishes its KV-cache events (set by ``serve_pods`` when it does)."""
        self.model = pod.labels.get("model") or DEFAULT_MODEL
        adapters = pod.labels.get("adapters", "").split(",")
        self.adapters = tuple(name.strip() for name in adapters if name.strip())
        self._clock = clock

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def app(self) -> web.Application:
        # Long prompts are normal for a model server: allow bodies up to 64 MiB, not 1 MiB.
        app = web.Application(
            middlewares=[_never_crash, self._dead_after_crash], client_max_size=64 * 2**20
        )
        app.on_response_prepare.append(self.stamp)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions/render", self.render_completions)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        # Everything else is the echo server, as in the GIE conformance backends.
        app.router.add_route("*", "/{tail:.*}", self.echo)
        return app

    async def stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        """Add the replica's identity and the echo headers to every response (module docstring)."""
        seen: set[str] = set()
        served = request.get(SERVED_MODEL)
        for name, value in self.echo_basic.stamp_headers(request.headers.items(), served):
            if name in seen:  # a repeated x-gateway-* request header: keep every value
                response.headers.add(name, value)
            else:  # otherwise replace what the handler set
                response.headers[name] = value
                seen.add(name)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def render_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, "completions")

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, "chat")

    async def _render(self, request: web.Request, api: Api) -> web.Response:
        """vLLM's render endpoints: the prompt's token ids, parsed exactly as for generation.

        The same ``openai.parse`` that feeds the engine produces the ids, so a
        router that tokenizes here sees the engine's own ids. Nothing is
        queued or generated, and faults such as ``--error-rate`` do not apply.
        """
        try:
            parsed = self._parse(request, api, await request.read())
        except ApiError as error:
            return _error(error)
        prefix = "cmpl" if api == "completions" else "chatcmpl"
        return _json(openai.render(parsed, lambda: f"{prefix}-{uuid.uuid4().hex}"))

    def _parse(self, request: web.Request, api: Api, raw: bytes) -> openai.Request:
        """The body, parsed; the model it names is noted for the response's stamp, also when
        the body is refused (a model this replica does not serve)."""
        try:
            parsed = openai.parse(api, raw, (self.model, *self.adapters))
        except ApiError:
            if (named := openai.named_model(raw)) is not None:
                request[SERVED_MODEL] = named
            raise
        request[SERVED_MODEL] = parsed.model
        return parsed

    @web.middleware
    async def _dead_after_crash(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A crashed replica answers nothing: it drops the connection, as a dead process would."""
        if self.engine.crashed:
            self._drop(request)
        return await handler(request)

    def _drop(self, request: web.Request) -> None:
        """Close the client's connection and stop listening (the crash fault)."""
        if request.transport is not None:
            request.transport.close()
        if self.stop_listening is not None:
            stop, self.stop_listening = self.stop_listening, None
            asyncio.get_running_loop().create_task(stop())
        raise ConnectionResetError("replica crashed")

    async def _generate(self, request: web.Request, api: Api) -> web.StreamResponse:
        try:
            parsed = self._parse(request, api, await request.read())
            problem = self.engine.validate(parsed.prompt_tokens, parsed.max_tokens)
            if problem is not None:
                raise openai.bad_request(problem)
        except ApiError as error:
            log.info(
                "request rejected", pod=self.pod.name, endpoint=self.endpoint, error=error.message
            )
            return _error(error)
        adapter = None if parsed.model == self.model else parsed.model
        rid = f"{'cmpl' if api == 'completions' else 'chatcmpl'}-{uuid.uuid4().hex}"
        created = int(self._clock())
        job = Request(rid, parsed.tokens, parsed.max_tokens, self.driver.now(), adapter)
        tokens = self.driver.generate(job)
        log.debug(
            "request",
            pod=self.pod.name,
            endpoint=self.endpoint,
            model=parsed.model,
            prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens,
            stream=parsed.stream,
        )
        if parsed.stream:
            return await self._stream(request, parsed, job, created, tokens)
        try:
            async with aclosing(tokens):
                text = "".join([output_token(index) async for index in tokens])
        except EngineError as error:
            if self.engine.crashed:
                self._drop(request)
            return _error(ApiError(500, "InternalServerError", str(error)))
        answer = openai.response(parsed, rid, created, text, parsed.max_tokens, self._cached(job))
        return _json(answer)

    def _cached(self, job: Request) -> int | None:
        return job.cached_tokens if self.prompt_tokens_details else None

    async def _stream(
        self,
        request: web.Request,
        parsed: openai.Request,
        job: Request,
        created: int,
        tokens: AsyncGenerator[int, None],
    ) -> web.StreamResponse:
        """Server-sent events: one ``data:`` line per token, the usage chunk, then ``[DONE]``.

        The response starts (status 200) when the first token is ready, so an
        error before it is still a plain error response, as in vLLM.
        """
        rid = job.id
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            async with aclosing(tokens):
                count = 0
                async for index in tokens:
                    if not response.prepared:
                        await response.prepare(request)
                    text = output_token(index)
                    chunk = openai.token_chunk(parsed, rid, created, index, text)
                    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                    count += 1
            chunk = openai.usage_chunk(parsed, rid, created, count, self._cached(job))
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except EngineError as error:
            if self.engine.crashed:
                self._drop(request)
            failure = ApiError(500, "InternalServerError", str(error))
            if not response.prepared:
                return _error(failure)
            await response.write(b"data: " + orjson.dumps(failure.body()) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client left mid-stream; ``aclosing`` has already freed the slot.
            log.info("client went away", endpoint=self.endpoint, request_id=rid)
        return response

    async def models(self, _request: web.Request) -> web.Response:
        """The base model and each adapter, shaped like vLLM's model list."""
        created = int(self._clock())
        cards = [{"id": self.model, "root": self.model, "parent": None}]
        cards += [{"id": name, "root": name, "parent": self.model} for name in self.adapters]
        data = [{"object": "model", "created": created, "owned_by": "vllm", **c} for c in cards]
        return _json({"object": "list", "data": data})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, _request: web.Request) -> web.Response:
        if self.engine.faults.dead_metrics:
            return web.Response(status=503, text="metrics unavailable (fault dead_metrics)\n")
        return web.Response(
            body=self.metrics_text().encode(), headers={"Content-Type": _METRICS_TYPE}
        )

    def metrics_text(self) -> str:
        """The engine's state in Prometheus text format, in the names of ``self.dialect``."""
        state = metrics.state_of(self.engine, self.model, self._clock(), self.adapters)
        return metrics.render(self.dialect, state)

    async def echo(self, request: web.Request) -> web.Response:
        """The Gateway API conformance echo (echo-basic), plus GIE's ``httpPort``."""
        proto = f"HTTP/{request.version.major}.{request.version.minor}"
        body = self.echo_basic.body(
            request.method, request.raw_path, request.host, proto, request.headers.items()
        )
        return _json(body)


class BindError(Exception):
    """A pod's address and port cannot be listened on (taken, or not this machine's)."""


def _bind(address: str, port: int, pod: str) -> socket.socket:
    """A listening socket bound up front, so the replica knows its port (0 = any free one).

    Raises ``BindError`` naming the pod, the address and the reason.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise BindError(f"pod {pod}: cannot listen on {address}:{port}: {reason}") from None
    return sock


def _http_port(pod: Pod, h2c_ports: Collection[int]) -> int:
    """The port an h2c port's echo reports as ``httpPort``: the pod's first HTTP port, or
    echo-basic's default ``HTTP_PORT`` (3000) when every port of the pod is h2c."""
    return next((port for port in pod.ports if port not in h2c_ports), ECHO_HTTP_PORT)


@asynccontextmanager
async def serve_pods(
    pods: Iterable[Pod],
    settings: Settings | None = None,
    *,
    sleep: Sleep = asyncio.sleep,
    clock: Callable[[], float] = time.time,
    grace: float = 5.0,
    dialect: str = "vllm",
    namespace: str = "",
    h2c_ports: Collection[int] = (),
    prompt_tokens_details: bool = False,
    kv_events: KVEventsConfig | None = None,
) -> AsyncIterator[tuple[Replica, ...]]:
    """Serve every port of every pod until the block exits; yields the replicas in file order.

    Each replica gets ``settings.engine(i)`` (its profile, overrides, faults,
    and seed ``settings.seed + i``) stepped in real time scaled by
    ``settings.time_scale``. ``sleep`` and ``clock`` are injected so tests
    can gate or record the engine's step delays and fix timestamps. A port of
    0 binds a free port (``Replica.endpoint`` tells which). On exit the
    listeners close first, then requests still in flight get ``grace``
    seconds to finish before they are cancelled.

    ``dialect`` names the engine whose metric names ``/metrics`` uses;
    ``namespace`` is what the conformance echo reports; a port listed in
    ``h2c_ports`` serves only the echo, as echo-basic's h2c port does
    (``simulator.h2c``: cleartext HTTP/2, or HTTP/1.1 asking to upgrade).
    ``prompt_tokens_details`` adds the cached prompt tokens to every answer's
    usage, as vLLM does with ``--enable-prompt-tokens-details``. ``kv_events``
    (vLLM's ``--kv-events-config``, when enabled) makes each replica publish its
    block-cache events on its own ZMQ endpoint (``simulator.kv_events``).
    """
    settings = settings or Settings()
    sockets: list[socket.socket] = []
    runners: list[web.AppRunner] = []
    h2c_servers: list[asyncio.Server] = []
    replicas: list[Replica] = []
    publishers: list[ZmqPublisher] = []
    try:
        for pod in pods:
            for port in pod.ports:
                sock = _bind(pod.address, port, pod.name)
                sockets.append(sock)
                replica = Replica(
                    pod,
                    sock.getsockname()[1],
                    settings.engine(len(replicas)),
                    clock,
                    dialect=dialect,
                    namespace=namespace,
                    prompt_tokens_details=prompt_tokens_details,
                    time_scale=settings.time_scale,
                    sleep=sleep,
                )
                if kv_events is not None and kv_events.enabled:
                    publisher = ZmqPublisher(
                        kv_events.endpoint_for(len(replicas)), kv_events.topic, kv_events.hwm
                    )
                    publishers.append(publisher)
                    hasher = BlockHasher(kv_events.algorithm)
                    engine = replica.engine
                    engine.publish_kv_events(
                        KVEventLog(engine.profile.block_size, publisher.send, hasher)
                    )
                    replica.kv_events_endpoint = publisher.endpoint
                replicas.append(replica)
                if port in h2c_ports:
                    http_port = _http_port(pod, h2c_ports)
                    h2c_servers.append(await serve_h2c_echo(replica.echo_basic, sock, http_port))
                    continue
                # A client that disconnects cancels its handler, which aborts its request in
                # the engine and frees its blocks, as vLLM aborts a request whose client left.
                runner = web.AppRunner(
                    replica.app(),
                    access_log=None,
                    shutdown_timeout=grace,
                    handler_cancellation=True,
                )
                await runner.setup()
                runners.append(runner)
                site = web.SockSite(runner, sock)
                await site.start()
                replica.stop_listening = site.stop
        log.info("listening", endpoints=[replica.endpoint for replica in replicas])
        yield tuple(replicas)
    finally:
        log.info("stopping", grace_seconds=grace)
        for server in h2c_servers:
            server.close()
        # All at once: each replica's in-flight requests share the same grace period.
        await asyncio.gather(*(runner.cleanup() for runner in runners))
        for replica in replicas:
            await replica.driver.aclose()
        for sock in sockets:
            sock.close()
        for publisher in publishers:
            publisher.close()
        log.info("stopped")
