"""The routing benchmark: its workloads, its oracle, and a smoke run of the whole harness."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench import routing, workloads
from bench.oracle import Oracle
from bench.report import Options, Section
from bench.workloads import AzureRecord, MooncakeRecord, MultiTurn, Replay, SharedPrefix
from lwepp.hooks import LLMRequest, Usage
from lwepp.pipeline import Pipeline
from lwepp.plugins.metrics_source import MetricsDataSource
from simulator import metrics, openai
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request
from simulator.profiles import PROFILES
from simulator.tokenizer import tokenize

SHAPE = SharedPrefix(groups=4, prefix_tokens=96, users=3, question_tokens=16, max_tokens=4)


def test_poisson_arrivals_have_the_asked_count_and_rate() -> None:
    """A shared-prefix workload has exactly ``count`` requests, in time order, at about ``rate``."""
    arrivals = workloads.shared_prefix(SHAPE, rate=50.0, count=4000, seed=3)
    assert len(arrivals) == 4000
    times = [a.at for a in arrivals]
    assert times == sorted(times)
    assert times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (a fixed schedule would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50.0, rel=0.1)
    assert len({a.request_id for a in arrivals}) == 4000


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    """Requests of one group share the P-token system prompt and nothing more; groups differ."""
    arrivals = workloads.shared_prefix(SHAPE, rate=20.0, count=300, seed=1)
    by_group: dict[str, list[workloads.Arrival]] = {}
    for arrival in arrivals:
        by_group.setdefault(arrival.group, []).append(arrival)
        assert arrival.prompt_tokens == tuple(tokenize(arrival.body["prompt"]))
        assert len(arrival.prompt_tokens) == SHAPE.prompt_tokens
        assert arrival.session.startswith(f"{arrival.group}-u")
        assert arrival.body["max_tokens"] == arrival.max_tokens == SHAPE.max_tokens
    assert len(by_group) == SHAPE.groups
    prefixes = set()
    for members in by_group.values():
        prefix = members[0].prompt_tokens[: SHAPE.prefix_tokens]
        assert all(m.prompt_tokens[: SHAPE.prefix_tokens] == prefix for m in members)
        start = SHAPE.prefix_tokens
        questions = {m.prompt_tokens[start : start + 4] for m in members}
        assert len(questions) == len(members)  # a fresh question every time
        prefixes.add(prefix[:4])
    assert len(prefixes) == SHAPE.groups  # different groups differ from their first words


def test_workloads_are_pure_functions_of_their_seed() -> None:
    """The same seed gives the same requests; another seed gives other ones."""
    one = workloads.shared_prefix(SHAPE, 10.0, 50, seed=7)
    assert one == workloads.shared_prefix(SHAPE, 10.0, 50, seed=7)
    assert one != workloads.shared_prefix(SHAPE, 10.0, 50, seed=8)
    chat = MultiTurn(sessions=4, turns=3, system_tokens=8, user_tokens=4, max_tokens=4)
    assert workloads.multi_turn(chat, 2) == workloads.multi_turn(chat, 2)


def test_multi_turn_resends_the_conversation() -> None:
    """Each turn's prompt starts with the previous turn's, plus the answer and a new message."""
    shape = MultiTurn(sessions=5, turns=4, system_tokens=20, user_tokens=10, max_tokens=6)
    arrivals = workloads.multi_turn(shape, seed=0)
    assert len(arrivals) == 20
    assert [a.at for a in arrivals] == sorted(a.at for a in arrivals)
    sessions: dict[str, list[workloads.Arrival]] = {}
    for arrival in arrivals:
        sessions.setdefault(arrival.session, []).append(arrival)
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            assert after.at > before.at
            assert after.prompt_tokens[: len(before.prompt_tokens)] == before.prompt_tokens
            assert len(after.body["messages"]) == len(before.body["messages"]) + 2
            assert after.body["messages"][-2]["role"] == "assistant"
        assert turns[-1].prompt_tokens == tuple(
            tokenize(workloads.chat_text(turns[-1].body["messages"]))
        )
    firsts = {turns[0].prompt_tokens[:20] for turns in sessions.values()}
    assert len(firsts) == 1  # one system prompt shared by every session


def test_mooncake_replay_scales_lengths_and_times_and_shares_hash_chains() -> None:
    """Equal hash ids give equal text blocks; lengths scale by block/512, times by time_scale."""
    records = [
        MooncakeRecord(1000.0, 1024, 100, (1, 2)),
        MooncakeRecord(3000.0, 1300, 7, (1, 2, 3)),
        MooncakeRecord(4000.0, 600, 1, (9, 10)),
    ]
    replay = Replay(length_scale=16 / 512, output_scale=0.5, time_scale=0.5, max_output=20)
    arrivals = workloads.mooncake(records, 16, replay)
    assert [a.at for a in arrivals] == [0.0, 1.0, 1.5]
    assert [len(a.prompt_tokens) for a in arrivals] == [32, 41, 19]  # ceil(len × 16/512)
    assert [a.max_tokens for a in arrivals] == [20, 4, 1]  # ceil(out × 0.5), capped, ≥ 1
    first, second, third = (a.prompt_tokens for a in arrivals)
    assert second[:32] == first
    assert third[:16] != first[:16]
    for arrival in arrivals:
        assert arrival.prompt_tokens == tuple(tokenize(arrival.body["prompt"]))


def test_azure_replay_scales_and_shares_nothing() -> None:
    """Azure rows become prompts of their scaled length, each its own text."""
    records = [AzureRecord(10.0, 400, 10), AzureRecord(12.0, 40, 3), AzureRecord(13.0, 400, 2)]
    arrivals = workloads.azure(records, Replay(0.25, 2.0, 2.0), seed=0)
    assert [a.at for a in arrivals] == [0.0, 4.0, 6.0]
    assert [len(a.prompt_tokens) for a in arrivals] == [100, 10, 100]
    assert [a.max_tokens for a in arrivals] == [20, 6, 4]
    assert arrivals[0].prompt_tokens[0] != arrivals[2].prompt_tokens[0]


def test_trace_readers_take_a_slice(tmp_path: Path) -> None:
    """The readers parse the published formats, take ``count`` rows from ``start``, and keep
    Azure's times relative to the file's first row (seven fractional digits included)."""
    jsonl = tmp_path / "mooncake.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 5, "output_length": 2, "hash_ids": [t]})
            for t in (0, 10, 20, 30)
        )
        + "\n"
    )
    assert [r.timestamp_ms for r in workloads.read_mooncake(jsonl, 1, 2)] == [10.0, 20.0]
    csv = tmp_path / "azure.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:05.9799600,110,27\n"
    )
    rows = workloads.read_azure(csv, 1, 5)
    assert [r.at for r in rows] == [pytest.approx(0.052), pytest.approx(2.0)]
    assert rows[0] == AzureRecord(rows[0].at, 3180, 8)


def drive(engine: Engine, loop: VirtualLoop, tokens: tuple[int, ...]) -> None:
    """Serve one request on ``engine`` to completion in virtual time."""
    done: list[Event] = []
    VirtualEngine(engine, loop, done.append).submit(Request("warm", tokens, 2, loop.now))
    loop.run()
    assert done
    assert done[-1].kind == "done"


def test_oracle_sends_a_request_where_its_prefix_is_cached() -> None:
    """With one engine holding the prompt's prefix, the oracle picks that engine."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=256)
    loop = VirtualLoop()
    engines = [Engine(profile, seed=i) for i in range(4)]
    prefix = tuple(range(1000, 1512))
    drive(engines[2], loop, (*prefix, 1, 2, 3))
    assert engines[2].cached_prefix((*prefix, 7)) >= 496
    oracle = Oracle(engines, profile)
    assert oracle.choose(Request("a", (*prefix, 7, 8, 9), 2, 0.0)) == 2


