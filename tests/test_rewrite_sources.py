"""Where the rewrites come from: a file reloaded on change, and the Kubernetes API's list/watch
(``lwepp.rewrite_sources``), against a fake API server speaking the real wire format."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lwepp.rewrite_sources import RewriteFile, RewriteWatch, parse_rewrites
from plugin_api.document import ConfigErrors
from pods.kubeapi import Backoff, ClusterConfig
from tests.fake_kube import FakeKube, eventually, in_background
from tests.test_kubernetes import Sleeps, run
from tests.test_model_rewrites import imr, rule

NS = "models"
CURRENT = "llm-d.ai/v1alpha2"
LEGACY = "inference.networking.x-k8s.io/v1alpha2"


def path_of(version: str) -> str:
    return f"/apis/{version}/namespaces/{NS}/inferencemodelrewrites"


def targets(source: RewriteFile | RewriteWatch, model: str = "m") -> str | None:
    """The first target of the rule deciding ``model`` now (None: no rule)."""
    found = source.table.lookup(model)
    return None if found is None else found.rule.targets[0].model


# --- a file ----------------------------------------------------------------------------------


def write(path: Path, *objects: dict[str, Any], text: str | None = None) -> None:
    """Write the file and move its modification time on, so a reload sees a change even within
    the file system's time resolution."""
    path.write_text(text if text is not None else yaml.safe_dump_all(objects))
    stamp = path.stat().st_mtime_ns + 1_000_000_000 * (1 + getattr(write, "bumps", 0))
    write.bumps = getattr(write, "bumps", 0) + 1  # type: ignore[attr-defined]
    os.utime(path, ns=(stamp, stamp))


def test_documents_and_lists_both_read() -> None:
    """``---``-separated objects, or a ``List`` (what ``kubectl get -o yaml`` prints)."""
    one, two = imr("one", rule("a", x=1)), imr("two", rule("b", y=1))
    documents = yaml.safe_dump_all([one, two])
    as_list = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [one, two]})
    for text in (documents, as_list, documents + "---\n"):
        rewrites, warnings = parse_rewrites(text, "r.yaml")
        assert [r.name for r in rewrites] == ["one", "two"]
        assert warnings == []


def test_every_problem_is_named_at_its_line() -> None:
    """All errors at once, each with the file, the line and the field; duplicates too."""
    good = imr("good", rule("a", x=1))
    bad = imr("bad", rule("a", x=0))
    text = yaml.safe_dump_all([good, bad, good], sort_keys=False)
    with pytest.raises(ConfigErrors) as error:
        parse_rewrites(text, "r.yaml")
    first, second = error.value.errors
    weight_line = 1 + text.splitlines().index("      weight: 0")
    assert first.startswith(f"r.yaml:{weight_line}: ")
    assert "spec.rules[0].targets[0].weight" in first
    assert second == "r.yaml: two rewrites named ns/good"
    with pytest.raises(ConfigErrors, match=r"r.yaml:3: not YAML"):
        parse_rewrites("a: 1\nb:\n\t- c\n", "r.yaml")


def test_a_file_applies_its_pool_s_rewrites_and_keeps_the_last_good_set(tmp_path: Path) -> None:
    """Only the rules whose poolRef names the pool; a change applies at the next reload; a
    broken or deleted file keeps the last good set, and the fix is taken."""
    path = tmp_path / "rewrites.yaml"
    write(path, imr("mine", rule("m", first=1)), imr("theirs", rule("m", other=1), pool="b"))
    source = RewriteFile(path, pool="a")
    assert source.reload()
    assert targets(source) == "first"
    assert [r.name for r in source.table.rewrites] == ["mine"]
    assert not source.reload()  # unchanged: not read again
    write(path, imr("mine", rule("m", second=1)))
    assert source.reload()
    assert targets(source) == "second"
    write(path, text="apiVersion: llm-d.ai/v1alpha2\nkind: InferenceModelRewrite\n")
    assert not source.reload()
    assert targets(source) == "second"
    assert source.error is not None
    assert "metadata" in source.error
    path.unlink()
    assert not source.reload()
    assert targets(source) == "second"
    write(path, imr("mine", rule("m", third=1)))
    assert source.reload()
    assert targets(source) == "third"
    assert not source.error
    assert targets(RewriteFile(path)) is None  # not read until reloaded
    everything = RewriteFile(path)
    everything.reload()
    assert targets(everything) == "third"


