"""What a pick and a whole stream cost in CPU instructions, counted by valgrind: the same every run.

``python -m bench.instructions`` runs each picker of ``bench.hooks`` (the
core's round-robin, the pipeline with 0, 1 and 5 do-nothing plugins, and
explained) and BBR under ``valgrind --tool=callgrind``, and prints the
instructions per pick and per stream, with each one's ratio to round-robin.

Timings on a shared 2-core machine move by tens of percent from run to run;
instruction counts do not (the same binary, the same inputs, the same count,
whatever else runs), so small differences can be read off them. They are
not time: a cache miss costs more than an add. Read them beside
``python -m bench.hooks``'s microseconds.

How: the measured calls run inside ``functools.reduce``, and callgrind
collects only while that C function runs (``--toggle-collect``), so the
interpreter's start, the imports and the warm-up are not counted. A stream is
request headers (15 headers, full-duplex body) and a 4 KB body, parsed from
bytes and every reply serialised, as gRPC would: the service's own work
without the network. Needs valgrind (Debian's package); about half a minute
per row.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry

from bbr.server import BodyBasedRouter
from bench import hooks
from bench.streams import HEADERS
from serving.logs import configure_logging
from serving.testing import request_body, request_headers
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse
from wire.stream import Handler, Stream

PICKS: Final = 1000
STREAMS: Final = 500
STREAM_KINDS: Final = ("round-robin", "0", "1", "5", "bbr")

WIRE: Final = (
    request_headers(
        HEADERS, body_modes=(BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
    ).SerializeToString(),
    request_body(b'{"model": "m", "prompt": "' + b"x" * 4000 + b'"}').SerializeToString(),
)
"""One stream as Envoy sends it, in bytes."""


class WireStream(Stream):
    """A stream that hands over ``messages`` (by default ``WIRE``) parsed from bytes, and
    serialises every reply."""

    __slots__ = ("pending",)

    def __init__(self, messages: Sequence[bytes] = WIRE) -> None:  # no gRPC call behind it
        self.pending = list(messages)

    async def recv(self) -> ProcessingRequest | None:
        return ProcessingRequest.FromString(self.pending.pop(0)) if self.pending else None

    async def send(self, reply: ProcessingResponse) -> None:
        reply.SerializeToString()


def _handler(kind: str) -> Handler:
    if kind == "bbr":
        return BodyBasedRouter(CollectorRegistry())
    return hooks.service(None if kind == "round-robin" else int(kind))


def _measured(what: str, which: str) -> tuple[Callable[[], Any], int]:
    """The call to count, ``n`` times over."""
    if what == "pick":
        return hooks.variants()[int(which)].route(), PICKS
    loop = asyncio.new_event_loop()
    handler = _handler(which)
    return (lambda: loop.run_until_complete(handler(WireStream()))), STREAMS


def run_one(what: str, which: str) -> None:
    """In the process valgrind watches: warm up, then the counted calls in ``reduce``."""
    configure_logging("warning")  # as served: per-request logs are at debug
    call, n = _measured(what, which)
    for _ in range(100):
        call()
    functools.reduce(lambda _acc, _i: call(), range(n), None)


def count(what: str, which: str) -> float:
    """Instructions per call of one row, from a callgrind run of this module."""
    module = ("bench.instructions", "--one", what, which)
    return per_call(module, PICKS if what == "pick" else STREAMS)


def per_call(module: Sequence[str], calls: int) -> float:
    """Instructions per call of ``python -m <module...>``, which makes ``calls`` calls inside
    ``functools.reduce`` (what callgrind collects), from a callgrind run."""
    return collected([sys.executable, "-m", *module]) / calls


def collected(command: Sequence[str]) -> int:
    """Instructions ``command`` runs inside ``functools.reduce``, counted by callgrind."""
    result = subprocess.run(
        [
            *("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"),
            "--toggle-collect=functools_reduce",
            *command,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in result.stderr.splitlines() if "Collected :" in line]
    return int(lines[-1].split(":")[-1].strip())


def table(rows: list[tuple[str, float]], unit: str) -> str:
    base = rows[0][1]
    lines = [f"| {unit} | instructions | vs round-robin |", "|---|---:|---:|"]
    lines += [f"| {name} | {n:,.0f} | {n / base:.2f}× |" for name, n in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        run_one(argv[1], argv[2])
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.instructions: valgrind not found (apt-get install valgrind)")
    picks = [(v.what, count("pick", str(i))) for i, v in enumerate(hooks.variants())]
    print(table(picks, "per pick"), flush=True)
    names = ["round-robin (the core)", "pipeline, 0 plugins", "pipeline, 1 plugin"]
    names += ["pipeline, 5 plugins", "BBR, default chain"]
    streams = [(n, count("stream", k)) for n, k in zip(names, STREAM_KINDS, strict=True)]
    print()
    print(table(streams, "per stream"))


if __name__ == "__main__":
    main(sys.argv[1:])
