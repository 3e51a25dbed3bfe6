"""``python -m bench.replay``: a trace of the user's own through the routing part's engines."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
from pathlib import Path
from typing import Any

import pytest
import structlog

from bench import replay, workloads
from bench.routing import AZURE_FILE, BOUND, MOONCAKE_FILE, ORACLES, TRACES, simulate


def rows(output: str) -> dict[str, list[float]]:
    """The table's rows by picker: p50 ms, p90 ms, p50/RR, p90/RR, p90/envelope, hit rate."""
    lines = output.splitlines()[2:]
    return {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines}


@pytest.mark.parametrize("trace", [MOONCAKE_FILE, AZURE_FILE])
def test_a_slice_of_a_trace_is_judged_against_round_robin_and_the_envelope(
    trace: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each picker and configuration file gets its TTFT over round-robin's and over the better
    oracle's, from the slice asked for; the envelope's own p90 ratio is 1 by construction."""
    config = tmp_path / "mine.yaml"
    config.write_text(Path("demo/configs/recommended.yaml").read_text())
    args = [str(TRACES / trace), "--start", "10", "--count", "60"]
    with structlog.testing.capture_logs():  # the pickers' log lines stay out of the table
        replay.main([*args, "--picker", "precise"])
        replay.main([*args, "--config", str(config)])
    first, second = re.split(
        rf"{trace}: records 10-69, .* prompt tokens/s over .*\n", capsys.readouterr().out
    )[1:]
    found = rows(f"{trace}\n" + first)
    assert list(found) == [
        "round-robin",
        "precise",
        "oracle-lookahead",
        "oracle-estimate",
        "request-path-bound",
    ]
    assert found["round-robin"][2:4] == [1.0, 1.0]
    assert min(found["oracle-lookahead"][4], found["oracle-estimate"][4]) == 1.0
    assert all(row[1] > 0 for row in found.values())
    expected = [*replay.PICKERS, "mine.yaml", "oracle-lookahead", "oracle-estimate", BOUND]
    assert list(rows(f"{trace}\n" + second)) == expected


def test_a_record_that_is_not_one_is_named_by_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record missing a field stops the replay with the file, the line and the field."""
    trace = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}'
    trace.write_text(f'{good}\n{{"timestamp": 5, "output_length": 2, "hash_ids": [1]}}\n')
    with pytest.raises(SystemExit) as stopped:
        replay.main([str(trace)])
    assert str(stopped.value) == (
        f"python -m bench.replay: {trace}: line 2: no field 'input_length'"
    )


def burst(tmp_path: Path) -> Path:
    """A BurstGPT CSV of 51 rows 2 s apart, 5 of them failed (0 response tokens)."""
    trace = tmp_path / "burst.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        + "".join(
            f"{n * 2},ChatGPT,{200 + n},{0 if n % 10 == 5 else 9},0,API log\n" for n in range(51)
        )
    )
    return trace


def test_the_rate_is_printed_and_time_scale_changes_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The first line gives the scaled rate; ``--time-scale`` replaces the benchmark's factor
    (0.1 for a CSV): twice the factor, half the rate; ``auto`` offers 5,000 prompt tokens/s."""
    trace = burst(tmp_path)
    with structlog.testing.capture_logs():
        for scale in (None, "0.2", "auto"):
            more = [] if scale is None else ["--time-scale", scale]
            replay.main([str(trace), "--picker", "round-robin", *more])
    first, second, auto = (
        line for line in capsys.readouterr().out.splitlines() if line.startswith("burst.csv")
    )
    # 51 rows, 5 of them failed (0 response tokens), 100 s from the first to the last;
    # prompts of 200-250 tokens become 13-16 (× 1/16): 668 in all
    assert first == (
        "burst.csv: records 0-45, 4.50 requests/s, 67 prompt tokens/s over 10.0 s (gaps × 0.1)"
    )
    assert second == (
        "burst.csv: records 0-45, 2.25 requests/s, 33 prompt tokens/s over 20.0 s (gaps × 0.2)"
    )
    assert auto == (
        "burst.csv: records 0-45, 336.83 requests/s, 5,000 prompt tokens/s over 0.1 s "
        "(gaps × 0.00134)"
    )


def test_engines_replays_on_that_many_keeping_each_ones_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--engines 2`` runs every picker on 2 engines; the default factor and ``auto`` give
    each engine the load the benchmark's 8 get (gaps × 8/2, 5,000 × 2/8 prompt tokens/s),
    while a factor given as a number is kept as given."""
    trace = burst(tmp_path)
    pools: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        pools.append(kwargs["engines"])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(replay, "simulate", counted)
    with structlog.testing.capture_logs():
        for scale in (None, "0.2", "auto"):
            more = [] if scale is None else ["--time-scale", scale]
            replay.main([str(trace), "--picker", "recommended", "--engines", "2", *more])
    assert set(pools) == {2}
    assert len(pools) == 3 * (3 + len(ORACLES))  # round-robin, recommended, the oracles, bound
    first, second, auto = (
        line for line in capsys.readouterr().out.splitlines() if line.startswith("burst.csv")
    )
    head = "burst.csv: records 0-45 on 2 engines, "
    assert first == head + "1.12 requests/s, 17 prompt tokens/s over 40.0 s (gaps × 0.4)"
    assert second == head + "2.25 requests/s, 33 prompt tokens/s over 20.0 s (gaps × 0.2)"
    assert auto.startswith(head)
    assert "1,250 prompt tokens/s" in auto


@pytest.mark.parametrize("engines", ["0", "-2"])
def test_a_pool_of_no_engines_is_refused(engines: str) -> None:
    """There is nothing to route to with fewer than one engine."""
    with pytest.raises(SystemExit) as stopped:
        replay.main([str(TRACES / AZURE_FILE), "--engines", engines])
    assert str(stopped.value) == "python -m bench.replay: --engines must be at least 1"


