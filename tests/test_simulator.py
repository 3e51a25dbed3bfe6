"""The model-server simulator over HTTP: OpenAI API, vLLM metrics, the real-time driver,
faults, echo server and CLI.

Servers are real aiohttp servers on 127.0.0.1 free ports. Timing is never
measured: engine steps wait through an injected sleep that either does nothing
(``time_scale=0``) or is a ``Gate`` the test opens step by step. The engine
model itself is tested in virtual time in ``test_engine_model.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from demo.topology import free_ports
from pods.model import Pod
from simulator import Faults, Replica, Request, Settings, count_tokens, output_token, serve_pods
from simulator.__main__ import _parser, main, settings_of
from simulator.clocks import EngineError, RealTimeEngine, Sleep
from simulator.echo import echo_set_headers
from simulator.engine import Engine, Scheduling
from simulator.profiles import PROFILES
from simulator.tokenizer import token_block, tokenize

INSTANT = Settings(time_scale=0)
ROOT = Path(__file__).resolve().parents[1]


def pod(name: str = "pod-a", ports: tuple[int, ...] = (0,), **labels: str) -> Pod:
    return Pod(name, "127.0.0.1", ports, labels)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))  # a bound against hangs, not a timing check


@asynccontextmanager
async def cluster(
    *pods: Pod,
    settings: Settings = INSTANT,
    sleep: Sleep = asyncio.sleep,
    clock: Callable[[], float] = lambda: 1_700_000_000.0,
) -> AsyncIterator[tuple[tuple[Replica, ...], aiohttp.ClientSession]]:
    """Replicas for ``pods`` (one default pod if none) and a client session, both stopped after."""
    async with (
        serve_pods(pods or (pod(),), settings, sleep=sleep, clock=clock, grace=1.0) as replicas,
        aiohttp.ClientSession() as session,
    ):
        yield replicas, session


class Gate:
    """An injected sleep that records each delay and blocks until the test lets it pass."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.free = False
        self._permits = asyncio.Semaphore(0)
        self._called = asyncio.Condition()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        async with self._called:
            self._called.notify_all()
        if not self.free:
            await self._permits.acquire()

    def step(self) -> None:
        """Let the oldest blocked sleep return."""
        self._permits.release()

    def open(self) -> None:
        """Let every sleep, now and later, return."""
        self.free = True
        for _ in self.delays:
            self._permits.release()

    async def reached(self, calls: int) -> None:
        """Wait until ``calls`` sleeps have started."""
        async with self._called:
            await self._called.wait_for(lambda: len(self.delays) >= calls)


async def post(
    session: aiohttp.ClientSession, replica: Replica, path: str, body: Any, **kw: Any
) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with session.post(replica.url + path, json=body, **kw) as response:
        return response.status, await response.json(), response


async def scrape(session: aiohttp.ClientSession, replica: Replica) -> dict[str, float]:
    """The samples of /metrics by metric name (each family here has one sample)."""
    async with session.get(replica.url + "/metrics") as response:
        text = await response.text()
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def sse_events(text: str) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream; each event must end in a blank line."""
    assert text.endswith("\n\n")
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        yield event.removeprefix("data: ")


# --- OpenAI API ----------------------------------------------------------------------------


def test_completion_answers_in_openai_shape() -> None:
    """A completion carries id, object, created, model, one choice and exact token usage."""

    async def test() -> None:
        async with cluster(pod(model="llama")) as ((replica,), session):
            body = {"model": "llama", "prompt": "Hello, world!", "max_tokens": 5}
            status, answer, _ = await post(session, replica, "/v1/completions", body)
        assert status == 200
        assert answer["object"] == "text_completion"
        assert answer["id"].startswith("cmpl-")
        assert answer["created"] == 1_700_000_000  # from the injected clock
        assert answer["model"] == "llama"
        (choice,) = answer["choices"]
        assert choice["text"] == "".join(output_token(i) for i in range(5))
        assert choice["finish_reason"] == "length"
        assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}

    run(test)


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("a b c", 3), (["a b", "c"], 3), ([1, 2, 3, 4], 4)],
    ids=["string", "list-of-strings", "token-ids"],
)
def test_completion_prompt_forms(prompt: Any, tokens: int) -> None:
    """A prompt may be a string, a list of strings (counted together) or token ids."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            body = {"model": "sim-model", "prompt": prompt}
            status, answer, _ = await post(session, replica, "/v1/completions", body)
        assert status == 200
        assert answer["usage"]["prompt_tokens"] == tokens
        assert answer["usage"]["completion_tokens"] == 16  # the default output length

    run(test)


