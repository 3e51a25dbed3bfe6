"""``python -m demo`` (``make demo``): the whole gateway on 127.0.0.1:8080 until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from types import FrameType

from demo.topology import DEMO_PICKER_FLAGS, Topology, TopologyError
from pods.file import PodFileError
from pods.model import Pod

DEFAULT_PODS = resources.files("demo") / "pods.yaml"
DEFAULT_REWRITES = resources.files("demo") / "rewrites.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description="Run Envoy, BBR, one LWEPP per pool and simulated model servers on "
        "127.0.0.1, print example requests, and stop everything on Ctrl-C or SIGTERM. "
        "With --no-simulator, the gateway fronts the servers your pod file names instead.",
    )
    add = parser.add_argument
    add("--port", type=int, default=8080, help="gateway port (default: %(default)s)")
    add("--admin-port", type=int, default=9901, help="Envoy admin port (default: %(default)s)")
    add("--work-dir", type=Path, default=Path("run/demo"), help="logs and Envoy's bootstrap")
    add("--pods", type=Path, help="pod file (default: the demo's, demo/pods.yaml)")
    add(
        "--picker-config",
        type=Path,
        metavar="FILE",
        help="run every pool's LWEPP with this EndpointPickerConfig (e.g. "
        "demo/configs/prefix-aware.yaml); requests sent with x-switchyard-explain: 1 "
        "then learn why they went where they went (x-switchyard-decision)",
    )
    add(
        "--no-simulator",
        action="store_true",
        help="start no model server: the pods are your own servers, already running (vLLM, "
        "SGLang, llama.cpp...); each is checked at start and probed for readiness while the "
        "gateway runs",
    )
    add(
        "--one-hop",
        action="store_true",
        help="one ext_proc service (python -m onehop) does BBR's job and every pool's "
        "pick, so Envoy calls Python once per request instead of twice (BBR, then the pool's "
        "picker, GIE's topology and the default); FailOpen then has no meaning: the one "
        "service reads every body, and fails closed as BBR does",
    )
    add(
        "--picker-replicas",
        type=int,
        default=1,
        metavar="N",
        help="N pickers per pool, one Envoy ext_proc cluster of N hosts (round-robin, health "
        "checked); with --picker-config they share what they learn through a redis-server "
        "the demo starts (docs/scale-out.md)",
    )
    add(
        "--plain",
        action="store_true",
        help="start BBR and the pickers with their own defaults, without what the demo turns "
        "on to show (the test-epp-endpoint-selection header, the served-endpoint report, "
        "explanations, debug pages): what a deployment runs. A picker that then needs no "
        "response headers (round-robin) is not sent them, one exchange less per request",
    )
    add(
        "--model-rewrites",
        type=Path,
        metavar="FILE",
        help="InferenceModelRewrites for the pools they name, re-read when the file changes "
        "(default with the demo's pods: demo/rewrites.yaml, the llama-canary 90/10 split)",
    )
    add(
        "--no-model-rewrites",
        action="store_true",
        help="no model rewrites: every model is served as the client names it",
    )
    add(
        "--fail-open",
        action="append",
        metavar="POOL",
        help="a FailOpen pool, repeatable (default: pool b of the demo's pod file)",
    )
    return parser


def _curl(url: str, path: str, body: object, *, stream: bool = False) -> str:
    data = body if isinstance(body, str) else json.dumps(body)
    flags = "-sN" if stream else "-si"
    header = "content-type: application/json"
    return f"curl {flags} {url}{path} -H {shlex.quote(header)} -d {shlex.quote(data)}"


def examples(topology: Topology) -> list[str]:
    """Ready-to-paste requests: each model three ways, then two the gateway refuses."""
    url, lines = topology.url, []
    for pool in topology.pools:
        for model in pool.models:
            ask = {"model": model, "max_tokens": 8}
            chat = {**ask, "messages": [{"role": "user", "content": "Say hello"}]}
            lines += [
                f"# {model} (pool {pool.name}): completion, chat, streamed chat",
                _curl(url, "/v1/completions", {**ask, "prompt": "Say hello"}),
                _curl(url, "/v1/chat/completions", chat),
                _curl(url, "/v1/chat/completions", {**chat, "stream": True}, stream=True),
                "",
            ]
    if topology.picker_config is not None:
        pool = topology.pools[0]
        prompt = "Say hello, twice: the second request finds the prefix cached"
        ask = {"model": pool.models[0], "prompt": prompt, "max_tokens": 8}
        lines += [
            f"# why did it go there? ({topology.picker_config.name}): "
            "the decision comes back in x-switchyard-decision",
            _curl(url, "/v1/completions", ask) + " -H 'x-switchyard-explain: 1'",
            "",
            "# a request's priority, by InferenceObjective (demo/objectives.yaml): with a "
            "configuration that governs requests (demo/configs/flow-control.yaml)",
            _curl(url, "/v1/completions", {**ask, "prompt": "Hi"})
            + " -H 'x-llm-d-inference-objective: interactive'",
            _curl(url, "/v1/completions", {**ask, "prompt": "Hi"})
            + " -H 'x-llm-d-inference-objective: batch'",
            "",
        ]
    if topology.model_rewrites is not None:
        rewritten = [pool for pool in topology.pools if pool.name in topology.rewritten]
        ask = {"model": rewritten[0].models[0], "prompt": "Say hello", "max_tokens": 8}
        lines += [
            f"# model rewrites ({topology.model_rewrites}): x-sim-served-model names the model "
            "the replica served, the answer's model the one you asked for; edit the weights "
            "in the file while the gateway runs, and the next requests follow them",
            _curl(url, "/v1/completions", ask) + " -o /dev/null -D - | grep -i x-sim-served-model",
            "",
        ]
    lines += [
        "# the models the gateway serves (OpenAI's list), and one of them",
        f"curl -s {url}/v1/models",
        f"curl -s {url}/v1/models/{topology.pools[0].models[0]}",
        "",
        "# not JSON: BBR refuses it (400)",
        _curl(url, "/v1/completions", '{"model": '),
        "# a model no pool serves: Envoy answers 404 (model_not_found, OpenAI-style JSON)",
        _curl(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
    ]
    return lines


def banner(topology: Topology) -> str:
    out = [f"Gateway: {topology.url}   Envoy admin: {topology.admin_url}", "", "Pools:"]
    for pool in topology.pools:
        mode = "FailOpen " if pool.fail_open else "FailClose"
        picker = "in the one hop" if topology.one_hop else f"127.0.0.1:{pool.picker_port}"
        out.append(
            f"  {pool.name}  {mode}  models {', '.join(pool.models)}  "
            f"replicas {', '.join(pool.endpoints)}  picker {picker}"
        )
    if not topology.simulator:
        out += ["", "Your servers (checked at start; probed for readiness every second):"]
        out += [check.line() for check in topology.checks]
    out += ["", *examples(topology), ""]
    if topology.simulator:
        out += [
            "In the answers: x-sim-pod and x-sim-endpoint name the replica; "
            "x-sim-received-x-gateway-*",
            "are the routing headers it received; x-conformance-test-served-endpoint is what the",
            "picker heard back from Envoy about the endpoint that served.",
        ]
    else:
        out += [
            "In the answers: x-conformance-test-served-endpoint is the server that answered, as",
            "Envoy reported it to the pool's picker. Errors, from any part, are OpenAI-style JSON.",
        ]
    out += [
        "",
        f"The pickers run {' '.join(DEMO_PICKER_FLAGS)}: off by default, on here so that",
        "there is something to see (docs/security.md says what each lets a client do).",
    ]
    out += ["", "Logs (JSON lines):"]
    for name, service in topology.services.items():
        metrics = service.listening.get("metrics_port")
        where = f"   metrics http://127.0.0.1:{metrics}/metrics" if metrics else ""
        out.append(f"  {name:<12} {service.log}{where}")
    work = topology.work_dir
    out += [
        f"  {'access log':<12} {work / 'envoy-access.log'}   (one line per request)",
        f"  {'bootstrap':<12} {work / 'envoy-bootstrap.json'}   (Envoy's configuration)",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(out)


def server_change(pod: Pod, why: str | None) -> None:
    """Say when a server of the pod file stops or starts answering (the readiness probe)."""
    if why is None:
        print(f"server {pod.name}: answers again; its pool's picker sends it requests", flush=True)
    else:
        print(f"server {pod.name}: {why}; its pool's picker leaves it out", flush=True)


def _stop(_signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stopping short
    raise SystemExit(0)  # unwinds through the Topology, which stops every service


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.picker_replicas < 1:
        parser.error(f"argument --picker-replicas: at least 1, got {args.picker_replicas}")
    signal.signal(signal.SIGTERM, _stop)
    # Ctrl-C raises KeyboardInterrupt even if SIGINT came in ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fail_open = args.fail_open if args.fail_open is not None else ([] if args.pods else ["b"])
    if args.one_hop and args.fail_open:
        sys.exit("demo: --fail-open has no meaning with --one-hop: the one service fails closed")
    if args.one_hop:
        fail_open = []
    if args.model_rewrites is not None and args.no_model_rewrites:
        sys.exit("demo: --model-rewrites and --no-model-rewrites: choose one")
    if args.no_simulator and args.pods is None:
        sys.exit("demo: --no-simulator needs --pods: the pod file naming your servers")
    with (
        resources.as_file(DEFAULT_PODS) as default_pods,
        resources.as_file(DEFAULT_REWRITES) as default_rewrites,
    ):
        pods = args.pods or default_pods
        rewrites = args.model_rewrites or (default_rewrites if args.pods is None else None)
        try:
            topology = Topology(
                args.work_dir,
                pods,
                port=args.port,
                admin_port=args.admin_port,
                fail_open=fail_open,
                picker_config=args.picker_config,
                simulator=not args.no_simulator,
                on_server_change=server_change,
                one_hop=args.one_hop,
                picker_replicas=args.picker_replicas,
                model_rewrites=None if args.no_model_rewrites else rewrites,
                demo_flags=not args.plain,
                die_with_parent=True,  # killed outright, the demo still takes its services along
            )
            print(f"Starting the gateway (logs in {args.work_dir}) ...", flush=True)
            with topology:
                print(banner(topology), flush=True)
                while not (stopped := [s for s in topology.services.values() if not s.running()]):
                    time.sleep(0.5)
                sys.exit(f"{stopped[0].name} exited unexpectedly; see {stopped[0].log}")
        except (TopologyError, PodFileError) as error:
            sys.exit(f"demo: {error}")
        except KeyboardInterrupt:
            print("\nStopped.")


if __name__ == "__main__":
    main()
