"""InferenceModelRewrite: decoding, the router's precedence, the weighted draw, the request
control that applies it, and the response mapped back (``lwepp.rewrites``,
``lwepp.rewrite_control``), down to one picker over real gRPC."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from lwepp.metrics import PickerMetrics
from lwepp.picking import Admitted, Choice, Pool, RequestInfo, RoundRobin
from lwepp.rewrite_control import CAP, ModelNameBack, ModelRewriteControl, RewriteMetrics
from lwepp.rewrite_sources import FixedRewrites
from lwepp.rewrites import ModelRewrite, RewriteError, RewriteTable, Rule, Target, decode
from lwepp.server import EndpointPickerService
from pods.model import Endpoint
from serving.testing import (
    exchange_with,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from tests.fakes import StaticPods, pod
from wire.exchange import Refusal
from wire.extproc import BodyMode


def imr(
    name: str,
    *rules: dict[str, Any],
    pool: str = "a",
    created: str | None = None,
    api: str = "llm-d.ai/v1alpha2",
) -> dict[str, Any]:
    """An InferenceModelRewrite object as the API serves it."""
    metadata: dict[str, Any] = {"name": name, "namespace": "ns"}
    if created:
        metadata["creationTimestamp"] = created
    return {
        "apiVersion": api,
        "kind": "InferenceModelRewrite",
        "metadata": metadata,
        "spec": {"poolRef": {"name": pool}, "rules": list(rules)},
    }


def rule(*models: str, **targets: int | None) -> dict[str, Any]:
    """A rule matching ``models`` (none: generic), sending to ``targets`` (name → weight)."""
    found: dict[str, Any] = {
        "targets": [
            {"modelRewrite": t, **({} if w is None else {"weight": w})} for t, w in targets.items()
        ]
    }
    if models:
        found["matches"] = [{"model": {"type": "Exact", "value": m}} for m in models]
    return found


# --- decoding ------------------------------------------------------------------------------


def test_decodes_the_router_s_fields_and_the_older_group() -> None:
    """poolRef, rules, matches and weighted targets; the older group reads the same."""
    for api in ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"):
        raw = imr("c", rule("m", m=90, canary=10), created="2026-01-02T03:04:05Z", api=api)
        rewrite = decode(raw)
        assert (rewrite.name, rewrite.namespace, rewrite.pool) == ("c", "ns", "a")
        assert rewrite.pool_group == "inference.networking.k8s.io"
        assert rewrite.created.isoformat() == "2026-01-02T03:04:05+00:00"
        assert rewrite.rules == (Rule(("m",), (Target("m", 90), Target("canary", 10))),)


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"apiVersion": "v1"}, "apiVersion", "expected one of"),
        ({"kind": "InferenceModel"}, "kind", "expected InferenceModelRewrite"),
        ({"spec": {"poolRef": {"name": "a"}}}, "spec.rules", "required"),
        ({"spec": {"poolRef": {}, "rules": []}}, "spec.poolRef.name", "required"),
        (
            {"spec": {"poolRef": {"name": "a", "kind": "Service"}, "rules": []}},
            "spec.poolRef.kind",
            "",
        ),
        ({"spec": {"poolRef": {"name": "a"}, "rules": [], "x": 1}}, "spec.x", "unknown field"),
        (
            {"spec": {"poolRef": {"name": "a"}, "rules": [{"targets": []}]}},
            "spec.rules[0].targets",
            "at least one",
        ),
        (
            {"spec": {"poolRef": {"name": "a"}, "rules": [rule("m", t=0)]}},
            "spec.rules[0].targets[0].weight",
            "1 to 1,000,000",
        ),
        (
            {"spec": {"poolRef": {"name": "a"}, "rules": [{"targets": [{"weight": 1}]}]}},
            "spec.rules[0].targets[0].modelRewrite",
            "required",
        ),
        (
            {
                "spec": {
                    "poolRef": {"name": "a"},
                    "rules": [{"matches": [{"model": {"value": ""}}]}],
                }
            },
            "spec.rules[0].matches[0].model.value",
            "non-empty",
        ),
        (
            {
                "spec": {
                    "poolRef": {"name": "a"},
                    "rules": [{"matches": [{"model": {"type": "Prefix", "value": "m"}}]}],
                }
            },
            "spec.rules[0].matches[0].model.type",
            "only Exact",
        ),
        (
            {"metadata": {"creationTimestamp": "yesterday", "name": "c"}},
            "metadata.creationTimestamp",
            "RFC 3339",
        ),
    ],
    ids=[
        "api-version",
        "kind",
        "no-rules",
        "no-pool-name",
        "pool-kind",
        "unknown-spec-field",
        "empty-targets",
        "weight-zero",
        "no-model-rewrite",
        "empty-match",
        "not-exact",
        "bad-timestamp",
    ],
)
def test_a_bad_field_is_named(change: dict[str, Any], field: str, message: str) -> None:
    """Every field the CRD constrains is checked, and the error names it."""
    raw = {**imr("c", rule("m", t=1)), **change}
    with pytest.raises(RewriteError) as error:
        decode(raw)
    assert message in str(error.value)
    if field:
        assert error.value.field == field


def test_suspicious_rules_are_warned_about() -> None:
    """Mixed weights (the unweighted are never drawn) and a rule with no target (400s)."""
    warnings: list[str] = []
    decode(imr("c", rule("m", a=1, b=None), {"matches": [{"model": {"value": "x"}}]}), warnings)
    assert len(warnings) == 2
    assert "never chosen" in warnings[0]
    assert "answered 400" in warnings[1]


# --- precedence --------------------------------------------------------------------------------


def table(*raws: dict[str, Any]) -> RewriteTable:
    return RewriteTable(decode(raw) for raw in raws)


def winner(t: RewriteTable, model: str) -> tuple[str, str] | None:
    """(the rewrite, the rule's only target) that decides ``model``."""
    found = t.lookup(model)
    return None if found is None else (found.rewrite, found.rule.targets[0].model)


def test_an_exact_match_wins_over_a_generic_rule_even_an_older_one() -> None:
    """The router's first rule: exact before generic, whatever their ages."""
    t = table(
        imr("old-generic", rule(everyone=None), created="2020-01-01T00:00:00Z"),
        imr("new-exact", rule("m", exact=None), created="2026-01-01T00:00:00Z"),
    )
    assert winner(t, "m") == ("new-exact", "exact")
    assert winner(t, "other") == ("old-generic", "everyone")


def test_among_equals_the_oldest_resource_wins() -> None:
    """The second rule: the oldest creationTimestamp, for exact and for generic rules."""
    t = table(
        imr("newer", rule("m", newer=None), rule(g_newer=None), created="2026-01-02T00:00:00Z"),
        imr("older", rule("m", older=None), rule(g_older=None), created="2026-01-01T00:00:00Z"),
    )
    assert winner(t, "m") == ("older", "older")
    assert winner(t, "x") == ("older", "g_older")


def test_within_one_resource_list_order_wins() -> None:
    """The third rule: the first rule of the object that matches."""
    t = table(imr("one", rule("x", first=None), rule("m", "x", second=None)))
    assert winner(t, "x") == ("one", "first")
    assert winner(t, "m") == ("one", "second")  # matches are OR'ed


def test_ties_the_router_leaves_open_go_in_the_source_s_order() -> None:
    """Same second (or no timestamp): the order the source gives (name from the API, position
    in a file) decides, every time: the router's unstable sort promises nothing there."""
    same = "2026-01-01T00:00:00Z"
    first = imr("b-first", rule("m", b=None), created=same)
    second = imr("a-second", rule("m", a=None), created=same)
    for _ in range(5):
        assert winner(table(first, second), "m") == ("b-first", "b")
        assert winner(table(second, first), "m") == ("a-second", "a")


def test_no_rule_no_decision() -> None:
    """A model no rule matches, with no generic rule (or no rewrite at all): no decision."""
    assert table(imr("c", rule("m", t=None))).lookup("other") is None
    assert RewriteTable().lookup("m") is None


# --- the weighted draw ----------------------------------------------------------------------


class Draws(random.Random):
    """A random source that returns the given numbers from ``randrange``, in turn."""

    def __init__(self, *numbers: int) -> None:
        super().__init__()
        self.numbers, self.asked = list(numbers), list[int]()

    def randrange(self, stop: int, *_: Any, **__: Any) -> int:  # type: ignore[override]
        self.asked.append(stop)
        return self.numbers.pop(0)


def test_weights_split_the_draw_at_their_running_sums() -> None:
    """Uniform over the sum of the weights: 0..89 → the first of 90/10, 90..99 → the second."""
    r = Rule(("m",), (Target("m", 90), Target("canary", 10)))
    draws = Draws(0, 89, 90, 99)
    assert [r.choose(draws) for _ in range(4)] == ["m", "m", "canary", "canary"]
    assert draws.asked == [100] * 4


def test_without_weights_uniform_and_mixed_only_the_weighted() -> None:
    """No weight anywhere: each target counts one; some weighted: the others are never drawn."""
    uniform = Rule((), (Target("a"), Target("b"), Target("c")))
    assert [uniform.choose(Draws(n)) for n in range(3)] == ["a", "b", "c"]
    mixed = Rule((), (Target("a"), Target("b", 5), Target("c", 5)))
    assert {mixed.choose(Draws(n)) for n in range(10)} == {"b", "c"}
    assert Rule((), ()).choose(Draws()) == ""
    assert Rule((), (Target("only", 3),)).choose(Draws()) == "only"  # no draw for one


# --- the request control ------------------------------------------------------------------------


def fixed(*raws: dict[str, Any]) -> FixedRewrites:
    return FixedRewrites(decode(raw) for raw in raws)


def control(*raws: dict[str, Any], rng: random.Random | None = None) -> ModelRewriteControl:
    registry = CollectorRegistry()
    return ModelRewriteControl(fixed(*raws), RewriteMetrics(registry), rng or Draws(*[0] * 50))


def admit(c: ModelRewriteControl, body: bytes | None, **headers: str) -> Admitted:
    pairs = [("x-gateway-model-name", "m"), *((k.replace("_", "-"), v) for k, v in headers.items())]
    return asyncio.run(c.admit(Admitted(RequestInfo(pairs, body))))


def refusal(c: ModelRewriteControl, body: bytes | None, **headers: str) -> Refusal:
    with pytest.raises(Refusal) as refused:
        admit(c, body, **headers)
    return refused.value


CANARY = imr("canary", rule("m", canary=None))


def test_a_matching_rule_rewrites_the_body_the_choice_and_the_model_header() -> None:
    """The body's model becomes the target, keys in the client's order; the choice sees it and
    an ``x-gateway-model-name`` naming it (LoRA-aware plugins read that); a followup maps back."""
    admitted = admit(control(CANARY), b'{"prompt": "hi", "model": "m", "n": 1}')
    assert admitted.body == b'{"prompt":"hi","model":"canary","n":1}'
    assert admitted.request.body == admitted.body
    assert dict(admitted.request.headers)["x-gateway-model-name"] == "canary"
    assert [type(f) for f in admitted.followups] == [ModelNameBack]


def test_unchanged_when_the_target_is_the_model() -> None:
    """No rule, or a rule drawing the model itself: the client's bytes go upstream untouched."""
    body = b'{"model": "m"}'
    for c in (control(), control(imr("same", rule("m", m=None)))):
        admitted = admit(c, body)
        assert admitted.body is None
        assert admitted.request.body == body
        assert admitted.followups == ()


def test_the_header_names_a_target_and_a_matching_rule_overrides_it() -> None:
    """``x-llm-d-model-name-rewrite`` (or the older name) seeds the target; a rule for the
    body's model draws over it, as in the router."""
    body = b'{"model": "m"}'
    seeded = admit(control(), body, x_llm_d_model_name_rewrite="from-header")
    assert seeded.body == b'{"model":"from-header"}'
    older = admit(control(), body, x_gateway_model_name_rewrite="old-header")
    assert older.body == b'{"model":"old-header"}'
    overridden = admit(control(CANARY), body, x_llm_d_model_name_rewrite="from-header")
    assert overridden.body == b'{"model":"canary"}'


def test_no_model_and_no_generic_rule_is_a_400_naming_the_field() -> None:
    """The router's "model not found in request body"; a generic rule supplies a model, and
    the response then keeps the target's name (there is no client name to map back to)."""
    answer = refusal(control(CANARY), b'{"prompt": "hi"}')
    assert answer.status == 400
    assert "'model'" in answer.message
    generic = admit(control(imr("default", rule(fallback=None))), b'{"prompt": "hi"}')
    assert generic.body == b'{"prompt":"hi","model":"fallback"}'
    assert generic.followups == ()
    assert refusal(
        control(imr("empty", {"matches": [{"model": {"value": "m"}}]})), b'{"model":"m"}'
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"not json", "not valid JSON"), (b"[1]", "not a JSON object"), (b'{"model": 7}', "'model'")],
    ids=["not-json", "not-an-object", "model-not-a-string"],
)
def test_a_body_that_names_no_model_properly_is_a_400(body: bytes, message: str) -> None:
    """Not JSON, not an object, a ``model`` that is no string: 400 saying which."""
    answer = refusal(control(CANARY), body)
    assert answer.status == 400
    assert message in answer.message


