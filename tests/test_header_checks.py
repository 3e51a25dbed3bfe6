"""Header changes are checked before Envoy sees them: a client's bad value is a 4xx, never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from bbr.plugins import DEFAULT_PLUGINS, PLUGINS, PluginSpec
from bbr.server import BodyBasedRouter
from lwepp.__main__ import build_parser
from lwepp.explain import DECISION_HEADER, EXPLAIN_HEADER, header_json
from lwepp.metrics import PickerMetrics
from lwepp.picking import Pool, RoundRobin
from lwepp.pipeline import Pipeline
from lwepp.server import EndpointPickerService
from plugin_api import ConfigError, Params
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    response_headers,
    running,
    set_headers,
)
from tests.fakes import StaticPods, pod
from tests.plugin_fakes import RecordingHook
from wire.exchange import (
    HEADER_VALUE_LIMIT,
    HEADERS_COUNT_LIMIT,
    HEADERS_SIZE_LIMIT,
    Refusal,
    check_headers_fit,
    header_value_problem,
)
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse

ROOT = Path(__file__).resolve().parent.parent
FDS = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r-1"}
ENDPOINT = "10.0.0.1:3000"


def size_of(headers: dict[str, str]) -> int:
    """Envoy's ``byteSize``: every name and value, in bytes."""
    return sum(len(k) + len(v.encode()) for k, v in headers.items())


def padded(total: int, **headers: str) -> dict[str, str]:
    """``POST`` plus ``headers`` plus ``x-pad``, sized so the whole is ``total`` bytes."""
    base = {**POST, **headers, "x-pad": ""}
    base["x-pad"] = "p" * (total - size_of(base))
    return base


# --- the checks themselves ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("llama\r\nx: y", "control character '\\r' at offset 5"),
        ("llama\n", "control character '\\n' at offset 5"),
        ("a\x00b", "control character '\\x00' at offset 1"),
        ("a\x1fb", "control character '\\x1f' at offset 1"),
        ("del\x7f", "control character '\\x7f' at offset 3"),
        ("lone \ud800", "lone surrogate"),
        ("m" * (HEADER_VALUE_LIMIT + 1), f"{HEADER_VALUE_LIMIT + 1} bytes long"),
        ("é" * (HEADER_VALUE_LIMIT // 2 + 1), f"{HEADER_VALUE_LIMIT + 2} bytes long"),
    ],
    ids=["crlf", "lf", "nul", "unit-separator", "del", "surrogate", "too-long", "too-long-utf8"],
)
def test_values_envoy_refuses_are_found(value: str, problem: str) -> None:
    """Control characters but tab, DEL, text that is no UTF-8 and values over the cap."""
    found = header_value_problem(value)
    assert found is not None
    assert problem in found


@pytest.mark.parametrize(
    "value",
    ["llama-3-8b", "tab\there", "spaces are fine ", "modèle-é", "", "m" * HEADER_VALUE_LIMIT],
    ids=["plain", "tab", "space", "utf8", "empty", "at-the-cap"],
)
def test_values_envoy_accepts_pass(value: str) -> None:
    """Tab, space, visible ASCII and UTF-8 (Envoy's obs-text), up to the cap."""
    assert header_value_problem(value) is None


def test_headers_may_grow_to_the_limit_and_not_a_byte_more() -> None:
    """Size as Envoy counts it: exactly the limit passes, one byte more is 431 naming the header."""
    added = [("x-gateway-model-name", "m")]
    fits = padded(HEADERS_SIZE_LIMIT - size_of(dict(added)))
    check_headers_fit("request", fits.items(), added)
    over = padded(HEADERS_SIZE_LIMIT - size_of(dict(added)) + 1)
    with pytest.raises(Refusal) as refused:
        check_headers_fit("request", over.items(), added)
    assert refused.value.status == 431
    assert "x-gateway-model-name" in refused.value.message


