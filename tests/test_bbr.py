"""BBR's ext_proc stream, driven by a real gRPC client exactly as Envoy drives it."""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from bbr.message import Message
from bbr.plugins import DEFAULT_PLUGINS, PLUGINS, PluginSpec
from bbr.server import HEALTH_SERVICES, BodyBasedRouter
from plugin_api import Factory, Params
from serving.server import Health
from serving.testing import (
    ExtProcClient,
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    running,
    set_headers,
)
from tests.processes import service
from wire.exchange import Refusal
from wire.extproc import CHUNK_LIMIT, BodyMode, ProcessingRequest, ProcessingResponse
from wire.stream import Stream

POST = {
    ":method": "POST",
    ":path": "/v1/chat/completions",
    "content-type": "application/json",
    "x-request-id": "req-1",
}
BODY = b'{"model": "llama-3", "messages": [{"role": "user", "content": "hi"}]}'
FDS = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
FDS_BOTH = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
BUFFERED = (BodyMode.BUFFERED, BodyMode.BUFFERED)
MODEL = "X-Gateway-Model-Name"


# --- hand-written plugins ----------------------------------------------------------


class Recorder:
    """Reads the shared body and notes its turn."""

    needs_body = True

    def __init__(self, label: str, turns: list[str]) -> None:
        self.label, self.turns = label, turns

    def process_request(self, message: Message) -> None:
        self.turns.append(f"{self.label}:{message.body.get('model')}")


class Renamer:
    """Changes the body: a copy with a new ``model``, returned as bytes."""

    needs_body = False

    def __init__(self, model: str) -> None:
        self.model = model

    def process_request(self, message: Message) -> bytes:
        body = message.body_copy()
        body["model"] = self.model
        return orjson.dumps(body)


class WritesSharedBody:
    """A buggy plugin: changes the shared parse in place."""

    needs_body = True

    def __init__(self, how: Callable[[Any], None]) -> None:
        self.how = how

    def process_request(self, message: Message) -> None:
        self.how(message.body)


class Refuses:
    """Stops the request with its own status."""

    needs_body = False

    def process_request(self, message: Message) -> None:
        raise Refusal(429, "too many tokens today")


class Crashes:
    """A bug that is not a Refusal."""

    needs_body = False

    def process_request(self, message: Message) -> None:
        raise RuntimeError("boom")


class UsageHeader:
    """A response plugin: reports the completion's token usage in a header."""

    needs_body = True

    def process_response(self, message: Message) -> None:
        usage = message.body.get("usage")
        if usage is not None:
            message.set_header("x-usage-total-tokens", str(usage["total_tokens"]))


class Redacts:
    """A response plugin that changes the body."""

    needs_body = True

    def process_response(self, message: Message) -> bytes:
        body = message.body_copy()
        body["choices"] = []
        return orjson.dumps(body)


def returning(plugin: object) -> Factory:
    """A factory that hands out an already-made plugin, named as configured."""

    def factory(name: str, _params: Params) -> object:
        plugin.name = name  # type: ignore[attr-defined]
        return plugin

    return factory


def bbr(
    *plugins: object,
    default: bool = True,
    registry: CollectorRegistry | None = None,
    streaming: bool = False,
    max_body_bytes: int = 10 * 1024 * 1024,
) -> BodyBasedRouter:
    """A router running the default chain (unless ``default=False``), then ``plugins``, in order."""
    made = {f"test-{i}": plugin for i, plugin in enumerate(plugins)}
    types = {**PLUGINS, **{name: returning(plugin) for name, plugin in made.items()}}
    specs = [*(DEFAULT_PLUGINS if default else ()), *(PluginSpec(t, t) for t in made)]
    return BodyBasedRouter(
        registry or CollectorRegistry(),
        specs,
        streaming=streaming,
        max_body_bytes=max_body_bytes,
        plugin_types=types,
    )