def test_oracle_counts_a_prompt_sent_but_not_yet_prefilled() -> None:
    """A prompt sent to an engine counts there as cached (and as work ahead) until prefilled."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=256)
    engines = [Engine(profile, seed=i) for i in range(4)]
    oracle = Oracle(engines, profile)
    prefix = tuple(range(5000, 5512))
    first = oracle.choose(Request("a", (*prefix, 1), 2, 0.0))
    assert oracle.ahead[first] == 513
    second = Request("b", (*prefix, 2), 2, 0.0)
    hashes = second.block_hashes(512 // 16, 16)
    assert oracle.hit(first, second, hashes) == 512
    assert oracle.hit((first + 1) % 4, second, hashes) == 0
    oracle.prefilled("a")
    assert oracle.ahead == [0, 0, 0, 0]
    assert oracle.hit(first, second, hashes) == 0  # nothing was really run


@pytest.fixture(scope="module")
def quick() -> Section:
    """One smoke-size run of the whole benchmark (seconds)."""
    return routing.run(Options(seed=0, quick=True))


def test_quick_run_measures_every_strategy_on_every_workload(quick: Section) -> None:
    """Every workload is run under every strategy, and every request is accounted for."""
    runs = quick.data["runs"]
    workloads_run = {r["workload"] for r in runs}
    assert {"shared-prefix", "multi-turn"} <= workloads_run
    for workload in workloads_run:
        rates = {r["rate"] for r in runs if r["workload"] == workload}
        for rate in rates:
            strategies = [
                r["strategy"] for r in runs if r["workload"] == workload and r["rate"] == rate
            ]
            assert strategies == list(routing.STRATEGIES)
    for r in runs:
        assert r["completed"] + r["failed"] == r["requests"] > 0
        assert r["failed"] == 0
        assert r["fallbacks"] == 0
        assert sum(r["per_engine"]) == r["requests"]
        assert r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"]
        assert 0.0 <= r["hit_rate"] <= 1.0
    assert [t.name for t in quick.targets]
    assert len(quick.targets) == 3
    assert any(t.title.startswith("Routing: shared-prefix") for t in quick.tables)


def test_quick_run_round_robin_spreads_evenly(quick: Section) -> None:
    """Round-robin gives every engine the same number of requests, give or take one."""
    for r in quick.data["runs"]:
        if r["strategy"] == "round-robin":
            assert max(r["per_engine"]) - min(r["per_engine"]) <= 1


def test_quick_run_scrapes_only_for_configs_with_a_metrics_source(quick: Section) -> None:
    """least-queue and prefix-aware read scraped metrics; the others never scrape."""
    for r in quick.data["runs"]:
        if r["strategy"] in ("least-queue", "prefix-aware"):
            assert r["scrapes"] > 0
        else:
            assert r["scrapes"] == 0


def test_nothing_shared_gives_no_prefix_hits() -> None:
    """A workload whose prompts share nothing has a hit rate of 0 under every strategy."""
    records = [AzureRecord(i * 0.05, 300, 4) for i in range(60)]
    arrivals = workloads.azure(records, Replay(1.0, 1.0, 1.0), seed=5)
    profile = routing.profile_for(routing.QUICK)
    for strategy in routing.STRATEGIES:
        outcome = routing.simulate("none", arrivals, strategy, profile)
        assert outcome.completed == 60
        assert outcome.hit_rate == 0.0


def test_shared_prefix_hits_when_routed_by_prefix() -> None:
    """On a shared-prefix workload the oracle finds cached prefixes: its hit rate is high."""
    arrivals = workloads.shared_prefix(SHAPE, 20.0, 80, seed=0)
    outcome = routing.simulate("sp", arrivals, "oracle", routing.profile_for(routing.QUICK))
    assert outcome.hit_rate > 0.5


def test_the_scraped_page_reads_back_as_the_engine_state() -> None:
    """An engine's rendered vLLM page, read by metrics-data-source, gives the engine's numbers."""
    profile = PROFILES[routing.PROFILE]
    engine = Engine(profile)
    loop = VirtualLoop()
    driver = VirtualEngine(engine, loop, lambda event: None)
    for n in range(3):
        driver.submit(Request(f"r{n}", tuple(range(n * 1000, n * 1000 + 600)), 4, 0.0))
    loop.run(until=profile.step_overhead / 2)  # the first step is scheduled, not finished
    page = metrics.render("vllm", routing.engine_state(engine, loop.now))
    values = MetricsDataSource("m").read(routing.endpoints()[0], page)
    assert values["queue_depth"] == engine.waiting
    assert values["running_requests"] == engine.running > 0
    assert values["kv_cache_usage"] == pytest.approx(engine.kv_usage)
    assert values["cache_block_size"] == profile.block_size
    assert values["cache_num_blocks"] == profile.num_blocks


class RecordingHook:
    """A response hook that writes down what it is told."""

    reads: frozenset[str] = frozenset()
    needs_body = False

    def __init__(self) -> None:
        self.name = "recorder"
        self.headers: list[tuple[str, str | None]] = []
        self.completed: list[tuple[str, str | None, Usage | None]] = []

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        self.headers.append((request.request_id, served))
        return {}

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        raise AssertionError("no body chunks are delivered")

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        self.completed.append((request.request_id, served, usage))


def test_response_hooks_hear_the_served_endpoint_and_usage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each request's response side runs once: headers at the first token, completion at the
    end, both with the endpoint that served it, the completion with the token usage."""
    hook = RecordingHook()

    def with_hook(*args: object, **kwargs: object) -> routing.PipelineRouter:
        return routing.PipelineRouter("rr", Pipeline(responses=[hook]), (), routing.endpoints())

    monkeypatch.setattr(routing, "router", with_hook)
    arrivals = workloads.shared_prefix(SHAPE, 20.0, 24, seed=0)
    outcome = routing.simulate("sp", arrivals, "round-robin", routing.profile_for(routing.QUICK))
    assert outcome.completed == 24
    assert sorted(r for r, _ in hook.headers) == sorted(a.request_id for a in arrivals)
    assert sorted((r, s) for r, s, _ in hook.completed) == sorted(hook.headers)
    pool = [e.hostport for e in routing.endpoints()]
    by_engine = [sum(1 for _, s, _ in hook.completed if s == p) for p in pool]
    assert by_engine == list(outcome.per_engine)
    for _, _, usage in hook.completed:
        assert usage is not None
        assert usage.prompt_tokens == SHAPE.prompt_tokens
        assert usage.completion_tokens == SHAPE.max_tokens


