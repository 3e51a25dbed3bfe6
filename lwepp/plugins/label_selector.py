"""``label-selector-filter``: keep the candidates whose labels match a Kubernetes label selector.

Parameters (a ``metav1.LabelSelector``, as the llm-d router's filter takes):

- ``matchLabels``: ``{key: value}``; every pair must be among the labels;
- ``matchExpressions``: ``[{key, operator, values}]`` with the operators
  ``In`` (the label is present with one of ``values``), ``NotIn`` (absent,
  or present with none of them), ``Exists`` and ``DoesNotExist`` (which take
  no ``values``).

All requirements must hold. With neither field every candidate is kept, as
an empty Kubernetes selector selects everything. Reads no attributes, so
there is no unknown data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from lwepp.contracts import Candidate, LLMRequest
from plugin_api import NO_PARAMS, Params

Requirement = Callable[[Mapping[str, str]], bool]
OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")


def requirement(key: str, operator: str, values: frozenset[str]) -> Requirement:
    """One ``matchExpressions`` entry as a test on a label mapping."""
    match operator:
        case "In":
            return lambda labels: labels.get(key) in values
        case "NotIn":
            return lambda labels: labels.get(key) not in values
        case "Exists":
            return lambda labels: key in labels
        case "DoesNotExist":
            return lambda labels: key not in labels
    raise ValueError(f"unknown operator {operator!r}")


class LabelSelectorFilter:
    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.match_labels: Mapping[str, str] = params.get("matchLabels", dict, {})
        for key, value in self.match_labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise params.error(f"matchLabels.{key}", "expected a string value")
        expressions: list[Any] = params.get("matchExpressions", list, [])
        self.requirements = [_expression(params, i, raw) for i, raw in enumerate(expressions)]

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        for test in self.requirements:  # noqa: SIM110 (a plain loop: no generator per candidate)
            if not test(labels):
                return False
        return True

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        return [c for c in candidates if self.matches(c.endpoint.labels)]


def _expression(params: Params, index: int, raw: Any) -> Requirement:
    entry = params.entry(f"matchExpressions[{index}]", raw)
    key, operator = entry.require("key", str), entry.require("operator", str)
    values: list[Any] = entry.get("values", list, [])
    entry.done()
    if not key:
        raise entry.error("key", "must not be empty")
    if operator not in OPERATORS:
        raise entry.error("operator", f"expected one of {', '.join(OPERATORS)}")
    if not all(isinstance(v, str) for v in values):
        raise entry.error("values", "expected a list of strings")
    # Kubernetes' rules: In/NotIn need values, Exists/DoesNotExist take none.
    if operator in ("In", "NotIn") and not values:
        raise entry.error("values", f"required with operator {operator}")
    if operator in ("Exists", "DoesNotExist") and values:
        raise entry.error("values", f"must be empty with operator {operator}")
    return requirement(key, operator, frozenset(values))
