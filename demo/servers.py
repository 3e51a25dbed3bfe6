"""Your own model servers behind the demo gateway: checked once at start, then probed for readiness.

``python -m demo --no-simulator`` starts no model server: the pod file names
servers already running (vLLM, SGLang, llama.cpp, anything that speaks the
OpenAI API). Two things stand in for what Kubernetes would do for them:

- **The start check** (``check_servers``): every ``ip:port`` is asked
  ``GET /v1/models``; one that answers is then checked as
  ``python -m lwepp.check_model_server`` checks it (its ``/metrics`` under
  each engine's names, the model list, a one-token completion of the pod's
  ``model``). What fails is named per server (unreachable, no ``/metrics``,
  unknown engine, a broken API, load signals a picker cannot read); nothing
  is refused: the gateway starts whatever the servers say.
- **The readiness probe** (``Readiness``): the kubelet's job outside a
  cluster. Every ``interval`` seconds each endpoint is asked ``GET
  /v1/models`` (every OpenAI server serves it, and llama.cpp answers 503
  while it loads); a pod is ready when all its ports answer 200 with a
  model list within ``timeout``. The pickers read a pod file the probe
  writes, the user's with ``ready: false`` on the pods that are not ready,
  and reload it when it changes (``pods.file.FileSource``). A server that
  never answers is thus never picked, one that dies is dropped within about
  two seconds (a probe, then the pickers' reload), and one that comes back
  is picked again. A pod the user marked ``ready: false`` stays out.

The probe runs on one thread per pod, so a server that hangs delays no
other's verdict. The user's pod file is read once, at start: the pools and
the gateway's routes are fixed then, as the demo's are.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from lwepp import check_model_server
from pods.file import dump_pods
from pods.model import Pod, join_host_port

PROBE_PATH: Final = "/v1/models"
PROBE_INTERVAL: Final = 1.0
PROBE_TIMEOUT: Final = 2.0
PROBE_MAX_BYTES: Final = 1 << 20
"""The most of a model list the probe reads: a list of a thousand models fits many times."""
CHECK_TIMEOUT: Final = 10.0
"""Seconds per request of the start check: a one-token completion on a busy CPU engine."""


def probe(hostport: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when ``GET /v1/models`` on ``hostport`` answers 200 with OpenAI's model list
    (a JSON object with a ``data`` list); else why not, in a few words.

    The body is read, not only the status: a port that answers anything with 200 (a
    metrics exporter, a web page, a pod file pointing one port off) is no model
    server, and every request a picker sent there would come back empty.
    """
    try:
        with urllib.request.urlopen(f"http://{hostport}{PROBE_PATH}", timeout=timeout) as page:
            body = page.read(PROBE_MAX_BYTES)
    except urllib.error.HTTPError as error:
        return f"GET {PROBE_PATH} answered {error.code}"
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"unreachable ({reason})"
    try:
        listing = json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"GET {PROBE_PATH} answered 200 with no JSON model list"
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return f"GET {PROBE_PATH} answered 200 with JSON that is not a model list (no 'data' list)"
    return None


@dataclass(frozen=True, slots=True)
class ServerCheck:
    """What the start check found on one ``ip:port`` of a pod.

    ``problems``: what a user must know, each naming the part that fails;
    ``notes``: what works (the engine recognised, the models listed).
    ``reachable``: the OpenAI API answered ``GET /v1/models`` with 200.
    """

    pod: str
    hostport: str
    reachable: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        verdict = "ok" if not self.problems else "PROBLEM"
        said = "; ".join([*self.problems, *self.notes])
        return f"  {self.pod:<14} {self.hostport:<22} {verdict:<8} {said}"


