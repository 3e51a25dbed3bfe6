"""``inflight-load-producer``: requests and prompt tokens in flight per endpoint, as picked.

Scraped metrics lag by the scrape interval, and an engine's waiting queue
stays at 0 until it saturates: between two scrapes a burst sees every engine
as idle and lands on one. The picker itself knows better. It counts each
request from the moment it picks an endpoint to the moment the response
ends, so the next pick, a microsecond later, sees it. This is the llm-d
router's ``inflight-load-producer``; ``active-request-scorer`` and
``token-load-scorer`` read what it counts.

The request's life, as the router tracks it:

1. prepare: leave the live counts in ``request.state`` under
   ``"<name>.load"`` (an ``InFlight``: read-only views, no copy) for the
   scorers;
2. picked: add one request and the prompt's *uncached* tokens to the primary
   pick (the endpoint the router's ``TargetEndpoints[0]`` is). The prompt's
   tokens are estimated as the prefix scorer estimates them, 4 characters a
   token; when a prefix scorer left its ``PrefixMatch`` (``lwepp.plugins.prefix``,
   the producer named in ``prefixMatchInfoProducerName``), the blocks the
   endpoint already holds are not counted: it will not compute them;
3. the first response chunk: prefill is over, so the prompt's tokens are
   released (the request stays counted);
4. response complete: the request and anything left are released.

A response that breaks off never completes (``lwepp.picking.Followup``): as
the router's plugin state does, an entry untouched for 5 minutes (no chunk,
no end) is released when the next request is picked, so a lost stream
cannot hold an endpoint down for ever. Counts that fall to zero are dropped,
so endpoints that left the pool leave nothing behind.

Parameters (the router's): ``addEstimatedOutputTokens`` (false): also count
an estimate of the output tokens, released only at the end;
``outputRatio`` (1.5, >= 0): that estimate is ``round(input × ratio)``,
capped by the request's own ``max_tokens`` / ``max_completion_tokens`` /
``max_output_tokens`` and by ``maxEstimatedOutputTokens`` (>= 0, unset: no
cap); ``prefixMatchInfoProducerName``: whose ``PrefixMatch`` discounts
cached blocks (default ``approx-prefix-cache-producer``, the prefix scorer's
default, when the configuration has one). ``syncCrossReplicaState`` is
accepted and has no effect: one picker replica counts only its own picks.

Beside the counts it offers ``request_tokens``, the router's
``UncachedRequestTokens``: what the request being picked would add to each
candidate, its prompt less the blocks that candidate holds, which
``token-load-scorer`` adds to the load it reads (the router's since v0.10),
so that a cache hit weighs as the prefill it saves.

The producer does not ask for the body itself: counting requests needs none
(the router's payload-agnostic configuration runs ``active-request-scorer``
behind a parser that reads no body). Tokens are counted when the body is
parsed for some plugin, as it is for ``token-load-scorer`` and
``prefix-cache-scorer``; otherwise a request adds 0 tokens, as the router's
does when nothing tokenized the prompt.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from lwepp.contracts import IN_FLIGHT_LOAD, PREFIX_MATCH, Candidate, LLMRequest, Usage, Want
from lwepp.plugins.approx_prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_PRODUCER,
    PrefixMatch,
    match_key,
    prompt_text,
)
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint

PRODUCER: Final = "inflight-load-producer"
"""The producer's type, and the name its consumers look for when they name none."""
STALE_SECONDS: Final = 300.0
"""An entry untouched this long is released (the router's plugin-state staleness, 5 minutes)."""
OUTPUT_LIMITS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
"""The request's own output cap, by API (chat and completions, chat's newer name, Responses)."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """Live, read-only counts per endpoint (``ip:port``); an endpoint not listed has none."""

    requests: Mapping[str, int]
    tokens: Mapping[str, int]


class Summed(Mapping[str, int]):
    """One replica's own counts plus the other replicas' (``lwepp.sharing``), read-only.

    ``peers`` is replaced whole by whoever syncs it, on the event loop (empty:
    no sharing, each replica on its own view). An endpoint with no count in
    either is absent, as in a plain count mapping.
    """

    __slots__ = ("own", "peers")

    def __init__(self, own: Mapping[str, int]) -> None:
        self.own = own
        self.peers: Mapping[str, int] = {}

    def __getitem__(self, key: str) -> int:
        total = self.own.get(key, 0) + self.peers.get(key, 0)
        if not total:
            raise KeyError(key)
        return total

    def get(self, key: str, default: int = 0) -> int:  # type: ignore[override]
        total = self.own.get(key, 0) + self.peers.get(key, 0)
        return total if total else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.own.keys() | self.peers.keys())

    def __len__(self) -> int:
        return len(self.own.keys() | self.peers.keys())


def load_key(producer: str) -> str:
    """The ``request.state`` key the producer named ``producer`` leaves its ``InFlight`` under."""
    return f"{producer}.load"


class _Entry:
    """One request's contribution to one endpoint: released once, in parts."""

    __slots__ = ("endpoint", "output", "prompt", "requests", "touched")

    def __init__(self, endpoint: str, prompt: int, output: int, now: float) -> None:
        self.endpoint, self.prompt, self.output = endpoint, prompt, output
        self.requests, self.touched = 1, now


