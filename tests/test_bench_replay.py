"""``python -m bench.replay``: a trace of the user's own through the routing part's engines."""

from __future__ import annotations

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
    first, second = capsys.readouterr().out.split(f"{trace}: records 10-69\n")[1:]
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
