"""``metrics-data-source``: engine mappings, parameters, and scraping real HTTP servers.

Servers are aiohttp servers on 127.0.0.1 free ports, stopped after each
test. Nothing is timed: a slow endpoint is held on an ``asyncio.Event``, and
tests wait for what the store received, bounded only against hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from demo.topology import free_ports
from lwepp.contracts import Candidate, DataSource
from lwepp.plugins import REGISTRY
from lwepp.plugins.metrics_source import BUILTIN_ENGINES, MetricsDataSource
from lwepp.plugins.prometheus import parse
from plugin_api import ConfigError, Params
from pods.model import Endpoint, Pod
from simulator import Settings, serve_pods
from tests.fakes import RecordingStore
from tests.plugin_fakes import configured

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="8192"} 1.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql, chat",waiting_lora_adapters="math"} 1.70000001e+09
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 12.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.125
sglang:cache_config_info{num_pages="50000",page_size="1"} 1.0
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""

TRTLLM = """\
trtllm_num_requests_waiting 2
trtllm_num_requests_running 6
trtllm_kv_cache_utilization 0.5
trtllm_kv_cache_tokens_per_block 32
trtllm_kv_cache_max_blocks 4096
"""

TRITON = """\
nv_trt_llm_request_metrics{model="e",request_type="waiting",version="1"} 8
nv_trt_llm_request_metrics{model="e",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="e",request_type="context",version="1"} 1
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="e"} 0.75
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="e"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="e"} 1000
"""

CUSTOM = """\
my_queue{state="waiting"} 11
my_queue{state="done"} 500
my_running 1
"""

ENGINE = "llm-d.ai/engine-type"


def endpoint(port: int = 8000, pod: str = "p", /, **labels: str) -> Endpoint:
    return Endpoint(pod, "127.0.0.1", port, labels)


def source(**parameters: Any) -> MetricsDataSource:
    built: MetricsDataSource = configured("metrics-data-source", parameters, "metrics")
    return built


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))  # a bound against hangs, not a timing check


# --- engine mappings -------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "page", "expected"),
    [
        (
            "vllm",
            VLLM,
            {
                "queue_depth": 7.0,
                "running_requests": 4.0,
                "kv_cache_usage": 0.42,
                "cache_block_size": 16.0,
                "cache_num_blocks": 8192.0,
                "lora_max": 4.0,
                "lora_running": frozenset({"sql", "chat"}),
                "lora_waiting": frozenset({"math"}),
            },
        ),
        (
            "sglang",
            SGLANG,
            {
                "queue_depth": 1.0,
                "running_requests": 3.0,
                "kv_cache_usage": 0.125,
                "cache_block_size": 1.0,
                "cache_num_blocks": 50000.0,
            },
        ),
        ("llamacpp", LLAMACPP, {"queue_depth": 5.0, "running_requests": 2.0}),
        (
            "trtllm-serve",
            TRTLLM,
            {
                "queue_depth": 2.0,
                "running_requests": 6.0,
                "kv_cache_usage": 0.5,
                "cache_block_size": 32.0,
                "cache_num_blocks": 4096.0,
            },
        ),
        (
            "triton-tensorrt-llm",
            TRITON,
            {
                "queue_depth": 8.0,
                "running_requests": 3.0,
                "kv_cache_usage": 0.75,
                "cache_block_size": 64.0,
                "cache_num_blocks": 1000.0,
            },
        ),
    ],
    ids=["vllm", "sglang", "llamacpp-no-kv", "trtllm-serve", "triton"],
)
def test_engine_page_maps_to_attributes(
    engine: str, page: str, expected: dict[str, object]
) -> None:
    """Each built-in engine's page yields its attributes; llama.cpp's has no KV usage, not 0."""
    assert source().read(endpoint(**{ENGINE: engine}), page) == expected


def test_lora_takes_the_newest_series() -> None:
    """The LoRA info gauge's value is a timestamp: the newest series is the current state."""
    values = source().read(endpoint(), VLLM)
    assert values["lora_running"] == frozenset({"sql", "chat"})


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 2\n", {"running_requests": 2.0}),
        ("vllm:num_requests_running 2\n", {"running_requests": 2.0}),
        (
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n',
            {"cache_block_size": 16.0},
        ),
        ("", {}),
    ],
    ids=["nan", "missing", "unparsable-label", "empty-page"],
)
def test_missing_or_nan_metrics_are_not_written(page: str, expected: dict[str, object]) -> None:
    """A metric absent, NaN or unreadable is left out: it stays unknown (or keeps ageing)."""
    assert source().read(endpoint(), page) == expected