def test_values_are_counted_in_utf8_bytes_not_characters() -> None:
    """A value of two-byte characters counts twice its length: headers under the limit in
    characters but over it in bytes are refused."""
    added = [("x-gateway-model-name", "é" * 100)]
    fits = padded(HEADERS_SIZE_LIMIT - size_of(dict(added)))
    check_headers_fit("request", fits.items(), added)
    over = padded(HEADERS_SIZE_LIMIT - size_of(dict(added)) + 1)
    assert sum(len(k) + len(v) for k, v in [*over.items(), *added]) < HEADERS_SIZE_LIMIT
    with pytest.raises(Refusal):
        check_headers_fit("request", over.items(), added)


def test_an_overwritten_header_is_counted_once() -> None:
    """Setting a header the client sent replaces it: its old value no longer counts."""
    old = padded(HEADERS_SIZE_LIMIT, **{"x-gateway-model-name": "m" * 100})
    check_headers_fit("request", old.items(), [("X-Gateway-Model-Name", "m" * 100)])
    check_headers_fit("request", old.items(), [("content-length", "9")], remove=["x-pad"])
    with pytest.raises(Refusal):
        check_headers_fit("request", old.items(), [("X-Gateway-Model-Name", "m" * 101)])


def test_setting_a_repeated_header_replaces_only_its_first_value() -> None:
    """As Envoy's ``setCopy``: a second value under the same name stays and still counts."""
    twice = [*padded(HEADERS_SIZE_LIMIT - 20).items(), ("x-m", "a" * 8), ("x-m", "b" * 8)]
    check_headers_fit("request", twice[:-1], [("x-m", "c" * 8)])
    with pytest.raises(Refusal):
        check_headers_fit("request", twice, [("x-m", "c" * 8)])


def test_header_count_limit_and_response_phase() -> None:
    """At most 100 headers after the change; a response over the limits is a 502."""
    many = [(f"x-h{i}", "v") for i in range(HEADERS_COUNT_LIMIT - 1)]
    check_headers_fit("request", many, [("a", "1")])
    with pytest.raises(Refusal) as refused:
        check_headers_fit("response", many, [("a", "1"), ("b", "2")])
    assert refused.value.status == 502


# --- BBR --------------------------------------------------------------------------------


def bbr_talk(*messages: ProcessingRequest, specs: Sequence[PluginSpec] = ()) -> list[Any]:
    router = BodyBasedRouter(CollectorRegistry(), specs or DEFAULT_PLUGINS)

    async def go() -> list[ProcessingResponse]:
        async with (
            running("bbr", router) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            return await client.exchange(messages)

    return asyncio.run(go())


def immediate(replies: Sequence[ProcessingResponse]) -> tuple[int, str]:
    assert replies[-1].WhichOneof("response") == "immediate_response"
    answer = replies[-1].immediate_response
    return answer.status.code, answer.body.decode()


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        ("llama-3-8b\r\nx: y", "contains the control character"),
        ("m" * (HEADER_VALUE_LIMIT + 1), "over the 4096-byte limit"),
        ({"a": "b\nc"}, "contains the control character"),
    ],
    ids=["crlf", "too-long", "object-rendered-with-lf"],
)
def test_bbr_answers_a_model_no_header_can_carry_with_400_naming_the_field(
    model: Any, problem: str
) -> None:
    """The model header is checked before it goes: 400 naming the body field and the header."""
    body = json.dumps({"model": model, "prompt": "hi"}).encode()
    status, text = immediate(bbr_talk(request_headers(POST, body_modes=FDS), request_body(body)))
    assert status == 400
    assert "'model'" in text
    assert "X-Gateway-Model-Name" in text
    assert problem in text


def test_bbr_answers_headers_that_would_outgrow_envoys_limit_with_431() -> None:
    """A client already near Envoy's 60 KiB gets 431 once the model header would not fit."""
    body = json.dumps({"model": "m" * 2000}).encode()
    headers = padded(HEADERS_SIZE_LIMIT - 1000)
    replies = bbr_talk(request_headers(headers, body_modes=FDS), request_body(body))
    status, text = immediate(replies)
    assert status == 431
    assert "X-Gateway-Model-Name" in text


