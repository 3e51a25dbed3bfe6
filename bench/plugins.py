"""Per-call cost of each built-in filter, scorer and data-source step, with 8 candidates.

Every number is a ratio to the cheapest possible scorer measured in the same
run (one that returns 1.0 for each candidate), so the table compares across
machines. Alongside: reading a vLLM-shaped ``/metrics`` page with the
project's parser against ``prometheus_client``'s, one scrape over loopback
HTTP, the prompt hash chain with xxhash64 against blake2b, and the memory the
prefix index takes per remembered block.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.codec import per_call_us
from bench.report import Timed
from lwepp.contracts import Candidate, Filter, LLMRequest, Measurement, Scorer, Usage
from lwepp.plugins import REGISTRY
from lwepp.plugins.inflight import InFlightLoadProducer
from lwepp.plugins.metrics_source import MetricsDataSource
from lwepp.plugins.precise_prefix import PrecisePrefixCacheProducer
from lwepp.plugins.predicted_latency import LatencyScorer, PredictedLatencyProducer
from lwepp.plugins.prefix import PrefixCacheScorer
from lwepp.plugins.prefix_index import PrefixIndex, block_hashes, seed
from lwepp.plugins.session_affinity import token
from plugin_api import Params
from plugin_api.frozen import FrozenDict
from pods.model import Endpoint

CANDIDATES = 8
PROMPT_BYTES = 4096


class NoopScorer:
    """The baseline: a scorer that does nothing but answer."""

    name = "noop"

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        return [1.0] * len(candidates)


def candidates(now: float) -> list[Candidate]:
    """8 vLLM endpoints with fresh metrics and LoRA state, two labels each."""
    pool = []
    for i in range(CANDIDATES):
        values: dict[str, float | frozenset[str]] = {
            "queue_depth": float(i % 4),
            "running_requests": float(i),
            "kv_cache_usage": i / 10,
            "cache_block_size": 16.0,
            "cache_num_blocks": 31250.0,
            "lora_max": 4.0,
            "lora_running": frozenset({"sql", "chat"} if i % 2 else {"math"}),
            "lora_waiting": frozenset(),
        }
        endpoint = Endpoint(
            f"pod-{i}",
            f"10.0.0.{i + 1}",
            8000,
            {"pool": "a", "role": "decode" if i % 2 else "both"},
        )
        pool.append(Candidate(endpoint, {k: Measurement(v, now) for k, v in values.items()}))
    return pool


def chat_body(size: int = PROMPT_BYTES) -> dict[str, object]:
    system = "You are a careful assistant. Answer in full sentences. " * (size // 55)
    return {
        "model": "sql",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "How many rows are in the table?"},
        ],
    }


def _scoring(
    scorer: Scorer, request: LLMRequest, pool: list[Candidate], now: float
) -> Callable[[], object]:
    return lambda: scorer.score(request, pool, now)


def build(kind: str, **parameters: object) -> Any:
    return REGISTRY[kind](kind, Params(parameters, kind))


Measure = Callable[[Callable[[], object]], float]
"""Microseconds per call of a function (``bench.codec.per_call_us`` with a budget, or a stub)."""


def timed(budget: float) -> Measure:
    return lambda fn: per_call_us(fn, budget)


def plugin_rows(measure: Measure) -> list[Timed]:
    now = time.monotonic()
    pool = candidates(now)
    headers = {"x-session-token": token("pod-3")}
    plain = LLMRequest("r", headers, model="sql")
    noop = NoopScorer()
    baseline = measure(lambda: noop.score(plain, pool, now))

    rows = [Timed("no-op scorer (baseline)", baseline, baseline)]
    for kind in (
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "lora-affinity-scorer",
        "session-affinity-scorer",
    ):
        scorer: Scorer = build(kind)
        rows.append(Timed(kind, measure(_scoring(scorer, plain, pool, now)), baseline))
    rows += load_rows(measure, pool, now, baseline)
    selector: Filter = build(
        "label-selector-filter",
        matchLabels={"pool": "a"},
        matchExpressions=[{"key": "role", "operator": "In", "values": ["decode"]}],
    )
    rows.append(
        Timed(
            "label-selector-filter (1 label, 1 expression)",
            measure(lambda: selector.filter(plain, pool, now)),
            baseline,
        )
    )

    # Prefix: a 4 KB chat prompt whose every block the index already knows.
    prefix = PrefixCacheScorer("prefix")
    body = FrozenDict(chat_body())  # as the pipeline hands it over: parsed once, read-only
    warm = LLMRequest("warm", {}, model="sql", parsed=body)
    prefix.prepare(warm)
    prefix.score(warm, pool, now)
    prefix.picked(warm, [pool[3].endpoint])

    def whole_request() -> None:
        request = LLMRequest("r", {}, model="sql", parsed=body)
        prefix.prepare(request)
        prefix.score(request, pool, now)
        prefix.picked(request, [pool[3].endpoint])

    def prepare_only() -> None:
        prefix.prepare(LLMRequest("r", {}, model="sql", parsed=body))

    scored = LLMRequest("r", {}, model="sql", parsed=body)
    prefix.prepare(scored)
    blocks = len(scored.state["prefix.prompt"].hashes)
    rows += [
        Timed(
            f"prefix-cache-scorer prepare (4 KB chat, {blocks} blocks)",
            measure(prepare_only),
            baseline,
        ),
        Timed(
            "prefix-cache-scorer score (all blocks held)",
            measure(lambda: prefix.score(scored, pool, now)),
            baseline,
        ),
        Timed(
            "prefix-cache-scorer prepare + score + picked",
            measure(whole_request),
            baseline,
        ),
    ]
    for learn in (False, True):
        rows.append(
            Timed(
                "approx-prefix-cache-producer prepare + match + picked + complete"
                + (", learnCapacity" if learn else ""),
                measure(producer_request(learn, body, pool, now)),
                baseline,
            )
        )
    return rows


def producer_request(
    learn: bool, body: FrozenDict, pool: list[Candidate], now: float
) -> Callable[[], None]:
    """One request's life in the producer, its prompt held by the pick, the response
    reporting it all cached (with ``learnCapacity``: what the learner compares)."""
    producer = REGISTRY["approx-prefix-cache-producer"](
        "approx", Params({"learnCapacity": learn}, "approx")
    )
    usage = Usage(1000, 10, 1000)

    def request() -> None:
        one = LLMRequest("r", {}, model="sql", parsed=body)
        producer.prepare(one)
        producer.prefix_match(one, pool, now)
        producer.picked(one, [pool[3].endpoint])
        producer.response_complete(one, pool[3].endpoint.hostport, usage)

    request()
    return request


def load_rows(measure: Measure, pool: list[Candidate], now: float, baseline: float) -> list[Timed]:
    """The request-path load plugins: the producer's whole life of a request, and the scorers
    reading it (every candidate with requests and tokens in flight) or the scraped queue."""
    producer = InFlightLoadProducer("inflight-load-producer")
    body = FrozenDict(chat_body())
    for i, candidate in enumerate(pool):  # i + 1 requests in flight on candidate i
        for _ in range(i + 1):
            producer.picked(LLMRequest("busy", {}, parsed=body), [candidate.endpoint])
    loaded = LLMRequest("r", {}, model="sql")
    producer.prepare(loaded)
    no_hit = build("no-hit-lru-scorer")
    for candidate in pool:  # every candidate in its LRU: the cold path's longest walk
        no_hit.score(loaded, pool, now)
        no_hit.picked(loaded, [candidate.endpoint])

    def request_life() -> None:
        request = LLMRequest("r", {}, model="sql", parsed=body)
        producer.prepare(request)
        producer.picked(request, [pool[3].endpoint])
        producer.response_chunk(request, b"data: {}")
        producer.response_complete(request, pool[3].endpoint.hostport, None)

    rows = [
        Timed(
            f"{kind} (requests and tokens in flight everywhere)",
            measure(_scoring(build(kind), loaded, pool, now)),
            baseline,
        )
        for kind in ("active-request-scorer", "token-load-scorer")
    ]
    rows += [
        Timed(
            "load-aware-scorer",
            measure(_scoring(build("load-aware-scorer"), loaded, pool, now)),
            baseline,
        ),
        Timed(
            "no-hit-lru-scorer (cold request)",
            measure(_scoring(no_hit, loaded, pool, now)),
            baseline,
        ),
        Timed(
            "inflight-load-producer prepare + picked + chunk + complete (4 KB chat)",
            measure(request_life),
            baseline,
        ),
    ]
    return (
        rows
        + precise_rows(measure, pool, now, baseline)
        + latency_rows(measure, pool, now, baseline)
    )


def latency_rows(
    measure: Measure, pool: list[Candidate], now: float, baseline: float
) -> list[Timed]:
    """The predicted latency: ``latency-scorer`` scoring 8 candidates, every one with its own
    fitted model and requests in flight (the producer's predictions are its cost); the
    response side, a first token and a completion, each refitting the endpoint's model."""
    config = {"streamingMode": True}
    producer = PredictedLatencyProducer("predicted-latency-producer", Params(config, "p"))
    inflight = InFlightLoadProducer("inflight-load-producer")
    scorer = LatencyScorer("latency-scorer")
    scorer.producer = producer
    body = FrozenDict(chat_body())
    usage = Usage(100, 32, 0)
    for i, candidate in enumerate(pool):  # a fitted model and i + 1 in flight everywhere
        for _ in range(i + 1):
            busy = LLMRequest("busy", {}, parsed=body)
            inflight.prepare(busy)
            producer.predict(busy, pool)
            inflight.picked(busy, [candidate.endpoint])
            producer.picked(busy, [candidate.endpoint])
            producer.response_chunk(busy, b"data: {}")
            producer.response_complete(busy, candidate.endpoint.hostport, usage)
            inflight.picked(LLMRequest("held", {}, parsed=body), [candidate.endpoint])
    request = LLMRequest("r", {"x-llm-d-slo-ttft-ms": "500"}, model="sql", parsed=body)
    inflight.prepare(request)

    def response() -> None:
        life = LLMRequest("r", {}, model="sql", parsed=body)
        inflight.prepare(life)
        producer.picked(life, [pool[3].endpoint])
        producer.response_chunk(life, b"data: {}")
        producer.response_complete(life, pool[3].endpoint.hostport, usage)

    return [
        Timed("latency-scorer + predictions (8 fitted models, SLO header)",
            measure(_scoring(scorer, request, pool, now)), baseline),
        Timed("predicted-latency-producer picked + first chunk + complete (2 refits)",
            measure(response), baseline),
    ]  # fmt: skip


def precise_rows(
    measure: Measure, pool: list[Candidate], now: float, baseline: float
) -> list[Timed]:
    """The precise prefix cache: tokenizing the 4 KB chat (the simulator's tokenizer) into
    block keys, scoring it with every block held by one engine, as its events said, and
    recording a pick's blocks as speculative entries (``speculativeIndexing``)."""
    params = {"tokenizer": "simulator.openai.prompt_token_ids", "speculativeIndexing": True}
    producer = PrecisePrefixCacheProducer("precise", Params(params, "precise"))
    scorer = PrefixCacheScorer("prefix")
    scorer.use_precise(producer)
    raw = orjson.dumps(chat_body())
    warm = LLMRequest("warm", {}, body=raw)
    producer.prepare(warm)
    keys = producer.request_keys(warm)
    producer.index.stored(pool[3].endpoint.address, list(range(len(keys))), keys)
    producer.sequence[pool[3].endpoint.address] = 0

    def prepare() -> None:
        producer.prepare(LLMRequest("r", {}, body=raw))

    def picked() -> None:
        producer.picked(warm, [pool[0].endpoint])

    return [
        Timed(f"precise-prefix-cache-producer prepare (4 KB chat, {len(keys)} blocks)",
            measure(prepare), baseline),
        Timed("prefix-cache-scorer score, precise (all blocks held by one)",
            measure(_scoring(scorer, warm, pool, now)), baseline),
        Timed(f"precise-prefix-cache-producer picked, speculative ({len(keys)} blocks)",
            measure(picked), baseline),
    ]  # fmt: skip


def vllm_page(histograms: int = 16, buckets: int = 28) -> str:
    """A vLLM-shaped ``/metrics`` page: the routing gauges among many histogram buckets."""
    labels = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} 12.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} 3.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.4375",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="31250"} 1.0',
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",'
        'waiting_lora_adapters=""} 1.7e+09',
    ]
    for h in range(histograms):
        name = f"vllm:request_latency_{h}_seconds"
        lines += [f"# HELP {name} Latency histogram {h}.", f"# TYPE {name} histogram"]
        for b in range(buckets):
            lines.append(f'{name}_bucket{{{labels},le="{0.001 * 2**b:.3f}"}} {b * 7}.0')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} 500.0')
        lines += [f"{name}_count{{{labels}}} 500.0", f"{name}_sum{{{labels}}} 123.4"]
    return "\n".join(lines) + "\n"