def test_chat_completion_answers_in_openai_shape() -> None:
    """Chat answers with an assistant message; the prompt is counted as ``role: content`` lines."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hi there"}],
                "max_completion_tokens": 3,
            }
            status, answer, _ = await post(session, replica, "/v1/chat/completions", body)
        assert status == 200
        assert answer["object"] == "chat.completion"
        assert answer["id"].startswith("chatcmpl-")
        (choice,) = answer["choices"]
        assert choice["message"] == {"role": "assistant", "content": "the quick simulated"}
        assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}

    run(test)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "one two three"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two"}]}),
    ],
    ids=["completions", "chat"],
)
def test_streaming_sends_one_event_per_token_then_usage_then_done(
    path: str, body: dict[str, Any]
) -> None:
    """A stream is SSE: one chunk per token, a chunk with only usage, then ``[DONE]``.

    The streamed text is the same as the non-streamed answer.
    """

    async def test() -> None:
        async with cluster() as ((replica,), session):
            request = {**body, "model": "sim-model", "max_tokens": 7}
            async with session.post(replica.url + path, json={**request, "stream": True}) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                text = await resp.text()
            _, whole, _ = await post(session, replica, path, request)
        *chunks, done = list(sse_events(text))
        assert done == "[DONE]"
        *tokens, final = [json.loads(chunk) for chunk in chunks]
        assert len(tokens) == 7
        assert final["choices"] == []
        assert final["usage"] == {**whole["usage"], "completion_tokens": 7}
        assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 6 + ["length"]
        if path == "/v1/completions":
            streamed = "".join(t["choices"][0]["text"] for t in tokens)
            assert streamed == whole["choices"][0]["text"]
        else:
            assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
            streamed = "".join(t["choices"][0]["delta"]["content"] for t in tokens)
            assert streamed == whole["choices"][0]["message"]["content"]
        assert count_tokens(streamed) == 7

    run(test)


def test_models_lists_the_model_and_its_adapters() -> None:
    """/v1/models names the base model and each LoRA adapter, which are served too."""

    async def test() -> None:
        async with cluster(pod(model="llama", adapters="sql-lora, chat-lora")) as (
            (replica,),
            session,
        ):
            async with session.get(replica.url + "/v1/models") as response:
                models = await response.json()
            body = {"model": "sql-lora", "prompt": "x", "max_tokens": 1}
            status, answer, _ = await post(session, replica, "/v1/completions", body)
        assert [m["id"] for m in models["data"]] == ["llama", "sql-lora", "chat-lora"]
        assert models["data"][1]["parent"] == "llama"
        assert status == 200
        assert answer["model"] == "sql-lora"

    run(test)


@pytest.mark.parametrize(
    ("raw", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "x"}', 400, "'model'"),
        (b'{"model": "sim-model"}', 400, "'prompt'"),
        (b'{"model": "sim-model", "prompt": "x", "max_tokens": 0}', 400, "'max_tokens'"),
        (b'{"model": "sim-model", "prompt": "x", "stream": "yes"}', 400, "'stream'"),
        (b'{"model": "gpt-9", "prompt": "x"}', 404, "`gpt-9`"),
    ],
    ids=[
        "malformed",
        "not-object",
        "no-model",
        "no-prompt",
        "bad-max-tokens",
        "bad-stream",
        "unknown-model",
    ],
)
def test_bad_requests_get_openai_errors(raw: bytes, status: int, says: str) -> None:
    """Bad input is a 400 naming the problem; an unknown model a 404 naming the model."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            async with session.post(replica.url + "/v1/completions", data=raw) as response:
                assert response.status == status
                error = (await response.json())["error"]
            # The replica is still fine afterwards.
            ok, _, _ = await post(
                session, replica, "/v1/completions", {"model": "sim-model", "prompt": "x"}
            )
        assert says in error["message"]
        assert error["code"] == status
        assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert ok == 200

    run(test)


