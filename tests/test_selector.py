"""Kubernetes label selectors in their string form: every operator, what each matches, the errors."""

from __future__ import annotations

import pytest

from pods.selector import LabelSelector, SelectorError

LABELS = {"app": "vllm", "tier": "gold", "gpus": "8"}


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("", True),
        ("app=vllm", True),
        ("app==vllm", True),
        ("app=sglang", False),
        ("app!=sglang", True),
        ("canary!=yes", True),  # absent: != holds, as in Kubernetes
        ("tier in (gold, silver)", True),
        ("tier in (silver)", False),
        ("tier notin (silver,bronze)", True),
        ("canary notin (yes)", True),
        ("tier", True),
        ("canary", False),
        ("!canary", True),
        ("!tier", False),
        ("gpus>4", True),
        ("gpus<4", False),
        ("app>4", False),  # not a number: no match
        ("app=vllm,tier in (gold,silver),!canary,gpus>7", True),
        ("app=vllm,tier in (silver,bronze)", False),
    ],
)
def test_each_operator_selects_as_kubernetes_does(text: str, matches: bool) -> None:
    """Each label selector operator (=, ==, !=, in, notin, exists, !, >, <) matches as in Kubernetes."""
    assert LabelSelector.parse(text).matches(LABELS) is matches


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tier in ()", "in needs at least one value"),
        ("app=vllm,=x", "not a requirement"),
        ("gpus>many", "> needs an integer"),
        ("bad key!=x", "not a requirement"),
        ("-app=x", "'-app' is not a label key"),
        ("app=not valid", "not a requirement"),
        ("app in (a,-b)", "'-b' is not a label value"),
    ],
)
def test_a_bad_selector_names_the_requirement_at_fault(text: str, message: str) -> None:
    """A malformed selector is refused naming the requirement, key or value at fault."""
    with pytest.raises(SelectorError, match=message.replace("(", r"\(")):
        LabelSelector.parse(text)


def test_the_string_form_reads_back_as_the_same_selector() -> None:
    """``str()`` is what the API server's labelSelector takes, and parses to an equal selector."""
    text = "app=vllm,tier in (gold,silver),canary!=yes,!beta,gpus>4,zone"
    selector = LabelSelector.parse(text)
    assert str(selector) == text
    assert LabelSelector.parse(str(selector)) == selector
    assert str(LabelSelector.from_labels({"b": "2", "a": "1"})) == "a=1,b=2"
    assert not LabelSelector.parse("  ")