def test_a_request_without_a_body_passes_untouched() -> None:
    """Headers only (a GET, or a body not streamed to the picker): nothing to rewrite."""
    request = Admitted(RequestInfo([("x-gateway-model-name", "m")]))
    assert asyncio.run(control(CANARY).admit(request)) is request


def test_each_decision_is_counted_with_the_router_s_labels() -> None:
    """``{model_rewrite_name, model_name, target_model}``; a generic rule's client names fold
    into ``other`` past the cap, the configured names never do."""
    registry = CollectorRegistry()
    generic = imr("default", rule(fallback=None))
    c = ModelRewriteControl(fixed(CANARY, generic), RewriteMetrics(registry), Draws(*[0] * 9))
    for body in (b'{"model":"m"}', b'{"model":"m"}', b'{"model":"z"}'):
        asyncio.run(c.admit(Admitted(RequestInfo([], body))))
    count = registry.get_sample_value
    labels = {"model_rewrite_name": "canary", "model_name": "m", "target_model": "canary"}
    assert count("llm_d_epp_model_rewrite_decisions_total", labels) == 2
    labels = {"model_rewrite_name": "default", "model_name": "z", "target_model": "fallback"}
    assert count("llm_d_epp_model_rewrite_decisions_total", labels) == 1
    metrics = RewriteMetrics(CollectorRegistry())
    for n in range(CAP + 1):
        metrics.count("default", f"client-{n}", "fallback", frozenset({"m"}))
    metrics.count("canary", "m", "canary", frozenset({"m"}))
    names = {s.labels["model_name"] for f in metrics.decisions.collect() for s in f.samples}
    assert "other" in names
    assert "m" in names
    assert f"client-{CAP}" not in names