@pytest.mark.parametrize(
    ("labels", "parameters", "engine"),
    [
        ({ENGINE: "sglang"}, {}, "sglang"),
        ({"inference.networking.k8s.io/engine-type": "sglang"}, {}, "sglang"),
        ({ENGINE: "llamacpp", "inference.networking.k8s.io/engine-type": "sglang"}, {}, "llamacpp"),
        ({}, {}, "vllm"),
        ({}, {"defaultEngine": "sglang"}, "sglang"),
        ({ENGINE: "no-such-engine"}, {}, "vllm"),
        ({"engine": "sglang"}, {"engineLabelKey": "engine"}, "sglang"),
    ],
    ids=["label", "legacy-label", "label-wins", "default", "default-param", "unknown", "own-key"],
)
def test_engine_is_chosen_per_endpoint(
    labels: dict[str, str], parameters: dict[str, Any], engine: str
) -> None:
    """The pod label names the engine, then the legacy label, then ``defaultEngine``."""
    assert source(**parameters).engine_of(endpoint(**labels)).name == engine


def test_engine_config_replaces_a_builtin_engine() -> None:
    """An ``engineConfigs`` entry named like a built-in replaces it whole; others are kept."""
    configured = source(
        engineConfigs=[
            {
                "name": "vllm",
                "queuedRequestsSpec": 'my_queue{state="waiting"}',
                "runningRequestsSpec": "my_running",
                "kvUsageSpec": "",
            }
        ]
    )
    assert configured.read(endpoint(), CUSTOM + VLLM) == {
        "queue_depth": 11.0,
        "running_requests": 1.0,
    }
    assert configured.read(endpoint(**{ENGINE: "llamacpp"}), LLAMACPP)["queue_depth"] == 5.0


def test_custom_engine_with_cache_info_labels() -> None:
    """A custom engine can name its info gauge and which labels hold the block size and count."""
    configured = source(
        defaultEngine="mine",
        engineConfigs=[
            {
                "name": "mine",
                "queuedRequestsSpec": "q",
                "cacheInfoSpec": "info",
                "cacheBlockSizeLabelName": "bs",
                "cacheNumBlocksLabelName": "n",
            }
        ],
    )
    page = 'q 3\ninfo{bs="8",n="100"} 1\n'
    assert configured.read(endpoint(), page) == {
        "queue_depth": 3.0,
        "cache_block_size": 8.0,
        "cache_num_blocks": 100.0,
    }


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"defaultEngine": "nope"}, r"parameters\.defaultEngine: no engine named 'nope'"),
        (
            {"engineConfigs": [{"name": "x", "queueSpec": "q"}]},
            r"engineConfigs\[0\]: unknown field 'queueSpec'",
        ),
        ({"engineConfigs": [{"queuedRequestsSpec": "q"}]}, r"engineConfigs\[0\]\.name: required"),
        ({"engineConfigs": ["x"]}, r"engineConfigs\[0\]: expected a mapping"),
        (
            {"engineConfigs": [{"name": "x", "queuedRequestsSpec": 'q{a!="b"}'}]},
            r"engineConfigs\[0\]\.queuedRequestsSpec: only exact-match",
        ),
        ({"engineConfigs": [{"name": "x", "kvUsageSpec": 3}]}, r"kvUsageSpec: expected str"),
        ({"engineConfigs": {"name": "x"}}, r"engineConfigs: expected list"),
        ({"scheme": "ftp"}, r"scheme: expected one of http, https"),
        ({"path": "metrics"}, r"path: must start with '/'"),
        ({"refreshIntervalSeconds": 0}, r"refreshIntervalSeconds: must be > 0"),
        ({"timeoutSeconds": -1}, r"timeoutSeconds: must be > 0"),
        ({"refreshInterval": 1}, r"unknown field 'refreshInterval'"),
    ],
    ids=[
        "default-engine",
        "unknown-spec-field",
        "no-name",
        "not-mapping",
        "not-exact",
        "spec-type",
        "configs-type",
        "scheme",
        "path",
        "interval",
        "timeout",
        "unknown-field",
    ],
)
def test_bad_parameters_name_the_field(parameters: dict[str, Any], message: str) -> None:
    """Every configuration error names the plugin and the field."""
    with pytest.raises(
        ConfigError, match=rf"plugin 'metrics' \(metrics-data-source\): .*{message}"
    ):
        source(**parameters)


def test_registered_and_satisfies_the_data_source_contract() -> None:
    """The registry builds it by the llm-d router's type name; it is a ``DataSource``."""
    built: DataSource = REGISTRY["metrics-data-source"]("m", Params(None, "m"))
    assert isinstance(built, MetricsDataSource)
    assert built.produces == {
        "queue_depth",
        "running_requests",
        "kv_cache_usage",
        "cache_block_size",
        "cache_num_blocks",
        "lora_max",
        "lora_running",
        "lora_waiting",
    }


