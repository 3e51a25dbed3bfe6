"""The metric scorers, the affinity scorers and the label filter: formulas, unknown data, parameters."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from lwepp.contracts import Candidate, Filter, LLMRequest, Measurement, ResponseHeadersHook, Scorer
from lwepp.pipeline import Pipeline
from lwepp.plugins import REGISTRY
from lwepp.plugins.kv_cache_scorer import KVCacheUtilizationScorer
from lwepp.plugins.label_selector import LabelSelectorFilter
from lwepp.plugins.lora_affinity import LoraAffinityScorer
from lwepp.plugins.queue_scorer import QueueScorer
from lwepp.plugins.session_affinity import SessionAffinityScorer, token
from plugin_api import ConfigError, Params
from pods.model import Endpoint
from tests.plugin_fakes import configured

NOW = 1000.0
STALE = NOW - 5.0  # older than the default maxAgeSeconds (1 s)


def candidate(
    name: str, at: float = NOW, labels: dict[str, str] | None = None, **values: Any
) -> Candidate:
    """A candidate ``name`` on 10.0.0.<n>:8000 whose attributes were measured at ``at``."""
    number = sum(map(ord, name)) % 250
    endpoint = Endpoint(name, f"10.0.0.{number}", 8000, labels or {})
    attributes = {
        key: Measurement(frozenset(v) if isinstance(v, set) else float(v), at)
        for key, v in values.items()
    }
    return Candidate(endpoint, attributes)


def request(model: str | None = None, **headers: str) -> LLMRequest:
    return LLMRequest("req-1", headers, model=model)


def scores(scorer: Scorer, *candidates: Candidate, req: LLMRequest | None = None) -> list[float]:
    return [round(s, 6) for s in scorer.score(req or request(), candidates, NOW)]


# --- queue-scorer -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("queues", "expected"),
    [
        ([0, 5, 10], [1.0, 0.5, 0.0]),
        ([3, 3, 3], [1.0, 1.0, 1.0]),
        ([7], [1.0]),
        ([2, 4], [1.0, 0.0]),
        ([0, None, 4], [1.0, 0.0, 0.0]),
        ([None, 6, None], [0.0, 1.0, 0.0]),
        ([None, None], [0.0, 0.0]),
        (["stale", 1, 3], [0.0, 1.0, 0.0]),
    ],
    ids=[
        "spread",
        "all-equal",
        "one",
        "two",
        "unknown-is-worst",
        "one-known",
        "none-known",
        "stale",
    ],
)
def test_queue_scorer(queues: list[Any], expected: list[float]) -> None:
    """(max - q) / (max - min) over known queues, 1 if all equal; unknown or stale scores 0."""
    candidates = []
    for i, q in enumerate(queues):
        if q is None:
            candidates.append(candidate(f"p{i}"))
        elif q == "stale":
            candidates.append(candidate(f"p{i}", STALE, queue_depth=0))
        else:
            candidates.append(candidate(f"p{i}", queue_depth=q))
    assert scores(QueueScorer("queue"), *candidates) == expected


def test_queue_scorer_max_age_parameter() -> None:
    """``maxAgeSeconds`` decides what is stale: 10 s makes a 5 s old measurement usable."""
    lenient = REGISTRY["queue-scorer"]("queue", Params({"maxAgeSeconds": 10}, "queue"))
    old, fresh = candidate("old", STALE, queue_depth=0), candidate("fresh", queue_depth=4)
    assert scores(lenient, old, fresh) == [1.0, 0.0]
    assert scores(QueueScorer("queue"), old, fresh) == [0.0, 1.0]


# --- kv-cache-utilization-scorer --------------------------------------------------


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (0.0, 1.0),
        (0.25, 0.75),
        (1.0, 0.0),
        (1.5, 0.0),
        (-0.1, 1.0),
        (None, 0.5),
        ("stale", 0.5),
    ],
    ids=["empty", "quarter", "full", "over-clamped", "negative-clamped", "unknown", "stale"],
)
def test_kv_cache_scorer(usage: Any, expected: float) -> None:
    """1 - usage, clamped to [0, 1]; unknown (llama.cpp) or stale is the neutral 0.5."""
    if usage is None:
        c = candidate("p")
    elif usage == "stale":
        c = candidate("p", STALE, kv_cache_usage=0.0)
    else:
        c = candidate("p", kv_cache_usage=usage)
    assert scores(KVCacheUtilizationScorer("kv"), c) == [expected]


# --- lora-affinity-scorer ---------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "expected"),
    [
        ({"lora_running": {"sql"}, "lora_waiting": set(), "lora_max": 1}, 1.0),
        ({"lora_running": {"chat"}, "lora_waiting": set(), "lora_max": 2}, 0.8),
        ({"lora_running": {"chat"}, "lora_waiting": {"sql"}, "lora_max": 2}, 0.6),
        ({"lora_running": {"chat"}, "lora_waiting": {"sql"}, "lora_max": 3}, 0.8),
        ({"lora_running": {"chat"}, "lora_waiting": {"math"}, "lora_max": 2}, 0.0),
        ({"lora_running": {"chat"}, "lora_waiting": set(), "lora_max": 1}, 0.0),
        ({"lora_running": set(), "lora_max": 1}, 0.8),
        ({"lora_running": {"chat"}}, 0.0),
        ({}, 0.0),
        ({"lora_waiting": {"sql"}, "lora_max": 4}, 0.0),
    ],
    ids=[
        "running",
        "room",
        "waiting-no-room",
        "room-beats-waiting",
        "full",
        "full-no-waiting",
        "no-waiting-set",
        "no-max",
        "no-data",
        "no-running-set",
    ],
)
def test_lora_affinity_scorer(lora: dict[str, Any], expected: float) -> None:
    """1.0 running, 0.8 a free slot, 0.6 already waiting, else 0; no running set scores 0."""
    scorer = LoraAffinityScorer("lora")
    assert scores(scorer, candidate("p", **lora), req=request("sql")) == [expected]


def test_lora_affinity_stale_and_no_model() -> None:
    """Stale LoRA data is unknown (0); a request without a model scores 0 everywhere."""
    scorer = LoraAffinityScorer("lora")
    stale = candidate("p", STALE, lora_running={"sql"}, lora_max=1)
    assert scores(scorer, stale, req=request("sql")) == [0.0]
    fresh = candidate("q", lora_running={"sql"}, lora_max=1)
    assert scores(scorer, fresh, req=request(None)) == [0.0]


# --- session-affinity-scorer ------------------------------------------------------


def test_session_token_is_base64_of_the_pod_s_namespace_and_name() -> None:
    """The token is standard base64 of ``namespace/name``, as the router writes it; a pod with
    no namespace (Switchyard's pod file) is ``default``'s, the router's file-discovery default."""
    assert token("pod-a", "ns") == base64.b64encode(b"ns/pod-a").decode()
    assert token("pod-a") == base64.b64encode(b"default/pod-a").decode()


def test_a_bare_name_token_still_matches() -> None:
    """Switchyard's earlier tokens (base64 of the pod name alone) keep their session."""
    bare = base64.b64encode(b"b").decode()
    req = LLMRequest("r", {"x-session-token": bare})
    got = scores(SessionAffinityScorer("s"), candidate("a"), candidate("b"), req=req)
    assert got == [0.0, 1.0]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (token("b"), [0.0, 1.0, 0.0]),
        (token("gone"), [0.0, 0.0, 0.0]),
        ("%%not-base64%%", [0.0, 0.0, 0.0]),
        (None, [0.0, 0.0, 0.0]),
    ],
    ids=["known-pod", "pod-left", "garbage", "no-header"],
)
def test_session_affinity_scores(header: str | None, expected: list[float]) -> None:
    """The pod the token names scores 1, every other 0; no usable token is no preference."""
    headers = {"x-session-token": header} if header else {}
    req = LLMRequest("r", headers)
    got = scores(
        SessionAffinityScorer("s"), candidate("a"), candidate("b"), candidate("c"), req=req
    )
    assert got == expected