# --- the response mapped back --------------------------------------------------------------------


STREAM = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"llama-canary","choices":[]}\n\n'
    b'data: {"id": "c1", "model": "llama-canary", "usage": {"total_tokens": 3}}\n\n'
    b"data: [DONE]\n\n"
)


def test_every_split_of_the_stream_maps_the_model_back() -> None:
    """Whichever byte a chunk ends on, the client sees its own name, spacing kept: the
    bytes that could begin the target's name wait for the next chunk."""
    expected = STREAM.replace(b"llama-canary", b"llama")
    for cut in range(len(STREAM) + 1):
        back = ModelNameBack("llama-canary", "llama")
        assert back.chunk(STREAM[:cut]) + back.chunk(STREAM[cut:]) == expected, cut
    byte_by_byte = ModelNameBack("llama-canary", "llama")
    assert b"".join(byte_by_byte.chunk(STREAM[i : i + 1]) for i in range(len(STREAM))) == expected


def test_only_the_model_field_naming_the_target_is_touched() -> None:
    """Other fields, other models, and names with regular-expression characters."""
    back = ModelNameBack("org/m.v1+x", "alias")
    body = b'{"model":"org/m.v1+x","note":"org/m.v1+x","other":{"model":"orgXm.v1+x"}}'
    assert back.chunk(body) == (
        b'{"model":"alias","note":"org/m.v1+x","other":{"model":"orgXm.v1+x"}}'
    )
    assert ModelNameBack("t", "a").chunk(b'{"model":"tt"}') == b'{"model":"tt"}'


