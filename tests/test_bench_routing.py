"""The routing benchmark: its workloads, its oracles and floor, and a smoke run of the whole
harness.

``make bench-routing`` also runs ``test_the_oracle_envelope_bounds_every_picker_in_a_full_run``
on the results it just wrote (``SWITCHYARD_ROUTING_RESULTS``); ``make test`` skips it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench import routing, workloads
from bench.oracle import Lookahead, Oracle, floor_ttfts, forecast, partition
from bench.report import Options, Section
from bench.workloads import AzureRecord, MooncakeRecord, MultiTurn, Replay, SharedPrefix
from lwepp.contracts import LLMRequest, Usage
from lwepp.pipeline import Pipeline
from lwepp.plugins.metrics_source import MetricsDataSource
from simulator import metrics, openai
from simulator.clocks import VirtualEngine, VirtualLoop
from simulator.engine import Engine, Event, Request, Scheduling
from simulator.profiles import PROFILES, Profile
from simulator.tokenizer import output_token_ids, token_block, tokenize

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


def test_a_longer_shared_prefix_run_starts_with_the_shorter_one() -> None:
    """The first half of a 2N-request run is exactly the N-request run, so a run's first half
    measures the run half as long (what 'p90 growth' compares)."""
    short = workloads.shared_prefix(SHAPE, 10.0, 50, seed=2)
    assert workloads.shared_prefix(SHAPE, 10.0, 100, seed=2)[:50] == short


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


def test_csv_traces_in_azure_2024_and_burstgpt_columns(tmp_path: Path) -> None:
    """Azure's 2024 timestamps carry an offset (taken into account, mixed with or without a
    fraction); BurstGPT's are seconds, with failed requests (0 response tokens) left out
    before the slice is taken."""
    azure = tmp_path / "azure2024.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,2162,5\n"
        "2024-05-10 00:00:01+00:00,10,1\n"
        "2024-05-10 02:00:03.5+02:00,20,2\n"
    )
    assert [(r.at, r.context_tokens) for r in workloads.read_azure(azure)] == [
        (0.0, 2162),
        (pytest.approx(0.99007), 10),
        (pytest.approx(3.49007), 20),
    ]
    burst = tmp_path / "BurstGPT_3.csv"
    burst.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
        "Total tokens,Log Type\n"
        "5,a,1.0,ChatGPT,472,18,490,Conversation log\n"
        "7,b,1.0,ChatGPT,300,0,300,API log\n"
        "45.5,a,2.0,GPT-4,1087,230,1317,Conversation log\n"
        "118,c,0.5,GPT-4,417,276,693,Conversation log\n"
    )
    assert workloads.read_azure(burst, 1) == [
        AzureRecord(40.5, 1087, 230),
        AzureRecord(113.0, 417, 276),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "time,in,out\n1,2,3\n",
            "line 1: columns 'time,in,out': expected Azure's "
            "TIMESTAMP,ContextTokens,GeneratedTokens or BurstGPT's Timestamp,Request tokens,"
            "Response tokens",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,1,2\n2024-05-10,1,2\n",
            "line 3: timestamp '2024-05-10' is not YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]",
        ),
        (
            "Timestamp,Request tokens,Response tokens\n1,2\n",
            "line 2: no value in column 'Response tokens'",
        ),
        (
            "Timestamp,Request tokens,Response tokens\nnan,2,3\n",
            "line 2: timestamp 'nan' is not a number of seconds",
        ),
        (
            "Timestamp,Request tokens,Response tokens\n1e300,2,3\n",
            "line 2: timestamp '1e300' is not a number of seconds",
        ),
        (
            "Timestamp,Request tokens,Response tokens\nnoon,2,3\n",
            "line 2: timestamp 'noon' is not a number of seconds",
        ),
    ],
)
def test_a_csv_trace_that_is_not_one_is_named_by_line_and_column(
    tmp_path: Path, text: str, error: str
) -> None:
    """Columns of neither format, a timestamp of neither, a short row: each stops the read
    with the line and what is wrong with it."""
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(ValueError, match=r"^line ") as raised:
        workloads.read_azure(trace)
    assert str(raised.value) == error


def drive(engine: Engine, loop: VirtualLoop, tokens: tuple[int, ...]) -> None:
    """Serve one request on ``engine`` to completion in virtual time."""
    done: list[Event] = []
    VirtualEngine(engine, loop, done.append).submit(Request("warm", tokens, 2, loop.now))
    loop.run()
    assert done
    assert done[-1].kind == "done"


def test_oracle_sends_a_request_where_its_prefix_is_cached() -> None:
    """With one engine holding the prompt's prefix, the estimate oracle picks that engine."""
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


