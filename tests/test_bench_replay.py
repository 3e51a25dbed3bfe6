"""``python -m bench.replay``: a trace of the user's own through the routing part's engines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import structlog

from bench import replay
from bench.routing import AZURE_FILE, MOONCAKE_FILE, TRACES


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
        rf"{trace}: records 10-69, .* requests/s over .* s\n", capsys.readouterr().out
    )[1:]
    found = rows(f"{trace}\n" + first)
    assert list(found) == ["round-robin", "precise", "oracle-lookahead", "oracle-estimate"]
    assert found["round-robin"][2:4] == [1.0, 1.0]
    assert min(found["oracle-lookahead"][4], found["oracle-estimate"][4]) == 1.0
    assert all(row[1] > 0 for row in found.values())
    expected = [*replay.PICKERS, "mine.yaml", "oracle-lookahead", "oracle-estimate"]
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


def test_the_rate_is_printed_and_time_scale_changes_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The first line gives the scaled rate; ``--time-scale`` replaces the benchmark's factor
    (0.1 for a CSV): twice the factor, half the rate."""
    trace = tmp_path / "burst.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        + "".join(
            f"{n * 2},ChatGPT,{200 + n},{0 if n % 10 == 5 else 9},0,API log\n" for n in range(51)
        )
    )
    with structlog.testing.capture_logs():
        replay.main([str(trace), "--picker", "round-robin"])
        replay.main([str(trace), "--picker", "round-robin", "--time-scale", "0.2"])
    first, second = (
        line for line in capsys.readouterr().out.splitlines() if line.startswith("burst.csv")
    )
    # 51 rows, 5 of them failed (0 response tokens), 100 s from the first to the last
    assert first == "burst.csv: records 0-45, 4.50 requests/s over 10.0 s"
    assert second == "burst.csv: records 0-45, 2.25 requests/s over 20.0 s"


@pytest.mark.parametrize("scale", ["0", "-1", "inf", "nan"])
def test_a_time_scale_that_is_not_positive_is_refused(scale: str, tmp_path: Path) -> None:
    trace = Path(TRACES / AZURE_FILE)
    with pytest.raises(SystemExit) as stopped:
        replay.main([str(trace), "--time-scale", scale])
    assert str(stopped.value) == "python -m bench.replay: --time-scale must be a number above 0"
