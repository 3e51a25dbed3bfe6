"""``python -m simulator``: serve every port of every pod in a pod file until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Final

import structlog

from blockhash.vllm import HASH_ALGORITHMS
from pods.file import PodFileError, load_pods
from pods.model import Pod, parse_selector
from serving.logs import configure_logging
from simulator.engine import Faults, Scheduling, Settings
from simulator.kv_events import KVEventsConfig
from simulator.metrics import ENGINES
from simulator.profiles import DEFAULT_PROFILE, PROFILES
from simulator.server import BindError, serve_pods

log = structlog.get_logger()

_OVERRIDES: Final = (
    # flag, Profile field, factor from the flag's unit to the field's, type, help
    ("--max-num-seqs", "max_num_seqs", 1, int, "running sequences at most (vLLM's max_num_seqs)"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        1,
        int,
        "tokens per engine step at most (chunked prefill's budget)",
    ),
    ("--num-blocks", "num_blocks", 1, int, "KV-cache blocks per replica"),
    ("--max-loras", "max_loras", 1, int, "LoRA adapters resident at once"),
    ("--lora-load-ms", "lora_load_time", 1e-3, float, "time to load an adapter not resident"),
    ("--step-overhead-ms", "step_overhead", 1e-3, float, "time of every engine step"),
    ("--prefill-us-per-token", "prefill_per_token", 1e-6, float, "step time per prefill token"),
    ("--decode-us-per-seq", "decode_per_seq", 1e-6, float, "step time per decoding sequence"),
    (
        "--decode-ns-per-context-token",
        "decode_per_context_token",
        1e-9,
        float,
        "step time per KV token attended by decoding sequences",
    ),
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
            "pod file, each an independent vLLM-like engine (continuous batching, chunked "
            "prefill, a block KV cache with prefix caching and preemption, LoRA loading) "
            "with its own /metrics. Step time = overhead + prefill tokens x prefill cost + "
            "decoding sequences x decode cost + attended KV tokens x context cost, with "
            "the coefficients of a named model/hardware profile. See simulator/README.md."
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
        "(prior knowledge or Upgrade: h2c), as echo-basic's h2c port; repeatable",
    )
    add(
        "--profile",
        choices=list(PROFILES),
        default=DEFAULT_PROFILE,
        help="the model/hardware profile every replica models (simulator/profiles.py says where "
        "each number comes from; default: %(default)s)",
    )
    add(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies every delay; 0 = no delay at all (default: %(default)s)",
    )
    add(
        "--max-running",
        type=int,
        default=None,
        help="running sequences at most per replica (overrides the profile's max_num_seqs)",
    )
    add(
        "--kv-capacity",
        type=int,
        default=None,
        metavar="TOKENS",
        help="KV-cache size in tokens per replica, cut into blocks (overrides the profile's)",
    )
    for flag, _field, _factor, kind, text in _OVERRIDES:
        add(flag, type=kind, default=None, help=f"{text} (default: the profile's)")
    add("--seed", type=int, default=0, help="seeds the fault draws (default: %(default)s)")
    add(
        "--kv-events-config",
        type=str,
        default=None,
        metavar="JSON",
        help="publish each replica's KV-cache events as vLLM does (e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv@10.0.0.1@model"}\'); replica i publishes on the endpoint\'s port + i. '
        "Block hashes use PYTHONHASHSEED as vLLM does (default: no events)",
    )
    add(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGORITHMS,
        default="sha256",
        help="how block hashes in KV-cache events are computed, as vLLM's flag "
        "(default: %(default)s)",
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens, the prompt tokens that hit "
        "the prefix cache (vLLM's flag of the same name)",
    )
    scheduling = parser.add_argument_group(
        "scheduling", "scheduler behaviours; each defaults to what current vLLM does"
    )
    scheduling.add_argument(
        "--scheduler-reserve-full-isl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="admit a waiting request only if its whole prompt fits in the free KV blocks "
        "(vLLM's flag of the same name); --no-...: only its first chunk must fit",
    )
    scheduling.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the next batch is decided while a step runs, so a request arriving at a busy "
        "replica waits one more step (vLLM's flag of the same name)",
    )
    scheduling.add_argument(
        "--cache-blocks-at-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="blocks are prefix-cache hits from when the step that fills them is scheduled, "
        "as in vLLM; --no-...: from when that step ends",
    )
    scheduling.add_argument(
        "--step-jitter",
        type=float,
        default=0.0,
        metavar="F",
        help="multiply each step's time by a seeded uniform draw from 1 +/- F, 0 <= F < 1 "
        "(default: %(default)s, exact step times)",
    )
    faults = parser.add_argument_group("faults", "failures to inject, to test a router")
    faults.add_argument(
        "--error-rate",
        type=float,
        default=0.0,
        help="fraction of requests answered with a 500 at once (default: %(default)s)",
    )
    faults.add_argument(
        "--stall-after-tokens",
        type=int,
        default=None,
        metavar="N",
        help="every stream stops after N tokens for --stall-seconds (default: never)",
    )
    faults.add_argument(
        "--stall-seconds",
        type=float,
        default=0.0,
        help="how long a stream stalls; inf = forever (default: %(default)s)",
    )
    faults.add_argument(
        "--dead-metrics", action="store_true", help="/metrics answers 503 (the rest works)"
    )
    faults.add_argument(
        "--crash-after",
        type=int,
        default=None,
        metavar="N",
        help="each replica serves N requests; the next crashes it: in-flight requests are cut "
        "and it stops listening (default: never)",
    )
    return parser


def settings_of(args: argparse.Namespace) -> Settings:
    """The replicas' settings from the parsed flags (ValueError names a bad one)."""
    changes = {
        field: getattr(args, flag[2:].replace("-", "_")) * factor
        for flag, field, factor, _kind, _text in _OVERRIDES
        if getattr(args, flag[2:].replace("-", "_")) is not None
    }
    if "max_num_seqs" in changes and args.max_running is not None:
        raise ValueError("--max-running and --max-num-seqs: give one")
    if "num_blocks" in changes and args.kv_capacity is not None:
        raise ValueError("--kv-capacity and --num-blocks: give one")
    profile = PROFILES[args.profile]
    return Settings(
        profile=profile.replace(**changes) if changes else profile,
        time_scale=args.time_scale,
        max_running=args.max_running,
        kv_capacity=args.kv_capacity,
        faults=Faults(
            error_rate=args.error_rate,
            stall_after_tokens=args.stall_after_tokens,
            stall_seconds=args.stall_seconds,
            dead_metrics=args.dead_metrics,
            crash_after=args.crash_after,
        ),
        seed=args.seed,
        scheduling=Scheduling(
            full_prompt_admission=args.scheduler_reserve_full_isl,
            async_scheduling=args.async_scheduling,
            cache_at_schedule=args.cache_blocks_at_schedule,
            step_jitter=args.step_jitter,
        ),
    )


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
        prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_events=args.kv_events,
    ):
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        settings = settings_of(args)
        args.kv_events = None
        if args.kv_events_config is not None:
            args.kv_events = KVEventsConfig.parse(
                args.kv_events_config, args.prefix_caching_hash_algo
            )
        pods = [pod for pod in load_pods(args.pods) if pod.matches(args.selector)]
    except (PodFileError, ValueError) as error:
        parser.error(str(error))
    if not pods:
        parser.error(f"no pod in {args.pods} matches the selector {args.selector}")
    try:
        asyncio.run(run(pods, settings, args))
    except BindError as error:
        sys.exit(f"simulator: {error}")


if __name__ == "__main__":
    main()