def busy_engines(
    profile: Profile, count: int = 4
) -> tuple[VirtualLoop, list[Engine], list[VirtualEngine]]:
    """``count`` engines on one loop, engine 0 holding a cached prefix and all of them busy
    mid-step with requests running and waiting; no arrival is scheduled after this."""
    loop = VirtualLoop()
    engines = [Engine(profile, seed=i) for i in range(count)]
    drivers = [VirtualEngine(e, loop, lambda event: None) for e in engines]
    drive(engines[0], loop, (*PREFIX, 1, 2, 3))
    start = loop.now
    for n in range(24):
        tokens = tuple(token_block(100 + n, 300 + 40 * n))
        drivers[n % count].submit(Request(f"busy{n}", tokens, 20, start))
    loop.run(until=start + 0.2)
    return loop, engines, drivers


PREFIX = tuple(range(1000, 1512))


@pytest.mark.parametrize("index", range(4))
def test_forecast_is_the_ttft_the_request_then_gets_and_touches_nothing(index: int) -> None:
    """Mid-step, with requests running and waiting: the look-ahead's forecast is exactly the
    TTFT the request gets on that engine when nothing else arrives, and forecasting leaves
    the engine as it was."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=400)
    loop, engines, drivers = busy_engines(profile)
    engine = engines[index]
    assert engine.in_flight is not None
    assert engine.waiting + engine.running > 1
    request = Request("new", (*PREFIX, 7, 8, 9), 2, loop.now)

    def state() -> tuple[object, ...]:
        return (engine.running, engine.waiting, engine.used_blocks, engine.pending_tokens())

    before = state()
    predicted = forecast(engine, request)
    assert state() == before
    drivers[index].submit(request)
    loop.run()
    assert request.ttft == pytest.approx(predicted, abs=1e-12)


def test_lookahead_sends_a_request_where_its_prefix_is_cached() -> None:
    """With one engine holding the prompt's prefix, the look-ahead picks that engine."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=256)
    loop = VirtualLoop()
    engines = [Engine(profile, seed=i) for i in range(4)]
    drive(engines[2], loop, (*PREFIX, 1, 2, 3))
    lookahead = Lookahead(engines)
    assert lookahead.choose(Request("a", (*PREFIX, 7, 8, 9), 2, loop.now)) == 2
    assert lookahead.sent == [0, 0, 1, 0]


def test_lookahead_sends_a_cold_request_to_the_engine_that_answers_it_first() -> None:
    """Engines 0, 1 and 3 busy with 8, 5 and 3 long prompts, engine 2 with one: a prompt
    cached nowhere goes to the engine whose forecast is earliest (engine 2)."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=400)
    loop = VirtualLoop()
    engines = [Engine(profile, seed=i) for i in range(4)]
    drivers = [VirtualEngine(e, loop, lambda event: None) for e in engines]
    for index, count in enumerate((8, 5, 1, 3)):
        for n in range(count):
            tokens = tuple(token_block(100 * index + n, 600))
            drivers[index].submit(Request(f"busy{index}-{n}", tokens, 20, 0.0))
    loop.run(until=0.1)
    request = Request("cold", tuple(token_block(9999, 800)), 2, loop.now)
    forecasts = [forecast(e, request) for e in engines]
    assert min(forecasts) == forecasts[2] < min(forecasts[:2] + forecasts[3:])
    assert Lookahead(engines).choose(request) == 2


def test_lookahead_choice_is_the_earliest_forecast_even_with_simulations_cut_short() -> None:
    """Engine 0 holds a long prefix and is the busiest (decoding streams), the others hold
    less work: at several moments the engine chosen is the one with the earliest full
    forecast (engine 0 for the prefix, not always for a cold prompt); stopping a simulation
    once it cannot win never changes the choice."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=600)
    loop = VirtualLoop()
    engines = [Engine(profile, seed=i) for i in range(4)]
    drivers = [VirtualEngine(e, loop, lambda event: None) for e in engines]
    prefix = tuple(token_block(77, 1600))
    drive(engines[0], loop, (*prefix, 1))
    for index, count in enumerate((6, 2, 3, 1)):
        for n in range(count):
            tokens = tuple(token_block(100 * index + n, 200))
            drivers[index].submit(Request(f"busy{index}-{n}", tokens, 60, loop.now))
    chosen = []
    for moment in range(4):
        loop.run(until=loop.now + 0.15)
        for name, tokens in (("hit", (*prefix, moment)), ("cold", tuple(token_block(moment, 90)))):
            request = Request(f"{name}{moment}", tokens, 2, loop.now)
            forecasts = [forecast(e, request) for e in engines]
            choice = Lookahead(engines).choose(request)
            assert forecasts[choice] == min(forecasts)
            chosen.append((name, choice))
    assert {choice for name, choice in chosen if name == "hit"} == {0}
    assert {choice for name, choice in chosen if name == "cold"} != {0}