def test_chat_without_messages_is_rejected() -> None:
    """Chat needs a non-empty ``messages`` list of objects with a role."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            body: dict[str, Any] = {"model": "sim-model", "messages": []}
            status, answer, _ = await post(session, replica, "/v1/chat/completions", body)
            body["messages"] = [{"content": "no role"}]
            status2, answer2, _ = await post(session, replica, "/v1/chat/completions", body)
        assert (status, status2) == (400, 400)
        assert "'messages'" in answer["error"]["message"]
        assert "messages[0]" in answer2["error"]["message"]

    run(test)


# --- render (vLLM's tokenize-only endpoints) -----------------------------------------------


def test_completion_render_gives_the_ids_the_engine_caches_by() -> None:
    """/v1/completions/render answers a list with one generate request whose token_ids are the
    prompt as the engine tokenizes it: sending those ids back as the prompt hits every full
    block the text prompt left in the prefix cache, and render itself queues nothing."""

    async def test() -> None:
        async with cluster(pod(model="llama")) as ((replica,), session):
            prompt = " ".join(f"word{i}" for i in range(40))
            body = {"model": "llama", "prompt": prompt, "max_tokens": 3}
            status, answer, _ = await post(session, replica, "/v1/completions/render", body)
            before = await scrape(session, replica)
            await post(session, replica, "/v1/completions", body)
            (item,) = answer
            by_ids = {"model": "llama", "prompt": item["token_ids"], "max_tokens": 3}
            await post(session, replica, "/v1/completions", by_ids)
            after = await scrape(session, replica)
        assert status == 200
        assert item["token_ids"] == tokenize(prompt)
        assert item["request_id"].startswith("cmpl-")
        assert item["model"] == "llama"
        assert item["sampling_params"] == {"max_tokens": 3}
        assert before["vllm:prompt_tokens_total"] == 0  # rendering generates nothing
        assert after["vllm:prefix_cache_hits_total"] == 32  # 2 full blocks of the 40 tokens

    run(test)


def test_completion_render_answers_one_entry_per_prompt_of_a_list() -> None:
    """A list of strings renders to one entry per string, each with its own request id; joined,
    their ids are the one sequence the engine runs (the usage of the same completion)."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            body = {"model": "sim-model", "prompt": ["Hello, world!", "a b c"]}
            status, answer, _ = await post(session, replica, "/v1/completions/render", body)
            _, done, _ = await post(session, replica, "/v1/completions", body)
            ids = {"model": "sim-model", "prompt": [7, 8, 9]}
            _, by_ids, _ = await post(session, replica, "/v1/completions/render", ids)
        assert status == 200
        assert [item["token_ids"] for item in answer] == [
            tokenize("Hello, world!"),
            tokenize("a b c"),
        ]
        assert len({item["request_id"] for item in answer}) == 2
        assert sum(len(item["token_ids"]) for item in answer) == done["usage"]["prompt_tokens"]
        assert [item["token_ids"] for item in by_ids] == [[7, 8, 9]]

    run(test)


def test_chat_render_answers_one_object_with_the_template_ids() -> None:
    """/v1/chat/completions/render answers a single object whose token_ids are the messages
    rendered by the chat template (``role: content`` lines), as the engine runs them."""

    async def test() -> None:
        async with cluster() as ((replica,), session):
            messages = [{"role": "user", "content": "Hi there"}, {"role": "user", "content": "x"}]
            body = {"model": "sim-model", "messages": messages, "stream": True}
            status, answer, _ = await post(session, replica, "/v1/chat/completions/render", body)
        assert status == 200
        assert answer["token_ids"] == tokenize("user: Hi there\nuser: x")
        assert answer["request_id"].startswith("chatcmpl-")
        assert answer["model"] == "sim-model"
        assert answer["stream"] is True

    run(test)


@pytest.mark.parametrize(
    ("path", "raw", "status", "says"),
    [
        ("/v1/completions/render", b"{not json", 400, "not valid JSON"),
        ("/v1/completions/render", b'{"model": "sim-model"}', 400, "'prompt'"),
        ("/v1/completions/render", b'{"model": "sim-model", "prompt": []}', 400, "'prompt'"),
        ("/v1/completions/render", b'{"model": "gpt-9", "prompt": "x"}', 404, "`gpt-9`"),
        ("/v1/chat/completions/render", b'{"model": "sim-model"}', 400, "'messages'"),
        ("/v1/chat/completions/render", b'{"model": "gpt-9", "messages": []}', 404, "`gpt-9`"),
    ],
    ids=["malformed", "no-prompt", "empty-prompt", "unknown-model", "no-messages", "chat-model"],
)
def test_render_errors_are_the_openai_layers(path: str, raw: bytes, status: int, says: str) -> None:
    """Render refuses what generation refuses, with the same bodies: 400 naming the field,
    404 naming an unknown model."""

    async def test() -> None:
        async with (
            cluster() as ((replica,), session),
            session.post(replica.url + path, data=raw) as response,
        ):
            answered = response.status
            error = (await response.json())["error"]
        assert answered == status
        assert says in error["message"]
        assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")

    run(test)


# --- metrics and load ----------------------------------------------------------------------