def talk(router: BodyBasedRouter, *messages: ProcessingRequest) -> list[ProcessingResponse]:
    """Serve ``router``, send ``messages`` on one stream, half-close, return every answer."""

    async def go() -> list[ProcessingResponse]:
        async with (
            running("bbr", router) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            return await client.exchange(messages)

    return asyncio.run(go())


def post(
    body: bytes = BODY, modes: Any = FDS, headers: Mapping[str, str] | None = None
) -> list[ProcessingRequest]:
    """A POST as Envoy sends it: headers, then the body in one chunk."""
    return [request_headers({**POST, **(headers or {})}, body_modes=modes), request_body(body)]


def response_trailers() -> ProcessingRequest:
    return ProcessingRequest(response_trailers=pb.HttpTrailers())


def kinds(replies: Sequence[ProcessingResponse]) -> list[str | None]:
    return [reply.WhichOneof("response") for reply in replies]


def common(reply: ProcessingResponse) -> Any:
    return getattr(reply, str(reply.WhichOneof("response"))).response


def streamed(replies: Sequence[ProcessingResponse]) -> tuple[bytes, list[bool], list[int]]:
    """The body sent back in ``streamed_response`` chunks: bytes, end flags, chunk sizes."""
    chunks = [common(reply).body_mutation.streamed_response for reply in replies]
    return (
        b"".join(c.body for c in chunks),
        [c.end_of_stream for c in chunks],
        [len(c.body) for c in chunks],
    )


def unchanged(reply: ProcessingResponse) -> bool:
    """An answer that changes nothing: Envoy continues as it would without us."""
    return bool(common(reply).ByteSize() == 0)


def immediate(replies: Sequence[ProcessingResponse]) -> tuple[int, str]:
    """The refusal's status and message, after checking it is an OpenAI-style JSON error."""
    assert kinds(replies)[-1] == "immediate_response"
    answer = replies[-1].immediate_response
    headers = [(h.header.key, h.header.raw_value) for h in answer.headers.set_headers]
    assert ("content-type", b"application/json") in headers
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "code"}
    return answer.status.code, error["message"]


# --- the request path ----------------------------------------------------------------


def test_headers_only_request_passes_through() -> None:
    """A request without a body (a GET) gets one empty headers answer: nothing to route on."""
    replies = talk(bbr(), request_headers({":method": "GET"}, end_of_stream=True))
    assert kinds(replies) == ["request_headers"]
    assert unchanged(replies[0])


