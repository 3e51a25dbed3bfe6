"""BBR's pieces without the wire: the message, its read-only body, the plugins, the registry."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from bbr.message import Message
from bbr.plugins import (
    BASE_MODEL_HEADER,
    DEFAULT_PLUGINS,
    BaseModelToHeader,
    BBRMetrics,
    BodyFieldToHeader,
    PluginSpec,
    build_chains,
    go_format,
)
from plugin_api import ConfigError, Params
from plugin_api.frozen import FrozenDict, FrozenList
from wire.exchange import Refusal

HEADERS = {"content-type": "application/json", "x-gateway-model-name": "old"}


def message(body: object = None, headers: Mapping[str, str] = HEADERS) -> Message:
    return Message("request", headers, orjson.dumps(body if body is not None else {}))


# --- header changes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "sets", "removes"),
    [
        ([("set", "X-New", "1")], [("X-New", "1")], []),
        ([("set", "X-Gateway-Model-Name", "old")], [], []),
        ([("set", "X-Gateway-Model-Name", "new")], [("X-Gateway-Model-Name", "new")], []),
        ([("set", "x-a", "1"), ("set", "X-A", "2")], [("X-A", "2")], []),
        ([("set", "x-gateway-model-name", "new"), ("set", "X-Gateway-Model-Name", "old")], [], []),
        ([("remove", "content-type")], [], ["content-type"]),
        ([("remove", "x-absent")], [], []),
        ([("set", "x-a", "1"), ("remove", "x-a")], [], []),
        (
            [("remove", "Content-Type"), ("set", "content-type", "text/plain")],
            [("content-type", "text/plain")],
            [],
        ),
        ([("remove", "content-type"), ("set", "content-type", "application/json")], [], []),
    ],
    ids=[
        "new-header",
        "same-value-as-client",
        "changed-value",
        "last-set-wins",
        "set-back-to-client-value",
        "remove-existing",
        "remove-absent-is-nothing",
        "remove-drops-pending-set",
        "set-un-removes",
        "set-un-removes-to-client-value",
    ],
)
def test_header_changes_follow_gie_inference_message(
    steps: list[tuple[str, ...]], sets: list[tuple[str, str]], removes: list[str]
) -> None:
    """Sets are recorded only when they differ from the client's header (names compared
    case-insensitively), removing drops a pending set, setting un-removes."""
    m = message()
    for op, *args in steps:
        if op == "set":
            m.set_header(args[0], args[1])
        else:
            m.remove_header(args[0])
    assert m.header_changes() == (sets, removes)


def test_content_length_is_always_sent() -> None:
    """Content-Length states the body BBR forwards, even when the client sent the same."""
    m = Message("request", {"content-length": "2"}, b"{}")
    m.remove_header("content-length")
    m.set_content_length()
    assert m.header_changes() == ([("Content-Length", "2")], [])


def test_headers_are_read_only() -> None:
    """Plugins read the client's headers; they change them only through set/remove."""
    m = message()
    with pytest.raises(TypeError):
        m.headers["x-new"] = "1"  # type: ignore[index]


# --- the read-only body --------------------------------------------------------------

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}


def assign(body: Any) -> None:
    body["model"] = "x"


def delete(body: Any) -> None:
    del body["model"]


def assign_nested(body: Any) -> None:
    body["messages"][0]["role"] = "system"


def assign_item(body: Any) -> None:
    body["messages"][0] = {}


def extend_in_place(body: Any) -> None:
    messages = body["messages"]
    messages += [{}]


@pytest.mark.parametrize(
    "change",
    [
        assign,
        delete,
        assign_nested,
        assign_item,
        extend_in_place,
        lambda body: body["messages"].append({}),
        lambda body: body["messages"].extend([{}]),
        lambda body: body["messages"].insert(0, {}),
        lambda body: body["messages"].pop(),
        lambda body: body["messages"].sort(),
        lambda body: body["messages"].clear(),
        lambda body: body.update(model="x"),
        lambda body: body.setdefault("stream", True),
        lambda body: body.pop("model"),
        lambda body: body.popitem(),
        lambda body: body.clear(),
        lambda body: body["messages"][0].update(role="x"),
        lambda body: body["messages"][:1].append({}),
    ],
    ids=[
        "assign",
        "delete",
        "assign-nested",
        "assign-item",
        "iadd",
        "append",
        "extend",
        "insert",
        "list-pop",
        "sort",
        "list-clear",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "clear",
        "nested-update",
        "slice-append",
    ],
)
def test_shared_body_cannot_be_changed(change: Callable[[Any], None]) -> None:
    """Any change to the shared parse, however deep, raises TypeError and changes nothing."""
    m = message(BODY)
    with pytest.raises(TypeError):
        change(m.body)
    assert m.body == BODY
    assert orjson.loads(m.raw) == BODY


