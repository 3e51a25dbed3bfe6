"""The llm-d router's role filters (label ``llm-d.ai/role``) and its deprecated ``by-label``."""

from __future__ import annotations

import pytest

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.role_filters import ByLabelFilter, DecodeFilter, EncodeFilter, PrefillFilter
from plugin_api import ConfigError, Params
from pods.model import Endpoint

ROLES = ["decode", "prefill", "prefill-decode", "both", "encode", "encode-prefill",
         "encode-prefill-decode", None]  # fmt: skip
REQUEST = LLMRequest("r", {}, None, None, None)


def kept(plugin: object, roles: list[str | None] = ROLES) -> list[str | None]:
    candidates = [
        Candidate(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, {} if r is None else {"llm-d.ai/role": r}))
        for i, r in enumerate(roles)
    ]
    chosen = plugin.filter(REQUEST, candidates, 0.0)  # type: ignore[attr-defined]
    return [c.endpoint.labels.get("llm-d.ai/role") for c in chosen]


def test_each_role_filter_keeps_the_roles_the_router_lists() -> None:
    """decode keeps decoders and unlabelled servers; prefill and encode keep only their roles."""
    assert kept(DecodeFilter("d")) == [
        "decode",
        "prefill-decode",
        "both",
        "encode-prefill-decode",
        None,
    ]
    assert kept(PrefillFilter("p")) == [
        "prefill", "prefill-decode", "both", "encode-prefill", "encode-prefill-decode",
    ]  # fmt: skip
    assert kept(EncodeFilter("e")) == ["encode", "encode-prefill", "encode-prefill-decode"]


def test_by_label_keeps_the_valid_values_and_unlabelled_ones_if_allowed() -> None:
    """by-label keeps endpoints whose label value is valid, and unlabelled ones when allowsNoLabel."""
    params = Params({"label": "llm-d.ai/role", "validValues": ["decode"], "allowsNoLabel": True})
    assert kept(ByLabelFilter("b", params)) == ["decode", None]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"validValues": ["a"]}, "label: required"),
        ({"label": "x"}, "validValues: must not be empty unless allowsNoLabel is true"),
        ({"label": "x", "validValues": [1]}, "validValues: expected a list of strings"),
    ],
)
def test_by_label_refuses_a_filter_that_could_never_keep_anything(
    raw: dict[str, object], message: str
) -> None:
    """by-label without a label, with no valid values (unless allowsNoLabel) or non-string ones is refused naming the field."""
    with pytest.raises(ConfigError, match=message):
        ByLabelFilter("b", Params(raw))
