"""Assembling an endpoint picker: the flags that shape it, and the one function that builds it.

``python -m lwepp`` serves one pool; ``python -m onehop`` serves several in
one process, one picker each. Both take the same picking flags
(``add_picker_flags``, read into ``PickerOptions``) and build every picker
with ``assemble``: the stream handler (``EndpointPickerService``) over the
pool, round-robin or the configuration's pipeline as its strategy, its
metrics, and the background work and debug pages that come with it. What a
plugin learns belongs to one picker: each ``assemble`` gets a configuration
of its own (``PickerOptions.load_config`` builds fresh plugins each call).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import structlog
from prometheus_client import CollectorRegistry

from lwepp import config as picker_config
from lwepp import objectives as inference_objectives
from lwepp import request_metrics
from lwepp.contracts import Candidate
from lwepp.explain import DecisionLog, ExplainMode
from lwepp.flowcontrol.config import OFF
from lwepp.flowcontrol.governance import govern
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RequestControl, RequestInfo, RoundRobin, Strategy
from lwepp.pipeline import Pipeline
from lwepp.rewrite_control import ModelRewriteControl, RewriteMetrics, RewriteSource
from lwepp.rewrite_sources import RewriteFile, load_rewrites
from lwepp.server import EndpointPickerService
from lwepp.sharing import SharedView
from pods.model import Endpoint
from serving.cli import add_bool, duration
from wire.stream import EXT_PROC_SERVICE

log = structlog.get_logger()

HEALTH_SERVICES: Final = ("", "inference-extension", "liveness", "readiness", EXT_PROC_SERVICE)
"""GIE's lwepp reports ``inference-extension``; the protocol document lists the others."""

Job = Callable[[], Coroutine[Any, Any, None]]
"""A background task's factory, as ``serving.server.Service.background`` takes them."""