def test_shared_body_reads_like_the_json() -> None:
    """The views read like dicts and lists: lookup, get, len, iteration, equality."""
    body = message(BODY).body
    assert isinstance(body, FrozenDict)
    assert isinstance(body["messages"], FrozenList)
    assert body.get("absent") is None
    assert list(body) == ["model", "messages", "n"]
    assert len(body["messages"]) == 1
    assert body["messages"][0]["content"] == "hi"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert dict(body["messages"][-1]) == {"role": "user", "content": "hi"}


def test_body_copy_is_the_callers_own() -> None:
    """``body_copy()`` is a fresh mutable parse; changing it leaves the shared body alone."""
    m = message(BODY)
    copy = m.body_copy()
    copy["messages"].append({"role": "system"})
    assert m.body == BODY
    assert message(BODY).body_copy() is not m.body_copy()


def test_replaced_body_is_what_later_readers_see() -> None:
    """After ``replace_body`` the message is marked mutated and reads the new body."""
    m = message(BODY)
    assert m.body["model"] == "m"
    m.replace_body(b'{"model": "n"}')
    assert (m.body_mutated, m.body["model"]) == (True, "n")


def test_parse_errors_are_400() -> None:
    """Parsing a body that is not a JSON object is refused with 400, in GIE's words."""
    with pytest.raises(Refusal) as caught:
        Message("request", {}, b"{").parse()
    assert (caught.value.status, caught.value.code) == (400, "BadRequest")
    assert caught.value.message.startswith("failed to parse request body: ")


# --- Go's %v -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("llama", "llama"),
        ("", ""),
        (7, "7"),
        (-3.0, "-3"),
        (1.5, "1.5"),
        (999999, "999999"),
        (1e6, "1e+06"),
        (123456789, "1.23456789e+08"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (1e21, "1e+21"),
        (1.5e300, "1.5e+300"),
        (-0.0, "-0"),
        (0.1 + 0.2, "0.30000000000000004"),
        (2**64, "1.8446744073709552e+19"),
        (True, "true"),
        (None, "<nil>"),
        ([1, "a", [2.5]], "[1 a [2.5]]"),
        ({"b": 1, "a": {"c": None}}, "map[a:map[c:<nil>] b:1]"),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_go_format_prints_like_go(value: object, text: str) -> None:
    """JSON values render as Go's %v renders them after decoding into map[string]any."""
    assert go_format(value) == text


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_go_format_of_a_float_reads_back_as_the_same_float(number: float) -> None:
    """Go prints the shortest digits that round-trip: reading them back gives the float."""
    text = go_format(number)
    assert float(text) == number
    assert math.copysign(1, float(text)) == math.copysign(1, number)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_go_format_of_an_integer_is_its_float64(number: int) -> None:
    """An integer is a float64 to Go: big ones lose digits exactly as the float does."""
    (as_float,) = struct.unpack("<d", struct.pack("<d", float(number)))
    assert float(go_format(number)) == as_float


# --- plugin configuration ---------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "spec"),
    [
        ("t:n", PluginSpec("t", "n", {})),
        ('t:n:{"a": "b:c"}', PluginSpec("t", "n", {"a": "b:c"})),
        ("pkg.mod.Class:n:{}", PluginSpec("pkg.mod.Class", "n", {})),
    ],
    ids=["no-json", "json-with-colons", "dotted-type"],
)
def test_plugin_flag_splits_on_the_first_two_colons(flag: str, spec: PluginSpec) -> None:
    """``type:name[:json]``: the JSON may itself contain colons."""
    assert PluginSpec.from_flag(flag) == spec


def make(plugin_type: str, parameters: Mapping[str, Any]) -> tuple[Any, Any]:
    return build_chains([PluginSpec(plugin_type, "p", parameters)], BBRMetrics(CollectorRegistry()))


