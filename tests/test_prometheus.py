"""The Prometheus text parser and exact-match selectors the metrics source uses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from lwepp.plugins.prometheus import Selector, parse, parse_selector

PAGE = """\
# HELP vllm:num_requests_waiting Requests queued.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_waiting_total 99
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25 1700000000000
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",} 1.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
plain 7
spaced {a="1"}   -Inf
weird{path="C:\\\\dir",quote="say \\"hi\\"",nl="one\\ntwo",brace="}{,"} NaN
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm:num_requests_waiting", [({"model_name": "m"}, 3.0)]),
        ("vllm:kv_cache_usage_perc", [({"model_name": "m", "engine": "0"}, 0.25)]),
        (
            "vllm:cache_config_info",
            [({"block_size": "16", "num_gpu_blocks": "2048"}, 1.0)],
        ),
        (
            "vllm:lora_requests_info",
            [
                (
                    {"max_lora": "2", "running_lora_adapters": "a,b", "waiting_lora_adapters": ""},
                    1.7e9,
                )
            ],
        ),
        ("plain", [({}, 7.0)]),
        ("spaced", [({"a": "1"}, -math.inf)]),
    ],
    ids=["labels", "timestamp", "trailing-comma", "empty-label", "no-labels", "spaces-inf"],
)
def test_parse_reads_samples(name: str, expected: list[tuple[dict[str, str], float]]) -> None:
    """Each wanted family comes back with its labels and value; comments and timestamps are ignored."""
    families = parse(PAGE, frozenset({name}))
    assert [(dict(labels), value) for labels, value in families[name]] == expected


def test_parse_unescapes_label_values_and_reads_nan() -> None:
    """Label values keep backslashes, quotes, newlines and braces; NaN is a value."""
    ((labels, value),) = parse(PAGE, frozenset({"weird"}))["weird"]
    assert labels == {"path": "C:\\dir", "quote": 'say "hi"', "nl": "one\ntwo", "brace": "}{,"}
    assert math.isnan(value)


def test_parse_keeps_only_wanted_names() -> None:
    """A name that merely starts like a wanted one is not taken, and unwanted names are absent."""
    families = parse(PAGE, frozenset({"vllm:num_requests_waiting"}))
    assert list(families) == ["vllm:num_requests_waiting"]
    assert len(families["vllm:num_requests_waiting"]) == 1


@pytest.mark.parametrize(
    "line",
    [
        'm{a="1" 2',
        "m{a=1} 2",
        "m",
        "m one",
        "m 1 2 3",
        'm{a="1"}',
        'm{a="1"b="2"} 3',
    ],
    ids=[
        "unclosed",
        "unquoted",
        "no-value",
        "bad-value",
        "too-many-fields",
        "labels-no-value",
        "no-comma",
    ],
)
def test_parse_skips_a_malformed_line_but_keeps_the_rest(line: str) -> None:
    """One bad line is dropped; the good line after it is still read."""
    families = parse(f"{line}\nm 5\n", frozenset({"m"}))
    assert [value for _, value in families["m"]] == [5.0]


def test_parse_agrees_with_prometheus_client_on_a_page() -> None:
    """Every sample of the page reads the same as with the reference client parser."""
    names = frozenset({"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "plain", "spaced"})
    ours = {
        (name, tuple(sorted(labels.items())), value)
        for name, samples in parse(PAGE, names).items()
        for labels, value in samples
    }
    theirs = {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(PAGE)
        for sample in family.samples
        if sample.name in names
    }
    assert ours == theirs


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@given(
    st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), st.text(), max_size=4)
)
def test_label_values_round_trip(labels: dict[str, str]) -> None:
    """Any label values, escaped as exposition writers do, parse back unchanged."""
    pairs = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
    families = parse(f"m{{{pairs}}} 1\n", frozenset({"m"}))
    assert dict(families["m"][0][0]) == labels


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting", Selector("vllm:num_requests_waiting", {})),
        ('my_queue{state="waiting"}', Selector("my_queue", {"state": "waiting"})),
        ("my_queue{state=waiting}", Selector("my_queue", {"state": "waiting"})),
        ('m{ a = 1 , b="x,y" ,}', Selector("m", {"a": "1", "b": "x,y"})),
    ],
    ids=["name", "quoted", "unquoted", "spaces-comma-in-value"],
)
def test_parse_selector(text: str, expected: Selector) -> None:
    """Selectors take quoted or bare values, as the llm-d router's engine configs do."""
    selector = parse_selector(text)
    assert (selector.name, dict(selector.labels)) == (expected.name, dict(expected.labels))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a metric selector"),
        ("1abc", "not a metric selector"),
        ('m{state!="x"}', "only exact-match"),
        ('m{state=~"x.*"}', "only exact-match"),
        ("m{=x}", "bad label matcher"),
    ],
    ids=["empty", "bad-name", "not-equal", "regex", "no-key"],
)
def test_parse_selector_refuses(text: str, message: str) -> None:
    """What the selector subset does not cover is an error, not a silent match-all."""
    with pytest.raises(ValueError, match=message):
        parse_selector(text)


def test_selector_matches_exactly() -> None:
    """A selector picks the series carrying all its labels, in page order."""
    page = 'q{state="waiting",x="1"} 4\nq{state="running"} 2\nq 9\n'
    selector = parse_selector("q{state=waiting}")
    assert [v for _, v in selector.select(parse(page, {"q"}))] == [4.0]
    assert [v for _, v in parse_selector("q").select(parse(page, {"q"}))] == [4.0, 2.0, 9.0]