# --- the Kubernetes API --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def watching(fake: FakeKube, pool: str = "a") -> AsyncIterator[RewriteWatch]:
    """Pool ``pool``'s rewrites read from ``fake`` for the block (backoff without waiting)."""
    sleeps = Sleeps()
    source = RewriteWatch(ClusterConfig(fake.url), NS, pool, backoff=lambda: Backoff(sleep=sleeps))
    async with in_background(source.run):
        yield source


def test_the_pool_s_rewrites_follow_the_api() -> None:
    """Listed, then watched: a change, a poolRef moving away, a deletion each apply at once; the
    other pool's and the other namespace's rewrites never enter."""

    async def scenario(fake: FakeKube) -> None:
        fake.served = {CURRENT: ["inferencemodelrewrites"]}
        fake.put(path_of(CURRENT), imr("canary", rule("m", first=1)))
        fake.put(path_of(CURRENT), imr("other-pool", rule("x", no=1), pool="b"))
        fake.put(f"/apis/{CURRENT}/namespaces/elsewhere/inferencemodelrewrites", imr("e"))
        async with watching(fake) as source:
            await eventually(lambda: targets(source) == "first", "the list")
            assert source.table.lookup("x") is None
            fake.put(path_of(CURRENT), imr("canary", rule("m", second=1)))
            await eventually(lambda: targets(source) == "second", "a change")
            fake.put(path_of(CURRENT), imr("canary", rule("m", second=1), pool="b"))
            await eventually(lambda: targets(source) is None, "the poolRef moved away")
            fake.put(path_of(CURRENT), imr("canary", rule("m", third=1)))
            await eventually(lambda: targets(source) == "third", "back")
            fake.delete(path_of(CURRENT), "canary")
            await eventually(lambda: len(source.table) == 0, "a deletion")
            assert source.api_version == CURRENT
        assert fake.count("list", "inferencemodelrewrites") == 1

    run(scenario)


def test_a_broken_object_keeps_its_last_good_version() -> None:
    """An object that no longer decodes (the API server validates, but schemas drift) keeps
    what it said before; the next good version replaces it."""

    async def scenario(fake: FakeKube) -> None:
        fake.served = {CURRENT: ["inferencemodelrewrites"]}
        fake.put(path_of(CURRENT), imr("canary", rule("m", good=1)))
        async with watching(fake) as source:
            await eventually(lambda: targets(source) == "good", "the list")
            fake.put(path_of(CURRENT), imr("canary", rule("m", bad=0)))
            fake.put(path_of(CURRENT), imr("marker", rule("z", seen=1)))
            await eventually(lambda: targets(source, "z") == "seen", "the events after it")
            assert targets(source) == "good"
            fake.put(path_of(CURRENT), imr("canary", rule("m", better=1)))
            await eventually(lambda: targets(source) == "better", "the fix")

    run(scenario)


@pytest.mark.parametrize(
    ("installed", "read"),
    [([CURRENT], CURRENT), ([LEGACY], LEGACY), ([CURRENT, LEGACY], CURRENT)],
    ids=["current", "legacy-only", "both"],
)
def test_the_group_is_chosen_by_discovery(installed: list[str], read: str) -> None:
    """llm-d.ai when its CRD is installed (the older group's objects then ignored), else the
    older group, as the router chooses."""

    async def scenario(fake: FakeKube) -> None:
        fake.served = {version: ["inferencemodelrewrites"] for version in installed}
        for version in installed:
            raw = imr("r", rule("m", **{version.split("/")[0].replace(".", "-"): 1}), api=version)
            fake.put(path_of(version), raw)
        async with watching(fake) as source:
            await eventually(lambda: source.table.lookup("m") is not None, "the list")
            assert source.api_version == read
            assert targets(source) == read.split("/")[0].replace(".", "-")

    run(scenario)


def test_with_no_crd_it_asks_again_until_one_is_installed() -> None:
    """No rewrites while neither group is served; discovery is retried with backoff."""

    async def scenario(fake: FakeKube) -> None:
        fake.put(path_of(CURRENT), imr("late", rule("m", late=1)))
        async with watching(fake) as source:
            await eventually(lambda: len(fake.discoveries) >= 4, "a second discovery")
            assert targets(source) is None
            fake.served = {CURRENT: ["inferencemodelrewrites"]}
            await eventually(lambda: targets(source) == "late", "the CRD installed")

    run(scenario)
