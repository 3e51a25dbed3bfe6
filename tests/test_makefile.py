"""The Makefile's `test` target: what it installs before running the suite."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_make_test_installs_the_peers_and_the_engines_before_the_suite() -> None:
    """`make test` installs pyproject's peers and engines extras, then runs pytest: the extras'
    stamps must be defined before the rule that names them, or they expand to nothing there
    and the tests needing them find them missing on a fresh checkout."""
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is not installed: `make test` is how the suite runs")
    dry_run = subprocess.run(
        [make, "--dry-run", "--always-make", "test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    installs = [line for line in dry_run if "pip install" in line and "-e" in line]
    assert [line.rsplit(" ", 1)[-1] for line in installs] == [
        "'.[dev]'",
        "'.[dev,peers]'",
        "'.[dev,engines]'",
    ]
    pytest_runs = [n for n, line in enumerate(dry_run) if line.endswith("-m pytest")]
    assert pytest_runs
    assert pytest_runs[0] > dry_run.index(installs[-1])
