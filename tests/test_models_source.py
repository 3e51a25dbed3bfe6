"""``models-data-source``: the ``/v1/models`` answer, parameters, and polling the simulator."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from lwepp.contracts import DataSource
from lwepp.plugins import REGISTRY
from lwepp.plugins.models_source import ModelsDataSource, served_models
from plugin_api import ConfigError, Params
from pods.model import Endpoint, Pod
from simulator import Settings, serve_pods
from tests.fakes import RecordingStore
from tests.plugin_fakes import configured


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))  # a bound against hangs, not a timing check


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            {"object": "list", "data": [{"id": "base"}, {"id": "sql", "parent": "base"}]},
            {"base", "sql"},
        ),
        ({"data": []}, set()),
        ({"data": [{"id": "a"}, {"name": "no-id"}, "junk", {"id": 3}]}, {"a"}),
    ],
    ids=["base-and-adapter", "empty", "skips-bad-entries"],
)
def test_served_models_reads_the_ids(answer: Any, expected: set[str]) -> None:
    """Base models and adapters alike go into one set; entries without a string id are skipped."""
    assert served_models(answer) == expected


@pytest.mark.parametrize(
    "answer", [[], {"models": []}, {"data": "x"}], ids=["list", "no-data", "bad-data"]
)
def test_served_models_refuses_what_is_not_a_model_list(answer: Any) -> None:
    """Not a model list is an error (nothing is written), never an empty set."""
    with pytest.raises(ValueError, match="not a model list"):
        served_models(answer)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"path": "v1/models"}, r"path: must start with '/'"),
        ({"refreshIntervalSeconds": -1.0}, r"refreshIntervalSeconds: must be > 0"),
        ({"insecureSkipVerify": "yes"}, r"insecureSkipVerify: expected bool"),
        ({"engineConfigs": []}, r"unknown field 'engineConfigs'"),
    ],
    ids=["path", "interval", "type", "unknown"],
)
def test_bad_parameters_name_the_field(parameters: dict[str, Any], message: str) -> None:
    """Every configuration error names the plugin and the field."""
    with pytest.raises(ConfigError, match=rf"plugin 'models' \(models-data-source\): .*{message}"):
        configured("models-data-source", parameters, "models")


def test_polls_the_simulator_for_models_and_adapters() -> None:
    """Each replica's list lands as ``served_models``, stamped with the injected clock."""

    async def test() -> None:
        store = RecordingStore()
        pods = [
            Pod("a", "127.0.0.1", (0,), {"model": "base", "adapters": "sql,chat"}),
            Pod("b", "127.0.0.1", (0,), {"model": "other"}),
        ]
        data_source: DataSource = REGISTRY["models-data-source"](
            "models", Params({"refreshIntervalSeconds": 0.005}, "models")
        )
        async with serve_pods(pods, Settings(time_scale=0), grace=0.1) as replicas:
            endpoints = [Endpoint(r.pod.name, "127.0.0.1", r.port) for r in replicas]
            task = asyncio.create_task(data_source.run(lambda: endpoints, store, lambda: 5.0))
            await store.until(lambda: len(store.writes) == 2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        a, b = (store.attributes[e.hostport]["served_models"] for e in endpoints)
        assert (a.value, a.at) == (frozenset({"base", "sql", "chat"}), 5.0)
        assert b.value == frozenset({"other"})

    run(test)


def test_a_bad_answer_writes_nothing() -> None:
    """An endpoint answering something that is not JSON keeps its last list (none here)."""

    async def test() -> None:
        store, hits = RecordingStore(), asyncio.Queue[None]()

        async def handler(_request: web.Request) -> web.Response:
            hits.put_nowait(None)
            return web.Response(text="<html>not json</html>")

        app = web.Application()
        app.router.add_get("/v1/models", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        target = Endpoint("p", "127.0.0.1", runner.addresses[0][1])
        data_source = ModelsDataSource("models", Params({"refreshIntervalSeconds": 0.005}))
        task = asyncio.create_task(data_source.run(lambda: [target], store, lambda: 1.0))
        for _ in range(3):
            await hits.get()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.cleanup()
        assert store.writes == {}

    run(test)
