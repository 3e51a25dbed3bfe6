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
    """A smoke-size run sends each workload (shared prefix, multi-turn chat) through the demo
    gateway with the recommended configuration and through the first peer's cache_aware;
    every request gets a whole stream, and each workload has its table and CDF."""
    section = live.run(Options(quick=True, out=tmp_path))

    assert section.key == "live"
    expected = [(live.SWITCHYARD, live.RECOMMENDED_POLICY), (peers.PEERS[0].name, "cache_aware")]
    sizes = {live.SHARED_PREFIX: live.QUICK, live.MULTI_TURN: live.CHAT_QUICK}
    assert [w["workload"] for w in section.data["workloads"]] == list(sizes)
    for workload in section.data["workloads"]:
        size = sizes[workload["workload"]]
        arms = {(arm["router"], arm["policy"]): arm for arm in workload["arms"]}
        assert list(arms) == expected
        for arm in arms.values():
            assert arm["errors"] == 0
            assert len(arm["outcomes"]) == size.count
            for outcome in arm["outcomes"]:
                assert outcome["error"] is None
                assert outcome["ttft"] is not None
                assert outcome["tokens"] == size.shape.max_tokens
    chat = section.data["workloads"][1]["arms"][0]["outcomes"]
    sessions = section.data["workloads"][1]["size"]["shape"]["sessions"]
    assert {o["group"] for o in chat} == {f"s{n}" for n in range(sessions)}  # one per session
    labels = [f"{r} {p}" for r, p in expected]
    assert [[row[0] for row in table.rows] for table in section.tables] == [labels, labels]
    assert [table.title.split(":")[0] for table in section.tables] == [
        "Shared prefix over HTTP",
        "Multi-turn chat over HTTP",
    ]
    assert [[s.label for s in plot.series] for plot in section.plots] == [labels, labels]
    assert len({plot.name for plot in section.plots}) == 2


def test_each_workload_runs_its_arms() -> None:
    """Shared prefix at 20/s has Switchyard's four configurations and both policies of each
    peer; at 30/s the prefix-aware ones and the peers' cache_aware; multi-turn chat has
    round-robin, recommended, predicted latency and the peers' cache_aware."""
    sizes = [s.name for s in live.SIMULATOR.sizes(quick=False)]
    assert sizes == ["shared-prefix", "shared-prefix-heavy", "multi-turn"]
    shared, _ = live.arms(False, live.SIMULATOR, live.FULL)
    heavy, _ = live.arms(False, live.SIMULATOR, live.HEAVY)
    chat, _ = live.arms(False, live.SIMULATOR, live.CHAT_FULL)

    def ours(chosen: list[live.Arm]) -> list[str]:
        return [a.policy for a in chosen if a.router == live.SWITCHYARD]

    assert ours(shared) == ["round-robin", "prefix-aware", "recommended", "predicted-latency"]
    assert ours(heavy) == ["prefix-aware", "recommended"]
    assert ours(chat) == ["round-robin", "recommended", "predicted-latency"]
    for peer in peers.PEERS:
        assert [a.policy for a in shared if a.router == peer.name] == list(peers.POLICIES)
        assert [a.policy for a in heavy if a.router == peer.name] == ["cache_aware"]
        assert [a.policy for a in chat if a.router == peer.name] == ["cache_aware"]
    assert live.HEAVY.shape == live.FULL.shape
    assert live.HEAVY.rate > live.FULL.rate


def test_recommended_is_judged_against_the_best_peer_with_a_margin() -> None:
    """The recommended arm's target is 0.9 x the best (lowest p90) peer cache_aware's p90, and
    a workload without a peer has only the round-robin target."""

    def result(router: str, policy: str, ttft: float) -> live.ArmResult:
        outcome = live.Outcome("r", "g", measured=True, ttft=ttft)
        return live.ArmResult(live.Arm(router, policy), [outcome], None, None)

    arms = [
        result(live.SWITCHYARD, "round-robin", 2.0),
        result(live.SWITCHYARD, "recommended", 0.5),
        result("sglang-router", "cache_aware", 1.0),
        result("vllm-router", "cache_aware", 0.8),
    ]
    targets = live.workload_targets({r.arm.label: r for r in arms}, live.MULTI_TURN)

    (peer, baseline) = targets
    assert "vllm-router cache_aware" in peer.name
    assert peer.limit == pytest.approx(0.9 * 800)
    assert peer.measured == 500
    assert peer.reached
    assert baseline.limit == 2000
    alone = live.workload_targets({r.arm.label: r for r in arms[:2]}, live.MULTI_TURN)
    assert [t.name for t in alone] == [baseline.name]


def test_spread_counts_the_replicas_a_router_left_idle() -> None:
    """Busiest replica / mean is taken over every replica of the run: a router that sends
    everything to one of 8 scores 8, not 1 (the replicas it never used count as 0)."""
    piled = [live.Outcome(f"r{n}", "g", measured=True, replica="sim-5") for n in range(4)]
    even = [live.Outcome(f"r{n}", "g", measured=True, replica=f"sim-{n}") for n in range(8)]

    assert live.ArmResult(live.Arm("x", "y"), piled, None, None).spread(8) == 8.0
    assert live.ArmResult(live.Arm("x", "y"), even, None, None).spread(8) == 1.0


def test_quick_run_on_real_llamacpp_engines(tmp_path: Path) -> None:
    """`--engine llamacpp`: the smoke run on two real llama.cpp engines; every request gets its
    tokens whatever the router, and llama.cpp's own counters give each arm's hit rate."""
    section = live.run(Options(quick=True, out=tmp_path, engine="llamacpp"))

    assert section.key == "live-llamacpp"
    assert section.data["engine"] == "llamacpp"
    (workload,) = section.data["workloads"]
    arms = {(arm["router"], arm["policy"]): arm for arm in workload["arms"]}
    assert list(arms) == [
        (live.SWITCHYARD, live.RECOMMENDED_POLICY),
        (peers.PEERS[0].name, "cache_aware"),
    ]
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
