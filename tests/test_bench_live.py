"""The live benchmark: the demo gateway and the peer routers, at smoke size, over HTTP."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bench import live, peers
from bench.report import Options


@pytest.mark.parametrize("peer", peers.PEERS, ids=[peer.name for peer in peers.PEERS])
def test_every_peer_the_extra_pins_is_installed(peer: peers.Peer) -> None:
    """`make test` installs pyproject's peers extra; a peer missing, or at another version,
    fails here (the benchmark itself would only note it and run without it)."""
    assert peer.unavailable() is None


def test_quick_run_answers_every_request(tmp_path: Path) -> None:
    """A smoke-size run sends the workload through the prefix-aware demo gateway, and through
    the first peer's cache_aware policy; every request gets a whole stream and no arm
    reports an error."""
    section = live.run(Options(quick=True, out=tmp_path))

    assert section.key == "live"
    arms = {(arm["router"], arm["policy"]): arm for arm in section.data["arms"]}
    expected = [(live.SWITCHYARD, "prefix-aware"), (peers.PEERS[0].name, "cache_aware")]
    assert list(arms) == expected
    for arm in arms.values():
        assert arm["errors"] == 0
        assert len(arm["outcomes"]) == live.QUICK.count
        for outcome in arm["outcomes"]:
            assert outcome["error"] is None
            assert outcome["ttft"] is not None
            assert outcome["tokens"] == live.QUICK.shape.max_tokens
    (table,) = section.tables
    assert [row[0] for row in table.rows] == [f"{r} {p}" for r, p in expected]
    assert [s.label for s in section.plots[0].series] == [f"{r} {p}" for r, p in expected]


def test_quick_run_on_real_llamacpp_engines(tmp_path: Path) -> None:
    """`--engine llamacpp`: the smoke run on two real llama.cpp engines; every request gets its
    tokens whatever the router, and llama.cpp's own counters give each arm's hit rate."""
    section = live.run(Options(quick=True, out=tmp_path, engine="llamacpp"))

    assert section.key == "live-llamacpp"
    assert section.data["engine"] == "llamacpp"
    arms = {(arm["router"], arm["policy"]): arm for arm in section.data["arms"]}
    assert list(arms) == [(live.SWITCHYARD, "prefix-aware"), (peers.PEERS[0].name, "cache_aware")]
    for arm in arms.values():
        assert arm["errors"] == 0
        assert arm["queries"] > 0
        assert 0 <= arm["hits"] <= arm["queries"]
        assert [o["tokens"] for o in arm["outcomes"]] == [
            live.LLAMACPP_QUICK.shape.max_tokens
        ] * live.LLAMACPP_QUICK.count


def test_peer_command_line_names_policy_ports_and_workers() -> None:
    """A peer router is started on the given port with its metrics on another, the policy
    asked for, and every worker URL after --worker-urls."""
    workers = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    argv = peers.SGLANG_ROUTER.argv("cache_aware", 30000, 30001, workers)

    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    assert argv[argv.index("--port") + 1] == "30000"
    assert argv[argv.index("--prometheus-port") + 1] == "30001"
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--worker-urls") + 1 :] == workers


def test_a_peer_not_installed_says_how_to_install_it() -> None:
    """A peer whose distribution is missing is unavailable, and the reason is the pip line."""
    missing = peers.Peer("nowhere", "switchyard-no-such-router", "1.2.3", "no_such_module", "warn")

    reason = missing.unavailable()

    assert reason is not None
    assert "switchyard-no-such-router==1.2.3" in reason


def test_the_peers_extra_pins_exactly_the_benchmarked_versions() -> None:
    """`make peers` installs pyproject's `peers` extra; it must name the versions the benchmark
    checks for, or every peer would be skipped as the wrong version."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = project["project"]["optional-dependencies"]["peers"]

    assert sorted(extra) == sorted(peer.requirement for peer in peers.PEERS)