def scrape_rows(measure: Measure, baseline: float) -> list[Timed]:
    page = vllm_page()
    source = MetricsDataSource("metrics")
    endpoint = Endpoint("p", "127.0.0.1", 8000)
    assert source.read(endpoint, page)["queue_depth"] == 3.0
    lines = page.count("\n")
    return [
        Timed(
            f"metrics page → attributes, this parser ({lines} lines, {len(page) // 1024} KB)",
            measure(lambda: source.read(endpoint, page)),
            baseline,
        ),
        Timed(
            "same page, prometheus_client text_string_to_metric_families",
            measure(lambda: list(text_string_to_metric_families(page))),
            baseline,
        ),
        Timed("one scrape over loopback HTTP (client + server)", _scrape_us(page), baseline),
    ]


def _scrape_us(page: str, count: int = 300) -> float:
    """Mean wall time of ``count`` scrapes of an in-process aiohttp server (both sides' CPU)."""

    async def measure() -> float:
        async def handler(_request: web.Request) -> web.Response:
            return web.Response(text=page)

        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        endpoint = Endpoint("p", "127.0.0.1", runner.addresses[0][1])
        source = MetricsDataSource("metrics")
        try:
            async with aiohttp.ClientSession() as session:
                await source.fetch(session, endpoint)
                start = time.perf_counter()
                for _ in range(count):
                    await source.fetch(session, endpoint)
                return (time.perf_counter() - start) / count * 1e6
        finally:
            await runner.cleanup()

    return asyncio.run(measure())