def test_bbr_model_at_the_cap_is_routed() -> None:
    """A model exactly at the cap is set as the header, as before."""
    model = "m" * HEADER_VALUE_LIMIT
    body = json.dumps({"model": model}).encode()
    replies = bbr_talk(request_headers(POST, body_modes=FDS), request_body(body))
    assert dict(set_headers(replies[0]))["X-Gateway-Model-Name"] == model


def test_bbr_refuses_a_header_name_envoy_would_refuse_at_start() -> None:
    """``headerName`` must be an HTTP token: a configuration error naming the field."""
    spec = PluginSpec("body-field-to-header", "x", {"fieldName": "model", "headerName": "X Model"})
    with pytest.raises(ConfigError, match=r"headerName.*'X Model' is not a valid header name"):
        BodyBasedRouter(CollectorRegistry(), [spec])


class SetsBadName:
    name = "bad-name"
    needs_body = False

    def __init__(self, name: str, params: Params) -> None:
        self.name = name

    def process_request(self, message: Any) -> None:
        message.set_header("x bad", "v")


def test_bbr_plugin_setting_an_invalid_name_is_a_500_naming_it() -> None:
    """A plugin's bug, not the client's: 500, the plugin named, nothing sent to Envoy."""
    router = BodyBasedRouter(
        CollectorRegistry(),
        [PluginSpec("bad", "mine")],
        plugin_types={**PLUGINS, "bad": SetsBadName},
    )

    async def go() -> list[ProcessingResponse]:
        async with running("bbr", router) as ports, ExtProcClient(f"127.0.0.1:{ports.grpc}") as c:
            return await c.exchange([request_headers(POST, body_modes=FDS), request_body(b"{}")])

    status, text = immediate(asyncio.run(go()))
    assert status == 500
    assert "'mine'" in text


# --- LWEPP --------------------------------------------------------------------------------


def lwepp_streams(
    exchanges: Sequence[Sequence[ProcessingRequest]],
    *,
    strategy: Any = None,
    test_selection: bool = True,
) -> list[list[ProcessingResponse]]:
    """One picker over two pods; each exchange on its own stream, in turn."""
    pods = StaticPods(pod("p0", "10.0.0.1", 3000), pod("p1", "10.0.0.2", 3000))
    service = EndpointPickerService(
        Pool(pods, {}),
        strategy or RoundRobin(),
        PickerMetrics(CollectorRegistry()),
        test_selection=test_selection,
        report_served=True,
    )

    async def go() -> list[list[ProcessingResponse]]:
        async with (
            running("lwepp", service) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as c,
        ):
            return [await c.exchange(messages) for messages in exchanges]

    return asyncio.run(go())


def lwepp_talk(*messages: ProcessingRequest, strategy: Any = None) -> list[ProcessingResponse]:
    return lwepp_streams([messages], strategy=strategy)[0]


def test_lwepp_answers_431_when_its_routing_headers_would_not_fit() -> None:
    """Client headers that leave no room for the destination headers: 431, not Envoy's 500."""
    routing = size_of(
        {
            "x-gateway-destination-endpoint": ENDPOINT,
            "X-Echo-Set-Header": f"x-conformance-test-served-endpoint:{ENDPOINT}",
        }
    )
    fits = lwepp_talk(request_headers(padded(HEADERS_SIZE_LIMIT - routing), end_of_stream=True))
    assert fits[0].WhichOneof("response") == "request_headers"
    over = padded(HEADERS_SIZE_LIMIT - routing + 2)
    status, text = immediate(lwepp_talk(request_headers(over, end_of_stream=True)))
    assert status == 431
    assert "x-gateway-destination-endpoint" in text


def test_lwepp_reports_served_metadata_no_header_can_carry_as_a_failure() -> None:
    """A served endpoint with CR/LF in it is never echoed into a response header."""
    served = {"envoy.lb": {"x-gateway-destination-endpoint-served": "1.2.3.4:80\r\nx: y"}}
    replies = lwepp_talk(
        request_headers(POST, end_of_stream=True),
        response_headers({":status": "200"}, metadata=served),
    )
    report = dict(set_headers(replies[1]))["x-conformance-test-served-endpoint"]
    assert report.startswith("fail: ")
    assert header_value_problem(report) is None


