"""Answers that take long, through the real Envoy, while a service's ext_proc stream stays open.

A service that hears the response (a picker whose plugins learn from it, the
served-endpoint report, BBR with response plugins, the one hop) holds its
stream open, with nothing to send, while the model server works on a
non-streamed answer. Envoy pings the connection all the while
(``demo.envoy.KEEPALIVE``). gRPC's default server policy counts those pings
as abuse once it has sent nothing for a while, and closes the connection
(GOAWAY "too_many_pings"): every request on it failed with 503
``ext_proc_error``. The services' ping policy (``serving.server.PING_POLICY``)
and Envoy's keepalive are set together so that they do not.

The quick tests shorten Envoy's keepalive to half a second, so that the old
behaviour showed within two seconds; the slow one keeps the demo's settings
and waits a minute for its answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Final

import aiohttp
import pytest

from demo.envoy import KEEPALIVE
from demo.topology import Topology
from serving.server import MIN_PING_INTERVAL_MS
from tests.conftest import POOLS, write_pod_file
from tests.reliability import record

pytestmark = pytest.mark.e2e

RECOMMENDED = Path(__file__).parent.parent / "demo" / "configs" / "recommended.yaml"
MODEL = POOLS["a"]
STAMP = "tests.plugin_fakes.BBRStampsResponse:stamp:{}"
EXTRACTOR = (
    'body-field-to-header:model-extractor:{"fieldName":"model","headerName":"X-Gateway-Model-Name"}'
)


def gateway(
    work_dir: Path,
    shape: str,
    *,
    stall: float,
    keepalive: timedelta,
    demo_flags: bool = False,
    config: Path | None = RECOMMENDED,
) -> Topology:
    """A gateway whose replicas answer ``stall`` seconds after the first token.

    ``shape``: ``bbr`` (BBR hears the response through a response plugin; the
    pickers are plain round-robin, which hears nothing), ``lwepp`` (the
    pickers run ``config``, and every shipped one learns from responses),
    ``onehop`` (the one hop with ``config``), or ``both`` (BBR and the pickers
    both hear it).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    bbr_args = ["--plugin", EXTRACTOR, "--plugin", STAMP] if shape in ("bbr", "both") else []
    config = None if shape == "bbr" else config
    return Topology(
        work_dir,
        write_pod_file(work_dir / "pods.yaml"),
        simulator_args=["--stall-after-tokens", "1", "--stall-seconds", str(stall)],
        picker_config=config,
        bbr_args=bbr_args,
        one_hop=shape == "onehop",
        demo_flags=demo_flags,
        keepalive=keepalive,
    )


async def ask(url: str, *, stream: bool, seconds: float) -> tuple[int, dict[str, str], bytes]:
    """One completion, streamed or not; its status, headers (lower case) and body."""
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 3, "stream": stream}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=seconds)) as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        headers = {name.lower(): value for name, value in response.headers.items()}
        return response.status, headers, await response.read()


async def ask_both(urls: Sequence[str], seconds: float) -> list[tuple[int, dict[str, str], bytes]]:
    """A non-streamed and a streamed completion through each gateway, all at once."""
    calls = [ask(url, stream=stream, seconds=seconds) for url in urls for stream in (False, True)]
    return await asyncio.gather(*calls)


def check(answers: Sequence[tuple[int, dict[str, str], bytes]], *, stamped: bool) -> None:
    for status, headers, body in answers:
        assert status == 200, body[:300]
        assert headers.get("x-sim-pod"), "served by a replica"
        if stamped:
            assert headers.get("x-bbr-response") == "stamp", "BBR's response chain ran"
    non_streamed = json.loads(answers[0][2])
    assert non_streamed["choices"][0]["text"], "the whole answer came back"