def test_session_affinity_all_ports_of_the_pod() -> None:
    """A data-parallel pod's ports all score 1: the token names the pod."""
    first = Candidate(Endpoint("dp", "10.0.0.9", 8000))
    second = Candidate(Endpoint("dp", "10.0.0.9", 8001))
    req = LLMRequest("r", {"x-session-token": token("dp")})
    assert scores(SessionAffinityScorer("s"), first, second, candidate("x"), req=req) == [1, 1, 0]


@pytest.mark.parametrize(
    ("served", "pod"),
    [("10.0.0.2:8000", "fallback"), (None, "primary"), ("10.9.9.9:1", "primary")],
    ids=["served-fallback", "nothing-reported", "unknown-served"],
)
def test_session_affinity_sets_the_token_on_the_response(served: str | None, pod: str) -> None:
    """The response carries the token of the served endpoint's pod, else of the primary pick."""
    scorer = SessionAffinityScorer("s")
    hook: ResponseHeadersHook = scorer
    req = LLMRequest("r", {})
    scorer.picked(
        req, [Endpoint("primary", "10.0.0.1", 8000), Endpoint("fallback", "10.0.0.2", 8000)]
    )
    assert hook.response_headers(req, served, {}) == {"x-session-token": token(pod)}


def test_session_affinity_without_a_pick_adds_nothing() -> None:
    """No pick recorded (the request never reached the picker): no header."""
    assert SessionAffinityScorer("s").response_headers(LLMRequest("r", {}), "1.2.3.4:5", {}) == {}