def test_partition_keeps_groups_whole_and_evens_out_requests() -> None:
    """Largest group first, each to the least loaded engine: groups of 5, 4, 3, 2 requests
    over two engines give loads of 7 and 7, every group on one engine."""
    groups = ["a"] * 5 + ["b"] * 4 + ["c"] * 3 + ["d"] * 2
    placed = partition(groups, 2)
    loads = [sum(1 for g in groups if placed[g] == engine) for engine in range(2)]
    assert loads == [7, 7]
    assert placed == {"a": 0, "b": 1, "c": 1, "d": 0}


@pytest.mark.parametrize("jitter", [0.0, 0.3], ids=["exact", "jittered"])
@pytest.mark.parametrize("engines", [4, 1], ids=["round-robin-over-4", "all-on-1"])
def test_floor_is_below_every_request_ttft_under_any_placement(jitter: float, engines: int) -> None:
    """Requests sharing prefixes, placed round-robin or all on one engine: every request's
    TTFT is at least its floor."""
    profile = PROFILES[routing.PROFILE].replace(num_blocks=300)
    arrivals = workloads.shared_prefix(SHAPE, 30.0, 80, seed=5)
    floors = floor_ttfts(
        [a.prompt_tokens for a in arrivals],
        [output_token_ids(0, a.max_tokens) for a in arrivals],
        profile,
        1.0 - jitter,
    )
    loop = VirtualLoop()
    scheduling = Scheduling(step_jitter=jitter)
    fleet = [Engine(profile, seed=i, scheduling=scheduling) for i in range(engines)]
    drivers = [VirtualEngine(e, loop, lambda event: None) for e in fleet]
    requests = [Request(a.request_id, a.prompt_tokens, a.max_tokens, a.at) for a in arrivals]
    for n, request in enumerate(requests):
        loop.at(request.arrival, functools.partial(drivers[n % engines].submit, request))
    loop.run()
    for request, floor in zip(requests, floors, strict=True):
        assert request.ttft is not None
        assert request.ttft >= floor - 1e-12


def test_floor_is_reached_alone_on_an_idle_engine_holding_the_prefix() -> None:
    """A repeated prompt on an idle engine that holds it takes exactly its floor: one step
    for the tokens after the last full cached block."""
    profile = PROFILES[routing.PROFILE]
    prompt = tuple(token_block(3, 900))
    engine = Engine(profile)
    drive(engine, VirtualLoop(), prompt)
    floor = floor_ttfts([prompt, prompt], [(), ()], profile)[1]
    assert floor == pytest.approx(profile.step_time(900 - 896, 0, 0))
    assert forecast(engine, Request("again", prompt, 1, 100.0)) == pytest.approx(floor)


def outcome(**changes: Any) -> routing.Outcome:
    """A made-up run: steady at 10/s, p90 200 ms, unless ``changes`` say otherwise."""
    base = routing.Outcome(
        workload="shared-prefix",
        strategy="round-robin",
        rate=10.0,
        requests=2000,
        completed=2000,
        failed=0,
        fallbacks=0,
        ttft_p50=0.1,
        ttft_p90=0.2,
        ttft_p99=0.3,
        ttft_p90_half=0.2,
        itl_mean=0.07,
        itl_p90=0.08,
        output_tokens_per_s=300.0,
        requests_per_s=10.0,
        answered_per_s=10.0,
        hit_rate=0.5,
        preemptions=0,
        per_engine=(250,) * 8,
        spread_max_mean=1.0,
        spread_cv=0.0,
        virtual_seconds=200.0,
        wall_seconds=1.0,
        scrapes=0,
        floor_p90=0.08,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "saturated"),
    [
        ({}, False),
        ({"ttft_p90": 0.27}, False),
        ({"ttft_p90": 0.3}, True),
        ({"answered_per_s": 9.4}, True),
        ({"answered_per_s": 9.6}, False),
        ({"rate": None, "answered_per_s": 1.0}, False),
    ],
    ids=["steady", "p90-grows-a-little", "p90-grows-1.5x", "backlog", "served", "trace"],
)
def test_a_run_is_saturated_when_its_p90_grows_with_it_or_its_rate_is_not_served(
    changes: dict[str, Any], saturated: bool
) -> None:
    """Saturated: p90 over the whole run above 1.4x its first half's, or (a swept rate) fewer
    than 95% of the offered requests answered while they kept arriving."""
    run = outcome(**changes)
    assert run.saturated is saturated
    assert run.state().startswith("saturated" if saturated else "steady")


