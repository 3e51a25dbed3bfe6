"""Simulated vLLM-like model servers for the demo and the end-to-end tests (no GPU needed).

``serve_pods`` serves every port of every pod as an independent replica;
``Settings`` holds the latency and capacity model described in ``engine``.
"""

from __future__ import annotations

from simulator.legacy import Engine, Settings
from simulator.server import DEFAULT_MODEL, Replica, serve_pods
from simulator.tokenizer import count_tokens, output_token

__all__ = [
    "DEFAULT_MODEL",
    "Engine",
    "Replica",
    "Settings",
    "count_tokens",
    "output_token",
    "serve_pods",
]
