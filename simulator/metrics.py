"""``/metrics`` in each engine's own names: one engine state, five ways to spell it.

An endpoint picker reads the same few signals from every model server (queue
length, running batch, KV-cache usage, LoRA state, cache geometry) but each
engine exports them under its own names, which is why GIE's model-server
protocol lists a column per engine and pickers carry a naming table per
engine. ``python -m simulator --engine sglang`` makes every replica speak one
of these dialects, so a picker or ``lwepp.check_model_server`` can be tried
against each without a GPU:

- ``vllm``: queued ``vllm:num_requests_waiting``, running
  ``vllm:num_requests_running``, KV ``vllm:kv_cache_usage_perc``, block size
  and count in the labels of ``vllm:cache_config_info`` (``block_size``,
  ``num_gpu_blocks``), LoRA in ``vllm:lora_requests_info``, and the counters
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (in
  prompt tokens, so hits over queries is the token hit rate) and
  ``vllm:num_preemptions_total``;
- ``sglang``: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``,
  ``sglang:token_usage``, ``sglang:cache_config_info`` (``page_size``,
  ``num_pages``) in SGLang's default geometry, one-token pages (``--page-size``
  1): the same capacity in tokens as the engine's blocks, counted as SGLang
  counts it;
- ``trtllm`` (trtllm-serve): ``trtllm_num_requests_waiting``,
  ``trtllm_num_requests_running``, ``trtllm_kv_cache_utilization``,
  ``trtllm_kv_cache_tokens_per_block``, ``trtllm_kv_cache_max_blocks``;
- ``triton`` (Triton's TensorRT-LLM backend): one family per kind, the
  quantity named by a label: ``nv_trt_llm_request_metrics{request_type=...}``
  (``waiting``, ``scheduled``, ...) and
  ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=...}``
  (``fraction``, ``tokens_per``, ``max``, ...);
- ``llamacpp`` (llama.cpp's server): ``llamacpp:requests_deferred`` and
  ``llamacpp:requests_processing``, nothing about the KV cache.

Only vLLM reports LoRA adapters (``vllm:lora_requests_info``, whose value is a
timestamp and whose labels carry the state). llama.cpp's server exports no
KV-cache gauge at all: a picker has to treat its KV usage as unknown.

The text is written by hand rather than with prometheus_client: a handful of
families, and the reader sees exactly what a picker scrapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from simulator.engine import Engine

ENGINES: Final = ("vllm", "sglang", "trtllm", "triton", "llamacpp")
"""The dialects, named as ``--engine`` takes them."""

BLOCK_SIZE: Final = 16
"""Tokens per KV-cache block unless a state says otherwise (vLLM's default block size)."""


@dataclass(frozen=True, slots=True)
class State:
    """What one replica reports, whatever the naming."""

    model: str
    running: int
    waiting: int
    max_running: int
    kv_usage: float
    kv_capacity: int
    """KV-cache size in tokens (``num_blocks * block_size`` when both are known)."""
    prompt_tokens: int
    generation_tokens: int
    lora: Mapping[str, str] | None
    """vLLM's LoRA labels (``max_lora``, ``running_lora_adapters``, ...), None without adapters."""
    now: float
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (vLLM's ``prefix_cache_hits``)."""
    preemptions: int = 0
    block_size: int = BLOCK_SIZE
    num_blocks: int | None = None
    """KV-cache blocks; None means ``kv_capacity`` cut into ``block_size``-token blocks."""

    @property
    def blocks(self) -> int:
        """KV-cache blocks: ``num_blocks``, or the token capacity cut into blocks."""
        if self.num_blocks is not None:
            return self.num_blocks
        return math.ceil(self.kv_capacity / self.block_size)


def state_of(engine: Engine, model: str, now: float, adapters: Sequence[str] = ()) -> State:
    """What ``engine`` reports on ``/metrics``, every field filled from the engine itself.

    The one construction of a replica's state: the HTTP server renders it on
    each scrape, and the routing benchmark renders it for pickers that read
    ``/metrics`` in virtual time, so both see the same page. ``model`` is the
    base model (the ``model_name`` label); ``now`` the timestamp vLLM puts in
    ``vllm:lora_requests_info``; ``adapters`` the LoRA adapters served (none:
    no LoRA family). ``max_lora`` is the profile's ``max_loras``, at most the
    number of adapters served, since that many can be resident at once.
    """
    profile = engine.profile
    lora = None
    if adapters:
        lora = {
            "max_lora": str(min(profile.max_loras, len(adapters))),
            "running_lora_adapters": ",".join(sorted(engine.running_adapters)),
            "waiting_lora_adapters": ",".join(sorted(engine.waiting_adapters)),
        }
    return State(
        model=model,
        running=engine.running,
        waiting=engine.waiting,
        max_running=profile.max_num_seqs,
        kv_usage=engine.kv_usage,
        kv_capacity=profile.kv_tokens,
        prompt_tokens=engine.prompt_tokens_total,
        generation_tokens=engine.generation_tokens_total,
        lora=lora,
        now=now,
        prefix_queries=engine.prefix_queries_total,
        prefix_hits=engine.prefix_hits_total,
        preemptions=engine.preemptions_total,
        block_size=profile.block_size,
        num_blocks=engine.num_blocks,
    )


Labels = Mapping[str, str]
Sample = tuple[Labels, float]


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: its name, help text, type and samples."""

    name: str
    help: str
    kind: str  # "gauge" or "counter"
    samples: Sequence[Sample]

    def lines(self) -> list[str]:
        """Prometheus text format 0.0.4; a counter keeps ``_total`` in HELP and TYPE, as
        prometheus_client (and so vLLM and SGLang) writes it."""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            pairs = ",".join(f'{key}="{_escape(text)}"' for key, text in labels.items())
            out.append(
                f"{self.name}{{{pairs}}} {float(value)!r}"
                if pairs
                else f"{self.name} {float(value)!r}"
            )
        return out


def _escape(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _gauge(name: str, help_: str, value: float, labels: Labels) -> Family:
    return Family(name, help_, "gauge", [(labels, value)])


def _counter(name: str, help_: str, value: float, labels: Labels) -> Family:
    return Family(name, help_, "counter", [(labels, value)])


def _vllm(s: State) -> list[Family]:
    model = {"model_name": s.model}
    families = [
        _gauge("vllm:num_requests_running", "Requests in the running batch.", s.running, model),
        _gauge(
            "vllm:num_requests_waiting", "Requests queued for a running slot.", s.waiting, model
        ),
        _gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV cache in use (1 = full).",
            s.kv_usage,
            model,
        ),
        _counter(
            "vllm:prompt_tokens_total", "Prompt (prefill) tokens processed.", s.prompt_tokens, model
        ),
        _counter(
            "vllm:generation_tokens_total", "Output tokens generated.", s.generation_tokens, model
        ),
        _counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
            model,
        ),
        _counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
            model,
        ),
        _counter(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
            model,
        ),
        # vLLM's info gauge: the value is 1, the labels carry the configuration.
        _gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            1,
            {"block_size": str(s.block_size), "num_gpu_blocks": str(s.blocks)},
        ),
    ]
    if s.lora is not None:
        # The LoRA gauge: the value is a timestamp, the labels carry the state.
        families.append(
            _gauge(
                "vllm:lora_requests_info",
                "LoRA adapters running and waiting; the value is a timestamp.",
                s.now,
                s.lora,
            )
        )
    return families


def _sglang(s: State) -> list[Family]:
    model = {"model_name": s.model}
    return [
        _gauge("sglang:num_running_reqs", "The number of running requests.", s.running, model),
        _gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            s.waiting,
            model,
        ),
        _gauge("sglang:token_usage", "The token usage (0-1).", s.kv_usage, model),
        _counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
            model,
        ),
        _counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
            model,
        ),
        _gauge(
            "sglang:cache_config_info",
            "Information of the cache configuration.",
            1,
            {"page_size": "1", "num_pages": str(s.blocks * s.block_size)},
        ),
    ]


def _trtllm(s: State) -> list[Family]:
    model = {"model_name": s.model}
    return [
        _gauge("trtllm_num_requests_running", "Requests in the running batch.", s.running, model),
        _gauge(
            "trtllm_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting, model
        ),
        _gauge(
            "trtllm_kv_cache_utilization", "Fraction of KV-cache blocks in use.", s.kv_usage, model
        ),
        _gauge(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV-cache block.", s.block_size, model
        ),
        _gauge("trtllm_kv_cache_max_blocks", "KV-cache blocks available.", s.blocks, model),
    ]


def _triton(s: State) -> list[Family]:
    """Triton's TensorRT-LLM backend: two families, the quantity named by a label."""

    def of(label: str, values: Mapping[str, float]) -> list[Sample]:
        return [({"model": s.model, label: kind, "version": "1"}, v) for kind, v in values.items()]

    requests = {
        "active": s.running + s.waiting,
        "max": s.max_running,
        "scheduled": s.running,
        "waiting": s.waiting,
    }
    used = round(s.kv_usage * s.blocks)
    blocks = {
        "max": s.blocks,
        "free": s.blocks - used,
        "used": used,
        "tokens_per": s.block_size,
        "fraction": s.kv_usage,
    }
    return [
        Family(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            "gauge",
            of("request_type", requests),
        ),
        Family(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            "gauge",
            of("kv_cache_block_type", blocks),
        ),
    ]


def _llamacpp(s: State) -> list[Family]:
    """llama.cpp's server (``--metrics``): no labels, and no KV-cache gauge."""
    return [
        _counter(
            "llamacpp:prompt_tokens_total",
            "Number of prompt tokens processed.",
            s.prompt_tokens,
            {},
        ),
        _counter(
            "llamacpp:tokens_predicted_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
            {},
        ),
        _gauge("llamacpp:requests_processing", "Number of requests processing.", s.running, {}),
        _gauge("llamacpp:requests_deferred", "Number of requests deferred.", s.waiting, {}),
    ]


_DIALECTS: Final[Mapping[str, Callable[[State], list[Family]]]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "trtllm": _trtllm,
    "triton": _triton,
    "llamacpp": _llamacpp,
}


def render(engine: str, state: State) -> str:
    """``state`` as ``engine``'s ``/metrics`` page (one of ``ENGINES``)."""
    return "\n".join(line for family in _DIALECTS[engine](state) for line in family.lines()) + "\n"