def test_ratios_with_a_saturated_run_name_it_instead_of_a_number() -> None:
    """Past saturation a ratio measures the run's length: the ratio table shows which run is
    saturated and the rate it sustained, and the targets count as not measured there."""
    runs = [
        outcome(strategy="round-robin", ttft_p90=30.0, ttft_p90_half=15.0, answered_per_s=8.1),
        outcome(strategy="prefix-aware", ttft_p90=0.15),
        outcome(strategy="oracle-lookahead", ttft_p90=0.14),
        outcome(strategy="oracle-estimate", ttft_p90=0.16),
    ]
    row = routing.ratio_table(runs).rows[0]
    assert row[1] == "saturated at 8.1/s"
    assert row[2] == "round-robin saturated (8.1/s)"
    assert row[3] == pytest.approx(0.15 / 0.14)
    assert row[5] == "oracle-lookahead"
    first, second, _ = routing.targets(runs, 10.0)
    assert math.isnan(first.measured)
    assert not first.reached
    assert second.measured == pytest.approx(0.15 / 0.14)


def test_bounds_flag_a_picker_more_than_two_percent_below_the_envelope() -> None:
    """The envelope is the better oracle's p90; a run where a picker's p90 is more than 2%
    under it is reported as not bounded, and the worst run is the bound target's value."""
    runs = [
        outcome(strategy="round-robin", ttft_p90=0.5),
        outcome(strategy="prefix-aware", ttft_p90=0.196),
        outcome(strategy="oracle-lookahead", ttft_p90=0.21),
        outcome(strategy="oracle-estimate", ttft_p90=0.2),
        outcome(workload="mooncake", rate=None, strategy="prefix-aware", ttft_p90=0.2),
        outcome(workload="mooncake", rate=None, strategy="oracle-lookahead", ttft_p90=0.206),
        outcome(workload="mooncake", rate=None, strategy="oracle-estimate", ttft_p90=0.22),
    ]
    found = {b.workload: b for b in routing.bounds(runs)}
    assert (found["shared-prefix"].oracle, found["shared-prefix"].picker) == (
        "oracle-estimate",
        "prefix-aware",
    )
    assert found["shared-prefix"].holds
    assert not found["mooncake"].holds
    assert routing.bound_target(runs).measured == pytest.approx(0.2 / 0.206)
    assert not routing.bound_target(runs).reached


def test_outcomes_read_back_from_results_json() -> None:
    """An outcome written to results.json (NaN as null) reads back as the same outcome."""
    import orjson

    original = outcome(itl_mean=math.nan)
    back = routing.Outcome.of(orjson.loads(orjson.dumps(dataclasses.asdict(original))))
    assert math.isnan(back.itl_mean)
    assert dataclasses.replace(back, itl_mean=0.0) == dataclasses.replace(original, itl_mean=0.0)


@pytest.fixture(scope="module")
def quick() -> Section:
    """One smoke-size run of the whole benchmark (seconds)."""
    return routing.run(Options(seed=0, quick=True))


