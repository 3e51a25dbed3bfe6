"""How a service is served: where it listens and every serving flag, as one value.

Every service's command line builds one ``ServingOptions`` from its serving
flags (``serving.cli.serving_options``) and hands it to ``serving.server.serve``,
which reads it whole. A flag added to the serving flags therefore reaches every
service at once: no command line passes it on by hand (and none can forget it).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.metrics_auth import MetricsAuth
from serving.tls import ServerTLS
from wire.exchange import MAX_BODY_BYTES


@dataclass(frozen=True, slots=True)
class Ports:
    """Where a service listens; 0 asks the OS for a free port."""

    host: str = "127.0.0.1"
    grpc: int = 9002
    health: int = 9003
    metrics: int = 9090


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """The serving flags, decoded (``--help`` on any service explains each).

    ``ports``: ``--host`` and the three ports. ``workers``: processes on the
    same ports. ``grace``/``drain``: the shutdown (``serve``). ``max_body_bytes``:
    the largest body a handler holds (handlers read it; ``serve`` does not).
    ``grpc_options``: the ext_proc server's message size limits.
    ``health_on_ext_proc``: the health service on the ext_proc port too.
    ``debug_pages``: serve the service's debug pages beside ``/metrics``.
    ``tls``: what the ext_proc port serves (None: plaintext). ``metrics_auth``:
    the metrics port's guard (None: open). ``kubeconfig``: the file that names
    the Kubernetes API (None: ``$KUBECONFIG``, else the pod's service account).
    ``trace_messages``: the file every
    ext_proc message is appended to. ``log_level``/``log_encoder``: logging.
    """

    ports: Ports = Ports()
    workers: int = 1
    grace: float = 10.0
    drain: float = 0.0
    max_body_bytes: int = MAX_BODY_BYTES
    grpc_options: tuple[tuple[str, int], ...] = ()
    health_on_ext_proc: bool = False
    debug_pages: bool = False
    tls: ServerTLS | None = None
    metrics_auth: MetricsAuth | None = None
    kubeconfig: str | None = None
    trace_messages: str | None = None
    log_level: str = "info"
    log_encoder: str = "json"
