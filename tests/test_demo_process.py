"""The demo's processes end with it, even when it is killed outright."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STARTS_A_SLEEPER = """
import sys, time
from pathlib import Path
from demo.topology import Process
service = Process(
    "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]),
    die_with_parent=True,
)
print(service.process.pid, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting for whoever adopted it to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_service_started_to_die_with_its_parent_ends_when_the_parent_is_killed(
    tmp_path: Path,
) -> None:
    """A Service started with die_with_parent (as `python -m demo` starts them all) gets SIGTERM
    when the process that started it is killed with SIGKILL, which no handler can catch."""
    with subprocess.Popen(
        [sys.executable, "-c", STARTS_A_SLEEPER, str(tmp_path / "sleeper.log")],
        stdout=subprocess.PIPE,
        text=True,
    ) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        try:
            assert not _gone(child)
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 10
            while not _gone(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _gone(child), "the service outlived the process that started it"
        finally:
            parent.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