def test_metrics_use_vllm_names_with_a_model_name_label() -> None:
    """/metrics is Prometheus text with vLLM's names; counters add up served tokens."""

    async def test() -> None:
        async with cluster(pod(model="llama")) as ((replica,), session):
            body = {"model": "llama", "prompt": "a b c", "max_tokens": 4}
            await post(session, replica, "/v1/completions", body)
            async with session.get(replica.url + "/metrics") as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                text = await response.text()
        assert "# TYPE vllm:prompt_tokens_total counter" in text
        assert "# TYPE vllm:num_requests_running gauge" in text
        assert 'vllm:num_requests_running{model_name="llama"} 0.0' in text
        assert 'vllm:num_requests_waiting{model_name="llama"} 0.0' in text
        assert 'vllm:kv_cache_usage_perc{model_name="llama"} 0.0' in text
        assert 'vllm:prompt_tokens_total{model_name="llama"} 3.0' in text
        assert 'vllm:generation_tokens_total{model_name="llama"} 4.0' in text

    run(test)


def test_running_and_waiting_reflect_requests_in_flight() -> None:
    """With one running slot, a held request runs, the next two wait, and all finish once let go."""

    async def test() -> None:
        gate = Gate()
        settings = Settings(max_running=1, kv_capacity=100)
        async with cluster(settings=settings, sleep=gate) as ((replica,), session):
            body = {"model": "sim-model", "prompt": "one two three four", "max_tokens": 2}
            requests = [
                asyncio.create_task(post(session, replica, "/v1/completions", body))
                for _ in range(3)
            ]
            await gate.reached(1)  # the first request is in its prefill
            metrics = await scrape(session, replica)
            while metrics["vllm:num_requests_waiting"] < 2:  # the others reach the queue
                metrics = await scrape(session, replica)
            assert metrics["vllm:num_requests_running"] == 1
            # 100 tokens are 7 blocks; the running request's 4-token prompt holds one.
            assert metrics["vllm:kv_cache_usage_perc"] == pytest.approx(1 / 7)
            gate.open()
            answers = await asyncio.gather(*requests)
            metrics = await scrape(session, replica)
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert metrics["vllm:num_requests_running"] == 0
        assert metrics["vllm:num_requests_waiting"] == 0
        assert metrics["vllm:kv_cache_usage_perc"] == 0
        assert metrics["vllm:prompt_tokens_total"] == 12
        assert metrics["vllm:generation_tokens_total"] == 6

    run(test)


def test_lora_metric_reports_running_adapters() -> None:
    """A pod with adapters exports ``vllm:lora_requests_info`` naming the adapters in use."""

    async def test() -> None:
        gate = Gate()
        async with cluster(pod(adapters="sql-lora"), sleep=gate) as ((replica,), session):
            body = {"model": "sql-lora", "prompt": "x", "max_tokens": 1}
            request = asyncio.create_task(post(session, replica, "/v1/completions", body))
            await gate.reached(1)
            async with session.get(replica.url + "/metrics") as response:
                text = await response.text()
            gate.open()
            await request
        assert 'max_lora="1",running_lora_adapters="sql-lora",waiting_lora_adapters=""' in text

    run(test)


def test_data_parallel_pod_serves_independent_replicas() -> None:
    """Each port of a pod is its own engine: load on one port does not show on the other."""

    async def test() -> None:
        async with cluster(pod("dp-0", ports=(0, 0))) as (replicas, session):
            first, second = replicas
            body = {"model": "sim-model", "prompt": "x", "max_tokens": 3}
            status, _, response = await post(session, first, "/v1/completions", body)
            async with session.get(second.url + "/") as echo:
                echoed = await echo.json()
            busy, idle = await scrape(session, first), await scrape(session, second)
        assert first.endpoint != second.endpoint
        assert status == 200
        assert response.headers["x-sim-endpoint"] == first.endpoint
        assert echoed["pod"] == "dp-0"
        assert echoed["httpPort"] == str(second.port)
        assert busy["vllm:generation_tokens_total"] == 3
        assert idle["vllm:generation_tokens_total"] == 0

    run(test)


def test_metrics_report_prefix_cache_preemptions_and_cache_geometry() -> None:
    """vLLM's prefix-cache counters count prompt tokens looked up and found; cache_config_info
    carries the real block count; preemptions are counted."""

    async def test() -> None:
        settings = Settings(time_scale=0, kv_capacity=320)
        async with cluster(settings=settings) as ((replica,), session):
            prompt = " ".join(f"word{i}" for i in range(100))
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
            for _ in range(2):
                await post(session, replica, "/v1/completions", body)
            async with session.get(replica.url + "/metrics") as response:
                text = await response.text()
        metrics = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert metrics["vllm:prefix_cache_queries_total"] == 200
        assert metrics["vllm:prefix_cache_hits_total"] == 96  # 6 full blocks of the 100 tokens
        assert metrics["vllm:num_preemptions_total"] == 0
        assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="20"} 1.0' in text

    run(test)


