"""Running a service as an operator would: a child process on free ports."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

FREE_PORTS = ("--grpc-port=0", "--grpc-health-port=0", "--metrics-port=0")
"""Every port a service listens on, chosen by the OS."""


@contextlib.contextmanager
def service(
    module: str, *args: str, tls: bool = False
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """``python -m module`` on free ports; yields the process and its ``listening`` log line.

    The ext_proc port is plaintext unless ``tls`` (the services' own default,
    which the TLS tests and the end-to-end tests keep). The process is killed
    on exit if the test has not already stopped it.
    """
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            *FREE_PORTS,
            "--grace=5",
            *([] if tls else ["--secure-serving=false"]),
            *args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        for line in process.stderr:
            event = json.loads(line)
            if event["event"] == "listening":
                break
        else:
            raise AssertionError(f"{module} exited with {process.wait()} before listening")
        yield process, event
    finally:
        process.kill()
        process.wait()
        process.stderr.close()


def start_events(module: str, *args: str) -> list[dict[str, Any]]:
    """The log events ``python -m module`` writes as it starts, through its ``listening`` line
    (plaintext, free ports); the process is then killed."""
    argv = [sys.executable, "-m", module, *FREE_PORTS, "--secure-serving=false", *args]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as process:
        assert process.stderr is not None
        events: list[dict[str, Any]] = []
        try:
            for line in process.stderr:
                events.append(json.loads(line))
                if events[-1]["event"] == "listening":
                    return events
        finally:
            process.kill()
    raise AssertionError(f"{module} exited before listening: {events}")
