"""Pickers: from the scored candidates to the endpoints, best first (primary, then fallbacks).

Three pickers, with the llm-d router's type names and its one parameter,
``maxNumOfEndpoints`` (default 1): how many endpoints to return. More than
one makes the reply a fallback list, ``ip:port,ip:port`` (GIE protocol
v0.4.0), which the proxy walks on retries.

``max-score-picker`` (the default when a profile names no picker)
    The highest total first. The router shuffles the candidates before a
    stable sort, so that ties fall at random; here **ties fall in turn**:
    among endpoints with the same total, each pick starts one further along
    (one counter for all requests, advanced once per pick). That spreads
    ties as evenly as shuffling does, is reproducible in tests, and, when
    nothing scores (every total is 0, all tie), is exactly the core's
    round-robin: the same counter start, the same candidate order, so a
    pipeline with no scorers answers byte for byte as LWEPP without one.

``random-picker``
    ``maxNumOfEndpoints`` candidates drawn uniformly at random, scores ignored.

``weighted-random-picker``
    Drawn at random with probability proportional to the total score,
    without replacement (Efraimidis–Spirakis: each candidate draws
    ``u ** (1 / total)`` and the largest keys win, which for one endpoint is
    exactly proportional sampling). Candidates with a total of 0 come after
    every positive one, in random order; if all are 0 the draw is uniform.

The random pickers take an injected ``random.Random`` (tests seed it).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from operator import attrgetter

from lwepp.contracts import LLMRequest, Scored
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint


class MaxScorePicker:
    """The highest totals first; equal totals in turn (see the module docstring)."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.max_endpoints = params.get("maxNumOfEndpoints", int, 1, at_least=1)
        # As the core's RoundRobin: advanced before use, so the first pick takes the second.
        self._turns = itertools.count(1)

    def pick(self, request: LLMRequest, scored: Sequence[Scored]) -> Sequence[Endpoint]:
        turn = next(self._turns)
        if self.max_endpoints == 1:  # the common case: only the best group matters
            best = max(s.total for s in scored)
            top = [s for s in scored if s.total == best]
            return (top[turn % len(top)].candidate.endpoint,)
        # sorted() is stable, also with reverse=True: equal totals keep candidate order.
        ranked = sorted(scored, key=attrgetter("total"), reverse=True)
        chosen: list[Endpoint] = []
        for _, tied in itertools.groupby(ranked, key=attrgetter("total")):
            group = list(tied)
            start = turn % len(group)
            chosen += [s.candidate.endpoint for s in group[start:] + group[:start]]
            if len(chosen) >= self.max_endpoints:
                break
        return chosen[: self.max_endpoints]


class RandomPicker:
    """``maxNumOfEndpoints`` candidates uniformly at random; the scores are not looked at."""

    def __init__(
        self, name: str, params: Params = NO_PARAMS, rng: random.Random | None = None
    ) -> None:
        self.name = name
        self.max_endpoints = params.get("maxNumOfEndpoints", int, 1, at_least=1)
        self.rng = rng or random.Random()

    def pick(self, request: LLMRequest, scored: Sequence[Scored]) -> Sequence[Endpoint]:
        drawn = self.rng.sample(list(scored), min(self.max_endpoints, len(scored)))
        return [s.candidate.endpoint for s in drawn]


class WeightedRandomPicker(RandomPicker):
    """At random, each candidate's chance proportional to its total (see the module docstring)."""

    def pick(self, request: LLMRequest, scored: Sequence[Scored]) -> Sequence[Endpoint]:
        draw = self.rng.random
        # A positive total's key lies in (0, 1]; a zero total's in [-1, 0): always behind.
        keys = [draw() ** (1.0 / s.total) if s.total > 0 else draw() - 1.0 for s in scored]
        order = sorted(range(len(scored)), key=keys.__getitem__, reverse=True)
        return [scored[i].candidate.endpoint for i in order[: self.max_endpoints]]