@pytest.mark.parametrize(
    ("body", "pieces"),
    [
        (BODY, 1),
        (BODY, 3),
        (orjson.dumps({"model": "llama-3", "prompt": "x" * 150_000}), 1),
        (orjson.dumps({"model": "llama-3", "prompt": "x" * 150_000}), 7),
    ],
    ids=["small", "small-in-3-chunks", "150kB", "150kB-in-7-chunks"],
)
def test_full_duplex_answers_headers_with_model_then_streams_body_back(
    body: bytes, pieces: int
) -> None:
    """FULL_DUPLEX_STREAMED: headers held, then at body end a headers answer with the model
    header, Content-Length and clear_route_cache, then the body in chunks of at most 62,000
    bytes, end_of_stream on the last only."""
    size = -(-len(body) // pieces)
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    messages = [request_headers(POST, body_modes=FDS)]
    messages += [request_body(c, end_of_stream=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    replies = talk(bbr(), *messages)
    assert kinds(replies)[0] == "request_headers"
    assert set(kinds(replies)[1:]) == {"request_body"}
    assert common(replies[0]).clear_route_cache
    assert set_headers(replies[0]) == [(MODEL, "llama-3"), ("Content-Length", str(len(body)))]
    echoed, ends, sizes = streamed(replies[1:])
    assert echoed == body
    assert ends == [False] * (len(ends) - 1) + [True]
    assert max(sizes) <= CHUNK_LIMIT
    assert len(sizes) == -(-len(body) // CHUNK_LIMIT)


def test_buffered_answers_headers_at_once_then_one_body_answer() -> None:
    """BUFFERED: an empty headers answer at once; the body answer carries the header and
    clear_route_cache, but no body and no Content-Length, since the body is unchanged."""
    replies = talk(bbr(), *post(modes=BUFFERED))
    assert kinds(replies) == ["request_headers", "request_body"]
    assert unchanged(replies[0])
    answer = common(replies[1])
    assert answer.clear_route_cache
    assert set_headers(replies[1]) == [(MODEL, "llama-3")]
    assert not answer.HasField("body_mutation")


@pytest.mark.parametrize("streaming", [True, False], ids=["--streaming", "no-flag"])
def test_without_protocol_config_the_flag_picks_the_mode(streaming: bool) -> None:
    """An Envoy that sends no protocol_config gets full duplex with ``--streaming``, else
    buffered: the headers answer is held (and carries the model) only when streaming."""
    replies = talk(bbr(streaming=streaming), *post(modes=None))
    assert kinds(replies) == ["request_headers", "request_body"]
    carrier = replies[0] if streaming else replies[1]
    assert (MODEL, "llama-3") in set_headers(carrier)
    assert unchanged(replies[0]) != streaming


def test_protocol_config_wins_over_the_flag() -> None:
    """Envoy's protocol_config says BUFFERED: the ``--streaming`` guess is not used."""
    replies = talk(bbr(streaming=True), *post(modes=BUFFERED))
    assert unchanged(replies[0])
    assert set_headers(replies[1]) == [(MODEL, "llama-3")]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"model=llama", "unexpected character"),
        (b"", "empty document"),
        (b'["model", "llama"]', "an array, not a json object"),
        (b'"llama"', "a scalar, not a json object"),
    ],
    ids=["not-json", "empty", "array", "string"],
)
@pytest.mark.parametrize("modes", [FDS, BUFFERED], ids=["full-duplex", "buffered"])
def test_body_that_is_not_a_json_object_is_400(body: bytes, reason: str, modes: Any) -> None:
    """A body that is not a JSON object is answered 400 with GIE's words for why."""
    status, text = immediate(talk(bbr(), *post(body, modes)))
    assert status == 400
    assert text.startswith("failed to parse request body: ")
    assert reason in text.lower()


FORM = (
    b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--x--\r\n'
)


@pytest.mark.parametrize(
    ("headers", "body", "status", "says"),
    [
        ({"content-encoding": "gzip"}, gzip.compress(BODY), 415, "content-encoding: gzip"),
        ({"content-encoding": "br"}, b"\x1b\x00\xf8\xa5", 415, "content-encoding: br"),
        ({"content-type": "multipart/form-data; boundary=x"}, FORM, 415, "multipart/form-data"),
        ({"content-encoding": "identity"}, b"model=llama", 400, "failed to parse"),
        ({"content-type": "text/plain"}, b"model=llama", 400, "failed to parse"),
        ({"content-encoding": "gzip"}, BODY, None, ""),  # it parses: the header is not ours
    ],
    ids=["gzip", "br", "multipart", "identity-not-json", "text-not-json", "gzip-but-json"],
)
def test_a_body_that_was_never_json_is_415_naming_why(
    headers: dict[str, str], body: bytes, status: int | None, says: str
) -> None:
    """A body that fails to parse because it was compressed or is a form upload says so
    (415), not "not valid UTF-8"; other bodies that are not JSON keep GIE's 400."""
    replies = talk(bbr(), *post(body, headers=headers))
    if status is None:
        assert set_headers(replies[0])[0] == (MODEL, "llama-3")
        return
    got, text = immediate(replies)
    assert got == status
    assert says in text


def test_body_without_model_passes_without_the_header() -> None:
    """No ``model``: no model header (the gateway's routes decide), the body still flows."""
    registry = CollectorRegistry()
    replies = talk(bbr(registry=registry), *post(b'{"prompt": "hi"}'))
    assert set_headers(replies[0]) == [("Content-Length", "16")]
    assert streamed(replies[1:])[0] == b'{"prompt": "hi"}'
    assert registry.get_sample_value("bbr_body_field_not_found_total", {"field": "model"}) == 1


@pytest.mark.parametrize(
    ("model", "header"),
    [(7, "7"), (1.5, "1.5"), (1e6, "1e+06"), (123456789, "1.23456789e+08"), (True, "true")],
    ids=["int", "float", "million", "large-int", "bool"],
)
def test_non_string_model_is_rendered_as_go_prints_it(model: object, header: str) -> None:
    """A number is a float64 to GIE, printed with %v: the header is what Go prints."""
    replies = talk(bbr(), *post(orjson.dumps({"model": model})))
    assert (MODEL, header) in set_headers(replies[0])


def test_model_rendering_empty_sets_no_header() -> None:
    """``"model": ""`` renders empty: no header, and bbr_body_field_empty_total counts it."""
    registry = CollectorRegistry()
    replies = talk(bbr(registry=registry), *post(b'{"model": ""}'))
    assert [name for name, _ in set_headers(replies[0])] == ["Content-Length"]
    assert registry.get_sample_value("bbr_body_field_empty_total", {"field": "model"}) == 1


@pytest.mark.parametrize(
    ("size", "status"),
    [(100, None), (101, 413)],
    ids=["exactly-the-limit", "one-byte-over"],
)
def test_body_over_the_limit_is_413(size: int, status: int | None) -> None:
    """A body of exactly ``--max-body-bytes`` is fine; one byte more is answered 413 at once,
    without waiting for the end of the body."""
    body = b'{"model": "m", "pad": "' + b"x" * (size - 25) + b'"}'
    assert len(body) == size
    first, rest = body[:60], body[60:]
    replies = talk(
        bbr(max_body_bytes=100),
        request_headers(POST, body_modes=FDS),
        request_body(first, end_of_stream=False),
        request_body(rest, end_of_stream=False),
        request_body(b"", end_of_stream=True),
    )
    if status is None:
        assert streamed(replies[1:])[0] == body
    else:
        code, text = immediate(replies)
        assert (code, len(replies)) == (413, 1)
        assert "100-byte limit" in text


def test_header_the_client_already_sent_is_not_set_again() -> None:
    """The client sent the same model header (Envoy lower-cases names): no change recorded."""
    replies = talk(bbr(), *post(headers={"x-gateway-model-name": "llama-3"}))
    assert set_headers(replies[0]) == [("Content-Length", str(len(BODY)))]


@pytest.mark.parametrize("modes", [FDS, BUFFERED], ids=["full-duplex", "buffered"])
def test_plugin_that_changes_the_body_sends_new_bytes_with_their_length(modes: Any) -> None:
    """A plugin's new body is what Envoy forwards, with its Content-Length; the model header
    comes from the original body, as the extractor ran first."""
    replies = talk(bbr(Renamer("mistral-7b")), *post(modes=modes))
    new = orjson.dumps({**orjson.loads(BODY), "model": "mistral-7b"})
    expected = [(MODEL, "llama-3"), ("Content-Length", str(len(new)))]
    if modes == FDS:
        assert set_headers(replies[0]) == expected
        assert streamed(replies[1:])[0] == new
    else:
        assert set_headers(replies[1]) == expected
        assert common(replies[1]).body_mutation.body == new


def test_later_plugins_read_the_changed_body() -> None:
    """Chain order is list order; a plugin after a body change reads the new body."""
    turns: list[str] = []
    talk(bbr(Recorder("a", turns), Renamer("m2"), Recorder("b", turns)), *post())
    assert turns == ["a:llama-3", "b:m2"]


def assign_field(body: Any) -> None:
    body["model"] = "evil"


def delete_field(body: Any) -> None:
    del body["model"]


def assign_in_list(body: Any) -> None:
    body["messages"][0] = {}


@pytest.mark.parametrize(
    "how",
    [
        assign_field,
        delete_field,
        assign_in_list,
        lambda body: body["messages"].append({"role": "system"}),
        lambda body: body["messages"][0].update(role="system"),
        lambda body: body.pop("model"),
    ],
    ids=["assign-field", "delete-field", "assign-in-list", "append", "update-nested", "pop"],
)
def test_changing_the_shared_body_is_refused_and_answered_500(
    how: Callable[[Any], None],
) -> None:
    """The shared parse is read-only: a change raises TypeError, answered 500; the stream
    ends normally (status OK), and the next stream is served."""
    router = bbr(WritesSharedBody(how))

    async def go() -> tuple[list[ProcessingResponse], Any, list[ProcessingResponse]]:
        async with (
            running("bbr", router) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            stream = client.open()
            for message in post():
                await stream.send(message)
            await stream.close()
            replies = []
            while (reply := await stream.recv()) is not None:
                replies.append(reply)
            after = await client.exchange(post())
            return replies, await stream.code(), after

    with capture_logs() as logs:
        replies, code, after = asyncio.run(go())
    status, text = immediate(replies)
    assert (status, code) == (500, grpc.StatusCode.OK)
    assert text.startswith("unexpected error: TypeError in request")
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    assert [type(entry["exc_info"]) for entry in errors] == [TypeError, TypeError]
    assert kinds(after) == ["immediate_response"]  # served again (and refused again)


def test_body_is_parsed_once_for_all_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three plugins read the body; orjson parses it once."""
    calls: list[bytes] = []
    loads = orjson.loads

    def counting(data: bytes) -> Any:
        calls.append(data)
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting)
    turns: list[str] = []
    talk(bbr(Recorder("a", turns), Recorder("b", turns)), *post())
    assert turns == ["a:llama-3", "b:llama-3"]
    assert calls == [BODY]


def test_chain_that_needs_no_parse_never_parses() -> None:
    """No plugin needs the parsed body: not even an invalid body is parsed (or refused)."""
    replies = talk(bbr(Refuses(), default=False), *post(b"not json"))
    assert immediate(replies)[0] == 429


def test_plugin_error_is_answered_with_its_status() -> None:
    """A plugin's Refusal becomes an ImmediateResponse with its status and message."""
    registry = CollectorRegistry()
    replies = talk(bbr(Refuses(), registry=registry), *post())
    assert immediate(replies) == (429, "too many tokens today")
    assert registry.get_sample_value("bbr_errors_total", {"reason": "ResourceExhausted"}) == 1


def test_unexpected_exception_is_logged_with_request_id_and_answered_500() -> None:
    """A plugin bug is logged (with the request id and the plugin) and answered 500."""
    registry = CollectorRegistry()
    with capture_logs() as logs:
        replies = talk(bbr(Crashes(), registry=registry), *post())
    status, text = immediate(replies)
    assert status == 500
    assert text == "unexpected error: RuntimeError in request plugin 'test-0' (type test-0)"
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    assert len(errors) == 1
    assert errors[0]["request_id"] == "req-1"
    assert isinstance(errors[0]["exc_info"], RuntimeError)
    assert registry.get_sample_value("bbr_errors_total", {"reason": "Internal"}) == 1


def test_trailers_end_a_full_duplex_body() -> None:
    """With trailers, the body's last chunk has no end_of_stream: the trailers end it, so the
    held headers answer and the body go first (the body without end_of_stream, which is
    Envoy's to announce), then the trailers answer."""
    replies = talk(
        bbr(),
        request_headers(POST, body_modes=FDS),
        request_body(BODY, end_of_stream=False),
        request_trailers(),
    )
    assert kinds(replies) == ["request_headers", "request_body", "request_trailers"]
    assert (MODEL, "llama-3") in set_headers(replies[0])
    assert streamed(replies[1:2])[:2] == (BODY, [False])


# --- the response path ---------------------------------------------------------------

COMPLETION = orjson.dumps(
    {"choices": [{"text": "hello"}], "usage": {"prompt_tokens": 3, "total_tokens": 12}}
)
SSE = b'data: {"choices": [{"text": "hel"}]}\n\ndata: {"choices": [{"text": "lo"}]}\n\n'


def full_exchange(response: bytes, modes: Any = FDS_BOTH) -> list[ProcessingRequest]:
    """A whole HTTP exchange: the POST, then the response: its body in two chunks when
    streamed, in one when buffered (as Envoy sends it)."""
    if modes == BUFFERED:
        chunks = [response_body(response)]
    else:
        chunks = [response_body(response[:20], end_of_stream=False), response_body(response[20:])]
    return [*post(modes=modes), response_headers({":status": "200"}), *chunks]


def test_response_plugin_runs_on_json_and_sets_a_header() -> None:
    """Full duplex: the response headers are held until the body ends, then answered with the
    plugin's header, and the body goes back unchanged (so no Content-Length)."""
    replies = talk(bbr(UsageHeader()), *full_exchange(COMPLETION))
    response = replies[kinds(replies).index("response_headers") :]
    assert kinds(response) == ["response_headers", "response_body"]
    assert set_headers(response[0]) == [("x-usage-total-tokens", "12")]
    assert common(response[0]).clear_route_cache
    assert streamed(response[1:]) == (COMPLETION, [True], [len(COMPLETION)])


@pytest.mark.parametrize("modes", [FDS_BOTH, BUFFERED], ids=["full-duplex", "buffered"])
def test_response_plugin_that_changes_the_body(modes: Any) -> None:
    """A response plugin's new body goes back with its Content-Length."""
    replies = talk(bbr(Redacts()), *full_exchange(COMPLETION, modes))
    new = orjson.dumps({**orjson.loads(COMPLETION), "choices": []})
    response = replies[kinds(replies).index("response_headers") :]
    if modes == FDS_BOTH:
        assert set_headers(response[0]) == [("Content-Length", str(len(new)))]
        assert streamed(response[1:])[0] == new
    else:
        assert kinds(response) == ["response_headers", "response_body"]
        assert unchanged(response[0])
        assert set_headers(response[1]) == [("Content-Length", str(len(new)))]
        assert common(response[1]).body_mutation.body == new


def test_event_stream_response_passes_unchanged() -> None:
    """A response that is not JSON (SSE) skips the response plugins and goes back as it came."""
    replies = talk(bbr(UsageHeader(), Redacts()), *full_exchange(SSE))
    response = replies[kinds(replies).index("response_headers") :]
    assert unchanged(response[0])
    assert streamed(response[1:])[:2] == (SSE, [True])


def test_response_without_plugins_flows_chunk_by_chunk() -> None:
    """No response plugin: the headers are answered at once and each chunk goes straight
    back, so a streamed completion is not held until its end."""
    replies = talk(bbr(), *full_exchange(SSE))
    response = replies[kinds(replies).index("response_headers") :]
    assert kinds(response) == ["response_headers", "response_body", "response_body"]
    assert streamed(response[1:]) == (SSE, [False, True], [20, len(SSE) - 20])


def test_buffered_response_without_plugins_is_unchanged() -> None:
    """BUFFERED, no response plugin: plain acknowledgements, nothing changed."""
    replies = talk(bbr(), *full_exchange(COMPLETION, BUFFERED), response_trailers())
    response = replies[kinds(replies).index("response_headers") :]
    assert kinds(response) == ["response_headers", "response_body", "response_trailers"]
    assert all(unchanged(reply) for reply in response[:2])


def test_response_trailers_end_a_held_response_body() -> None:
    """As on the request side: trailers end a held response body, then are answered."""
    replies = talk(
        bbr(UsageHeader()),
        *post(modes=FDS_BOTH),
        response_headers({":status": "200"}),
        response_body(COMPLETION, end_of_stream=False),
        response_trailers(),
    )
    response = replies[kinds(replies).index("response_headers") :]
    assert kinds(response) == ["response_headers", "response_body", "response_trailers"]
    assert set_headers(response[0]) == [("x-usage-total-tokens", "12")]
    assert streamed(response[1:2])[:2] == (COMPLETION, [False])


def test_response_larger_than_the_limit_streams_through() -> None:
    """A response too large to hold is let through, what came so far first, then the rest."""
    body = b"x" * 150
    replies = talk(
        bbr(Redacts(), max_body_bytes=100),
        *post(b'{"model": "m"}', modes=FDS_BOTH),
        response_headers({":status": "200"}),
        response_body(body[:60], end_of_stream=False),
        response_body(body[60:120], end_of_stream=False),
        response_body(body[120:], end_of_stream=True),
    )
    response = replies[kinds(replies).index("response_headers") :]
    assert unchanged(response[0])
    assert streamed(response[1:]) == (body, [False, True], [120, 30])


def test_plugin_in_both_chains() -> None:
    """One object with both hooks joins both chains."""

    class Both:
        needs_body = True

        def __init__(self) -> None:
            self.seen: list[str] = []

        def process_request(self, message: Message) -> None:
            self.seen.append("request")

        def process_response(self, message: Message) -> None:
            self.seen.append("response")

    both = Both()
    talk(bbr(both), *full_exchange(COMPLETION))
    assert both.seen == ["request", "response"]


# --- the stream's end, health, metrics -------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    ["awaiting-request-body", "awaiting-response"],
)
def test_client_cancel_mid_stream_leaves_no_error(mode: str) -> None:
    """Envoy cancelling mid-stream ends the handler quietly: no error logged, and the server
    goes on serving."""
    router = bbr()
    ended = asyncio.Event()
    outcome: list[str] = []

    async def observed(stream: Stream) -> None:
        try:
            await router(stream)
            outcome.append("returned")
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        finally:
            ended.set()

    async def go() -> list[ProcessingResponse]:
        async with (
            running("bbr", observed) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            stream = client.open()
            if mode == "awaiting-request-body":
                await stream.send(request_headers(POST, body_modes=BUFFERED))
                await stream.recv()  # the headers answer: the handler now waits for the body
            else:
                for message in post():
                    await stream.send(message)
                for _ in range(2):
                    await stream.recv()  # the request is done; the response has not come
            stream.cancel()
            await asyncio.wait_for(ended.wait(), timeout=10)
            outcome.append("ended")
            return await client.exchange(post())

    with capture_logs() as logs:
        after = asyncio.run(go())
    # grpc.aio ends the read with EOF (today) or cancels the handler: both are clean.
    assert outcome[:2] in (["returned", "ended"], ["cancelled", "ended"])
    assert [entry for entry in logs if entry["log_level"] in ("error", "critical")] == []
    assert (MODEL, "llama-3") in set_headers(after[0])


def test_health_reports_serving_for_the_ext_proc_service() -> None:
    """Health answers SERVING for "" and the ext_proc service name."""

    async def go() -> list[int]:
        health = Health(list(HEALTH_SERVICES))
        async with running("bbr", bbr(), health) as ports:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports.health}")
            stub = health_pb2_grpc.HealthStub(channel)
            statuses = []
            for name in HEALTH_SERVICES:
                # Watch streams each change: SERVING is set by a background task at start.
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=name))
                async for answer in watch:
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                watch.cancel()
                statuses.append(answer.status)
            await channel.close()
            return statuses

    assert asyncio.run(go()) == [health_pb2.HealthCheckResponse.SERVING] * 2