# --- label-selector-filter --------------------------------------------------------

POOL = [
    candidate("a", labels={"role": "decode", "gpu": "h100"}),
    candidate("b", labels={"role": "prefill", "gpu": "h100"}),
    candidate("c", labels={"role": "decode"}),
    candidate("d", labels={}),
]


@pytest.mark.parametrize(
    ("parameters", "kept"),
    [
        ({}, "abcd"),
        ({"matchLabels": {"role": "decode"}}, "ac"),
        ({"matchLabels": {"role": "decode", "gpu": "h100"}}, "a"),
        (
            {"matchExpressions": [{"key": "role", "operator": "In", "values": ["prefill", "x"]}]},
            "b",
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["h100"]}]}, "cd"),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, "ab"),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, "cd"),
        (
            {
                "matchLabels": {"role": "decode"},
                "matchExpressions": [{"key": "gpu", "operator": "Exists"}],
            },
            "a",
        ),
        ({"matchLabels": {"role": "encode"}}, ""),
    ],
    ids=[
        "empty-keeps-all",
        "labels",
        "labels-and",
        "in",
        "notin-incl-absent",
        "exists",
        "absent",
        "both",
        "none",
    ],
)
def test_label_selector_filter(parameters: dict[str, Any], kept: str) -> None:
    """Kubernetes label-selector semantics; order of the candidates is kept."""
    plugin: Filter = REGISTRY["label-selector-filter"]("f", Params(parameters, "f"))
    assert "".join(c.endpoint.pod for c in plugin.filter(request(), POOL, NOW)) == kept


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"matchLabels": {"a": 1}}, r"matchLabels\.a: expected a string value"),
        ({"matchLabels": ["a"]}, r"matchLabels: expected dict"),
        ({"matchExpressions": [{"key": "a", "operator": "Has"}]}, r"operator: expected one of"),
        (
            {"matchExpressions": [{"key": "a", "operator": "In"}]},
            r"values: required with operator In",
        ),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            r"values: must be empty",
        ),
        ({"matchExpressions": [{"operator": "Exists"}]}, r"\[0\]\.key: required"),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "vals": []}]},
            r"matchExpressions\[0\]: unknown field 'vals' \(known: key, operator, values\)",
        ),
        ({"selector": {}}, r"unknown field 'selector'"),
    ],
    ids=[
        "label-type",
        "labels-type",
        "operator",
        "in-no-values",
        "exists-values",
        "no-key",
        "typo",
        "unknown",
    ],
)
def test_label_selector_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    """Every configuration error names the plugin and the field."""
    with pytest.raises(ConfigError, match=rf"plugin 'f' \(label-selector-filter\): .*{message}"):
        configured("label-selector-filter", parameters, "f")


# --- shared ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer"],
)
@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"maxAgeSeconds": 0}, "maxAgeSeconds: must be > 0"),
        ({"weight": 2}, "unknown field 'weight'"),
    ],
    ids=["max-age", "unknown"],
)
def test_metric_scorers_share_max_age(kind: str, parameters: dict[str, Any], message: str) -> None:
    """Scorers reading metrics take ``maxAgeSeconds`` and nothing else."""
    with pytest.raises(ConfigError, match=message):
        configured(kind, parameters)


def test_declared_reads() -> None:
    """Each scorer declares the attributes it reads, so configuration can check a source exists."""
    assert QueueScorer.reads == {"queue_depth"}
    assert KVCacheUtilizationScorer.reads == {"kv_cache_usage"}
    assert LoraAffinityScorer.reads == {"lora_running", "lora_waiting", "lora_max"}
    reading_nothing = Pipeline([SessionAffinityScorer("s"), LabelSelectorFilter("f")])
    assert reading_nothing.reads == frozenset()  # no ``reads``: the rule's default, none