QUICK_KEEPALIVE: Final = timedelta(milliseconds=MIN_PING_INTERVAL_MS * 5 // 4)
"""Envoy's PING interval in the quick tests: just over the least the services accept."""


def test_the_demo_keepalive_is_one_the_services_accept() -> None:
    """Envoy only adds jitter to its PING interval (``KeepaliveSettings.interval_jitter``), so
    the demo's keepalive, and the quick tests', never comes closer than the services' minimum
    between pings."""
    least = timedelta(milliseconds=MIN_PING_INTERVAL_MS)
    assert 2 * least <= KEEPALIVE
    assert least < QUICK_KEEPALIVE


@pytest.mark.parametrize("shape", ["bbr", "onehop"])
def test_a_quiet_stream_outlives_many_keepalive_pings(tmp_path: Path, shape: str) -> None:
    """With Envoy pinging every 1.25 s, an answer that takes 7 s keeps the stream of the service
    that hears the response quiet for five pings; it comes back whole, streamed and not.
    (gRPC's default policy took the fourth ping for abuse, about 5 s in, and closed the
    connection: 503 ``ext_proc_error``.) As a deployment runs them: no demo flags."""
    with gateway(tmp_path, shape, stall=7.0, keepalive=QUICK_KEEPALIVE) as topology:
        started = time.monotonic()
        answers = asyncio.run(ask_both([topology.url], seconds=60))
        took = time.monotonic() - started
    check(answers, stamped=shape == "bbr")
    assert took >= 7.0, "the replicas really were slow"


def test_every_shipped_picker_config_outlives_many_keepalive_pings(tmp_path: Path) -> None:
    """The same with each of ``demo/configs/`` in the pickers (two hops), the demo's flags on
    (the served-endpoint report too): one gateway per config, all asked at once."""
    configs = sorted(RECOMMENDED.parent.glob("*.yaml"))
    assert len(configs) >= 5, configs
    with contextlib.ExitStack() as stack:
        gateways = [
            stack.enter_context(
                gateway(
                    tmp_path / config.stem,
                    "lwepp",
                    stall=7.0,
                    keepalive=QUICK_KEEPALIVE,
                    demo_flags=True,
                    config=config,
                )
            )
            for config in configs
        ]
        answers = asyncio.run(ask_both([each.url for each in gateways], seconds=60))
    pairs = [answers[i : i + 2] for i in range(0, len(answers), 2)]
    for config, pair in zip(configs, pairs, strict=True):
        try:
            check(pair, stamped=False)
        except AssertionError as error:
            error.add_note(f"picker config {config.name}")
            raise


def test_a_minute_long_answer_with_the_demo_settings(tmp_path: Path) -> None:
    """The demo's own settings (Envoy pings every 5 s; the demo's flags, served-endpoint report
    on) and a 60 s answer, through two hops where BBR and the recommended picker both hear the
    response, and through the one hop: every answer is a 200."""
    with contextlib.ExitStack() as stack:
        two = stack.enter_context(
            gateway(tmp_path / "two", "both", stall=60.0, keepalive=KEEPALIVE, demo_flags=True)
        )
        one = stack.enter_context(
            gateway(tmp_path / "one", "onehop", stall=60.0, keepalive=KEEPALIVE, demo_flags=True)
        )
        started = time.monotonic()
        answers = asyncio.run(ask_both([two.url, one.url], seconds=120))
        took = time.monotonic() - started
    check(answers[:2], stamped=True)
    check(answers[2:], stamped=False)
    assert took >= 60.0, "the replicas really were slow"
    record(
        "Faults",
        "an answer taking 60 s (non-streamed and streamed) while BBR and the picker hear the "
        "response (recommended config, served-endpoint report, BBR response plugin; the one hop "
        "too), Envoy pinging every 5 s",
        f"**200** ×4 after {took:.0f} s, the whole answer. Before the services accepted a "
        "gateway's pings on a quiet stream (`serving.server.PING_POLICY`), the non-streamed one "
        "got **503** `ext_proc_error_gRPC_error_14{Too_many_pings{via_upstream}}` after 27 s "
        "(measured then), and every request sharing its connection failed the same way",
    )
