"""``python -m tests.fake_metrics MODE_FILE``: four model servers' ``/metrics``, one of them faulty.

Prints ``{"ports": [...]}`` once listening, then serves vLLM's page (``tests/data/metrics/
vllm.txt``) on every port, except that the first answers as ``MODE_FILE`` says, read on
each request: ``ok``; ``hang`` (never answers; the scraper must give up); ``garbage`` (16 KB
of binary nonsense). A process of its own, so serving it takes nothing from the test's client.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web

PAGE = (Path(__file__).parent / "data/metrics/vllm.txt").read_bytes()
GARBAGE = bytes(range(256)) * 64


async def main(mode_file: Path) -> None:
    ports: list[int] = []

    async def page(request: web.Request) -> web.StreamResponse:
        faulty = request.url.port == ports[0]
        mode = mode_file.read_text().strip() if faulty else "ok"  # noqa: ASYNC240 (a few bytes)
        if mode == "hang":
            await asyncio.Event().wait()  # until the scraper hangs up
        body = GARBAGE if mode == "garbage" else PAGE
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    for _ in range(4):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        ports.append(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