@pytest.mark.parametrize(
    ("plugin_type", "parameters", "error"),
    [
        ("body-field-to-header", {}, "parameters.fieldName: required"),
        ("body-field-to-header", {"fieldName": "model"}, "parameters.headerName: required"),
        (
            "body-field-to-header",
            {"fieldName": "model", "headerName": "h", "field_name": "x"},
            "parameters: unknown field 'field_name' (known: fieldName, headerName)",
        ),
        (
            "body-field-to-header",
            {"fieldName": 3, "headerName": "h"},
            "parameters.fieldName: expected str, got int 3",
        ),
        (
            "body-field-to-header",
            {"fieldName": "", "headerName": "h"},
            "parameters.fieldName: must not be empty",
        ),
        ("base-model-to-header", {"models": {}}, "parameters: unknown field 'models'"),
        ("base-model-to-header", {"baseModels": []}, "parameters.baseModels: expected dict"),
        (
            "base-model-to-header",
            {"baseModels": {"b": "a"}},
            "parameters.baseModels.b: must be a list of strings",
        ),
        ("base-model-to-header", {"baseModels": {" ": []}}, "has an empty base model"),
        (
            "base-model-to-header",
            {"baseModels": {"b1": ["a"], "b2": ["a"]}},
            "adapter 'a' has two base models",
        ),
        (
            "base-model-to-header",
            {"baseModels": {}, "configMapFile": "x.yaml"},
            "parameters.configMapFile: give baseModels or configMapFile, not both",
        ),
        ("bbr.plugins.Missing", {}, "type: cannot load 'bbr.plugins.Missing'"),
        ("bbr.plugins.go_format", {}, "TypeError"),
        ("bbr.plugins.BBRMetrics", {}, "TypeError"),
        (f"{__name__}.NotAPlugin", {}, "NotAPlugin is no plugin here"),
        ("model-extractor", {}, "type: unknown"),
    ],
    ids=[
        "no-params",
        "missing-header",
        "unknown-field",
        "wrong-type",
        "empty-field",
        "base-unknown-field",
        "base-not-object",
        "base-not-list",
        "base-empty",
        "base-adapter-twice",
        "base-two-sources",
        "path-missing",
        "path-not-a-factory",
        "path-wrong-signature",
        "path-not-a-plugin",
        "unknown-type",
    ],
)
def test_bad_plugin_configuration_names_plugin_and_field(
    plugin_type: str, parameters: Mapping[str, Any], error: str
) -> None:
    """Configuration errors name the plugin (name and type) and what is wrong."""
    with pytest.raises(ConfigError) as caught:
        make(plugin_type, parameters)
    assert str(caught.value).startswith(f"plugin 'p' ({plugin_type}): ")
    assert error in str(caught.value)


class NotAPlugin:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name


class Counts:
    """A user plugin, loaded by its dotted path."""

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.calls = 0

    def process_request(self, message: Message) -> None:
        self.calls += 1


def test_user_plugin_loads_by_dotted_path() -> None:
    """A type with a dot is ``package.module.Class``, imported and called as the factory."""
    request, response = make(f"{__name__}.Counts", {})
    assert [(step.type, step.name) for step in request.steps] == [(f"{__name__}.Counts", "p")]
    assert not response.needs_body
    assert len(response) == 0


def test_built_in_loads_by_dotted_path_too() -> None:
    """The built-ins are plain classes, so their dotted path works as well."""
    request, _ = make("bbr.plugins.BodyFieldToHeader", {"fieldName": "a", "headerName": "b"})
    assert request.needs_body


def test_default_chain_is_the_model_extractor() -> None:
    """No --plugin: one request plugin, copying ``model`` to X-Gateway-Model-Name."""
    request, response = build_chains(DEFAULT_PLUGINS, BBRMetrics(CollectorRegistry()))
    assert [(s.type, s.name) for s in request.steps] == [
        ("body-field-to-header", "model-extractor")
    ]
    assert len(response) == 0


# --- built-in plugins ---------------------------------------------------------------


def test_body_field_to_header_copies_any_field() -> None:
    """fieldName/headerName pick the field and the header; the value renders as Go's %v."""
    metrics = BBRMetrics(CollectorRegistry())
    params = Params({"fieldName": "priority", "headerName": "x-priority"}, host=metrics)
    plugin = BodyFieldToHeader("p", params)
    m = message({"priority": 2})
    plugin.process_request(m)
    assert m.header_changes() == ([("x-priority", "2")], [])


BASES = {"baseModels": {"llama-3": ["sql-lora", " chat-lora "], "qwen": []}}


@pytest.mark.parametrize(
    ("body", "header"),
    [
        ({"model": "sql-lora"}, "llama-3"),
        ({"model": "chat-lora"}, "llama-3"),
        ({"model": " sql-lora "}, "llama-3"),
        ({"model": "llama-3"}, "llama-3"),
        ({"model": "qwen"}, "qwen"),
        ({"model": "unknown"}, ""),
        ({"prompt": "no model"}, None),
    ],
    ids=[
        "adapter",
        "trimmed-adapter",
        "trimmed-model",
        "base",
        "base-no-adapters",
        "unknown",
        "no-model",
    ],
)
def test_base_model_to_header(body: object, header: str | None) -> None:
    """The adapter's base model, the base model itself, else "" (always set when ``model``
    is present), nothing without ``model``."""
    plugin = BaseModelToHeader("p", Params(BASES))
    m = message(body)
    plugin.process_request(m)
    expected = [] if header is None else [(BASE_MODEL_HEADER, header)]
    assert m.header_changes()[0] == expected
