"""Simulated vLLM-like model servers for the demo, the tests and the benchmarks (no GPU needed).

``serve_pods`` serves every port of every pod as an independent replica;
``Settings`` picks each replica's model/hardware profile (``profiles``), time
scale and faults. The engine model (``engine``) runs on either clock
(``clocks``): real time behind HTTP, or virtual time in-process.
"""

from __future__ import annotations

from simulator.engine import Engine, Faults, Request, Scheduling, Settings
from simulator.profiles import PROFILES, Profile
from simulator.server import DEFAULT_MODEL, Replica, serve_pods
from simulator.tokenizer import count_tokens, output_token

__all__ = [
    "DEFAULT_MODEL",
    "PROFILES",
    "Engine",
    "Faults",
    "Profile",
    "Replica",
    "Request",
    "Scheduling",
    "Settings",
    "count_tokens",
    "output_token",
    "serve_pods",
]