def bailian(sessions: int) -> str:
    """A trace in Bailian's format: sessions of three turns, 60 s apart, each turn resending
    the conversation so far; every session starts with the same system block."""
    lines = []
    chat = 0
    for session in range(sessions):
        blocks = [0]
        parent = -1
        for turn in range(1, 4):
            blocks += [1000 * (session + 1) + len(blocks) + n for n in range(20)]
            record = {
                "chat_id": chat,
                "parent_chat_id": parent,
                "timestamp": round(session * 1.5 + (turn - 1) * 60.0, 3),
                "input_length": len(blocks) * 16 - 5,
                "output_length": 100,
                "type": "text",
                "turn": turn,
                "hash_ids": list(blocks),
            }
            lines.append(json.dumps(record))
            parent, chat = chat, chat + 1
    return "\n".join(sorted(lines, key=lambda line: json.loads(line)["timestamp"])) + "\n"


def test_a_bailian_trace_is_read_in_seconds_and_16_token_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Bailian's records (known by ``chat_id``) are timed in seconds and hash 16-token
    blocks; with no factor of its own, the replay offers 5,000 prompt tokens/s, and a later
    turn finds its conversation where the earlier one went."""
    trace = tmp_path / "qwen_traceA_blksz_16.jsonl"
    trace.write_text(bailian(20))
    assert workloads.hashed_format(trace) is workloads.BAILIAN
    root_only = tmp_path / "roots.jsonl"  # a first turn may leave parent_chat_id out
    root_only.write_text(
        '{"chat_id": 1, "timestamp": 0.5, "input_length": 20, "output_length": 2, "hash_ids": [7, 8]}\n'
    )
    assert workloads.hashed_format(root_only) is workloads.BAILIAN
    assert workloads.hashed_format(TRACES / MOONCAKE_FILE) is workloads.MOONCAKE
    assert [r.timestamp_ms for r in workloads.read_mooncake(trace, 0, 3)] == [0.0, 1500.0, 3000.0]
    with structlog.testing.capture_logs():
        replay.main([str(trace), "--picker", "round-robin", "--picker", "recommended"])
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"qwen_traceA_blksz_16.jsonl: records 0-59, [0-9.]+ requests/s, 5,000 prompt tokens/s "
        r"over [0-9.]+ s \(gaps × [0-9.]+\)",
        out[0],
    )
    found = rows("\n".join(out))
    assert found["recommended"][5] > found["round-robin"][5] + 0.2  # hit rate
    # the longest prompt, 61 blocks of 16 tokens less 5 (971), is replayed as 122 (× 1/8)
    replayed, _ = replay.arrivals(trace, 0, 60, 0)
    assert max(len(arrival.prompt_tokens) for arrival in replayed) == 122


@pytest.mark.parametrize("scale", ["0", "-1", "inf", "nan", "fast"])
def test_a_time_scale_that_is_not_positive_is_refused(scale: str) -> None:
    """A factor of 0 would put every request at once; a negative one, inf, nan or a word
    other than auto is no factor at all."""
    trace = Path(TRACES / AZURE_FILE)
    with pytest.raises(SystemExit) as stopped:
        replay.main([str(trace), "--time-scale", scale])
    assert str(stopped.value) == (
        "python -m bench.replay: --time-scale must be a number above 0, or auto"
    )


def test_a_compressed_trace_is_read_as_the_plain_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``.gz``, ``.xz`` and ``.bz2`` files replay as their contents would; one that is not
    what its name says stops with the file and the decompressor's complaint."""
    for trace in (MOONCAKE_FILE, AZURE_FILE):
        plain = (TRACES / trace).read_bytes()
        for suffix, compress in (
            (".gz", gzip.compress),
            (".xz", lzma.compress),
            (".bz2", bz2.compress),
        ):
            packed = tmp_path / f"{trace}{suffix}"
            packed.write_bytes(compress(plain))
            with structlog.testing.capture_logs():
                replay.main([str(packed), "--count", "30", "--picker", "round-robin"])
                replay.main([str(TRACES / trace), "--count", "30", "--picker", "round-robin"])
            out = capsys.readouterr().out
            packed_report, plain_report = out.split(f"{trace}{suffix}: ")[1].split(f"{trace}: ")
            assert packed_report.startswith("records 0-29, ")
            assert packed_report == plain_report
    broken = tmp_path / "trace.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(SystemExit) as stopped:
        replay.main([str(broken)])
    assert str(stopped.value).startswith(f"python -m bench.replay: {broken}: Not a gzipped file")


def test_step_jitter_makes_the_seed_vary_a_hashed_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """A Mooncake slice has nothing random in it: every seed gives the same run. With
    ``--step-jitter`` each seed is a run of its own, and the same seed the same run."""
    args = [str(TRACES / MOONCAKE_FILE), "--count", "40", "--picker", "round-robin"]

    def p90(*more: str) -> float:
        with structlog.testing.capture_logs():
            replay.main([*args, *more])
        return rows(capsys.readouterr().out)["round-robin"][1]

    assert p90("--seed", "1") == p90("--seed", "2")
    jittered = p90("--seed", "1", "--step-jitter", "0.1")
    assert jittered == p90("--seed", "1", "--step-jitter", "0.1")
    assert jittered != p90("--seed", "2", "--step-jitter", "0.1")
    with pytest.raises(SystemExit) as stopped:
        replay.main([*args, "--step-jitter", "1"])
    assert str(stopped.value) == (
        "python -m bench.replay: --step-jitter must be at least 0 and below 1"
    )
