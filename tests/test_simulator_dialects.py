"""The simulator's /metrics in each engine's naming (``--engine``), read as a picker reads it."""

from __future__ import annotations

import asyncio
import functools

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pods.model import Pod
from simulator import Settings, metrics, serve_pods
from simulator.__main__ import main
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Request
from simulator.metrics import ENGINES
from simulator.profiles import PROFILES
from simulator.tokenizer import token_block

# Per engine: (queued, running, KV usage) as (metric name, labels that pick the sample).
SIGNALS = {
    "vllm": (
        ("vllm:num_requests_waiting", {}),
        ("vllm:num_requests_running", {}),
        ("vllm:kv_cache_usage_perc", {}),
    ),
    "sglang": (
        ("sglang:num_queue_reqs", {}),
        ("sglang:num_running_reqs", {}),
        ("sglang:token_usage", {}),
    ),
    "trtllm": (
        ("trtllm_num_requests_waiting", {}),
        ("trtllm_num_requests_running", {}),
        ("trtllm_kv_cache_utilization", {}),
    ),
    "triton": (
        ("nv_trt_llm_request_metrics", {"request_type": "waiting"}),
        ("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
        ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"}),
    ),
    "llamacpp": (
        ("llamacpp:requests_deferred", {}),
        ("llamacpp:requests_processing", {}),
        None,
    ),
}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics page, parsed by prometheus_client's own parser."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def value(text: str, name: str, labels: dict[str, str]) -> float:
    (found,) = [v for n, ls, v in samples(text) if n == name and labels.items() <= ls.items()]
    return found


async def scrape_under_load(engine: str) -> str:
    """/metrics of a one-slot replica while one request runs and one waits.

    The engine's sleep blocks until released, so both requests stay where they are.
    """
    release = asyncio.Event()

    async def held(_seconds: float) -> None:
        await release.wait()

    settings = Settings(max_running=1, kv_capacity=64)
    pod = Pod("p-0", "127.0.0.1", (0,), {"model": "m"})
    async with (
        serve_pods([pod], settings, sleep=held, dialect=engine) as (replica,),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "m", "prompt": "one two three four", "max_tokens": 1}
        calls = [
            asyncio.create_task(session.post(replica.url + "/v1/completions", json=body))
            for _ in range(2)
        ]
        while replica.engine.waiting < 1 or replica.engine.running < 1:  # noqa: ASYNC110
            await asyncio.sleep(0)
        async with session.get(replica.url + "/metrics") as response:
            text = await response.text()
        release.set()
        for call in calls:
            (await call).release()
    return text


@pytest.mark.parametrize("engine", ENGINES)
def test_each_dialect_reports_queue_running_and_kv_under_its_own_names(engine: str) -> None:
    """One running and one waiting request show under the engine's names; KV usage too,
    except for llama.cpp, whose server has no KV-cache gauge."""
    text = asyncio.run(asyncio.wait_for(scrape_under_load(engine), 10))
    queued, running, kv = SIGNALS[engine]
    assert value(text, *queued) == 1
    assert value(text, *running) == 1
    if kv is None:
        assert "kv" not in text.lower()
    else:
        assert value(text, *kv) == pytest.approx(1 / 4)  # one block of four holds the prompt
    other_prefixes = {"vllm:", "sglang:", "trtllm_", "nv_trt_llm_", "llamacpp:"}
    own = {p for p in other_prefixes if all(n.startswith(p) for n, _, _ in samples(text))}
    assert len(own) == 1, "every sample uses the one engine's naming"


@pytest.mark.parametrize(
    ("engine", "size", "count", "geometry"),
    [
        (
            "vllm",
            ("vllm:cache_config_info", "block_size"),
            ("vllm:cache_config_info", "num_gpu_blocks"),
            ("16", "4"),  # 64 tokens in 16-token blocks
        ),
        (
            "sglang",
            ("sglang:cache_config_info", "page_size"),
            ("sglang:cache_config_info", "num_pages"),
            ("1", "64"),  # the same 64 tokens in SGLang's default one-token pages
        ),
    ],
    ids=["vllm", "sglang"],
)
def test_cache_geometry_rides_on_info_labels(
    engine: str, size: tuple[str, str], count: tuple[str, str], geometry: tuple[str, str]
) -> None:
    """vLLM and SGLang report block size and count as labels of an info gauge."""
    text = asyncio.run(asyncio.wait_for(scrape_under_load(engine), 10))
    by_name = {name: labels for name, labels, _ in samples(text)}
    assert (by_name[size[0]][size[1]], by_name[count[0]][count[1]]) == geometry


def test_cli_takes_engine_namespace_and_h2c_ports(capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents the three flags the conformance harness and the checker use."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--engine", "--namespace", "--h2c-port", "llamacpp"):
        assert flag in text


def test_state_of_fills_every_field_from_the_engine() -> None:
    """``metrics.state_of`` reads the engine's own gauges, counters and cache geometry, so the
    server and the routing benchmark render the same page; adapters add the LoRA labels."""
    engine = Engine(PROFILES["llama-3.1-8b-h100"].replace(num_blocks=64))
    loop = VirtualLoop()
    driver = VirtualEngine(engine, loop, on_event=lambda _event: None)
    for n in range(2):
        request = Request(f"r{n}", token_block(3, 40), 4, float(n))
        loop.at(n, functools.partial(driver.submit, request))
    loop.run()
    state = metrics.state_of(engine, "llama", 7.0)
    with_adapters = metrics.state_of(engine, "llama", 7.0, ("a", "b"))
    assert (state.model, state.now, state.lora) == ("llama", 7.0, None)
    assert (state.running, state.waiting, state.kv_usage) == (0, 0, 0.0)
    assert (state.prompt_tokens, state.generation_tokens) == (80, 8)
    assert (state.prefix_queries, state.prefix_hits) == (80, 32)
    assert (state.preemptions, state.block_size, state.num_blocks) == (0, 16, 64)
    assert state.max_running == 1024
    assert with_adapters.lora == {
        "max_lora": "2",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