def test_metrics_count_requests_successes_errors_and_plugin_time() -> None:
    """Two requests and a refused one: the counters and the per-plugin histogram agree."""
    registry = CollectorRegistry()
    router = bbr(registry=registry)

    async def go() -> None:
        async with (
            running("bbr", router) as ports,
            ExtProcClient(f"127.0.0.1:{ports.grpc}") as client,
        ):
            await client.exchange(post())
            await client.exchange(post(modes=BUFFERED))
            await client.exchange(post(b"[]"))

    asyncio.run(go())
    sample = registry.get_sample_value
    assert sample("bbr_requests_total") == 3
    assert sample("bbr_success_total") == 2
    assert sample("bbr_errors_total", {"reason": "BadRequest"}) == 1
    labels = {
        "extension_point": "request",
        "plugin_type": "body-field-to-header",
        "plugin_name": "model-extractor",
    }
    assert sample("bbr_plugin_duration_seconds_count", labels) == 2


# --- the command line -------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bbr", *args], capture_output=True, text=True, timeout=60
    )


def test_help_explains_every_flag() -> None:
    """``--help`` documents each flag."""
    out = run_cli("--help").stdout
    for flag in (
        "--host",
        "--grpc-port",
        "--grpc-health-port",
        "--metrics-port",
        "--plugin",
        "--streaming",
        "--max-body-bytes",
        "--log-level",
        "--grace",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--plugin", "body-field-to-header"], "'body-field-to-header': expected type:name"),
        (["--plugin", ":name"], "':name': expected type:name"),
        (["--plugin", "t:"], "'t:': expected type:name"),
        (["--plugin", "t:n:{oops"], "'t:n:{oops': parameters are not JSON"),
        (["--plugin", "t:n:[1]"], "'t:n:[1]': parameters must be a JSON object"),
        (["--plugin", "nope:n"], "plugin 'n' (nope): type: unknown"),
        (["--plugin", "no.such.Module:n"], "plugin 'n' (no.such.Module): type: cannot load"),
        (
            ["--plugin", 'body-field-to-header:x:{"fieldName": "model"}'],
            "plugin 'x' (body-field-to-header): parameters.headerName: required",
        ),
        (
            ["--plugin", 'body-field-to-header:x:{"fieldName":"m","headerName":"h","extra":1}'],
            "plugin 'x' (body-field-to-header): parameters: unknown field 'extra'",
        ),
        (["--grpc-port", "70000"], "argument --grpc-port: 70000 is not a port"),
        (["--metrics-port", "9004"], "must differ"),
        (["--max-body-bytes", "0"], "argument --max-body-bytes: must be at least 1"),
        (["--grace", "-1"], "argument --grace: '-1': must be 0 or more"),
        (["--log-level", "loud"], "argument --log-level: invalid choice"),
    ],
    ids=[
        "no-name",
        "empty-type",
        "empty-name",
        "bad-json",
        "json-not-object",
        "unknown-type",
        "bad-path",
        "missing-field",
        "unknown-field",
        "bad-port",
        "same-ports",
        "zero-limit",
        "negative-grace",
        "bad-level",
    ],
)
def test_bad_configuration_exits_2_with_one_line(args: list[str], message: str) -> None:
    """Bad configuration exits non-zero with one line naming the flag, plugin or field
    (GIE's BBR exits 0 on an unknown plugin type)."""
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert message in result.stderr


def test_cli_serves_then_stops_on_sigterm() -> None:
    """``python -m bbr`` serves the default chain on the ports it reports, and SIGTERM stops
    it cleanly (exit 0)."""
    with service("bbr") as (process, event):

        async def go() -> list[ProcessingResponse]:
            async with ExtProcClient(f"127.0.0.1:{event['grpc_port']}") as client:
                return await client.exchange(post())

        replies = asyncio.run(go())
        assert (MODEL, "llama-3") in set_headers(replies[0])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