# --- one picker over real gRPC ----------------------------------------------------------------------


class Seeing(RoundRobin):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[RequestInfo] = []

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        self.seen.append(request)
        return super().choose(request, candidates)


STREAMED = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.FULL_DUPLEX_STREAMED)
POST = {":method": "POST", ":path": "/v1/chat/completions", "x-gateway-model-name": "m"}


def test_the_picker_sends_the_rewritten_body_and_maps_the_streamed_answer_back() -> None:
    """Through a picker with the control: the body upstream names the target, with its
    length; the strategy saw it; the streamed response comes back with the client's name,
    though the target's name was split across chunks (one of them all of it held back)."""
    strategy = Seeing()
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    picker = EndpointPickerService(
        pool,
        strategy,
        PickerMetrics(CollectorRegistry()),
        controls=[control(CANARY)],
    )
    assert picker.reads_response_body
    answer = b'data: {"model":"canary","choices":[]}\n\ndata: [DONE]\n\n'
    start, cut = answer.index(b'"model"'), answer.index(b"nary")
    pieces = (answer[:start], answer[start:cut], answer[cut:])  # the middle: '"model":"ca'

    messages = [
        request_headers(POST, body_modes=STREAMED),
        request_body(b'{"model": "m", "messages": []}'),
        response_headers({":status": "200"}),
        *(response_body(p, end_of_stream=False) for p in pieces[:2]),
        response_body(pieces[2]),
    ]
    routed, sent, _, *replies = asyncio.run(exchange_with("lwepp", picker, messages))
    upstream = sent.request_body.response.body_mutation.streamed_response.body
    assert upstream == b'{"model":"canary","messages":[]}'
    assert ("content-length", str(len(upstream))) in set_headers(routed)
    assert strategy.seen[0].body == upstream
    chunks = [r.response_body.response.body_mutation.streamed_response.body for r in replies]
    assert chunks[0] == pieces[0]  # the piece of the name: held back, no message for it
    assert b"".join(chunks) == answer.replace(b"canary", b"m")


def test_rewrites_leave_a_picker_without_them_as_it_was() -> None:
    """The control comes only with rewrites: a picker built without one neither parses bodies
    nor reads responses."""
    pool = Pool(StaticPods(pod("p0", "10.0.0.1", 3000)), {})
    picker = EndpointPickerService(pool, RoundRobin(), PickerMetrics(CollectorRegistry()))
    assert (picker.controls, picker.reads_response_body) == ((), False)


def test_a_model_rewrite_names_its_models() -> None:
    """What ``GET /v1/models`` and the metric's cardinality guard read."""
    rewrite: ModelRewrite = decode(imr("c", rule("alias", "m", t1=1, t2=2)))
    assert rewrite.names() == {"alias", "m", "t1", "t2"}
    assert table(imr("c", rule("alias", t=1)), imr("d", rule(g=1))).clients == {"alias"}
