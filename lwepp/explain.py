"""Why a request went where it went: explained decisions, for the client and for the operator.

Off unless asked for: a decision names every candidate's address and load.
With ``explain="header"`` a request with ``x-switchyard-explain: 1`` (with
``explain="all"`` every request) gets ``x-switchyard-decision`` on its
response: compact JSON of what each filter removed, every candidate's scores
and the pick, or the failure that made it round-robin. The record is built
only when asked for (``Explanation``); the last ones, and every fallback, are
kept for ``GET /debug/decisions`` (``DecisionLog``).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import orjson

from lwepp.attributes import plain
from lwepp.contracts import Candidate, Scored, Scorer
from pods.model import Endpoint
from wire.exchange import HEADER_VALUE_LIMIT

EXPLAIN_HEADER: Final = "x-switchyard-explain"
"""Request header asking for the decision to be explained (``1``, ``true``, ``yes``)."""

DECISION_HEADER: Final = "x-switchyard-decision"
"""Response header carrying the explained decision, compact JSON."""

ExplainMode = Literal["header", "all", "off"]
"""When to explain: on request (the header), every request, or never."""

_YES: Final = frozenset({"1", "true", "yes", "on"})


def asked(mode: ExplainMode, headers: Mapping[str, str]) -> bool:
    """Whether this request's decision is to be explained (``headers``: lower-case names)."""
    return mode == "all" or (mode == "header" and headers.get(EXPLAIN_HEADER, "").lower() in _YES)


class DecisionLog:
    """The last decisions explained, and every fallback, for ``GET /debug/decisions``.

    A bounded deque: the oldest record goes when a new one comes. A fallback
    is kept even unexplained (a short record): a failing plugin is exactly
    what one looks for here.
    """

    def __init__(self, size: int = 100) -> None:
        self._records: collections.deque[Mapping[str, Any]] = collections.deque(maxlen=size)

    def add(self, record: Mapping[str, Any]) -> None:
        self._records.append(record)

    def render(self) -> bytes:
        """The records, oldest first, as a JSON array."""
        return orjson.dumps(list(self._records))


def header_json(data: Mapping[str, Any]) -> str:
    """Compact JSON that is safe in a header value: ASCII only, no line breaks, bounded.

    A decision over ``HEADER_VALUE_LIMIT`` bytes (a large pool, a long client
    ``x-request-id``) keeps the best-scored rows that fit and says it was cut
    short; the whole record is on ``/debug/decisions``.
    """
    text = _compact(data)
    if len(text) <= HEADER_VALUE_LIMIT:
        return text
    cut: dict[str, Any] = {
        key: value for key, value in data.items() if key not in ("candidates", "filters", "scores")
    }
    cut["truncated"] = "the whole decision is on /debug/decisions"
    budget = HEADER_VALUE_LIMIT - len(_compact({**cut, "scores": []}))
    rows = []
    for row in data.get("scores", ()):
        budget -= len(_compact(row)) + 1
        if budget < 0:
            break
        rows.append(row)
    cut["scores"] = rows
    if len(text := _compact(cut)) > HEADER_VALUE_LIMIT:  # a request id of kilobytes, say
        text = _compact({"picked": list(data.get("picked", ()))[:1], "truncated": cut["truncated"]})
    return text


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True)


class Explanation:
    """Why a request went where it went, as JSON-ready data (built only when asked for).

    ``candidates``: the endpoints the request could go to; ``filters``: what
    each filter removed; ``weights``: each scorer's weight; ``scores``: each
    candidate (best first) with its total, each scorer's raw score and the
    attributes the plugins read (value and age in seconds); ``picked``: the
    answer; ``fallback``: the plugin failure that made it round-robin.
    """

    __slots__ = ("data",)

    def __init__(self, request_id: str, candidates: Sequence[Endpoint]) -> None:
        self.data: dict[str, Any] = {
            "request": request_id,
            "candidates": [e.hostport for e in candidates],
            "filters": [],
            "weights": {},
            "scores": [],
            "picker": None,
            "picked": [],
            "fallback": None,
        }

    def filtered(self, name: str, before: Sequence[Candidate], after: Sequence[Candidate]) -> None:
        kept = {id(c) for c in after}
        removed = [c.endpoint.hostport for c in before if id(c) not in kept]
        self.data["filters"].append({"filter": name, "removed": removed})

    def scored(
        self,
        scorers: Sequence[tuple[Scorer, float]],
        scored: Sequence[Scored],
        reads: frozenset[str],
        now: float,
    ) -> None:
        self.data["weights"] = {scorer.name: weight for scorer, weight in scorers}
        rows = []
        for s in sorted(scored, key=lambda s: s.total, reverse=True):
            row: dict[str, Any] = {
                "endpoint": s.candidate.endpoint.hostport,
                "total": round(s.total, 4),
                "scores": {name: round(score, 4) for name, score in s.scores.items()},
            }
            measured = {
                n: s.candidate.attributes[n] for n in sorted(reads) if n in s.candidate.attributes
            }
            if measured:
                row["attributes"] = {
                    n: {"value": plain(m.value), "age": round(now - m.at, 3)}
                    for n, m in measured.items()
                }
            rows.append(row)
        self.data["scores"] = rows

    def picked(self, picker: str, endpoints: Sequence[Endpoint]) -> None:
        self.data["picker"] = picker
        self.data["picked"] = [e.hostport for e in endpoints]

    def fell_back(self, failure: Exception, endpoints: Sequence[Endpoint]) -> None:
        self.data["fallback"] = str(failure)
        self.picked("round-robin (fallback)", endpoints)
