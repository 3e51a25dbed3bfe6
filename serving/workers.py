"""Several processes on one port: ``--workers N`` as a supervisor and N copies of a service.

One Python process serves one core: the event loop runs the handlers one at
a time. ``run_workers`` runs N copies of a service on the same ext_proc and
health ports, which Linux spreads over them by connection (``SO_REUSEPORT``);
each worker keeps its own state, and the supervisor serves their metrics,
summed, on the one metrics port (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, multiprocess, start_http_server

from serving.options import Ports

WORKER_ENV: Final = "SWITCHYARD_WORKER"
"""Set by ``run_workers`` in each worker's environment: ``<index>/<count>``."""

MULTIPROCESS_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's switch to multiprocess mode: where each process writes its samples."""

log = structlog.get_logger()


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, never listening.

    It holds the port (``0``: a free one, chosen once for every worker) while
    the workers bind it too: Linux hands connections only to listening sockets,
    so this one takes no traffic, and no unrelated process can take the port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, port))
    return holder


def die_with_parent() -> None:
    """In a child, before it runs: SIGTERM when its parent dies (``PR_SET_PDEATHSIG``).

    A supervisor killed outright (SIGKILL, an OOM kill) cannot forward the
    signal itself; without this, its workers would go on serving the port.
    Linux ties the signal to the thread that started the child: start it from
    a thread that lives as long as the parent (the main one).
    """
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def worker_argv(args: Sequence[str], ports: Ports) -> list[str]:
    """A worker's flags: the supervisor's, then its ports and ``--workers 1`` (the last wins).

    The ext_proc and health ports are the shared ones. Each worker serves its
    own metrics page on a free port (its debug pages are there too); the
    supervisor serves all their samples together on ``--metrics-port``.
    """
    return [
        *args,
        *("--grpc-port", str(ports.grpc), "--grpc-health-port", str(ports.health)),
        *("--metrics-port", "0", "--workers", "1"),
    ]


def serve_worker_metrics(directory: str, ports: Ports) -> Any:
    """The one metrics page of N workers: every worker's samples, read from ``directory``.

    Workers started with ``PROMETHEUS_MULTIPROC_DIR`` write each sample to a
    file there; counters and histograms are summed over the workers, gauges
    declare how to combine (``multiprocess_mode``, e.g. the largest of the live
    workers). Served from a thread of the supervisor, which otherwise only
    waits for its workers. Returns the HTTP server (``shutdown()`` stops it).
    """
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    server, _thread = start_http_server(ports.metrics, ports.host, registry)
    log.info("serving metrics", metrics_port=server.server_port, pid=os.getpid())
    return server


def run_workers(
    module: str,
    args: Sequence[str],
    workers: int,
    ports: Ports,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``python -m module`` ``workers`` times on the same ports; return an exit status.

    The workers share the ext_proc port and the gRPC health port (any worker
    can answer a probe: each reports its own state, and they start and stop
    together), and one metrics page (``serve_worker_metrics``); ``environ``
    is added to their environment. SIGTERM or SIGINT here is passed to every
    worker, which drains as a single process does; the supervisor returns
    once all have exited. Should one worker exit by itself, the others are
    stopped too and the status is 1: a replica serving on fewer cores than
    asked should be restarted whole (by Kubernetes, say), not limp on.
    """
    holders = [_reserve(ports.host, ports.grpc), _reserve(ports.host, ports.health)]
    shared = Ports(
        ports.host, holders[0].getsockname()[1], holders[1].getsockname()[1], ports.metrics
    )
    samples = tempfile.mkdtemp(prefix="switchyard-metrics-")
    metrics_server = serve_worker_metrics(samples, shared)
    stopping = False
    running: dict[int, subprocess.Popen[bytes]] = {}

    def stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in running:
            os.kill(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(workers):
            child = subprocess.Popen(
                [sys.executable, "-m", module, *worker_argv(args, shared)],
                env={
                    **os.environ,
                    **(environ or {}),
                    WORKER_ENV: f"{index}/{workers}",
                    MULTIPROCESS_ENV: samples,
                },
                preexec_fn=die_with_parent,
            )
            running[child.pid] = child
        status = 0
        while running:
            pid, code = os.wait()  # children are reaped here only, never by Popen.poll
            if pid not in running:
                continue
            child = running.pop(pid)
            child.returncode = os.waitstatus_to_exitcode(code)
            multiprocess.mark_process_dead(pid, samples)  # type: ignore[no-untyped-call]
            if not stopping:
                log.error("worker exited", pid=pid, status=child.returncode)
                status = 1
                stop(signal.SIGTERM, None)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in running.values():
            child.kill()
            child.wait()
        for holder in holders:
            holder.close()
        metrics_server.shutdown()
        metrics_server.server_close()
        shutil.rmtree(samples, ignore_errors=True)