def test_usage_reports_cached_prompt_tokens_when_enabled() -> None:
    """With vLLM's --enable-prompt-tokens-details, usage says how many prompt tokens hit the
    prefix cache: none the first time, every full block but the last token's the second."""

    async def test() -> None:
        async with (
            serve_pods(
                [pod()], INSTANT, clock=lambda: 0.0, grace=1.0, prompt_tokens_details=True
            ) as (replica,),
            aiohttp.ClientSession() as session,
        ):
            prompt = " ".join(f"word{i}" for i in range(40))
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
            _, first, _ = await post(session, replica, "/v1/completions", body)
            _, again, _ = await post(session, replica, "/v1/completions", body)
            async with session.post(
                replica.url + "/v1/completions", json={**body, "stream": True}
            ) as response:
                *_, final, _done = sse_events(await response.text())
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert json.loads(final)["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}

    run(test)


# --- the real-time driver ------------------------------------------------------------------

SMALL = PROFILES["llama-3.1-8b-h100"].replace(num_blocks=64)


def test_real_time_driver_waits_each_step_times_the_time_scale() -> None:
    """One sleep per engine step, of the step's modelled duration times ``time_scale``: the
    prefill step, then one decode step per further token."""

    async def test() -> None:
        gate = Gate()
        gate.open()
        driver = RealTimeEngine(Engine(SMALL), time_scale=3.0, sleep=gate)
        request = Request("r", token_block(1, 40), 3, 0.0)
        assert [index async for index in driver.generate(request)] == [0, 1, 2]
        expected = [SMALL.step_time(40, 0, 0), SMALL.step_time(0, 1, 41), SMALL.step_time(0, 1, 42)]
        assert gate.delays == pytest.approx([3 * delay for delay in expected])

    run(test)


def test_time_scale_zero_streams_exactly_max_tokens_over_http() -> None:
    """With no delays at all, concurrent streams through a small batch still get exactly
    ``max_tokens`` tokens each, in order, one chunk per token."""

    async def test() -> None:
        settings = Settings(time_scale=0, max_running=3, kv_capacity=256)

        async def stream(session: aiohttp.ClientSession, replica: Replica, n: int) -> list[str]:
            body = {"model": "sim-model", "prompt": f"question {n}", "max_tokens": 5 + n}
            body["stream"] = True
            async with session.post(replica.url + "/v1/completions", json=body) as response:
                chunks = list(sse_events(await response.text()))
            return [json.loads(c)["choices"][0]["text"] for c in chunks[:-2]]

        async with cluster(settings=settings) as ((replica,), session):
            texts = await asyncio.gather(*(stream(session, replica, n) for n in range(10)))
            metrics = await scrape(session, replica)
        for n, text in enumerate(texts):
            assert text == [output_token(i) for i in range(5 + n)]
        assert metrics["vllm:generation_tokens_total"] == sum(5 + n for n in range(10))
        assert metrics["vllm:num_requests_running"] == 0

    run(test)


def test_abandoned_requests_free_their_slots() -> None:
    """A queued request that is cancelled leaves the queue; a closed stream frees its blocks."""

    async def test() -> None:
        gate = Gate()
        engine = Engine(SMALL.replace(max_num_seqs=1))
        driver = RealTimeEngine(engine, time_scale=1.0, sleep=gate)
        holder = driver.generate(Request("a", token_block(1, 40), 10, 0.0))
        first = asyncio.create_task(anext(holder))
        await gate.reached(1)  # the prefill step is under way
        queued = asyncio.create_task(anext(driver.generate(Request("b", [1, 2], 1, 0.0))))
        await asyncio.sleep(0)  # one turn of the loop: the new request is added
        assert (engine.running, engine.waiting) == (1, 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert engine.waiting == 0
        gate.step()
        assert await first == 0
        await holder.aclose()  # the client went away mid-stream
        assert (engine.running, engine.waiting, engine.kv_usage) == (0, 0, 0)
        gate.open()
        await driver.aclose()

    run(test)


def test_an_engine_error_raises_in_the_stream() -> None:
    """An injected error reaches the caller as EngineError, before any token."""

    async def test() -> None:
        driver = RealTimeEngine(Engine(SMALL, faults=Faults(error_rate=1.0)), time_scale=0)
        with pytest.raises(EngineError, match="injected"):
            await anext(driver.generate(Request("r", [1, 2, 3], 2, 0.0)))
        await driver.aclose()

    run(test)


# --- faults --------------------------------------------------------------------------------


def test_error_rate_answers_500_and_an_error_body() -> None:
    """--error-rate 1: every generation is a 500 with vLLM's error shape; the rest works."""

    async def test() -> None:
        settings = Settings(time_scale=0, faults=Faults(error_rate=1.0))
        async with cluster(settings=settings) as ((replica,), session):
            body = {"model": "sim-model", "prompt": "x"}
            status, answer, _ = await post(session, replica, "/v1/completions", body)
            stream_status, _, _ = await post(
                session, replica, "/v1/completions", {**body, "stream": True}
            )
            async with session.get(replica.url + "/health") as health:
                healthy = health.status
        assert (status, stream_status, healthy) == (500, 500, 200)
        assert answer["error"]["type"] == "InternalServerError"
        assert "injected" in answer["error"]["message"]

    run(test)


def test_dead_metrics_answer_503_while_serving_goes_on() -> None:
    """--dead-metrics: /metrics is a 503; completions still work."""

    async def test() -> None:
        settings = Settings(time_scale=0, faults=Faults(dead_metrics=True))
        async with cluster(settings=settings) as ((replica,), session):
            async with session.get(replica.url + "/metrics") as response:
                status = response.status
            ok, _, _ = await post(
                session, replica, "/v1/completions", {"model": "sim-model", "prompt": "x"}
            )
        assert (status, ok) == (503, 200)

    run(test)


def test_stalled_stream_stops_after_n_tokens_until_the_client_leaves() -> None:
    """--stall-after-tokens 2 --stall-seconds inf: two tokens arrive, then nothing; the
    request keeps its slot until the client disconnects, which frees it."""

    async def test() -> None:
        faults = Faults(stall_after_tokens=2, stall_seconds=math.inf)
        async with cluster(settings=Settings(time_scale=0, faults=faults)) as (
            (replica,),
            session,
        ):
            body = {"model": "sim-model", "prompt": "x y", "max_tokens": 5, "stream": True}
            async with session.post(replica.url + "/v1/completions", json=body) as response:
                chunks = [await response.content.readuntil(b"\n\n") for _ in range(2)]
                assert replica.engine.running == 1
                assert replica.engine.generation_tokens_total == 2
                response.close()  # the client gives up
            while replica.engine.running:  # noqa: ASYNC110
                await asyncio.sleep(0)
        assert [json.loads(c[6:])["choices"][0]["text"] for c in chunks] == [
            output_token(0),
            output_token(1),
        ]
        assert replica.engine.kv_usage == 0

    run(test)


def test_crash_after_n_requests_drops_connections_and_stops_listening() -> None:
    """--crash-after 1: the first request is served; the second crashes the replica (its
    connection is dropped) and afterwards nothing connects."""

    async def test() -> None:
        settings = Settings(time_scale=0, faults=Faults(crash_after=1))
        async with cluster(settings=settings) as ((replica,), session):
            body = {"model": "sim-model", "prompt": "x", "max_tokens": 2}
            status, _, _ = await post(session, replica, "/v1/completions", body)
            with pytest.raises(aiohttp.ClientError):
                await post(session, replica, "/v1/completions", body)
            async with aiohttp.ClientSession() as fresh:
                with pytest.raises(aiohttp.ClientConnectionError):
                    await fresh.get(replica.url + "/health")
        assert status == 200
        assert replica.engine.crashed

    run(test)


def test_a_request_too_long_for_the_cache_is_a_400() -> None:
    """A prompt and output that could never fit in the replica's KV cache are refused, as
    vLLM refuses a context longer than it can hold."""

    async def test() -> None:
        async with cluster(settings=Settings(time_scale=0, kv_capacity=32)) as (
            (replica,),
            session,
        ):
            body = {"model": "sim-model", "prompt": "a " * 30, "max_tokens": 10}
            status, answer, _ = await post(session, replica, "/v1/completions", body)
        assert status == 400
        assert "KV blocks" in answer["error"]["message"]

    run(test)


# --- headers and the conformance echo ------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", {"model": "sim-model", "prompt": "x"}),
        ("POST", "/v1/completions", {"model": "sim-model", "prompt": "x", "stream": True}),
        ("POST", "/v1/completions", {"model": "other", "prompt": "x"}),
        ("POST", "/v1/chat/completions", None),
        ("GET", "/metrics", None),
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("PUT", "/anything/else", None),
    ],
    ids=["completion", "stream", "404", "400", "metrics", "health", "models", "echo"],
)
def test_every_response_names_the_replica_and_what_it_received(
    method: str, path: str, body: Any
) -> None:
    """x-sim-pod, x-sim-endpoint and x-sim-received-x-gateway-* are on every response."""

    async def test() -> None:
        headers = {
            "x-gateway-model-name": "sim-model",
            "X-Gateway-Destination-Endpoint": "10.0.0.1:8000",
            "x-other": "not echoed",
        }
        async with (
            cluster(pod("pod-b")) as ((replica,), session),
            session.request(method, replica.url + path, json=body, headers=headers) as response,
        ):
            await response.read()
            got = response.headers
        assert got["x-sim-pod"] == "pod-b"
        assert got["x-sim-endpoint"] == replica.endpoint
        assert got["x-sim-received-x-gateway-model-name"] == "sim-model"
        assert got["x-sim-received-x-gateway-destination-endpoint"] == "10.0.0.1:8000"
        assert not any(name.lower().endswith("x-other") for name in got)
        named = body.get("model") if isinstance(body, dict) else None
        assert got.get("x-sim-served-model") == named  # the OpenAI endpoints: the body's model

    run(test)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["X-Foo:bar"], {"X-Foo": "bar"}),
        (["X-Foo: a, X-Bar: b"], {"X-Foo": "a", "X-Bar": "b"}),
        (["X-Foo:a,X-Foo:b"], {"X-Foo": "a,b"}),
        (["X-Foo:a", "X-Bar:b"], {"X-Foo": "a", "X-Bar": "b"}),
        (["X-Url: http://host:80/"], {"X-Url": "http://host:80/"}),
        (["X-Empty", "bad name:x", ":empty"], {"X-Empty": ""}),
        (["Content-Length: 3, Transfer-Encoding: x"], {}),
    ],
    ids=["one", "list", "repeated-name", "two-headers", "first-colon", "odd-items", "framing"],
)
def test_echo_set_header_parsing(values: list[str], expected: dict[str, str]) -> None:
    """Each value splits on "," and each item cuts at its first ":", as echo-basic does."""
    assert echo_set_headers(values) == expected