def hashing_rows(measure: Measure, baseline: float) -> list[Timed]:
    text = orjson.dumps(chat_body()["messages"])[:PROMPT_BYTES]
    start = seed("sql")

    def blake() -> int:
        previous = start
        for i in range(0, len(text), 64):
            digest = hashlib.blake2b(
                text[i : i + 64] + previous.to_bytes(8, "little"), digest_size=8
            )
            previous = int.from_bytes(digest.digest(), "little")
        return previous

    return [
        Timed(
            "hash chain, 4 KB prompt: xxhash64",
            measure(lambda: block_hashes(text, start, 64, 256)),
            baseline,
        ),
        Timed(
            "same chain with blake2b (for comparison)",
            measure(blake),
            baseline,
        ),
    ]


def index_bytes_per_block(blocks: int = 31250) -> float:
    """Memory the prefix index takes per remembered block (one endpoint at default capacity)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    hashes = [seed(str(i)) for i in range(blocks)]
    index.add("10.0.0.1:8000", hashes, blocks)
    del hashes
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.size() == blocks
    return used / blocks


def run(budget: float = 0.1) -> tuple[list[Timed], float]:
    measure = timed(budget)
    rows = plugin_rows(measure)
    baseline = rows[0].baseline_us
    rows += scrape_rows(measure, baseline)
    rows += hashing_rows(measure, baseline)
    return rows, index_bytes_per_block()


def table(rows: list[Timed], bytes_per_block: float) -> str:
    lines = [
        f"| with {CANDIDATES} candidates | µs per call | × no-op scorer |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r.what} | {r.us:.2f} | {r.ratio:.1f}× |" for r in rows]
    per_endpoint = bytes_per_block * 31250 / 2**20
    lines.append(
        f"\nPrefix index memory: {bytes_per_block:.0f} bytes per remembered block, "
        f"{per_endpoint:.1f} MiB per endpoint at the default lruCapacityPerServer (31250)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(*run()))
