"""``decode-filter``, ``prefill-filter`` and ``encode-filter``: keep the endpoints whose pod serves
that stage of disaggregated serving, by the pod label ``llm-d.ai/role`` (the llm-d router's
``bylabel`` filters); and ``by-label``, the general form they are built on.

==============  ===============================================  ======================
filter          keeps pods whose ``llm-d.ai/role`` is one of      pods without the label
==============  ===============================================  ======================
decode-filter   decode, prefill-decode, both, encode-prefill-decode  kept
prefill-filter  prefill, encode-prefill, prefill-decode, both,       dropped
                encode-prefill-decode
encode-filter   encode, encode-prefill, encode-prefill-decode         dropped
==============  ===============================================  ======================

A pod without the label is a plain model server that does everything, so the
decode filter keeps it: the router's sample configurations put
``decode-filter`` in their one profile, and a pool of unlabelled servers then
routes exactly as without it. The three take no parameters.

``by-label`` (deprecated in the router since v0.9, kept for old files) takes
``label``, ``validValues`` (a list of strings) and ``allowsNoLabel`` (false);
``validValues`` may be empty only when ``allowsNoLabel`` is true.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from lwepp.contracts import Candidate, LLMRequest
from plugin_api import NO_PARAMS, Params

ROLE_LABEL: Final = "llm-d.ai/role"


class ByLabelFilter:
    """Keep candidates whose ``label`` is one of ``valid``, or, with ``allows_none``, absent."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.label = params.require("label", str)
        valid: list[object] = params.get("validValues", list, [])
        self.allows_none = params.get("allowsNoLabel", bool, False)
        if not self.label:
            raise params.error("label", "must not be empty")
        if not all(isinstance(v, str) for v in valid):
            raise params.error("validValues", "expected a list of strings")
        if not valid and not self.allows_none:
            raise params.error("validValues", "must not be empty unless allowsNoLabel is true")
        self.valid = frozenset(str(v) for v in valid)

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        kept = []
        for candidate in candidates:
            value = candidate.endpoint.labels.get(self.label)
            if value in self.valid or (value is None and self.allows_none):
                kept.append(candidate)
        return kept


class _RoleFilter(ByLabelFilter):
    """One stage's filter on ``llm-d.ai/role``; no parameters of its own."""

    roles: frozenset[str] = frozenset()
    allows_unlabelled: bool = False

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.label, self.valid, self.allows_none = ROLE_LABEL, self.roles, self.allows_unlabelled


class DecodeFilter(_RoleFilter):
    roles = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
    allows_unlabelled = True


class PrefillFilter(_RoleFilter):
    roles = frozenset(
        {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}
    )


class EncodeFilter(_RoleFilter):
    roles = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})