def test_echo_set_header_applies_to_any_response() -> None:
    """X-Echo-Set-Header headers come back on the echo and on API responses alike."""

    async def test() -> None:
        headers = [("X-Echo-Set-Header", "X-Foo: a, X-Bar: b"), ("X-Echo-Set-Header", "X-Foo:c")]
        async with cluster() as ((replica,), session):
            async with session.get(replica.url + "/", headers=headers) as echo:
                echoed = echo.headers
            body = {"model": "sim-model", "prompt": "x"}
            _, _, completion = await post(
                session, replica, "/v1/completions", body, headers=headers
            )
        for got in (echoed, completion.headers):
            assert got["X-Foo"] == "a,c"
            assert got["X-Bar"] == "b"

    run(test)


def test_other_paths_answer_with_the_conformance_echo() -> None:
    """Any other path returns echo-basic's JSON: request line, Go-style headers, pod, httpPort."""

    async def test() -> None:
        async with (
            cluster(pod("primary-0")) as ((replica,), session),
            session.post(
                replica.url + "/primary-gateway-test?x=1", headers={"test-epp": "a"}
            ) as resp,
        ):
            assert resp.status == 200
            echoed = await resp.json()
        assert echoed["path"] == "/primary-gateway-test?x=1"
        assert echoed["method"] == "POST"
        assert echoed["proto"] == "HTTP/1.1"
        assert echoed["host"] == replica.endpoint
        assert echoed["headers"]["Test-Epp"] == ["a"]
        assert "Host" not in echoed["headers"]
        assert echoed["pod"] == "primary-0"
        assert echoed["httpPort"] == str(replica.port)
        assert (echoed["namespace"], echoed["ingress"], echoed["service"]) == ("", "", "")

    run(test)


