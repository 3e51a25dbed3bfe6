"""Peer routers for the live benchmark: vLLM's and SGLang's, started in front of simulators.

Both peers are Rust routers shipped on PyPI as wheels with a Python launcher,
and both route OpenAI ``/v1/completions`` and ``/v1/chat/completions``
(streamed or not) to a list of worker URLs:

``vllm-router``
    ``python -m vllm_router.launch_router`` (the ``vllm-router`` console
    script), policies ``round_robin``, ``cache_aware`` and more.
``sglang-router``
    ``python -m sglang_router.launch_router``, the same two policies.

``cache_aware`` is the same idea in both (both routers descend from one
code base): an approximate radix tree of the request *text* per worker; a
request whose longest match covers more than ``--cache-threshold`` (0.3) of
its text goes to the worker holding that match, otherwise to the least
loaded one, and when the in-flight loads differ by more than
``--balance-abs-threshold`` (64) *and* ``--balance-rel-threshold`` (1.5)
times, to the least loaded one whatever the tree says. The benchmark runs
them with those defaults, as a user who installs them gets them.

What the routers ask of a worker, and what the simulator answers:

- ``GET /health`` at start and every ``--health-check-interval-secs``: 200.
- vllm-router's ``cache_aware`` has every worker tokenize each request first,
  ``POST /v1/completions/render`` (vLLM's endpoint; the simulator answers it
  with the token ids its engine will use), and matches its tree on those ids.
- SGLang's router first tries gRPC on the worker port (the HTTP/2 preface;
  the simulator's aiohttp refuses it and the router falls back to HTTP), then
  reads ``/server_info`` (falling back to ``/get_server_info``) and
  ``/model_info`` (``/get_model_info``): a worker that answers with a JSON
  object without ``model_path`` is registered under the model id
  ``unknown``, and requests naming any model still reach it.

Each router also serves Prometheus metrics on a port of its own (default
29000 for both, so two routers on one machine would collide): the launcher
here always passes a free one.

``python -m bench.peers`` prints which peers are installed, at which version
against the pin, and the command line each policy runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from demo.topology import HOST, Process, free_ports

POLICIES: Final = ("round_robin", "cache_aware")
"""The policies benchmarked on each peer: the baseline and the prefix-aware one."""


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer router: the PyPI distribution and version pinned, and how to launch it.

    ``module`` is the launcher run as ``python -m``; ``log_level`` the value
    its ``--log-level`` takes for "warnings only" (the two spell it apart).
    """

    name: str
    distribution: str
    version: str
    module: str
    log_level: str

    @property
    def requirement(self) -> str:
        """The pip requirement line that installs exactly the benchmarked version."""
        return f"{self.distribution}=={self.version}"

    def argv(self, policy: str, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
        """The command line of this router on ``port`` in front of ``workers`` (URLs)."""
        return [
            *(sys.executable, "-m", self.module),
            *("--host", HOST, "--port", str(port)),
            *("--prometheus-host", HOST, "--prometheus-port", str(metrics_port)),
            *("--policy", policy, "--log-level", self.log_level),
            "--worker-urls",
            *workers,
        ]

    def unavailable(self) -> str | None:
        """Why this peer cannot run here (not installed, another version), or None."""
        try:
            installed = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{self.distribution} is not installed (pip install '{self.requirement}')"
        if installed != self.version:
            return (
                f"{self.distribution} {installed} is installed, the benchmark pins "
                f"{self.version} (pip install '{self.requirement}')"
            )
        if importlib.util.find_spec(self.module) is None:
            return f"{self.distribution} {installed} has no module {self.module}"
        return None


VLLM_ROUTER: Final = Peer(
    "vllm-router", "vllm-router", "0.1.17", "vllm_router.launch_router", "warning"
)
SGLANG_ROUTER: Final = Peer(
    "sglang-router", "sglang-router", "0.3.2", "sglang_router.launch_router", "warn"
)
PEERS: Final = (VLLM_ROUTER, SGLANG_ROUTER)


class PeerError(RuntimeError):
    """A router that did not come up (the message quotes the end of its log)."""


def _get_json(url: str) -> object | None:
    """The JSON of a 200 answer, or None (refused, an error status, not JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            parsed: object = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return parsed


def registered(base: str, workers: Sequence[str]) -> bool:
    """Whether the router at ``base`` lists every worker in ``workers`` as healthy.

    SGLang's router lists its workers at ``GET /workers`` (``{"workers":
    [{"url", "is_healthy"}, ...]}``) and registers them in the background
    after it starts listening; vLLM's router starts listening only once
    every worker answered its health check, and lists them at
    ``GET /list_workers`` (``{"urls": [...]}``).
    """
    listing = _get_json(f"{base}/workers")
    if isinstance(listing, dict) and isinstance(listing.get("workers"), list):
        healthy = {
            w.get("url")
            for w in listing["workers"]
            if isinstance(w, dict) and w.get("is_healthy", True)
        }
        return set(workers) <= healthy
    listing = _get_json(f"{base}/list_workers")
    if isinstance(listing, dict) and isinstance(listing.get("urls"), list):
        return set(workers) <= set(listing["urls"])
    return False


@dataclass(slots=True)
class Router:
    """A running peer router: its process, policy and URL."""

    peer: Peer
    policy: str
    url: str
    service: Process

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the stop timeout; closes its log."""
        self.service.stop()


def start(
    peer: Peer,
    policy: str,
    workers: Sequence[str],
    work_dir: Path,
    *,
    timeout: float = 60.0,
) -> Router:
    """Start ``peer`` with ``policy`` in front of ``workers`` and wait until it routes to all.

    Raises ``PeerError`` (quoting the log) when the process exits or does not
    list every worker within ``timeout`` seconds; the process is stopped then.
    """
    if (reason := peer.unavailable()) is not None:
        raise PeerError(reason)
    work_dir.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_ports(2)
    name = f"{peer.name}-{policy}"
    service = Process(
        name, peer.argv(policy, port, metrics_port, workers), work_dir / f"{name}.log"
    )
    router = Router(peer, policy, f"http://{HOST}:{port}", service)
    deadline = time.monotonic() + timeout
    while not registered(router.url, workers):
        failed = None
        if not service.running():
            failed = service.failure("exited before it was ready")
        elif time.monotonic() > deadline:
            failed = service.failure(f"did not list its workers after {timeout:.0f} s")
        if failed is not None:
            router.stop()
            raise PeerError(str(failed))
        time.sleep(0.1)
    return router


def main(argv: Sequence[str] | None = None) -> None:
    """Print each peer's install status, its pin and the command line of each policy."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description="Which peer routers the live benchmark can run here, and how it runs them.",
    )
    parser.parse_args(argv)
    example = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    for peer in PEERS:
        reason = peer.unavailable()
        print(f"{peer.requirement}: {'ready' if reason is None else reason}")
        for policy in POLICIES:
            print("  " + shlex.join(peer.argv(policy, 30000, 29000, example)))


if __name__ == "__main__":
    main()