# --- scraping over HTTP -------------------------------------------------------------


class Clock:
    """An injected clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Page:
    """A ``/metrics`` handler: serves ``text`` (or ``status``), counts hits, may hold requests."""

    def __init__(self, text: str = VLLM) -> None:
        self.text = text
        self.status = 200
        self.hits = 0
        self.hit = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def handle(self, _request: web.Request) -> web.Response:
        self.hits += 1
        self.hit.set()
        if self.gate is not None:
            await self.gate.wait()
        return web.Response(text=self.text, status=self.status)

    async def until_hits(self, count: int) -> None:
        while self.hits < count:
            self.hit.clear()
            await self.hit.wait()


@contextlib.asynccontextmanager
async def serving(*pages: Page) -> AsyncIterator[list[int]]:
    """One server per page on a free port; yields the ports."""
    runners = []
    try:
        for page in pages:
            app = web.Application()
            app.router.add_get("/metrics", page.handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
        yield [runner.addresses[0][1] for runner in runners]
    finally:
        for page in pages:
            if page.gate is not None:
                page.gate.set()
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def running(
    data_source: DataSource,
    endpoints: Callable[[], Sequence[Endpoint]],
    store: RecordingStore,
    clock: Callable[[], float],
) -> AsyncIterator[None]:
    task = asyncio.create_task(data_source.run(endpoints, store, clock))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def fast(**parameters: Any) -> MetricsDataSource:
    return source(refreshIntervalSeconds=0.005, **parameters)


def written(store: RecordingStore, hostport: str) -> Mapping[str, object]:
    return {name: m.value for name, m in store.attributes.get(hostport, {}).items()}


def test_scrapes_each_engine_over_http_stamped_with_the_clock() -> None:
    """Three engines on three servers: each endpoint's page is read with its own mapping."""

    async def test() -> None:
        store, clock = RecordingStore(), Clock(123.0)
        async with serving(Page(VLLM), Page(SGLANG), Page(LLAMACPP)) as ports:
            endpoints = [
                endpoint(ports[0], **{ENGINE: "vllm"}),
                endpoint(ports[1], **{ENGINE: "sglang"}),
                endpoint(ports[2], **{ENGINE: "llamacpp"}),
            ]
            async with running(fast(), lambda: endpoints, store, clock):
                await store.until(lambda: len(store.attributes) == 3)
        vllm, sglang, llamacpp = (store.attributes[e.hostport] for e in endpoints)
        assert vllm["queue_depth"].value == 7.0
        assert sglang["kv_cache_usage"].value == 0.125
        assert llamacpp["queue_depth"].value == 5.0
        assert "kv_cache_usage" not in llamacpp
        assert {m.at for m in (*vllm.values(), *sglang.values(), *llamacpp.values())} == {123.0}

    run(test)


def test_slow_and_dead_endpoints_never_delay_the_others() -> None:
    """A held endpoint and a closed port write nothing, while a healthy one keeps being scraped."""

    async def test() -> None:
        store = RecordingStore()
        healthy, slow = Page(VLLM), Page(VLLM)
        slow.gate = asyncio.Event()
        (dead_port,) = free_ports(1)
        async with serving(healthy, slow) as ports:
            endpoints = [endpoint(ports[0]), endpoint(ports[1]), endpoint(dead_port)]
            # A long timeout: the healthy endpoint must not be waiting on it.
            async with running(fast(timeoutSeconds=60), lambda: endpoints, store, Clock()):
                await store.until(lambda: store.writes.get(endpoints[0].hostport, 0) >= 5)
                assert slow.hits == 1  # asked once and still answering
                assert set(store.writes) == {endpoints[0].hostport}
                slow.gate.set()
                await store.until(lambda: endpoints[1].hostport in store.writes)
                assert endpoints[2].hostport not in store.writes

    run(test)


def test_a_hung_scrape_is_abandoned_after_the_timeout_and_retried() -> None:
    """``timeoutSeconds`` gives up on a request that never answers; polling goes on."""

    async def test() -> None:
        store, hung = RecordingStore(), Page(VLLM)
        hung.gate = asyncio.Event()
        async with serving(hung) as ports:
            endpoints = [endpoint(ports[0])]
            # The poller waits for each answer, so a second request means the first was dropped.
            async with running(fast(timeoutSeconds=0.1), lambda: endpoints, store, Clock()):
                await hung.until_hits(2)
        assert store.writes == {}

    run(test)


