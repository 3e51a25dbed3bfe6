"""What the model rewrite costs per request: without it, with it and nothing to do, with 100 rules.

``python -m bench.rewrites`` measures one request's whole ext_proc work in
the picker (``EndpointPickerService``, round-robin), its messages parsed
from bytes and every reply serialised, without the network:

- **round-robin, no control**: the request headers and a 4 KB body, full
  duplex; a picker that hears nothing of the response is sent none of it.
- **round-robin, the response through it**: the same, and the response
  (headers and a JSON answer, full duplex) passed through the picker, as the
  gateway sends it to a picker that reads the response body: the part of
  the next rows that is the response's passage, not the control's work.
- **rewrite control, no rewrite configured**: the same, plus the control's
  work: the body parsed to find its ``model`` (the router's 400 when there is
  none).
- **100 rules, none for this model**: the same lookup in a table of 100
  exact rules (one dict lookup: the winner of each model is decided when the
  table is built).
- **100 rules, this model rewritten**: the body re-serialised with the
  target, its length set, and the answer's ``model`` mapped back.

Each figure is a ratio to the first row of the same run, in microseconds
(best of five, on a shared machine) and, with ``--instructions``, in CPU
instructions counted by valgrind's callgrind (the same from run to run; see
``bench.instructions``).
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import sys
import timeit
from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CollectorRegistry

from bench.instructions import WireStream, per_call
from bench.streams import HEADERS
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin
from lwepp.rewrite_control import ModelRewriteControl, RewriteMetrics
from lwepp.rewrite_sources import FixedRewrites
from lwepp.rewrites import ModelRewrite, Rule, Target
from lwepp.server import EndpointPickerService
from pods.model import Pod, StaticSource
from serving.logs import configure_logging
from serving.testing import request_body, request_headers, response_body, response_headers
from wire.extproc import BodyMode

RULES: Final = 100
CALLS: Final = 500
PODS: Final = tuple(Pod(f"pod-{i}", f"10.0.0.{i + 1}", (8000,), {"pool": "a"}) for i in range(8))
DUPLEX: Final = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)


def body(model: str) -> bytes:
    return b'{"model": "' + model.encode() + b'", "prompt": "' + b"x" * 4000 + b'"}'


def answer(model: str) -> bytes:
    """A completion's JSON answer, as a server of ``model`` writes it."""
    return (
        b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"'
        + model.encode()
        + b'","choices":[{"index":0,"finish_reason":"length","text":"the quick brown fox"}],'
        b'"usage":{"prompt_tokens":1000,"completion_tokens":4,"total_tokens":1004}}'
    )


def wire(model: str, served: str, response: bool) -> tuple[bytes, ...]:
    """One request as Envoy sends it, in bytes: the request, and with ``response`` the answer."""
    messages = [
        request_headers([*HEADERS, ("x-gateway-model-name", model)], body_modes=DUPLEX),
        request_body(body(model)),
    ]
    if response:
        messages += [
            response_headers([(":status", "200"), ("content-type", "application/json")]),
            response_body(answer(served)),
        ]
    return tuple(m.SerializeToString() for m in messages)


def rules(count: int) -> list[ModelRewrite]:
    """``count`` exact rules, ``model-i`` → ``model-i-canary`` (one rewrite each)."""
    return [
        ModelRewrite(f"r{i}", "ns", "a", (Rule((f"model-{i}",), (Target(f"model-{i}-canary"),)),))
        for i in range(count)
    ]


def picker(count: int | None) -> EndpointPickerService:
    """Round-robin, with the rewrite control over ``count`` rules (None: no control)."""
    controls = []
    if count is not None:
        source = FixedRewrites(rules(count))
        controls.append(ModelRewriteControl(source, RewriteMetrics(CollectorRegistry())))
    pool = Pool(StaticSource(*PODS), {"pool": "a"})
    return EndpointPickerService(
        pool, RoundRobin(), PickerMetrics(CollectorRegistry()), controls=controls
    )


VARIANTS: Final[tuple[tuple[str, int | None, str, str, bool], ...]] = (
    ("round-robin, no control (the baseline)", None, "m", "m", False),
    ("round-robin, the response through it", None, "m", "m", True),
    ("rewrite control, no rewrite configured", 0, "m", "m", True),
    (f"{RULES} rules, none for this model", RULES, "m", "m", True),
    (f"{RULES} rules, this model rewritten", RULES, "model-42", "model-42-canary", True),
)
"""(what, the rules (None: no control), the model asked for, the model served, whether the
response passes through the picker)."""


def call(index: int) -> Callable[[], Any]:
    """One request through variant ``index``'s picker, ready to time."""
    _, count, model, served, response = VARIANTS[index]
    service = picker(count)
    messages = wire(model, served, response)
    loop = asyncio.new_event_loop()
    return lambda: loop.run_until_complete(service(WireStream(messages)))


def microseconds(budget: float = 0.3, rounds: int = 3) -> list[tuple[str, float]]:
    """µs per request of each variant, interleaved ``rounds`` times, the best kept."""
    calls = [call(i) for i in range(len(VARIANTS))]
    best: list[float] = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, fn in enumerate(calls):
            timer = timeit.Timer(fn)
            number = max(1, int(budget / (timer.timeit(50) / 50)))
            best[i] = min(best[i], min(timer.repeat(5, number)) / number * 1e6)
    return [(v[0], us) for v, us in zip(VARIANTS, best, strict=True)]


def run_one(index: int) -> None:
    """In the process valgrind watches: warm up, then the counted calls inside ``reduce``."""
    configure_logging("warning")
    fn = call(index)
    for _ in range(100):
        fn()
    functools.reduce(lambda _acc, _i: fn(), range(CALLS), None)


def instructions(index: int) -> float:
    """Instructions per request of one variant, from a callgrind run of this module."""
    return per_call(("bench.rewrites", "--one", str(index)), CALLS)


def table(rows: list[tuple[str, float]], unit: str) -> str:
    base = rows[0][1]
    lines = [f"| per request | {unit} | vs the baseline |", "|---|---:|---:|"]
    lines += [f"| {name} | {n:,.2f} | {n / base:.2f}× |" for name, n in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        run_one(int(argv[1]))
        return
    print(table(microseconds(), "µs"), flush=True)
    if "--instructions" in argv:
        if shutil.which("valgrind") is None:
            raise SystemExit("bench.rewrites: valgrind not found (apt-get install valgrind)")
        counts = [(v[0], instructions(i)) for i, v in enumerate(VARIANTS)]
        print()
        print(table(counts, "instructions"))


if __name__ == "__main__":
    main(sys.argv[1:])
