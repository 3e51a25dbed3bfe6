"""The attribute store, data sources in the background, and a configured picker put together."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from lwepp.attributes import AttributeStore, keep_running
from lwepp.config import load_config
from lwepp.contracts import Measurement
from lwepp.explain import DECISION_HEADER, EXPLAIN_HEADER
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool
from lwepp.plugins import REGISTRY
from lwepp.server import EndpointPickerService
from pods.model import Endpoint
from serving.testing import ExtProcClient, request_headers, response_headers, running, set_headers
from tests.fakes import StaticPods, pod
from tests.plugin_fakes import Boom, FakeSource, fake_scorer, fake_source


def test_a_write_makes_a_new_snapshot_and_leaves_the_old_one_alone() -> None:
    """Copy-on-write: a snapshot a pick holds never changes; other attributes are kept."""
    store = AttributeStore()
    store.write(
        "a:1", {"queue_depth": Measurement(1.0, 0.0), "kv_cache_usage": Measurement(0.5, 0.0)}
    )
    before = store.snapshot
    store.write("a:1", {"queue_depth": Measurement(4.0, 1.0)})
    assert before["a:1"]["queue_depth"].value == 1.0
    assert store.snapshot["a:1"]["queue_depth"].value == 4.0
    assert store.snapshot["a:1"]["kv_cache_usage"].value == 0.5
    assert store.snapshot is not before


def test_retain_forgets_endpoints_that_left_and_describe_shows_ages() -> None:
    """Departed endpoints are dropped; each measurement is described with its age."""
    store = AttributeStore()
    store.write("a:1", {"lora_running": Measurement(frozenset({"y", "x"}), 1.0)})
    store.write("b:1", {"queue_depth": Measurement(2.0, 2.0)})
    store.retain({"a:1"})
    assert store.describe(now=3.5) == {"a:1": {"lora_running": {"value": ["x", "y"], "age": 2.5}}}


def test_a_failing_source_is_reported_and_restarted() -> None:
    """Each failure is reported with the source's name; after the delay the source runs again."""
    source = FakeSource("metrics", {"queue_depth": 3.0}, failures=2)
    store, failures, delays = AttributeStore(), [], []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    async def scenario() -> None:
        endpoints = [Endpoint("p", "10.0.0.1", 80)]
        task = asyncio.create_task(
            keep_running(
                source,
                lambda: endpoints,
                store,
                lambda: 7.0,
                lambda name, error: failures.append((name, type(error))),
                restart_delay=0.5,
                sleep=sleep,
            )
        )
        await source.wrote.wait()
        task.cancel()

    asyncio.run(scenario())
    assert failures == [("metrics", Boom), ("metrics", Boom)]
    assert delays == [0.5, 0.5]
    assert store.snapshot["10.0.0.1:80"]["queue_depth"] == Measurement(3.0, 7.0)


def test_a_configured_picker_scores_on_what_its_source_measured(tmp_path: Path) -> None:
    """End to end in-process: the source runs in the background, the pick explains its inputs."""
    path = tmp_path / "picker.yaml"
    path.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- {type: fake-source, name: gauges, parameters: {values: {queue_depth: 5}}}\n"
        "- {type: fake-scorer, name: q, parameters: {reads: [queue_depth], "
        "table: {'10.0.0.2:80': 1.0}}}\n"
    )
    config = load_config(path, {**REGISTRY, "fake-source": fake_source, "fake-scorer": fake_scorer})
    pipeline = config.pipeline(clock=lambda: 100.0, explain="header")
    (source,) = pipeline.sources
    assert isinstance(source, FakeSource)
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 80), pod("p1", "10.0.0.2", 80)), {})
    service = EndpointPickerService(pool, pipeline, PickerMetrics(CollectorRegistry()))

    async def scenario() -> None:
        async with (
            running(
                "lwepp",
                service,
                background=pipeline.background(lambda: pool.endpoints),
                json_routes=pipeline.debug_pages(),
            ) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            await source.wrote.wait()
            replies = await client.exchange(
                [
                    request_headers({EXPLAIN_HEADER: "1"}, end_of_stream=True),
                    response_headers({":status": "200"}),
                ]
            )
            assert dict(set_headers(replies[0]))["x-gateway-destination-endpoint"] == "10.0.0.2:80"
            decision = json.loads(dict(set_headers(replies[1]))[DECISION_HEADER])
            best = decision["scores"][0]
            assert best["attributes"] == {"queue_depth": {"value": 5, "age": 0.0}}
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{ports.metrics}/debug/attributes") as page,
            ):
                assert (await page.json())["10.0.0.1:80"]["queue_depth"]["value"] == 5

    asyncio.run(scenario())