@pytest.mark.parametrize("strategy", ["random", "prefix-aware", "oracle"])
def test_a_run_is_deterministic_for_its_seed(strategy: str) -> None:
    """The same workload and seed give the same measurements, random picks and scrapes included."""
    arrivals = workloads.shared_prefix(SHAPE, 10.0, 40, seed=4)
    profile = routing.profile_for(routing.QUICK)
    one, two = (routing.simulate("sp", arrivals, strategy, profile, seed=4) for _ in range(2))
    assert dataclasses.replace(one, wall_seconds=0.0) == dataclasses.replace(two, wall_seconds=0.0)


def test_prompt_tokens_are_what_the_simulator_server_reads_from_the_body() -> None:
    """Each workload's ``prompt_tokens`` equal the tokens the simulator's OpenAI layer parses
    from its body, so the in-process benchmark and one over HTTP cache the same prompts."""
    chat = MultiTurn(sessions=2, turns=3, system_tokens=8, user_tokens=5, max_tokens=3)
    records = [MooncakeRecord(0.0, 700, 5, (1, 2))]
    every = [
        *workloads.shared_prefix(SHAPE, 10.0, 5, seed=0),
        *workloads.multi_turn(chat, seed=0),
        *workloads.mooncake(records, 16, Replay(16 / 512, 1.0, 1.0)),
        *workloads.azure([AzureRecord(0.0, 40, 3)], Replay(1.0, 1.0, 1.0)),
    ]
    for arrival in every:
        api: openai.Api = "chat" if arrival.path.endswith("chat/completions") else "completions"
        parsed = openai.parse(api, arrival.body_bytes(), {workloads.MODEL})
        assert parsed.tokens == arrival.prompt_tokens
        assert parsed.max_tokens == arrival.max_tokens
