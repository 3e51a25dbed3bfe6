"""The originals' command lines work here: every flag GIE's lwepp, the llm-d router and the payload
processor define, and the exact argument lists their manifests and charts pass
(``tests/data/upstream/``, sources named there)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from bbr.__main__ import IGNORED as BBR_IGNORED
from bbr.__main__ import parser as bbr_parser
from lwepp.__main__ import build_parser, warnings
from serving.cli import ignored_warnings, log_level
from tests.fake_kube import FakeKube, ThreadedFakeKube

DATA = Path(__file__).parent / "data"
ARGS = yaml.safe_load((DATA / "upstream" / "serving-args.yaml").read_text())
FLAGS = yaml.safe_load((DATA / "upstream" / "flags.yaml").read_text())
CHART_CONFIGS = DATA / "llm-d-router" / "chart"


def words(flag: str | list[str]) -> list[str]:
    return [flag] if isinstance(flag, str) else list(flag)


def by_id(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {entry["id"]: entry for entry in entries}


PICKERS = by_id(ARGS["pickers"])
BBRS = by_id(ARGS["bbr"])


# --- every flag ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag",
    [*FLAGS["gie-lwepp"], *FLAGS["llm-d-router"], *FLAGS["zap"]],
    ids=lambda f: " ".join(words(f)),
)
def test_every_flag_of_gie_lwepp_and_the_router_is_accepted(flag: str | list[str]) -> None:
    """Each flag the originals define parses, with a value of its kind, beside a pool name."""
    build_parser().parse_args(["--pool-name", "p", *words(flag)])


def test_the_router_s_standalone_selector_flags_are_accepted() -> None:
    """``--endpoint-selector`` takes the full label-selector syntax, with target ports."""
    args = build_parser().parse_args(FLAGS["selector-mode"])
    assert str(args.endpoint_selector) == "app=vllm,tier in (gold,silver),!canary"
    assert args.endpoint_target_ports == (8000, 8001)


@pytest.mark.parametrize(
    "flag",
    [*FLAGS["payload-processor"], *FLAGS["gie-bbr"], *FLAGS["zap"]],
    ids=lambda f: " ".join(words(f)),
)
def test_every_flag_of_the_payload_processor_and_gie_bbr_is_accepted(flag: str | list[str]) -> None:
    """Every flag the payload processor and GIE's BBR take is accepted (argparse exits on an unknown one)."""
    bbr_parser().parse_args(words(flag))


# --- the manifests' argument lists, parsed --------------------------------------------------

EXPECTED_WARNINGS = {
    "llm-d-router-gateway-ha": ["--tracing=true: ignored: Switchyard emits no traces"],
    "llm-d-router-gateway-optimized-baseline": [
        "--enable-pprof=true: ignored: Python has no pprof handlers"
    ],
}
"""The warnings each list draws; a list not named draws none."""


@pytest.mark.parametrize("entry", list(PICKERS))
def test_each_picker_argument_list_parses_as_written(entry: str) -> None:
    """The manifest's args, unchanged, parse; the warnings name exactly the ignored values."""
    args = build_parser().parse_args(PICKERS[entry]["args"])
    assert warnings(args) == EXPECTED_WARNINGS.get(entry, [])
    assert args.zap_encoder == "json"
    if "--v=4" in PICKERS[entry]["args"]:
        assert log_level(args) == "debug"


@pytest.mark.parametrize("entry", list(BBRS))
def test_each_bbr_argument_list_parses_as_written(entry: str) -> None:
    """Each upstream BBR argument list parses with no ignored-flag warning, into the two standard plugins."""
    args = bbr_parser().parse_args(BBRS[entry]["args"])
    assert ignored_warnings(args, BBR_IGNORED) == []
    assert [p.type for p in args.plugins] == ["body-field-to-header", "base-model-to-header"]
    assert log_level(args) == "info"  # --v=3 is the originals' VERBOSE, below DEBUG


# --- the manifests' argument lists, run ------------------------------------------------------


def environment(entry: dict[str, Any], kubeconfig: Path) -> dict[str, str]:
    """The container's environment as Kubernetes fills it (fieldRef → the pod's values)."""
    filled = {"<metadata.namespace>": "llm-d", "<metadata.name>": "epp-0"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "NAMESPACE"))}
    for name, value in entry["env"].items():
        env[name] = filled.get(value, value)
    return {**env, "KUBECONFIG": str(kubeconfig)}


def runnable(args: Sequence[str], tmp: Path) -> list[str]:
    """The args with two things changed, as the pod would see them: ``/config/`` (the
    ConfigMap's mount) is the chart's files copied to ``tmp``; then free ports, since the
    fixed ones (9002, 9003, 9090) may be taken on a test machine."""
    changed = [arg.replace("/config/", f"{tmp}/") for arg in args]
    return [*changed, "--grpc-port=0", "--grpc-health-port=0", "--metrics-port=0", "--grace=1"]