def findings(report: check_model_server.Report) -> tuple[list[str], list[str]]:
    """The check's report as problems and notes (the checker's own words where it has them)."""
    problems = [f"{api.name}: {api.detail}" for api in report.api if not api.ok]
    notes = [f"lists {api.detail}" for api in report.api if api.ok and api.name == "GET /v1/models"]
    error = report.metrics_error or ""
    if error.startswith("/metrics"):
        problems.append(f"no /metrics ({error}): a picker cannot weigh its load")
    elif error:
        problems.append(f"unknown engine: {error}")
    if report.engine is not None:
        notes.insert(0, f"engine {report.engine}")
        for finding in report.findings:
            if finding.signal in check_model_server.CORE and finding.status != "ok":
                label = check_model_server.LABELS[finding.signal]
                why = finding.note or finding.status
                notes.append(f"{label} {finding.status} ({why})")
    return problems, notes


def check_server(pod: Pod, port: int, timeout: float = CHECK_TIMEOUT) -> ServerCheck:
    """The start check of one ``ip:port``: the probe, then ``check_model_server.check``
    with the pod's first ``model`` label as the completion's model."""
    hostport = join_host_port(pod.address, port)
    if (why := probe(hostport, timeout)) is not None:
        return ServerCheck(pod.name, hostport, False, (why,))
    model = pod.labels.get("model", "").split(",")[0].strip() or None
    report = check_model_server.check(f"http://{hostport}", model=model, timeout=timeout)
    problems, notes = findings(report)
    return ServerCheck(pod.name, hostport, True, tuple(problems), tuple(notes))


def check_servers(pods: Sequence[Pod], timeout: float = CHECK_TIMEOUT) -> list[ServerCheck]:
    """``check_server`` on every port of every pod, all at once; in pod-file order."""
    targets = [(pod, port) for pod in pods for port in pod.ports]
    if not targets:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(lambda target: check_server(target[0], target[1], timeout), targets))


def write_ready(path: Path, pods: Sequence[Pod], ready: Callable[[Pod], bool]) -> None:
    """Write ``pods`` to ``path``, a pod ready only if the user's file and ``ready`` both say
    so; atomically (a rename), so a picker never reads half a file."""
    marked = [dataclasses.replace(pod, ready=pod.ready and ready(pod)) for pod in pods]
    scratch = path.with_name(path.name + ".new")
    scratch.write_text(dump_pods(marked))
    os.replace(scratch, path)


class Readiness:
    """The readiness probe: keeps ``path`` (the pickers' pod file) up to date; see the module
    docstring. ``changed(pod, why)`` hears each change (``why`` None: ready again)."""

    def __init__(
        self,
        pods: Sequence[Pod],
        path: Path,
        *,
        unready: dict[str, str],
        changed: Callable[[Pod, str | None], None] = lambda pod, why: None,
        interval: float = PROBE_INTERVAL,
        timeout: float = PROBE_TIMEOUT,
    ) -> None:
        self.pods, self.path = tuple(pods), path
        self.unready = dict(unready)
        """Pod name → why it is not ready (its first failing port's reason)."""
        self._changed = changed
        self._interval, self._timeout = interval, timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def write(self) -> None:
        with self._lock:
            write_ready(self.path, self.pods, lambda pod: pod.name not in self.unready)

    def start(self) -> None:
        """Write the file as it stands, then probe every pod on its own thread."""
        self.write()
        for pod in self.pods:
            thread = threading.Thread(
                target=self._watch, args=(pod,), name=f"probe-{pod.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _watch(self, pod: Pod) -> None:
        while not self._stop.wait(self._interval):
            reasons = [
                probe(join_host_port(pod.address, port), self._timeout) for port in pod.ports
            ]
            why = next((reason for reason in reasons if reason is not None), None)
            with self._lock:
                if (pod.name in self.unready) == (why is not None):
                    continue  # no change: the file stays as it is
                if why is None:
                    del self.unready[pod.name]
                else:
                    self.unready[pod.name] = why
                write_ready(self.path, self.pods, lambda p: p.name not in self.unready)
            self._changed(pod, why)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
