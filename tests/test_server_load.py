"""The ext_proc server under a burst: every stream a proxy opens is served, none reset."""

from __future__ import annotations

import asyncio

from serving.testing import ExtProcClient, request_headers, running
from wire import extproc
from wire.stream import Stream

BURST = 2500
"""Streams opened at once: past gRPC's default of 1,000 held before the loop takes them."""


async def _answer_headers(stream: Stream) -> None:
    while await stream.recv() is not None:
        await stream.send(extproc.headers_response("request"))


async def _burst() -> list[object]:
    async with (
        running("burst", _answer_headers) as ports,
        ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
    ):
        message = request_headers([(":path", "/")], end_of_stream=True)
        calls = (client.exchange([message]) for _ in range(BURST))
        return list(await asyncio.gather(*calls, return_exceptions=True))


def test_a_burst_past_a_thousand_streams_is_answered_whole() -> None:
    """Each of 2,500 streams opened together gets its answer: the server holds the streams its
    event loop has not taken yet instead of resetting them (Envoy would answer those 503)."""
    results = asyncio.run(_burst())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {BURST} failed, e.g. {failures[0]!r}"
    assert all(isinstance(r, list) and len(r) == 1 for r in results)