def cluster(kube: ThreadedFakeKube) -> None:
    """What the manifests expect to find: GIE's five pools in their namespace, the chart's
    pool and its model servers in ``llm-d`` (one ready pod each)."""
    gie = "inference-conformance-app-backend"
    pools = [(gie, e["args"][1]) for e in ARGS["pickers"] if e["id"].startswith("gie-")]
    pools.append(("llm-d", "release-name"))
    for namespace, name in pools:
        pool = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
            },
        }
        path = f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
        kube.do(functools.partial(FakeKube.put, collection=path, obj=pool))
    for index, namespace in enumerate((gie, "llm-d")):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"vllm-{index}",
                "namespace": namespace,
                "labels": {"app": "vllm"},
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "podIP": "10.0.0.9"},
        }
        path = f"/api/v1/namespaces/{namespace}/pods"
        kube.do(functools.partial(FakeKube.put, collection=path, obj=pod))


@contextlib.contextmanager
def started(module: str, args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()


def events(process: subprocess.Popen[str], until: str, limit: float = 60.0) -> list[dict[str, Any]]:
    """The log lines up to the first ``until`` event, or all of them if the process exits first;
    failing if neither happens within ``limit`` seconds (a bound, not a timing)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {until!r} within {limit} s; logged: {seen}") from None
        if line is None:
            return seen
        seen.append(json.loads(line) if line.startswith("{") else {"event": "text", "text": line})
        if seen[-1]["event"] == until:
            return seen


def distinct(entries: dict[str, dict[str, Any]]) -> list[str]:
    """One entry per set of flags: GIE's five pickers differ in their pool's name only, and the
    standalone chart with a pool renders the gateway chart's args."""
    seen, kept = set(), []
    for entry, spec in entries.items():
        shape = tuple(a for a in spec["args"] if a.startswith("-")), tuple(spec["env"])
        if shape not in seen:
            seen.add(shape)
            kept.append(entry)
    return kept


def test_every_manifest_s_picker_command_runs(tmp_path: Path) -> None:
    """Each picker starts with its manifest's args and env (pods from a fake API server), logs
    its ignored flags, and reaches the pool's pods (the optimized-baseline values' own config,
    with no-hit-lru-scorer, included)."""
    assert len(distinct(PICKERS)) == len(PICKERS) - 5
    for config in CHART_CONFIGS.iterdir():
        (tmp_path / config.name).write_text(config.read_text())
    with ThreadedFakeKube() as kube:
        cluster(kube)
        kubeconfig = kube.kubeconfig(tmp_path / "kubeconfig")
        with contextlib.ExitStack() as stack:
            running = {
                entry: stack.enter_context(
                    started(
                        "lwepp",
                        runnable(spec["args"], tmp_path),
                        environment(spec, kubeconfig),
                    )
                )
                for entry, spec in PICKERS.items()
                if entry in distinct(PICKERS)
            }
            for entry, process in running.items():
                seen = events(process, until="pods")
                flagged = [e["detail"] for e in seen if e["event"] == "flag"]
                assert flagged == EXPECTED_WARNINGS.get(entry, []), entry
                [listening] = [e for e in seen if e["event"] == "listening"]
                assert listening["tls"] is ("--secure-serving=false" not in PICKERS[entry]["args"])
                [pods] = [e for e in seen if e["event"] == "pods"]
                assert [p.split("@")[1] for p in pods["ready"]] == ["10.0.0.9"], entry


def test_every_chart_s_bbr_command_runs(tmp_path: Path) -> None:
    """BBR starts with the payload processor's and GIE's chart args, TLS on (their default), in
    a cluster (a fake API server), where base-model-to-header reads its ConfigMaps; outside
    one, it starts and warns that the base-model header will be empty, naming what is missing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "NAMESPACE"))}
    with ThreadedFakeKube() as kube:
        kubeconfig = kube.kubeconfig(tmp_path / "kubeconfig")
        in_cluster = env | {"NAMESPACE": "llm-d", "KUBECONFIG": str(kubeconfig)}
        for number, (entry, spec) in enumerate(BBRS.items(), start=1):
            with started("bbr", runnable(spec["args"], tmp_path), in_cluster) as process:
                seen = events(process, until="listening")
                assert seen[-1]["event"] == "listening", (entry, seen)
                assert seen[-1]["tls"] is True
                assert not [e for e in seen if e["event"] == "flag"]
                deadline = time.monotonic() + 10  # the ConfigMaps are listed in the background
                while kube.do(lambda f: f.count("list", "configmaps")) < number:
                    assert time.monotonic() < deadline, f"{entry}: ConfigMaps never listed"
                    time.sleep(0.01)
    entry, spec = next(iter(BBRS.items()))
    with started("bbr", runnable(spec["args"], tmp_path), env) as process:
        seen = events(process, until="listening")
    [warning] = [e["detail"] for e in seen if e["event"] == "flag"]
    assert "base-model-to-header" in warning
    assert "inference.llm-d.ai/ipp-managed" in warning