@pytest.mark.parametrize(("honoured", "allowed"), [(True, {"10.0.0.2:3000"}), (False, None)])
def test_test_selection_header_can_be_turned_off(honoured: bool, allowed: set[str] | None) -> None:
    """Honoured, the header pins the replica; off, requests go round-robin over the pool."""
    headers = {**POST, "test-epp-endpoint-selection": "10.0.0.2"}
    streams = [[request_headers(headers, end_of_stream=True)]] * 4
    replies = lwepp_streams(streams, test_selection=honoured)
    picked = {dict(set_headers(r[0]))["x-gateway-destination-endpoint"] for r in replies}
    assert picked == (allowed or {"10.0.0.1:3000", "10.0.0.2:3000"})


@pytest.mark.parametrize(
    ("flags", "honoured"),
    [
        ([], False),
        (["--enable-test-selection-header"], True),
        (["--disable-test-selection-header"], False),
    ],
    ids=["default", "enabled", "old-flag"],
)
def test_the_test_header_is_honoured_only_when_enabled(flags: list[str], honoured: bool) -> None:
    """Off by default; ``--enable-test-selection-header`` turns it on; the old flag still parses."""
    args = build_parser().parse_args(["--pods", "p.yaml", *flags])
    assert args.test_selection is honoured


def test_an_explanation_too_long_for_a_header_keeps_the_best_rows() -> None:
    """The decision header stays under the cap, best rows first, and says it was cut."""
    rows = [
        {"endpoint": f"10.0.{i // 250}.{i % 250}:8000", "total": 1 - i / 1000} for i in range(500)
    ]
    data = {"request": "r", "candidates": [r["endpoint"] for r in rows], "scores": rows}
    data["picked"] = [rows[0]["endpoint"]]
    text = header_json(data)
    assert len(text) <= HEADER_VALUE_LIMIT
    cut = json.loads(text)
    assert cut["picked"] == [rows[0]["endpoint"]]
    assert cut["scores"] == rows[: len(cut["scores"])]
    assert len(cut["scores"]) > 10
    assert "/debug/decisions" in cut["truncated"]
    long_id = header_json({**data, "request": "x" * 10_000})
    assert len(long_id) <= HEADER_VALUE_LIMIT
    assert json.loads(long_id)["picked"] == [rows[0]["endpoint"]]


def test_a_response_hook_adding_a_bad_value_is_skipped_and_counted() -> None:
    """The hook's header is dropped (Envoy would fail the response); the failure is counted."""
    registry = CollectorRegistry()
    hook = RecordingHook("bad", [], add_headers={"x-note": "a\r\nb"})
    pipeline = Pipeline([hook], registry=registry, explain="header")
    replies = lwepp_talk(
        request_headers({**POST, EXPLAIN_HEADER: "1"}, end_of_stream=True),
        response_headers({":status": "200"}),
        strategy=pipeline,
    )
    added = dict(set_headers(replies[1]))
    assert "x-note" not in added
    assert DECISION_HEADER in added
    count = registry.get_sample_value(
        "llm_d_epp_plugin_errors_total", {"plugin": "bad", "stage": "response_headers"}
    )
    assert count == 1


def test_the_manifests_pickers_ignore_the_test_header() -> None:
    """In production (the Kubernetes manifests) no client may choose its replica."""
    documents = yaml.safe_load_all((ROOT / "manifests" / "base" / "lwepp.yaml").read_text())
    pickers = [d for d in documents if d and d["kind"] == "Deployment"]
    assert pickers
    for picker in pickers:
        (container,) = picker["spec"]["template"]["spec"]["containers"]
        args = build_parser().parse_args(container["args"])
        assert args.test_selection is False, picker["metadata"]["name"]
