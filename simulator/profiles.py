"""Named model/hardware profiles: the coefficients of the engine's step-time and capacity model.

One engine step runs one batch: some prefill tokens (new prompts, or chunks
of them) and one token for each decoding sequence. Its duration is modelled
as a sum of four terms::

    step_time = step_overhead
              + prefill_per_token        * prefill tokens in the batch
              + decode_per_seq           * decoding sequences in the batch
              + decode_per_context_token * KV tokens those sequences attend to

The overhead is the floor of every step: for a model of this size on one GPU
it is dominated by reading all the weights once from HBM (decoding is
memory-bound), plus scheduling, sampling and kernel launches. Prefill is
compute-bound: each prompt token costs about 2 FLOPs per parameter.
Decoding sequences add their own compute, and attention reads every KV
token of every decoding sequence. Prefill attention's quadratic term is left
out (for an 8B model, about 4 x 32 layers x 4096 x context FLOPs per token
against 16 GFLOPs of weights: 12% at 4,000 tokens of context), which makes
time to first token exactly linear in the uncached prompt tokens.

Facts used by the 8B profiles (from public documents; the 70B profile's
``source`` adds its own):

- Llama-3.1-8B (its ``config.json`` on Hugging Face): 32 layers, 8 KV heads,
  head dim 128, 8.03 B parameters. In bf16 the weights are 16.06 GB
  (14.96 GiB), and one token's KV is 2 (K and V) x 32 x 8 x 128 x 2 bytes =
  131,072 bytes = **128 KiB**; a 16-token block is 2 MiB.
- vLLM: ``block_size`` 16 and ``gpu_memory_utilization`` 0.9 are its
  defaults (its engine-arguments documentation); the KV cache gets what is
  left of 0.9 x GPU memory after the weights and the peak activation memory
  of a profiling run. The OpenAI server's batch defaults
  (``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py``) are
  ``max_num_seqs`` 1024 and ``max_num_batched_tokens`` 8192 on GPUs with at
  least 70 GiB other than A100 (so H100), and 256 and 2048 otherwise (L4).
- Decode at batch 1 is memory-bound and reaches roughly 75-80% of peak HBM
  bandwidth in practice: a public vLLM sweep of this model on one A100 40 GB
  (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100") measured
  about 75 tokens/s at concurrency 1, 77% of the bandwidth ceiling. The
  step overheads below assume the same efficiency.
- A public table of vLLM KV capacities (H100 NVL 94 GB, Llama-3.1-8B:
  542,960 tokens) agrees with the memory arithmetic used for ``num_blocks``
  (0.9 x 94 GB minus weights and overheads, at 128 KiB per token).
- NVIDIA's data sheets: H100 SXM 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS dense
  bf16; L4 24 GB GDDR6 at 300 GB/s, 121 TFLOPS dense bf16 (242 with sparsity).

The numbers, in short (each profile's ``source`` below says, number by
number, how it is derived and which parts are estimates)::

                              8b-h100    8b-l4     70b-h100-tp4
    step_overhead             6.0 ms     67 ms     16 ms     weights / bandwidth at ~80%
    prefill_per_token         30 us      270 us    71 us     2 FLOPs/param at ~50-55% of peak
    decode_per_seq            16 us      133 us    36 us     2 FLOPs/param at peak
    decode_per_context_token  40 ns      440 ns    25 ns     KV bytes per token / bandwidth
    num_blocks                27,000     2,000     29,000    0.9 x memory - weights - overhead
    max_num_seqs              1024       256       1024      vLLM's defaults
    max_num_batched_tokens    8192       2048      8192      vLLM's defaults
    max_loras, lora_load_time 4, 50 ms   4, 100 ms 4, 100 ms estimates

Derived: everything computed from the facts above (bandwidth, FLOPs, memory,
vLLM's defaults). Estimates: the efficiencies (~80% of peak bandwidth, taken
from one public measurement; ~50-55% of peak FLOPs for prefill), the non-KV
memory overhead, the 70B all-reduce time, and the LoRA numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """One model on one hardware setup under vLLM: step-time coefficients and capacity."""

    name: str
    summary: str
    source: str
    """Where every number comes from: derived (and from what) or estimated."""
    step_overhead: float
    """Seconds per engine step whatever it holds (weights read once, scheduling, sampling)."""
    prefill_per_token: float
    """Seconds per prefill token in a step."""
    decode_per_seq: float
    """Seconds per decoding sequence in a step."""
    decode_per_context_token: float
    """Seconds per KV-cache token attended by the decoding sequences of a step."""
    num_blocks: int
    """KV-cache blocks per engine (vLLM's ``num_gpu_blocks``)."""
    max_num_seqs: int
    """Running sequences at most (vLLM's ``max_num_seqs``)."""
    max_num_batched_tokens: int
    """Tokens per step at most, prefill and decode together (chunked prefill's budget)."""
    block_size: int = 16
    """Tokens per KV-cache block (vLLM's default)."""
    max_loras: int = 4
    """LoRA adapters resident at once, and distinct adapters in one batch (vLLM's ``max_loras``)."""
    lora_load_time: float = 0.05
    """Seconds added to a step that must first load an adapter that is not resident."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"{field.name}: must not be negative")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    def step_time(self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int) -> float:
        """Seconds one step takes with this batch (the module docstring's sum)."""
        return (
            self.step_overhead
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_seq * decode_seqs
            + self.decode_per_context_token * decode_context_tokens
        )

    def replace(self, **changes: Any) -> Profile:
        """A copy with some fields changed (``profile.replace(num_blocks=64)``)."""
        return dataclasses.replace(self, **changes)


_H100_SOURCE: Final = """\
Llama-3.1-8B-Instruct, bf16, vLLM V1 OpenAI server, one H100 SXM 80 GB.
step_overhead 6.0 ms: derived, 16.06 GB of weights / 3.35 TB/s = 4.8 ms per step at peak
  bandwidth; at the ~77-80% efficiency measured for this model under vLLM on an A100 that is
  6.0-6.2 ms (about 165 tokens/s for one stream).
prefill_per_token 30 us: derived, 2 x 8.03e9 FLOPs per token at 989 TFLOPS is 16.2 us at
  full use; 30 us assumes about 55% of peak (an estimate, typical prefill MFU), i.e. about
  33k prefill tokens/s.
decode_per_seq 16 us: derived, the same 16.06 GFLOPs per token at 989 TFLOPS with no
  efficiency loss (decode is memory-bound, so each extra sequence adds mostly its compute).
decode_per_context_token 40 ns: derived, 128 KiB of KV read per attended token at 3.35 TB/s
  is 39 ns.
num_blocks 27,000: derived, 0.9 x 79.6 GiB (the card's 81,559 MiB) = 71.7 GiB, minus
  14.96 GiB of weights, minus about 3.5 GiB of activations, CUDA graphs and other non-KV
  memory (an estimate) leaves ~53 GiB = ~27,000 blocks of 2 MiB (432k tokens).
max_num_seqs 1024, max_num_batched_tokens 8192: vLLM V1's OpenAI-server defaults on a
  GPU with at least 70 GiB.
max_loras 4: an estimate (vLLM's default is 1; serving several adapters needs more).
lora_load_time 50 ms: an estimate for a rank-16 adapter (tens of MB) loaded from host memory.
"""

_L4_SOURCE: Final = """\
Llama-3.1-8B-Instruct, bf16, vLLM V1 OpenAI server, one L4 24 GB.
step_overhead 67 ms: derived, 16.06 GB of weights / 300 GB/s = 53.5 ms per step at peak
  bandwidth; at the same ~80% efficiency as measured on the A100 that is 67 ms (about 15
  tokens/s for one stream; the efficiency on an L4 is an estimate).
prefill_per_token 270 us: derived, 2 x 8.03e9 FLOPs per token at 121 TFLOPS is 133 us at
  full use; 270 us assumes about 50% of peak (an estimate), i.e. about 3.7k tokens/s.
decode_per_seq 133 us: derived, 16.06 GFLOPs per token at 121 TFLOPS, no efficiency loss.
decode_per_context_token 440 ns: derived, 128 KiB per attended token at 300 GB/s is 437 ns.
num_blocks 2,000: derived, 0.9 x 22.5 GiB (the card's 23,034 MiB) = 20.2 GiB, minus
  14.96 GiB of weights, minus about 1.3 GiB of activations, CUDA graphs and other non-KV
  memory (an estimate) leaves ~3.9 GiB = ~2,000 blocks of 2 MiB (32k tokens). A small cache:
  long prompts evict each other and preemption is common.
max_num_seqs 256, max_num_batched_tokens 2048: vLLM V1's OpenAI-server defaults on a GPU
  with less than 70 GiB.
max_loras 4, lora_load_time 100 ms: estimates (PCIe Gen4 host-to-device and a slower card).
"""

_70B_TP4_SOURCE: Final = """\
Llama-3.1-70B-Instruct, bf16, vLLM V1 OpenAI server, four H100 SXM 80 GB, tensor parallel 4.
Model facts (its config.json): 80 layers, 8 KV heads, head dim 128, 70.6 B parameters: 141.1 GB
  of weights (35.3 GB per GPU) and 2 x 80 x 8 x 128 x 2 bytes = 320 KiB of KV per token
  (a quarter of it on each GPU).
step_overhead 16 ms: derived, 35.3 GB per GPU / 3.35 TB/s = 10.5 ms at peak bandwidth, 13.2 ms
  at the ~80% efficiency used for the 8B profiles; plus about 3 ms for tensor parallelism's
  two all-reduces per layer (160 per step; the per-all-reduce latency is an estimate).
prefill_per_token 71 us: derived, 2 x 70.6e9 FLOPs per token on 4 x 989 TFLOPS at an estimated
  50% of peak.
decode_per_seq 36 us: derived, the same FLOPs at full peak on four GPUs.
decode_per_context_token 25 ns: derived, 320 KiB per attended token read from 4 x 3.35 TB/s.
num_blocks 29,000: derived, 4 x 0.9 x 79.6 GiB = 286.6 GiB, minus 131.4 GiB of weights, minus
  about 3 GiB per GPU of activations, CUDA graphs and other non-KV memory (an estimate) leaves
  ~143 GiB = ~29,000 blocks of 5 MiB (~470k tokens).
max_num_seqs 1024, max_num_batched_tokens 8192: vLLM V1's OpenAI-server defaults on H100.
max_loras 4, lora_load_time 100 ms: estimates (adapters for a 70B model are larger).
"""

PROFILES: Final[Mapping[str, Profile]] = MappingProxyType(
    {
        "llama-3.1-8b-h100": Profile(
            name="llama-3.1-8b-h100",
            summary="Llama-3.1-8B, bf16, vLLM on one H100 SXM 80 GB",
            source=_H100_SOURCE,
            step_overhead=6.0e-3,
            prefill_per_token=30e-6,
            decode_per_seq=16e-6,
            decode_per_context_token=40e-9,
            num_blocks=27_000,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            max_loras=4,
            lora_load_time=0.05,
        ),
        "llama-3.1-8b-l4": Profile(
            name="llama-3.1-8b-l4",
            summary="Llama-3.1-8B, bf16, vLLM on one L4 24 GB",
            source=_L4_SOURCE,
            step_overhead=67e-3,
            prefill_per_token=270e-6,
            decode_per_seq=133e-6,
            decode_per_context_token=440e-9,
            num_blocks=2_000,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_loras=4,
            lora_load_time=0.1,
        ),
        "llama-3.1-70b-h100-tp4": Profile(
            name="llama-3.1-70b-h100-tp4",
            summary="Llama-3.1-70B, bf16, vLLM on four H100 SXM 80 GB (tensor parallel 4)",
            source=_70B_TP4_SOURCE,
            step_overhead=16e-3,
            prefill_per_token=71e-6,
            decode_per_seq=36e-6,
            decode_per_context_token=25e-9,
            num_blocks=29_000,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            max_loras=4,
            lora_load_time=0.1,
        ),
    }
)
"""The named profiles, by name (``--profile``)."""

DEFAULT_PROFILE: Final = "llama-3.1-8b-h100"
"""The profile a replica uses unless told otherwise."""
