"""``no-hit-lru-scorer``: send cold requests (no cached prefix anywhere) least recently used first.

A request that hits no endpoint's cache will fill new KV blocks wherever it
goes; sending such requests in turn, to the endpoint that took a cold one
longest ago, spreads the cache's growth (and the prefill work) evenly
instead of piling it where the other scorers happen to tie. The llm-d
router's scorer, with its rules:

- cold or warm: the request is cold when the prefix scorer's ``PrefixMatch``
  (``lwepp.plugins.prefix``, left in ``request.state`` by the
  ``prefix-cache-scorer`` reading ``prefixMatchInfoProducerName``) shows no
  candidate holding any block, or when there is none. The prefix scorer must
  therefore run first: list it before this one in the profile.
- warm: every candidate scores 0.5 (neutral: cache affinity decides).
- cold, with ``n`` candidates: the ones never given a cold request score
  ``1 - i/(n-1)`` in candidate order; each one that was scores
  ``1 - (never + position)/(n-1)``, at least 0, where ``position`` is its
  place in the LRU (0: least recently used) and ``never`` how many have
  never had one. A single candidate scores 1.
- picked: when the request was cold, the primary pick becomes the most
  recently used. The LRU remembers at most ``lruSize`` endpoints (1024).

Parameters: ``lruSize`` (1024; <= 0 means the default, as in the router),
``prefixMatchInfoProducerName`` (the prefix producer, default
``approx-prefix-cache-producer``), and the router's deprecated
``prefixPluginType``/``prefixPluginName``, accepted and unused (as there).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence

from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.approx_prefix import DEFAULT_PRODUCER, PrefixMatch, match_key
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint


class NoHitLRUScorer:
    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        params.get("prefixPluginType", str, "")  # deprecated in the router: never used there
        params.get("prefixPluginName", str, "")
        size = params.get("lruSize", int, 1024)
        self.size = size if size > 0 else 1024
        producer = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        self._match, self._cold = match_key(producer), f"{name}.cold"
        self.lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Endpoints (``ip:port``) that took a cold request, least recently first."""
        self.on_cold: Callable[[str], None] | None = None
        """Told of every cold pick (``lwepp.sharing`` publishes it)."""
        self.phase, self.replicas = 0, 1
        """This replica's place among the replicas sharing the LRU, and how many they are."""
        self._order: list[str] = []
        self._since = 0

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        match: PrefixMatch | None = request.state.get(self._match)
        cold = match is None or not any(match.matched.values())
        request.state[self._cold] = cold
        n = len(candidates)
        if not cold:
            return [0.5] * n
        if n == 1:
            return [1.0]
        position = {endpoint: i for i, endpoint in enumerate(self._spread())}
        keys = [c.endpoint.hostport for c in candidates]
        never = sum(1 for key in keys if key not in position)
        scores, unused, span = [], 0, n - 1
        for key in keys:
            if key in position:
                scores.append(max(0.0, 1.0 - (never + position[key]) / span))
            else:
                scores.append(1.0 - unused / span)
                unused += 1
        return scores

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints or not request.state.pop(self._cold, False):
            return
        key = endpoints[0].hostport
        self.touch(key)
        self._since += 1
        if self.on_cold is not None:  # lwepp.sharing: the other replicas hear of it
            self.on_cold(key)

    def synced(self, phase: int, replicas: int) -> None:
        """The others' cold picks were applied (``lwepp.sharing``): this is replica ``phase`` of
        ``replicas``, all holding about this order until the next sync.

        Between two syncs every replica would send its cold requests to the same least
        recently used endpoint, having the same order and not seeing the others' picks. So
        each takes its own turns in the order as synced: replica ``phase``'s ``j``-th cold
        pick since the sync goes to position ``phase + j × replicas``, the positions before
        it left to the others, as one replica would have dealt the same requests in turn.
        """
        self.phase, self.replicas = phase, replicas
        self._order = list(self.lru)
        self._since = 0

    def _spread(self) -> Iterable[str]:
        """The LRU as this replica reads it: the positions the other replicas presumably took
        since the last sync moved to the most recently used end (``synced``)."""
        if self.replicas <= 1:
            return self.lru  # one replica: the order as it is, not copied on every pick
        taken = {
            key
            for i, key in enumerate(self._order[: self.phase + self._since * self.replicas])
            if i % self.replicas != self.phase
        }
        if not taken:
            return self.lru
        return [k for k in self.lru if k not in taken] + [k for k in self.lru if k in taken]

    def touch(self, key: str) -> None:
        """``key`` took a cold request: it becomes the most recently used."""
        self.lru[key] = None
        self.lru.move_to_end(key)
        if len(self.lru) > self.size:
            self.lru.popitem(last=False)
