"""One hop for a single gateway: BBR's job and the pool's pick in the same ext_proc stream.

GIE's topology calls Python twice per request: BBR (a filter of its own)
reads the body and sets ``X-Gateway-Model-Name``; Envoy matches the routes
again; the matched pool's endpoint picker (a second filter, a second gRPC
stream) names the endpoint. Each hop costs a stream's worth of gRPC and
Python whatever the service does (``make bench-overhead``), so a gateway
that runs both services itself, on one machine, can do both in one stream.

``OneHop`` is that stream. It keeps GIE's two services' rules, reusing their
code rather than restating it:

``request_headers``
    Kept, with the message (its ``envoy.lb.subset_hint`` metadata names the
    candidates). In ``FULL_DUPLEX_STREAMED`` the answer is held until the
    body ends, as both services hold it; otherwise it goes now, unchanged.
    Headers that end the request (no body) are routed at once.
``request_body``
    Held (at most ``--max-body-bytes``); at its end BBR's request chain runs
    (``BodyBasedRouter.read_request``: not a JSON object is 400). The model
    it found names the pool (``--pool NAME=MODEL,...``); that pool's picker
    (``EndpointPickerService``) chooses among its candidates, given the
    request's headers as BBR changed them and the body. One answer carries
    both services' header changes, the ``envoy.lb`` metadata and
    ``clear_route_cache``; in full duplex the body follows it. A model no
    pool serves is answered with BBR's changes alone, so Envoy's routes
    answer it (404) as they do behind two hops.
``request_trailers``
    End a streamed body whose last chunk had no ``end_of_stream``, as in both.
``response_*``
    The picker's: the served-endpoint report and the pick's followup.

Refusals and errors become an ``ImmediateResponse`` in one place
(``OneHop.refusal``): counted by the pool's picker once a pool was chosen
(``llm_d_epp_request_error_total``), by BBR before (``bbr_errors_total``).

What is lost against two hops: Envoy's own route match between the services
(the one hop maps models to pools itself, from its flags, which must agree
with the routes), a pool-by-pool failure mode (the one service is BBR, which
fails closed, so every pool does), and separate scaling of the two services.
``lwepp.server`` itself stays unaware of BBR; this module is the one place
that imports both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TextIO, final

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from bbr.plugins import DEFAULT_PLUGINS, PluginSpec
from bbr.server import BodyBasedRouter
from lwepp import config as picker_config
from lwepp.__main__ import HEALTH_SERVICES, refresh_metrics
from lwepp.metrics import MODEL_HEADER, PickerMetrics
from lwepp.picking import Pool, RoundRobin, Strategy
from lwepp.pipeline import DecisionLog, Pipeline
from lwepp.server import (
    DESTINATION,
    EndpointPickerService,
    PickState,
    pass_chunk,
    routing_headers,
)
from plugin import ConfigError
from pods.file import FileSource, PodFileError, load_pods
from pods.kubeapi import KubeconfigError
from pods.model import Endpoint
from protos import extproc
from protos.cli import (
    COMMON_IGNORED,
    Parser,
    add_bool,
    add_ignored_flags,
    add_serving_flags,
    grpc_options,
    log_level,
    metrics_auth,
    ports_of,
    server_tls,
    serving_problem,
)
from protos.exchange import MAX_BODY_BYTES, Refusal, check_headers_fit
from protos.extproc import ProcessingRequest, ProcessingResponse
from protos.logs import configure_logging
from protos.metrics_auth import MetricsAuth
from protos.server import Health, Ports, Stream, run_workers, serve
from protos.tls import TLSError, shared_tls

log = structlog.get_logger()

ANY_MODEL: Final = "*"
"""``--pool NAME=*``: the pool for any model no other pool names (one pool, one machine)."""


class OneHopState(PickState):
    """A picker's stream state, plus the headers message and the pool's picker, once chosen."""

    __slots__ = ("first", "picker")

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.first: ProcessingRequest | None = None
        self.picker: EndpointPickerService | None = None


@final
class OneHop:
    """The ext_proc handler (``protos.server.Handler``): BBR's chain, then the model's pool's pick.

    ``router`` runs the request chain (its response chain is not run here: GIE's
    BBR has no response plugin by default, and the picker owns the response);
    ``pickers`` maps each model name to its pool's picker service; the pool of
    ``ANY_MODEL`` takes the models no other names, and requests that name none.
    """

    def __init__(
        self,
        router: BodyBasedRouter,
        pickers: Mapping[str, EndpointPickerService],
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.router = router
        self.pickers = dict(pickers)
        self.max_body_bytes = max_body_bytes
        self.hears_response = any(picker.hears_response for picker in self.pickers.values())
        """Whether some pool's picker needs the response headers (``EndpointPickerService``'s)."""

    async def __call__(self, stream: Stream) -> None:
        state = OneHopState(self.max_body_bytes)
        while (message := await stream.recv()) is not None:
            picker = state.picker
            try:
                match extproc.kind(message):
                    case "request_headers":
                        replies = self.request_headers(message, state)
                    case "request_body":
                        replies = self.request_body(message.request_body, state)
                    case "request_trailers":
                        finished = (
                            self.finish(state, end_of_stream=False) if state.request.held else []
                        )
                        replies = [*finished, extproc.trailers_response("request")]
                    case "response_headers" if picker is not None:
                        replies = picker.on_response_headers(message, state)
                    case "response_body" if picker is not None:
                        replies = picker.on_response_body(message.response_body, state)
                    case "response_headers":  # no pool chose: Envoy's own answer (a 404)
                        replies = [extproc.headers_response("response")]
                    case "response_body":
                        replies = [pass_chunk(state.response, message.response_body)]
                    case "response_trailers":
                        EndpointPickerService.end_response(state)
                        replies = [extproc.trailers_response("response")]
                    case other:
                        raise ValueError(f"unexpected ext_proc message {other!r}")
            except Exception as error:
                await stream.send(self.refusal(state, error))  # the exchange ends here
                return
            for reply in replies:
                await stream.send(reply)

    def refusal(self, state: OneHopState, error: Exception) -> ProcessingResponse:
        """The one place an error becomes an HTTP answer: the pool's picker counts a refusal
        once it was chosen, BBR before that (and every unexpected error, as a 500)."""
        if state.picker is not None and isinstance(error, Refusal):
            return state.picker.refuse(state, error)
        return self.router.refusal(state, error)

    def request_headers(
        self, message: ProcessingRequest, state: OneHopState
    ) -> list[ProcessingResponse]:
        """Keep the headers; route now if no body follows, else answer or hold as BBR does."""
        self.router.metrics.requests.inc()
        state.use_modes(message)
        state.first = message
        state.request.headers = extproc.header_pairs(message.request_headers)
        if message.request_headers.end_of_stream:
            return [self.route(state, [], [], None, headers=True)]
        if state.request.streamed:
            state.request.held = True
            return []
        return [extproc.headers_response("request")]

    def request_body(self, chunk: Any, state: OneHopState) -> list[ProcessingResponse]:
        """Hold a chunk; at the end of the body, run BBR's chain and pick."""
        state.request.hold(chunk.body)
        if state.request.streamed and not chunk.end_of_stream:
            return []
        return self.finish(state, end_of_stream=True)

    def finish(self, state: OneHopState, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """BBR's chain on the whole body, then the pick, in one answer (then the body, streamed).

        In full duplex the answer is the held headers reply and the body
        follows it (Envoy forwards only what we send back); with a buffered
        body it is the body reply, carrying the body only if BBR changed it.
        """
        half = state.request
        message = self.router.read_request(state)
        set_headers, remove = message.header_changes()
        check_headers_fit("request", half.headers, set_headers, remove)  # as BBR: 431
        held, half.held = half.held, False
        if not half.streamed:
            new_body = message.raw if message.body_mutated else None
            return [self.route(state, set_headers, remove, message.raw, new_body=new_body)]
        chunks = extproc.streamed_body_responses(
            "request", message.raw, end_of_stream=end_of_stream
        )
        if not held:  # a body without headers before it, which Envoy never sends
            return chunks
        return [self.route(state, set_headers, remove, message.raw, headers=True), *chunks]

    def route(
        self,
        state: OneHopState,
        set_headers: list[tuple[str, str]],
        remove: list[str],
        body: bytes | None,
        *,
        headers: bool = False,
        new_body: bytes | None = None,
    ) -> ProcessingResponse:
        """Pick in the model's pool, if one serves it; answer with every header change.

        ``body`` is what the strategy sees (None: the request had none). The
        answer is a ``headers`` reply, or else a body reply replacing the body
        with ``new_body`` when given. Either way it clears the route cache, so
        Envoy matches the routes again, by model, and the pool's ORIGINAL_DST
        cluster follows the destination header.
        """
        half = state.request
        half.headers = with_changes(half.headers, set_headers, remove)
        model = extproc.first_header(half.headers, MODEL_HEADER) or ANY_MODEL
        picker = self.pickers.get(model) or self.pickers.get(ANY_MODEL)
        metadata = None
        if picker is not None and state.first is not None:
            state.picker = picker
            state.candidates = picker.candidates_for(state.first, half.headers)
            endpoint = picker.choose(state, body)
            set_headers = [*set_headers, *routing_headers(endpoint, picker.report_served)]
            metadata = {extproc.LB_NAMESPACE: {DESTINATION: endpoint}}
        if headers:
            return extproc.headers_response(
                "request", set_headers, remove, clear_route_cache=True, dynamic_metadata=metadata
            )
        answer = extproc.body_response(
            "request", set_headers, remove, clear_route_cache=True, body=new_body
        )
        if metadata is not None:
            answer.dynamic_metadata.CopyFrom(extproc.struct(metadata))
        return answer


def with_changes(
    headers: Sequence[tuple[str, str]],
    set_headers: Sequence[tuple[str, str]],
    remove: Iterable[str],
) -> list[tuple[str, str]]:
    """``headers`` as Envoy has them after the mutation (a set overwrites; names lower-cased)."""
    if not set_headers and not remove:
        return list(headers)
    gone = {name.lower() for name, _ in set_headers} | {name.lower() for name in remove}
    kept = [(name, value) for name, value in headers if name.lower() not in gone]
    return [*kept, *((name.lower(), value) for name, value in set_headers)]


# --- one metrics page over several pools ------------------------------------------------


class Registries:
    """A collector over several registries: each pool's picker keeps its own metrics (their
    names collide across pools), and the one ``/metrics`` page shows them all, each family once
    with every pool's samples (a sample two registries share, the build's ``*_info``, once)."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for registry in self.registries:
            for family in registry.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        merged.samples.append(sample)
        yield from families.values()


# --- the command line -------------------------------------------------------------------


def pool_flag(text: str) -> tuple[str, tuple[str, ...]]:
    """``--pool NAME=MODEL[,MODEL...]``: a pool (its pods carry ``pool=NAME``) and its models."""
    name, sign, models = text.partition("=")
    served = tuple(m.strip() for m in models.split(",") if m.strip())
    if not sign or not name.strip() or not served:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=MODEL[,MODEL...]")
    return name.strip(), served


def plugin_flag(flag: str) -> PluginSpec:
    try:
        return PluginSpec.from_flag(flag)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m lwepp.onehop",
        description="BBR and the endpoint pickers of several pools in one ext_proc service, "
        "for a gateway that calls Python once per request: the model from the body "
        "(X-Gateway-Model-Name), then the model's pool's pick, in the same stream.",
    )
    add = parser.add_argument
    add("--pods", required=True, help="YAML pod file listing the model-server pods")
    add(
        "--pool",
        dest="pools",
        type=pool_flag,
        action="append",
        required=True,
        metavar="NAME=MODEL[,MODEL...]",
        help="a pool and the models routed to it (repeatable); its pods are those whose "
        "--pool-label is NAME; MODEL * takes any model no other pool names, and requests "
        "naming none. Must agree with the gateway's routes",
    )
    add("--pool-label", default="pool", help="the pod label naming a pod's pool (%(default)s)")
    add(
        "--kubeconfig",
        help="kubeconfig file for the Kubernetes API that --metrics-endpoint-auth asks "
        "(default: $KUBECONFIG, else the in-cluster service account)",
    )
    add("--pods-interval", type=float, default=1.0, help="seconds between pod file checks")
    add(
        "--config",
        metavar="FILE",
        help="an EndpointPickerConfig every pool's picker runs (each its own instance); "
        "default: round-robin",
    )
    add(
        "--explain",
        choices=["header", "all", "off"],
        default="off",
        help="with --config: explain decisions in x-switchyard-decision, when a request asks "
        "(header), for every request (all), or never (the default, as python -m lwepp: the "
        "header names every candidate's address and scores)",
    )
    add(
        "--plugin",
        dest="plugins",
        type=plugin_flag,
        action="append",
        metavar="TYPE:NAME[:JSON]",
        help="BBR's request plugins, in order (as python -m bbr); default: the model extractor",
    )
    add(
        "--enable-test-selection-header",
        dest="test_selection",
        action="store_true",
        help="honour test-epp-endpoint-selection, as python -m lwepp does (default: ignored)",
    )
    add(
        "--report-served-endpoint",
        action="store_true",
        help="name the replica that served each request in x-conformance-test-served-endpoint, "
        "as python -m lwepp does (default: never)",
    )
    add_bool(
        parser,
        "--streaming",
        True,
        "expect FULL_DUPLEX_STREAMED request bodies when Envoy does not say (no protocol_config)",
    )
    add(
        "--refresh-prometheus-metrics-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often the pool gauges are recomputed (default 5)",
    )
    add_serving_flags(parser, Ports("127.0.0.1", 9002, 9003, 9090))
    add_ignored_flags(parser, COMMON_IGNORED)
    return parser


def endpoints_now(pool: Pool) -> Sequence[Endpoint]:
    """The pool's endpoints at this moment (what a pipeline's data sources poll)."""
    return pool.endpoints


def build(
    args: argparse.Namespace, source: FileSource
) -> tuple[OneHop, Registries, list[Callable[[], Coroutine[Any, Any, None]]], dict[str, Any]]:
    """The handler, its metrics, background jobs and debug pages, from the flags.

    Each pool gets its own registry and its own copy of the configuration's
    plugins: what a plugin learns (a prefix index) belongs to one pool.
    Raises ``ConfigError`` or ``picker_config.ConfigErrors``.
    """
    bbr_registry = CollectorRegistry()
    router = BodyBasedRouter(
        bbr_registry,
        args.plugins or DEFAULT_PLUGINS,
        streaming=args.streaming,
        max_body_bytes=args.max_body_bytes,
    )
    registries = [bbr_registry]
    jobs: list[Callable[[], Coroutine[Any, Any, None]]] = [source.run]
    pages: dict[str, Any] = {}
    pickers: dict[str, EndpointPickerService] = {}
    names = [name for name, _ in args.pools]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"--pool: pool {repeated[0]!r} is given twice (list its models once)")
    for name, models in args.pools:
        registry = CollectorRegistry()
        registries.append(registry)
        pool = Pool(source, {args.pool_label: name})
        strategy: Strategy = RoundRobin()
        pipeline: Pipeline | None = None
        if args.config is not None:
            pipeline = picker_config.load_config(args.config).pipeline(
                registry=registry, explain=args.explain, decisions=DecisionLog(100), pool=name
            )
            strategy = pipeline
            jobs += pipeline.background(functools.partial(endpoints_now, pool))
            pages |= {f"{path}/{name}": page for path, page in pipeline.debug_pages().items()}
        metrics = PickerMetrics(registry, name)
        picker = EndpointPickerService(
            pool,
            strategy,
            metrics,
            args.max_body_bytes,
            test_selection=args.test_selection,
            report_served=args.report_served_endpoint,
        )
        every = args.refresh_prometheus_metrics_interval
        jobs.append(functools.partial(refresh_metrics, every, metrics, pool, pipeline))
        for model in models:
            if model in pickers:
                raise ConfigError(f"--pool: model {model!r} is in two pools")
            pickers[model] = picker
    return OneHop(router, pickers, args.max_body_bytes), Registries(registries), jobs, pages


async def run(
    args: argparse.Namespace,
    built: tuple[OneHop, Registries, list[Callable[[], Coroutine[Any, Any, None]]], dict[str, Any]],
    source: FileSource,
    trace: TextIO | None,
    tls: Any,
    auth: MetricsAuth | None = None,
) -> None:
    handler, registries, jobs, pages = built
    registry = CollectorRegistry()
    registry.register(registries)
    await serve(
        "onehop",
        handler,
        ports_of(args),
        Health(HEALTH_SERVICES, ready=lambda: source.synced),
        registry,
        background=jobs,
        json_routes=pages if args.enable_debug_pages else None,
        metrics_auth=auth,
        grace=args.grace,
        trace=trace,
        tls=tls,
        drain=args.drain_timeout,
        grpc_options=grpc_options(args),
        health_on_ext_proc=bool(args.health_checking),
        announce={"response_headers": handler.hears_response},
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := serving_problem(args):
        parser.error(problem)
    if args.workers > 1 and args.config is not None:
        parser.error("--workers with --config: each worker would learn from its share only")
    source = FileSource(args.pods, interval=args.pods_interval)
    try:
        built = build(args, source)  # a bad --config, --plugin or --pool stops here
    except picker_config.ConfigErrors as error:
        parser.error(f"argument --config:\n{error}")
    except ConfigError as error:
        parser.error(str(error))
    configure_logging(log_level(args), args.zap_encoder)
    try:
        load_pods(args.pods)  # fail fast on a broken file
        source.reload()
        for name, models in args.pools:  # a typo in a name: every request of its models gets 503
            if not built[0].pickers[models[0]].pool.endpoints:  # the pool build() made
                selector = f"{args.pool_label}={name}"
                log.warning("no pod matches the pool", pool=name, pods=args.pods, selector=selector)
        tls = server_tls(args)
        auth = metrics_auth(args, args.kubeconfig)
    except (PodFileError, TLSError, KubeconfigError) as error:
        sys.exit(f"onehop: {error}")
    if args.workers > 1:
        flags = list(sys.argv[1:] if argv is None else argv)
        sys.exit(run_workers("lwepp.onehop", flags, args.workers, ports_of(args), shared_tls(tls)))
    with contextlib.ExitStack() as files:
        trace = files.enter_context(open(args.trace_messages, "a")) if args.trace_messages else None
        asyncio.run(run(args, built, source, trace, tls, auth))


if __name__ == "__main__":
    main()