class InFlightLoadProducer:
    provides: Final = frozenset({IN_FLIGHT_LOAD})
    """The scorers that name it read its counts (``lwepp.contracts.Want``)."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.add_output = params.get("addEstimatedOutputTokens", bool, False)
        self.output_ratio = params.get("outputRatio", float, 1.5, at_least=0)
        cap = params.get("maxEstimatedOutputTokens", int, -1)
        if "maxEstimatedOutputTokens" in params and cap < 0:
            raise params.error("maxEstimatedOutputTokens", f"must be >= 0, got {cap}")
        self.output_cap: int | None = cap if cap >= 0 else None
        producer = params.get("prefixMatchInfoProducerName", str, "") or DEFAULT_PRODUCER
        params.get("syncCrossReplicaState", bool, True)
        self.prefix: Any = None
        """The prefix producer whose match discounts cached blocks, when there is one."""
        self.wants = (
            Want(
                "prefixMatchInfoProducerName",
                producer,
                PREFIX_MATCH,
                self.use_prefix,
                default=DEFAULT_PRODUCER,
            ),
        )
        self.clock: Callable[[], float] = time.monotonic
        """When entries were last touched (injected in tests)."""
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self.requests = Summed(MappingProxyType(self._requests))
        self.tokens = Summed(MappingProxyType(self._tokens))
        """Counts as the scorers read them: this replica's picks (``own``), plus the other
        replicas' when ``lwepp.sharing`` syncs them (``peers``)."""
        self.load = InFlight(self.requests, self.tokens)
        self._key, self._match = f"{name}.entry", match_key(producer)
        self._load = load_key(name)
        self._tokens_key = f"{name}.prompt_tokens"
        self._live: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        """Entries not yet released, least recently touched first (for the 5-minute sweep)."""
        self._ids = itertools.count()

    def use_prefix(self, producer: Any) -> None:
        """Discount the blocks the named prefix producer finds held (``Want.give``)."""
        self.prefix = producer

    def prepare(self, request: LLMRequest) -> None:
        request.state[self._load] = self.load

    def request_tokens(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> dict[str, int]:
        """The prompt tokens each candidate (``ip:port``) would have to compute for this
        request: its uncached part (the router's ``UncachedRequestTokens``)."""
        prompt = self._prompt_tokens(request)
        if self.prefix is not None and prompt:
            self.prefix.prefix_match(request, candidates, now)  # computed once, kept in state
        return {
            c.endpoint.hostport: self._uncached(request, c.endpoint.hostport, prompt)
            for c in candidates
        }

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        now = self.clock()
        self._sweep(now)
        if not endpoints:
            return
        endpoint = endpoints[0].hostport
        prompt = self._prompt_tokens(request)
        uncached = self._uncached(request, endpoint, prompt)
        output = self._output_tokens(request, prompt) if self.add_output else 0
        entry = _Entry(endpoint, uncached, output, now)
        self._requests[endpoint] = self._requests.get(endpoint, 0) + 1
        self._add_tokens(endpoint, uncached + output)
        key = next(self._ids)
        self._live[key] = entry
        request.state[self._key] = key

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        entry = self._entry(request)
        if entry is None:
            return
        entry.touched = self.clock()
        self._live.move_to_end(request.state[self._key])
        if entry.prompt:  # the first chunk: prefill is over, its tokens are computed
            self._add_tokens(entry.endpoint, -entry.prompt)
            entry.prompt = 0

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        key = request.state.pop(self._key, None)
        entry = self._live.pop(key, None) if key is not None else None
        if entry is not None:
            self._release(entry)

    # --- the counts --------------------------------------------------------------

    def _entry(self, request: LLMRequest) -> _Entry | None:
        key = request.state.get(self._key)
        return None if key is None else self._live.get(key)

    def _release(self, entry: _Entry) -> None:
        self._add_tokens(entry.endpoint, -(entry.prompt + entry.output))
        entry.prompt = entry.output = 0
        left = self._requests.get(entry.endpoint, 0) - entry.requests
        if left > 0:
            self._requests[entry.endpoint] = left
        else:
            self._requests.pop(entry.endpoint, None)
        entry.requests = 0

    def _add_tokens(self, endpoint: str, delta: int) -> None:
        if not delta:
            return
        total = self._tokens.get(endpoint, 0) + delta
        if total > 0:
            self._tokens[endpoint] = total
        else:  # never below zero (the router clamps too)
            self._tokens.pop(endpoint, None)

    def _sweep(self, now: float) -> None:
        """Release the entries of responses untouched for ``STALE_SECONDS`` (lost streams)."""
        live = self._live
        while live:
            key, entry = next(iter(live.items()))
            if now - entry.touched < STALE_SECONDS:
                return
            del live[key]
            self._release(entry)

    # --- the estimates -----------------------------------------------------------

    def _prompt_tokens(self, request: LLMRequest) -> int:
        """The prompt's tokens (``prompt_tokens``), computed once per request."""
        known: int | None = request.state.get(self._tokens_key)
        if known is None:
            request.state[self._tokens_key] = known = prompt_tokens(request)
        return known

    def _uncached(self, request: LLMRequest, endpoint: str, prompt: int) -> int:
        return uncached_tokens(request.state.get(self._match), endpoint, prompt)

    def _output_tokens(self, request: LLMRequest, prompt: int) -> int:
        """``round(prompt × outputRatio)``, capped by the request's limit and the configured cap."""
        if prompt <= 0:
            return 0
        estimate = round(prompt * self.output_ratio)
        body = request.parsed or {}
        for field in OUTPUT_LIMITS:
            limit = body.get(field)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
                estimate = min(estimate, limit)
                break
        if self.output_cap is not None:
            estimate = min(estimate, self.output_cap)
        return estimate


def prompt_tokens(request: LLMRequest) -> int:
    """The prompt's tokens, estimated from its text (4 characters a token), or 0."""
    text = prompt_text(request.parsed) if request.parsed is not None else None
    return len(text) // CHARS_PER_TOKEN if text else 0


def uncached_tokens(match: PrefixMatch | None, endpoint: str, prompt: int) -> int:
    """The prompt's tokens ``endpoint`` must compute: those past the blocks ``match`` says it
    holds (all of them without a match). A trailing partial block is indexed too, so what is
    held can exceed the prompt."""
    if match is None or match.block_tokens <= 0:
        return prompt
    return max(0, prompt - match.matched.get(endpoint, 0) * match.block_tokens)