# --- command line --------------------------------------------------------------------------


def test_a_pod_port_already_taken_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A pod whose port another process holds stops the simulator with one line naming the pod,
    its address and port and the reason (exit status 1), as `python -m demo` shows it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        f"pods:\n- name: busy\n  address: 127.0.0.1\n  ports: [{port}]\n  labels: {{pool: a}}\n"
    )
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["--pods", str(pods), "--log-level", "error"])
    finally:
        holder.close()
    assert exit_.value.code == (
        f"simulator: pod busy: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """--help lists every flag with its meaning."""
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--pods",
        "--selector",
        "--time-scale",
        "--profile",
        "llama-3.1-8b-h100",
        "llama-3.1-8b-l4",
        "--max-running",
        "--kv-capacity",
        "--max-num-batched-tokens",
        "--step-overhead-ms",
        "--error-rate",
        "--stall-after-tokens",
        "--stall-seconds",
        "--dead-metrics",
        "--crash-after",
        "--enable-prompt-tokens-details",
        "--log-level",
    ):
        assert flag in text


def test_flags_become_settings() -> None:
    """Profile, overrides in the flags' units, old capacity flags and faults reach Settings."""
    args = _parser().parse_args(
        [
            "--pods=p.yaml",
            "--profile=llama-3.1-8b-l4",
            "--time-scale=0.5",
            "--max-running=3",
            "--kv-capacity=100",
            "--step-overhead-ms=2",
            "--lora-load-ms=10",
            "--error-rate=0.25",
            "--stall-after-tokens=4",
            "--stall-seconds=inf",
            "--dead-metrics",
            "--crash-after=7",
        ]
    )
    settings = settings_of(args)
    profile = settings.engine_profile()
    assert profile.name == "llama-3.1-8b-l4"
    assert (profile.max_num_seqs, profile.num_blocks) == (3, 7)
    assert profile.step_overhead == pytest.approx(0.002)
    assert profile.lora_load_time == pytest.approx(0.01)
    assert profile.prefill_per_token == PROFILES["llama-3.1-8b-l4"].prefill_per_token
    assert settings.time_scale == 0.5
    assert settings.faults == Faults(
        error_rate=0.25,
        stall_after_tokens=4,
        stall_seconds=math.inf,
        dead_metrics=True,
        crash_after=7,
    )
    with pytest.raises(ValueError, match="give one"):
        settings_of(_parser().parse_args(["--pods=p", "--num-blocks=5", "--kv-capacity=9"]))


def test_scheduling_flags_default_to_vllm_and_turn_each_behaviour_off() -> None:
    """With no flag every scheduler switch is current vLLM's; each --no-... flag turns its
    behaviour off, --step-jitter sets the jitter, and a jitter of 1 is refused by name."""
    assert settings_of(_parser().parse_args(["--pods=p"])).scheduling == Scheduling()
    args = _parser().parse_args(
        [
            "--pods=p",
            "--no-scheduler-reserve-full-isl",
            "--no-async-scheduling",
            "--no-cache-blocks-at-schedule",
            "--step-jitter=0.1",
        ]
    )
    assert settings_of(args).scheduling == Scheduling(
        full_prompt_admission=False,
        async_scheduling=False,
        cache_at_schedule=False,
        step_jitter=0.1,
    )
    assert settings_of(args).engine().scheduling == settings_of(args).scheduling
    with pytest.raises(ValueError, match="step_jitter"):
        settings_of(_parser().parse_args(["--pods=p", "--step-jitter=1"]))


def free_port() -> int:
    return free_ports(1)[0]


def test_cli_serves_selected_pods_and_exits_on_sigterm(tmp_path: Path) -> None:
    """The process logs "listening" with its endpoints, serves them, and exits 0 on SIGTERM."""

    async def test() -> None:
        wanted, other = free_port(), free_port()
        pods = tmp_path / "pods.yaml"
        pods.write_text(
            "pods:\n"
            f"- {{name: a-0, address: 127.0.0.1, ports: [{wanted}], labels: {{pool: a}}}}\n"
            f"- {{name: b-0, address: 127.0.0.1, ports: [{other}], labels: {{pool: b}}}}\n"
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "simulator",
            "--pods",
            str(pods),
            "--selector",
            "pool=a",
            "--time-scale",
            "0",
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert process.stderr is not None
        try:
            event: dict[str, Any] = {}
            while event.get("event") != "listening":
                event = json.loads(await process.stderr.readline())
            assert event["endpoints"] == [f"127.0.0.1:{wanted}"]
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{wanted}/health") as response,
            ):
                assert response.status == 200
                assert response.headers["x-sim-pod"] == "a-0"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    run(test)


@pytest.mark.parametrize(
    ("knobs", "field"),
    [
        ({"time_scale": -1.0}, "time_scale"),
        ({"max_running": 0}, "max_running"),
        ({"profile": "gpt-9-on-a-toaster"}, "profile"),
    ],
    ids=["negative", "no-slots", "unknown-profile"],
)
def test_settings_reject_impossible_values(knobs: dict[str, Any], field: str) -> None:
    """Settings are checked where they are made, and the error names the field."""
    with pytest.raises(ValueError, match=field):
        Settings(**knobs)
