"""BBR's base models fed by ConfigMaps (``bbr.base_models``): the payload processor's format and
label, several ConfigMaps per base model, and a map recomputed whole (nothing stale) from a file
or a live list/watch against a fake API server."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from bbr.assembly import router_of
from bbr.base_models import (
    LABEL,
    AdapterSet,
    BaseModels,
    ConfigMapError,
    ConfigMapFile,
    ConfigMapWatch,
    KubeAccess,
    base_map,
    decode_configmap,
    feed,
)
from bbr.message import Message
from bbr.plugins import BASE_MODEL_HEADER, BaseModelToHeader, PluginSpec
from plugin_api import ConfigError, Params
from pods.kubeapi import Backoff, ClusterConfig
from tests.fake_kube import FakeKube, eventually, in_background
from tests.test_kubernetes import Sleeps, run

NS = "llm-d"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"


def configmap(
    name: str, base: str | None, *adapters: str, labelled: bool = True, namespace: str = NS
) -> dict[str, Any]:
    """A ConfigMap as the payload processor's chart writes one (adapters a YAML block)."""
    data: dict[str, str] = {}
    if base is not None:
        data["baseModel"] = base
    if adapters:
        data["adapters"] = "".join(f"- {a}\n" for a in adapters)
    labels = {LABEL: "true"} if labelled else {}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": data,
    }


def header_for(plugin: BaseModelToHeader, model: str) -> str:
    message = Message("request", [], f'{{"model": "{model}"}}'.encode())
    message.parse()
    plugin.process_request(message)
    return dict(message.header_changes()[0])[BASE_MODEL_HEADER]


# --- reading one ConfigMap, and the map ---------------------------------------------------------


def test_a_configmap_reads_as_the_payload_processor_reads_it() -> None:
    """``baseModel`` trimmed; ``adapters`` a YAML list, each trimmed, blanks skipped."""
    obj = configmap("c", " llama ", " sql ", "", "chat")
    assert decode_configmap(obj) == AdapterSet(f"{NS}/c", "llama", ("sql", "chat"))
    assert decode_configmap(configmap("c", "llama")).adapters == ()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({}, "data.baseModel: required"),
        ({"baseModel": "  "}, "data.baseModel: required"),
        ({"baseModel": "b", "adapters": "a: b"}, "data.adapters: expected a list"),
        ({"baseModel": "b", "adapters": "- [x"}, "data.adapters: not YAML"),
    ],
    ids=["no-base", "blank-base", "not-a-list", "not-yaml"],
)
def test_an_unreadable_configmap_is_named_with_its_field(data: dict[str, str], field: str) -> None:
    """No ``baseModel``, or ``adapters`` not a YAML list: an error naming the ConfigMap and the
    field, as the payload processor refuses to parse it."""
    with pytest.raises(ConfigMapError, match=f"ConfigMap {NS}/bad: {field}"):
        decode_configmap({"metadata": {"name": "bad", "namespace": NS}, "data": data})


def test_several_configmaps_per_base_model_and_a_conflict_resolved_by_name() -> None:
    """A base model's adapters may be split across ConfigMaps; an adapter two of them give
    to different base models stays with the first by namespace and name, and is reported."""
    sets = [
        AdapterSet("ns/b-more", "llama", ("chat",)),
        AdapterSet("ns/a-first", "llama", ("sql",)),
        AdapterSet("ns/c-other", "qwen", ("sql", "code")),
    ]
    base_of, conflicts = base_map(sets)
    assert base_of == {
        "llama": "llama",
        "qwen": "qwen",
        "sql": "llama",
        "chat": "llama",
        "code": "qwen",
    }
    assert conflicts == [
        "'sql' is an adapter of 'llama' and, in ConfigMap ns/c-other, of 'qwen': 'llama' kept"
    ]


# --- the plugin fed --------------------------------------------------------------------------------


def test_a_fixed_mapping_needs_no_feed_and_none_at_all_is_warned_about() -> None:
    """``baseModels``: nothing to run. Neither parameter and no API reachable: no job, and a
    warning naming the parameters and the label the ConfigMaps would carry."""
    fixed = BaseModelToHeader("p", Params({"baseModels": {"b": ["a"]}}))
    assert feed(fixed, KubeAccess()) == (None, None)
    bare = BaseModelToHeader("bare", Params({}))
    nowhere = KubeAccess(kubeconfig=os.devnull)  # an empty file: no context to use
    job, warning = feed(bare, nowhere)
    assert job is None
    assert warning is not None
    assert "base-model-to-header:bare: no mapping" in warning
    assert "baseModels nor configMapFile" in warning
    assert f"{LABEL}=true" in warning
    assert header_for(bare, "anything") == ""