def add_picker_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that shape a picker: its configuration, explanations, the pool gauges' refresh
    and GIE's two conformance switches (the llm-d router's spellings where it has them)."""
    picking = parser.add_argument_group("picking")
    configs = picking.add_mutually_exclusive_group()
    configs.add_argument(
        "--config",
        "--config-file",
        dest="config",
        metavar="FILE",
        help="an EndpointPickerConfig (the llm-d router's YAML format): filters, scorers, a "
        "picker and data sources instead of plain round-robin (format: lwepp/config.py)",
    )
    configs.add_argument(
        "--config-text",
        metavar="YAML",
        help="the EndpointPickerConfig itself, in lieu of a file",
    )
    picking.add_argument(
        "--inference-objectives",
        metavar="FILE",
        help="InferenceObjectives as YAML (the Kubernetes objects, several separated by ---): "
        "a request naming one in x-llm-d-inference-objective gets its priority; re-read when "
        "it changes (lwepp/objectives.py). With --pool-name they are read from the Kubernetes "
        "API instead, unless this is given",
    )
    picking.add_argument(
        "--explain",
        choices=["header", "all", "off"],
        default=None,
        help="with --config: explain decisions (every candidate's address, scores and "
        "measurements) to the client, in the response header x-switchyard-decision, when a "
        "request asks (x-switchyard-explain: 1), for every request, or never (default off)",
    )
    add_bool(
        picking,
        "--emit-endpoint-scores",
        False,
        "the llm-d router's switch for the same: --explain=all (default false)",
    )
    picking.add_argument(
        "--debug-decisions",
        type=int,
        default=100,
        metavar="N",
        help="with --config and --enable-debug-pages: how many explained decisions and "
        "fallbacks GET /debug/decisions on the metrics port keeps",
    )
    picking.add_argument(
        "--request-metrics",
        choices=request_metrics.LEVELS,
        default="request",
        help="what the picker records of each request (lwepp/request_metrics.py): nothing (off); "
        "its body's size and the choice's time (request, the default: no exchange added); or "
        "also its duration, time to first token, inter-token latency, tokens and objective "
        "attainment (response: the gateway must stream the response body through the picker, "
        "one exchange per chunk; docs/benchmarks.md says what that costs)",
    )
    picking.add_argument(
        "--refresh-prometheus-metrics-interval",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="how often the pool gauges (ready endpoints, with --config the pool's averages) "
        "are recomputed (default 5s, as the llm-d router)",
    )
    rewrites = parser.add_argument_group("model rewrites (InferenceModelRewrite)")
    rewrites.add_argument(
        "--model-rewrites",
        metavar="FILE|api|off",
        help="where the pool's InferenceModelRewrites come from: a YAML file of them (re-read "
        "when it changes, keeping the last good set), 'api' (the Kubernetes API, the default "
        "with --pool-name, as the llm-d router), or 'off' (the default otherwise). With "
        "rewrites, a request naming no model gets 400, as from the router",
    )
    rewrites.add_argument(
        "--model-rewrites-pool",
        metavar="NAME",
        help="with a rewrite file and no --pool-name: apply the file's rewrites whose "
        "spec.poolRef names this pool (default: every rewrite in the file)",
    )
    conformance = parser.add_argument_group(
        "GIE's conformance tests (both off: they let a client choose, or learn, its replica)"
    )
    conformance.add_argument(
        "--enable-test-selection-header",
        dest="test_selection",
        action="store_true",
        help="honour test-epp-endpoint-selection, the header with which a client names the "
        "replicas that may serve it (GIE's lwepp always does; default: ignored)",
    )
    conformance.add_argument(
        "--disable-test-selection-header",
        dest="test_selection",
        action="store_false",
        help="ignore that header: the default; accepted for deployments that still say so "
        "(of the two flags, the last one given wins)",
    )
    conformance.add_argument(
        "--report-served-endpoint",
        action="store_true",
        help="name the replica that served each request in the response header "
        "x-conformance-test-served-endpoint (with x-went-into-resp-headers), and ask GIE's "
        "echo server to echo it, as GIE's lwepp always does (default: never)",
    )


@dataclass(frozen=True, slots=True)
class PickerOptions:
    """The picking flags, decoded (``add_picker_flags`` explains each).

    ``explain``: ``--explain``, else ``all`` with ``--emit-endpoint-scores``,
    else ``off``: a decision shows every candidate's address and load, so no
    client sees one unasked.
    """

    config_path: str | None = None
    config_text: str | None = None
    explain: ExplainMode = "off"
    decisions: int = 100
    refresh_every: float = 5.0
    test_selection: bool = False
    report_served: bool = False
    request_metrics: request_metrics.Level = "request"
    model_rewrites: str | None = None
    model_rewrites_pool: str | None = None
    objectives: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PickerOptions:
        explain = args.explain or ("all" if args.emit_endpoint_scores else "off")
        return cls(
            config_path=args.config,
            config_text=args.config_text,
            explain=cast(ExplainMode, explain),
            decisions=args.debug_decisions,
            refresh_every=args.refresh_prometheus_metrics_interval,
            test_selection=args.test_selection,
            report_served=args.report_served_endpoint,
            request_metrics=args.request_metrics,
            model_rewrites=args.model_rewrites,
            model_rewrites_pool=args.model_rewrites_pool,
            objectives=args.inference_objectives,
        )

    def load_config(self) -> picker_config.PickerConfig | None:
        """The configuration, built anew (fresh plugins) on each call; None for round-robin.
        Raises ``lwepp.config.ConfigErrors`` listing every problem."""
        if self.config_path is not None:
            return picker_config.load_config(self.config_path)
        if self.config_text is not None:
            return picker_config.load_text(self.config_text)
        return None

    @property
    def rewrite_path(self) -> str | None:
        """The rewrite file ``--model-rewrites`` names, if it names one."""
        return None if self.model_rewrites in (None, "api", "off") else self.model_rewrites

    def rewrite_file(self, pool: str | None) -> RewriteFile | None:
        """The rewrite file's source for ``pool`` (its rewrites whose ``poolRef`` names it; None:
        all), read now; None without a file. Raises ``ConfigErrors`` naming each problem."""
        if (path := self.rewrite_path) is None:
            return None
        load_rewrites(path)  # a broken file stops the start, with its lines
        source = RewriteFile(path, pool)
        source.reload()
        return source

    def objective_file(self) -> inference_objectives.ObjectiveFile | None:
        """``--inference-objectives``, read now; None without the flag. Raises
        ``lwepp.config.ConfigErrors`` naming the file and line of every problem."""
        if self.objectives is None:
            return None
        return inference_objectives.load(self.objectives)


@dataclass(frozen=True, slots=True)
class Assembly:
    """One pool's picker, ready to serve: its stream handler, what runs beside it (the pool
    gauges' refresh, the pipeline's data sources, flow control's dispatcher), its debug pages,
    and what to call when it stops (flow control answers what it holds)."""

    service: EndpointPickerService
    background: list[Job] = field(default_factory=list)
    debug_pages: dict[str, Callable[[], bytes]] = field(default_factory=dict)
    stopping: list[Callable[[], None]] = field(default_factory=list)


def assemble(
    pool: Pool,
    config: picker_config.PickerConfig | None,
    options: PickerOptions,
    registry: CollectorRegistry,
    *,
    name: str,
    namespace: str = "",
    max_body_bytes: int,
    rewrites: RewriteSource | None = None,
    objectives: inference_objectives.ObjectiveSource | None = None,
    shared_store: str = "",
) -> Assembly:
    """The picker for ``pool``: round-robin, or ``config``'s pipeline (its warnings logged),
    with the request controls its ``flowControl`` section asks for (``lwepp.flowcontrol``).

    ``name`` labels its metrics (``llm_d_epp_*{name}``) and its log lines;
    ``registry`` takes its metrics. The pool's endpoints are read afresh by
    every background task (``Pool.endpoints``). ``rewrites``: the pool's
    InferenceModelRewrites, applied first (``lwepp.rewrite_control``), as the
    router applies them before anything else decides. ``objectives``: where its
    InferenceObjectives come from (default: ``--inference-objectives``, if given).
    ``shared_store``: the Redis the replicas share learned state through (``lwepp.sharing``).
    """
    strategy: Strategy = RoundRobin()
    pipeline: Pipeline | None = None
    jobs: list[Job] = []
    pages: dict[str, Callable[[], bytes]] = {}
    if config is not None:
        for warning in config.warnings:
            log.warning("configuration", pool=name, detail=warning)
        pipeline = config.pipeline(
            registry=registry,
            explain=options.explain,
            decisions=DecisionLog(options.decisions),
            pool=name,
        )
        strategy, jobs, pages = (
            pipeline,
            pipeline.background(functools.partial(current_endpoints, pool)),
            pipeline.debug_pages(),
        )
        if shared_store:
            jobs.append(SharedView(shared_store, pipeline.plugins, registry, name).run)
    objectives = objectives or options.objective_file()
    governed = govern(
        config.flow if config is not None else OFF,
        None if pipeline is None else functools.partial(pool_candidates, pipeline, pool),
        pipeline.clock if pipeline is not None else time.monotonic,
        objectives,
        registry,
        name,
    )
    priority = None if objectives is None else functools.partial(priority_by, objectives)
    metrics = PickerMetrics(registry, name, namespace, priority)
    if pipeline is not None and priority is not None:  # the admitters read it
        pipeline.priority = priority
    # The router's order: the model rewrite first, then the objective and admission (flow
    # control), then what observes the request as it is served.
    controls: list[RequestControl] = []
    if rewrites is not None:
        controls.append(ModelRewriteControl(rewrites, RewriteMetrics(registry)))
        jobs.append(rewrites.run)
    controls += governed.controls
    strategy, observing = request_metrics.install(
        options.request_metrics,
        strategy,
        metrics.labels,
        registry,
        objective_of=functools.partial(known_objective, objectives),
    )
    controls += observing
    controls += pipeline.controls if pipeline is not None else ()  # last: just before the pick
    service = EndpointPickerService(
        pool,
        strategy,
        metrics,
        max_body_bytes,
        test_selection=options.test_selection,
        report_served=options.report_served,
        controls=controls,
    )
    jobs += [
        *governed.jobs,
        functools.partial(refresh_metrics, options.refresh_every, metrics, pool, pipeline),
    ]
    return Assembly(service, jobs, pages, list(governed.stopping))


def priority_by(
    source: inference_objectives.ObjectiveSource, headers: Sequence[tuple[str, str]]
) -> int:
    """The priority of the objective ``headers`` name, among the pool's now (metric labels)."""
    return inference_objectives.priority_of(headers, source.objectives)


def known_objective(
    source: inference_objectives.ObjectiveSource | None, request: RequestInfo
) -> str:
    """The InferenceObjective a request names, for metric labels: only one the pool knows (a
    name a client makes up would grow the series without bound), else empty."""
    name = inference_objectives.objective_name(request.headers)
    return name if name is not None and source is not None and name in source.objectives else ""


def current_endpoints(pool: Pool) -> Sequence[Endpoint]:
    """The pool's endpoints at this moment (what a pipeline's data sources poll)."""
    return pool.endpoints


def pool_candidates(pipeline: Pipeline, pool: Pool) -> Sequence[Candidate]:
    """The pool's endpoints now, with their attributes (what a saturation detector reads)."""
    return pipeline.candidates(pool.endpoints).candidates


async def refresh_metrics(
    every: float, metrics: PickerMetrics, pool: Pool, pipeline: Pipeline | None
) -> None:
    """Recompute the pool gauges now and every ``every`` seconds (the router's
    ``--refresh-prometheus-metrics-interval``): one value per scrape, in every worker."""
    while True:
        metrics.refresh(pool.endpoints)
        if pipeline is not None:
            pipeline.refresh_metrics(pool.endpoints)
        await asyncio.sleep(every)