def test_quick_run_measures_every_strategy_on_every_workload(quick: Section) -> None:
    """Every workload is run under every strategy (shared prefix also offline), and every
    request is accounted for."""
    runs = quick.data["runs"]
    workloads_run = {r["workload"] for r in runs}
    assert {"shared-prefix", "multi-turn"} <= workloads_run
    for workload in workloads_run:
        expected = list(routing.STRATEGIES)
        if workload == "shared-prefix":
            expected.append(routing.OFFLINE)
        if workload == "system-prompt":
            expected.append(routing.MISMATCHED)
        expected.append(routing.BOUND)
        rates = {r["rate"] for r in runs if r["workload"] == workload}
        for rate in rates:
            strategies = [
                r["strategy"] for r in runs if r["workload"] == workload and r["rate"] == rate
            ]
            assert strategies == expected
    for r in runs:
        assert r["completed"] + r["failed"] == r["requests"] > 0
        assert r["failed"] == 0
        assert r["fallbacks"] == 0
        assert sum(r["per_engine"]) == r["requests"]
        assert r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"]
        assert r["floor_p90"] <= r["ttft_p90"]
        assert 0.0 <= r["hit_rate"] <= 1.0
    assert [t.name for t in quick.targets]
    drop_in = [t for t in quick.targets if ", worst run (" in t.name]
    assert len(drop_in) == 2 * len(routing.DROP_IN)  # against round-robin and llm-d's default
    rest = [t for t in quick.targets if t not in drop_in]
    recommended = [t for t in rest if t.name.startswith("recommended")]
    precise = [t for t in rest if t.name.startswith("precise")]
    latency = [t for t in rest if t.name.startswith("predicted-latency")]
    assert len(rest) - len(recommended) - len(precise) - len(latency) == 4
    assert "mixed-pool" in workloads_run
    assert sum("oracle envelope" in t.name for t in latency) == len(workloads_run)
    assert len(precise) == 2 * sum(w in workloads_run for w in ("shared-prefix", "mooncake"))
    assert len(recommended) == sum(
        w in workloads_run for w, *_ in routing.RECOMMENDED_LIMITS
    )  # each limit whose workload ran
    assert any(t.title.startswith("Routing: shared-prefix") for t in quick.tables)
    assert {v["variant"] for v in quick.data["variants"]} == {n for n, _ in routing.VARIANTS[1:]}


def test_the_oracle_envelope_bounds_every_picker_in_the_quick_run(quick: Section) -> None:
    """In every run of the smoke benchmark no picker's TTFT p90 is more than 2% below the
    oracle envelope's."""
    outcomes = [routing.Outcome.of(r) for r in quick.data["runs"]]
    assert routing.bounds(outcomes)
    assert [b for b in routing.bounds(outcomes) if not b.holds] == []


@pytest.mark.skipif(
    "SWITCHYARD_ROUTING_RESULTS" not in os.environ,
    reason="reads a full run's results.json: run `make bench-routing`",
)
def test_the_oracle_envelope_bounds_every_picker_in_a_full_run() -> None:
    """In every run of a full `make bench-routing` (its results.json) no picker's TTFT p90 is
    more than 2% below the oracle envelope's."""
    path = Path(os.environ["SWITCHYARD_ROUTING_RESULTS"])
    sections = json.loads(path.read_text())
    (routing_section,) = [s for s in sections if s["key"] == "routing"]
    assert not routing_section["data"]["quick"], "a smoke run proves nothing here"
    outcomes = [routing.Outcome.of(r) for r in routing_section["data"]["runs"]]
    found = routing.bounds(outcomes)
    assert len(found) >= len(routing.FULL.rates) + 1
    assert [b for b in found if not b.holds] == []


def test_quick_run_round_robin_spreads_evenly(quick: Section) -> None:
    """Round-robin gives every engine the same number of requests, give or take one."""
    for r in quick.data["runs"]:
        if r["strategy"] == "round-robin":
            assert max(r["per_engine"]) - min(r["per_engine"]) <= 1


def test_quick_run_scrapes_only_for_configs_with_a_metrics_source(quick: Section) -> None:
    """least-queue, prefix-aware, vllm and sglang (and sglang's on vLLM's pages) read scraped
    metrics, and predicted-latency its engines' KV cache sizes; the others (llamacpp's reads
    none: llama.cpp has no KV gauge) never scrape."""
    scraping = (
        "least-queue",
        "prefix-aware",
        "vllm",
        "sglang",
        routing.MISMATCHED,
        "predicted-latency",
    )
    for r in quick.data["runs"]:
        if r["strategy"] in scraping:
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


@pytest.mark.parametrize("strategy", ["oracle-lookahead", "oracle-estimate", "offline-partition"])
def test_shared_prefix_hits_when_routed_by_prefix(strategy: str) -> None:
    """On a shared-prefix workload the references find cached prefixes: their hit rate is
    high."""
    arrivals = workloads.shared_prefix(SHAPE, 20.0, 80, seed=0)
    run = routing.simulate("sp", arrivals, strategy, routing.profile_for(routing.QUICK))
    assert run.hit_rate > 0.5


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
    """A response headers and completion hook that writes down what it is told."""

    def __init__(self) -> None:
        self.name = "recorder"
        self.headers: list[tuple[str, str | None]] = []
        self.completed: list[tuple[str, str | None, Usage | None]] = []

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        self.headers.append((request.request_id, served))
        return {}

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
        return routing.PipelineRouter("rr", Pipeline([hook]), (), routing.endpoints())

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


@pytest.mark.parametrize(
    "strategy", ["random", "prefix-aware", "oracle-lookahead", "oracle-estimate"]
)
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
