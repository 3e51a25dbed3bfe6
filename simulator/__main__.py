"""``python -m simulator``: serve every port of every pod in a pod file until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import Final

import structlog

from pods.file import PodFileError, load_pods
from pods.model import Pod, parse_selector
from protos.logs import configure_logging
from simulator.legacy import Settings
from simulator.metrics import ENGINES
from simulator.server import serve_pods

log = structlog.get_logger()

_DEFAULTS: Final = Settings()

_KNOBS: Final = (
    # flag, default in the flag's unit, help
    ("--ttft-ms", _DEFAULTS.ttft_base * 1e3, "time to first token, empty prompt, idle replica"),
    ("--prefill-ms-per-token", _DEFAULTS.prefill_per_token * 1e3, "extra ttft per prompt token"),
    ("--itl-ms", _DEFAULTS.itl_base * 1e3, "time between two output tokens, idle replica"),
    ("--load-factor", _DEFAULTS.load_factor, "slowdown per additional running request"),
    ("--max-running", _DEFAULTS.max_running, "requests run at once per replica; the rest queue"),
    ("--kv-capacity", _DEFAULTS.kv_capacity, "KV-cache size in tokens per replica"),
    ("--time-scale", _DEFAULTS.time_scale, "multiplies every delay; 0 = no delay at all"),
)


def selector(text: str) -> dict[str, str]:
    try:
        return parse_selector(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator",
        description=(
            "Simulated vLLM-like model servers: one HTTP server per port of every pod in the "
            "pod file, each an independent engine with its own queue, KV usage and /metrics. "
            "Time to first token = (ttft + prefill * prompt_tokens) * load; time between "
            "tokens = itl * load; load = 1 + load-factor * (running requests - 1); "
            "KV usage = tokens held by running requests / kv-capacity. "
            "See simulator/README.md."
        ),
    )
    add = parser.add_argument
    add("--pods", required=True, metavar="FILE", help="pod file (YAML, see pods/file.py)")
    add(
        "--selector",
        type=selector,
        default={},
        metavar="K=V[,K=V]",
        help="serve only the pods whose labels match every pair (default: all pods)",
    )
    add(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="lowest level logged, as JSON lines on stderr (default: %(default)s)",
    )
    add(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may finish (default: %(default)s)",
    )
    add(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="whose metric names /metrics uses: vLLM, SGLang, trtllm-serve, Triton's "
        "TensorRT-LLM backend or llama.cpp's server (default: %(default)s)",
    )
    add(
        "--namespace",
        default="",
        help="the namespace the conformance echo reports, as echo-basic's NAMESPACE "
        "(default: none)",
    )
    add(
        "--h2c-port",
        type=int,
        action="append",
        default=[],
        metavar="PORT",
        help="a pod port that serves only the conformance echo, over cleartext HTTP/2 "
        "(prior knowledge), as echo-basic's h2c port; repeatable",
    )
    for flag, default, text in _KNOBS:
        add(flag, type=type(default), default=default, help=f"{text} (default: %(default)s)")
    return parser


async def run(pods: Sequence[Pod], settings: Settings, args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT, then stop (in-flight requests get ``--grace`` seconds)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_pods(
        pods,
        settings,
        grace=args.grace,
        dialect=args.engine,
        namespace=args.namespace,
        h2c_ports=frozenset(args.h2c_port),
    ):
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        settings = Settings(
            ttft_base=args.ttft_ms / 1e3,
            prefill_per_token=args.prefill_ms_per_token / 1e3,
            itl_base=args.itl_ms / 1e3,
            load_factor=args.load_factor,
            max_running=args.max_running,
            kv_capacity=args.kv_capacity,
            time_scale=args.time_scale,
        )
        pods = [pod for pod in load_pods(args.pods) if pod.matches(args.selector)]
    except (PodFileError, ValueError) as error:
        parser.error(str(error))
    if not pods:
        parser.error(f"no pod in {args.pods} matches the selector {args.selector}")
    asyncio.run(run(pods, settings, args))


if __name__ == "__main__":
    main()