def test_an_endpoint_that_stops_answering_keeps_ageing_values() -> None:
    """Old measurements stay with their old time, so ``max_age`` turns them unknown."""

    async def test() -> None:
        store, clock, page = RecordingStore(), Clock(100.0), Page(VLLM)
        async with serving(page) as ports:
            target = endpoint(ports[0])
            async with running(fast(), lambda: [target], store, clock):
                await store.until(lambda: target.hostport in store.writes)
                writes = store.writes[target.hostport]
                page.status = 500
                clock.now = 200.0
                hits = page.hits
                await page.until_hits(hits + 3)
                assert store.writes[target.hostport] == writes  # failures write nothing
        candidate = Candidate(target, store.attributes[target.hostport])
        assert candidate.value("queue_depth", now=100.5, max_age=1.0) == 7.0
        assert candidate.value("queue_depth", now=200.0, max_age=1.0) is None
        assert candidate.names("lora_running", now=200.0, max_age=1.0) is None

    run(test)


def test_endpoints_that_leave_are_no_longer_scraped() -> None:
    """The endpoint list is re-read: a removed endpoint's polling stops, a new one starts."""

    async def test() -> None:
        store, first, second = RecordingStore(), Page(VLLM), Page(SGLANG)
        async with serving(first, second) as ports:
            a, b = endpoint(ports[0]), endpoint(ports[1], **{ENGINE: "sglang"})
            current = [a]
            async with running(fast(), lambda: current, store, Clock()):
                await store.until(lambda: a.hostport in store.writes)
                current = [b]
                await store.until(lambda: b.hostport in store.writes)
                hits = first.hits
                await store.until(lambda: store.writes[b.hostport] >= 5)
                assert first.hits <= hits + 1  # at most one scrape already under way
        assert written(store, b.hostport)["queue_depth"] == 1.0

    run(test)


# The simulator's --engine names, and the engine label values the router (and this source) use.
DIALECTS = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "trtllm-serve",
    "triton": "triton-tensorrt-llm",
    "llamacpp": "llamacpp",
}


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_reads_every_simulator_dialect(dialect: str) -> None:
    """The project's simulator in each engine's names: an idle engine, geometry where published."""

    async def test() -> None:
        store = RecordingStore()
        pod = Pod("sim", "127.0.0.1", (0,), {"model": "m", "adapters": "sql,chat"})
        async with serve_pods([pod], Settings(time_scale=0), grace=0.1, dialect=dialect) as sims:
            target = endpoint(sims[0].port, "sim", **{ENGINE: DIALECTS[dialect]})
            async with running(fast(), lambda: [target], store, Clock()):
                await store.until(lambda: target.hostport in store.writes)
        values = written(store, target.hostport)
        assert (values["queue_depth"], values["running_requests"]) == (0.0, 0.0)
        if dialect == "llamacpp":
            assert set(values) == {"queue_depth", "running_requests"}  # no KV gauge: unknown
        else:
            assert values["kv_cache_usage"] == 0.0
            # SGLang's default pages are one token; the other engines publish 16-token blocks.
            assert values["cache_block_size"] == (1.0 if dialect == "sglang" else 16.0)
            assert "cache_num_blocks" in values
        if dialect == "vllm":
            assert (values["lora_max"], values["lora_running"]) == (2.0, frozenset())

    run(test)


SAMPLES = Path(__file__).parent / "data" / "metrics"


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ("vllm", {"queue_depth": 1.0, "running_requests": 2.0, "kv_cache_usage": 0.3412}),
        ("sglang", {"queue_depth": 0.0, "running_requests": 3.0, "kv_cache_usage": 0.18}),
        ("llamacpp", {"queue_depth": 1.0, "running_requests": 2.0}),
    ],
    ids=["vllm", "sglang", "llamacpp"],
)
def test_reads_the_representative_engine_pages(sample: str, expected: dict[str, float]) -> None:
    """The shared sample pages (``tests/data/metrics``) give their stated load signals."""
    text = (SAMPLES / f"{sample}.txt").read_text()
    values = source().read(endpoint(8000, "p", **{ENGINE: DIALECTS[sample]}), text)
    assert {k: values.get(k) for k in expected} == expected
    if sample == "vllm":  # the newest LoRA series, and the geometry labels
        assert values["lora_running"] == frozenset({"sql-lora", "tweet-lora"})
        assert (values["cache_block_size"], values["cache_num_blocks"]) == (16.0, 27264.0)


@pytest.mark.parametrize("sample", list(DIALECTS))
def test_parser_agrees_with_prometheus_client_on_every_sample(sample: str) -> None:
    """For every name an engine mapping reads, both parsers find the same series."""
    text = (SAMPLES / f"{sample}.txt").read_text()
    names = BUILTIN_ENGINES[DIALECTS[sample]].metric_names
    ours = {
        (name, tuple(sorted(labels.items())), value)
        for name, series in parse(text, names).items()
        for labels, value in series
    }
    theirs = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in names
    }
    assert ours == theirs
    assert ours  # the sample does carry the engine's metrics
