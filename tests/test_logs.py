"""Log lines: one JSON object per line, even from several processes sharing stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
import structlog
from serving.logs import configure_logging
configure_logging("info")
log = structlog.get_logger()
for i in range(2000):
    log.info("line", n=i, padding="x" * 200)
"""


def test_workers_sharing_stderr_never_merge_their_lines() -> None:
    """Three processes log 2,000 lines each into one pipe (as --workers do): every line read
    back is one whole JSON object. Each line is written in one call; were the newline written
    apart (print()), lines from different processes would run together."""
    read, write = os.pipe()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER], stderr=write) for _ in range(3)]
    os.close(write)
    with open(read) as pipe:
        lines = pipe.read().splitlines()
    for writer in writers:
        assert writer.wait(timeout=60) == 0
    assert len(lines) == 3 * 2000
    assert all(json.loads(line)["event"] == "line" for line in lines)