def write(path: Path, *objects: dict[str, Any], text: str | None = None) -> None:
    """Write the file, its modification time moved on past any earlier write's."""
    path.write_text(text if text is not None else yaml.safe_dump_all(objects))
    bumps = getattr(write, "bumps", 0) + 1
    write.bumps = bumps  # type: ignore[attr-defined]
    stamp = path.stat().st_mtime_ns + bumps * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def test_a_file_of_configmaps_is_read_and_reread_keeping_the_last_good_map(tmp_path: Path) -> None:
    """``configMapFile``: read at start (broken: a ConfigError naming plugin, file and field);
    re-read on change; a broken edit keeps the map; a dropped adapter leaves it."""
    path = tmp_path / "adapters.yaml"
    write(path, configmap("one", "llama", "sql"), configmap("two", "llama", "chat"))
    plugin = BaseModelToHeader("p", Params({"configMapFile": str(path)}))
    job, warning = feed(plugin, KubeAccess())
    assert job is not None
    assert warning is None
    assert [header_for(plugin, m) for m in ("sql", "chat", "llama", "x")] == [
        "llama",
        "llama",
        "llama",
        "",
    ]
    source = ConfigMapFile(path, BaseModels(plugin))
    assert source.reload()
    write(path, configmap("one", "llama", "sql"))
    assert source.reload()
    assert header_for(plugin, "chat") == ""  # gone with its ConfigMap
    write(path, text="kind: ConfigMap\ndata: {adapters: '- x'}\n")
    assert not source.reload()
    assert source.error is not None
    assert "data.baseModel" in source.error
    assert header_for(plugin, "sql") == "llama"
    write(path, text="not: [yaml\n")
    broken = BaseModelToHeader("q", Params({"configMapFile": str(path)}))
    with pytest.raises(
        ConfigError,
        match=r"plugin 'q' \(base-model-to-header\): parameters.configMapFile: .*adapters.yaml",
    ):
        feed(broken, KubeAccess())


@contextlib.asynccontextmanager
async def watching(fake: FakeKube, plugin: BaseModelToHeader) -> AsyncIterator[None]:
    """``plugin``'s map fed from ``fake``'s ConfigMaps for the block (backoff without waiting)."""
    sleeps = Sleeps()
    watch = ConfigMapWatch(
        ClusterConfig(fake.url, namespace=NS),
        NS,
        BaseModels(plugin),
        backoff=lambda: Backoff(sleep=sleeps),
    )
    async with in_background(watch.run):
        yield


def test_the_labelled_configmaps_are_followed_and_nothing_stale_stays() -> None:
    """Only labelled ConfigMaps of the namespace count. Where the payload processor keeps stale
    entries, here a deleted ConfigMap takes its adapters along, a changed ``baseModel`` moves
    them, a ConfigMap losing its label leaves, and a base model named by two ConfigMaps stays
    until the last is gone."""

    async def scenario(fake: FakeKube) -> None:
        plugin = BaseModelToHeader("p", Params({}))
        fake.put(CONFIGMAPS, configmap("one", "llama", "sql"))
        fake.put(CONFIGMAPS, configmap("two", "llama", "chat"))
        fake.put(CONFIGMAPS, configmap("unlabelled", "qwen", "code", labelled=False))
        fake.put(
            "/api/v1/namespaces/other/configmaps", configmap("far", "mistral", namespace="other")
        )

        def now(model: str) -> str:
            return header_for(plugin, model)

        async with watching(fake, plugin):
            await eventually(lambda: now("chat") == "llama", "the list")
            assert (now("code"), now("mistral"), now("qwen")) == ("", "", "")
            fake.delete(CONFIGMAPS, "two")
            await eventually(lambda: now("chat") == "", "a deletion")
            assert now("llama") == "llama"  # "one" still names it
            fake.put(CONFIGMAPS, configmap("one", "llama-3.1", "sql"))
            await eventually(lambda: now("sql") == "llama-3.1", "a new baseModel")
            assert now("llama") == ""  # no ConfigMap names it any more
            fake.put(CONFIGMAPS, configmap("one", "llama-3.1", "sql", labelled=False))
            await eventually(lambda: now("sql") == "", "the label removed")
        assert fake.count("list", "configmaps") == 1
        lists = [r for r in fake.requests if r.verb == "list"]
        assert {r.query.get("labelSelector") for r in lists} == {f"{LABEL}=true"}

    run(scenario)


def test_a_configmap_turned_unreadable_keeps_its_last_good_contents() -> None:
    """A ConfigMap that loses its ``baseModel`` keeps what it mapped before (the original's
    failed reconcile does the same); its new adapters are not taken."""

    async def scenario(fake: FakeKube) -> None:
        plugin = BaseModelToHeader("p", Params({}))
        fake.put(CONFIGMAPS, configmap("one", "llama", "sql"))
        async with watching(fake, plugin):
            await eventually(lambda: header_for(plugin, "sql") == "llama", "the list")
            fake.put(CONFIGMAPS, configmap("one", None, "sql", "chat"))
            fake.put(CONFIGMAPS, configmap("marker", "qwen"))
            await eventually(lambda: header_for(plugin, "qwen") == "qwen", "later events")
            assert (header_for(plugin, "sql"), header_for(plugin, "chat")) == ("llama", "")

    run(scenario)


def test_bbr_s_assembly_feeds_the_plugin_and_runs_its_source(tmp_path: Path) -> None:
    """``router_of``: the plugin's source is a background task of the router, and its warning
    goes to the start-up warnings."""
    path = tmp_path / "adapters.yaml"
    write(path, configmap("one", "llama", "sql"))
    spec = PluginSpec("base-model-to-header", "b", {"configMapFile": str(path)})
    args = argparse.Namespace(plugins=[spec], streaming=True, kubeconfig=None)
    router, warnings = router_of(args, CollectorRegistry(), 1 << 20)
    assert warnings == []
    assert len(router.background) == 1
    bare = PluginSpec("base-model-to-header", "bare", {})
    args = argparse.Namespace(plugins=[bare], streaming=True, kubeconfig=os.devnull)
    router, warnings = router_of(args, CollectorRegistry(), 1 << 20)
    assert router.background == []
    assert len(warnings) == 1
