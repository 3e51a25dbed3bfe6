"""``approx-prefix-cache-producer`` with ``learnCapacity``: each server's cache size, learned
from the cached tokens its responses report."""

from __future__ import annotations

from typing import Any

import pytest

from lwepp.contracts import Candidate, LLMRequest, Measurement, Usage
from lwepp.plugins.approx_prefix import (
    ApproxPrefixCacheProducer,
    CapacityLearner,
    PrefixMatch,
    Prepared,
)
from plugin_api import ConfigError
from pods.model import Endpoint
from tests.plugin_fakes import configured

A = Endpoint("a", "10.0.0.1", 8000)
B = Endpoint("b", "10.0.0.2", 8000)
CEILING = 1000


def producer(**parameters: Any) -> ApproxPrefixCacheProducer:
    params = {"learnCapacity": True, "lruCapacityPerServer": CEILING, **parameters}
    made: ApproxPrefixCacheProducer = configured("approx-prefix-cache-producer", params)
    return made


def prompt(i: int) -> str:
    """A prompt of its own: 640 bytes, ten 64-byte blocks (16 tokens of 4 characters)."""
    return f"{i:08d}" + "x" * 632


def pick(plugin: ApproxPrefixCacheProducer, text: str, at: Endpoint, **values: float) -> LLMRequest:
    """Prepare, match against A and B, pick ``at``; the request, not yet answered."""
    request = LLMRequest("r", {}, model="m", parsed={"model": "m", "prompt": text})
    plugin.prepare(request)
    pool = [Candidate(e, {k: Measurement(v, 0.0) for k, v in values.items()}) for e in (A, B)]
    plugin.prefix_match(request, pool, 0.0)
    plugin.picked(request, [at])
    return request


def answer(plugin: ApproxPrefixCacheProducer, request: LLMRequest, cached: int | None) -> None:
    """The response: 160 prompt tokens (the prompt's ten blocks), ``cached`` of them cached."""
    plugin.response_complete(request, A.hostport, Usage(160, 5, cached))


def served(plugin: ApproxPrefixCacheProducer, text: str, cached: int | None) -> LLMRequest:
    request = pick(plugin, text, A)
    answer(plugin, request, cached)
    return request


def fill(plugin: ApproxPrefixCacheProducer, prompts: int, start: int = 0) -> None:
    """``prompts`` different prompts served by A, each new to it (nothing predicted, nothing
    cached): the index holds ten blocks of each."""
    for i in range(start, start + prompts):
        served(plugin, prompt(i), 0)


def learner(plugin: ApproxPrefixCacheProducer) -> CapacityLearner:
    assert plugin.learner is not None
    return plugin.learner


def predicted(request: LLMRequest) -> int:
    """The blocks the index predicted A holds, for a request already answered."""
    prepared: Prepared = request.state["p.prompt"]
    assert prepared.flight is None
    found: PrefixMatch = request.state["p.match"]
    return found.matched[A.hostport]


def test_a_server_with_less_than_predicted_shrinks_its_capacity_at_once() -> None:
    """Predicted ten blocks, cached none: the index held blocks A had evicted, so A's
    capacity becomes 0.9× what its index holds (a far too large default is gone in one step)."""
    plugin = producer()
    fill(plugin, 30)  # 300 blocks held
    request = served(plugin, prompt(0), 0)
    assert predicted(request) == 10
    assert learner(plugin).of(A.hostport) == 270
    served(plugin, prompt(99), 0)  # the next pick of A applies it
    assert plugin.index.capacity(A.hostport) == 270
    assert plugin.index.size(A.hostport) == 270


def test_a_prediction_the_server_confirms_teaches_nothing() -> None:
    """Cached within two blocks of the prediction (the engine caches whole blocks only)."""
    plugin = producer()
    fill(plugin, 30)
    served(plugin, prompt(0), 160 - 2 * 16)
    assert learner(plugin).capacity == {}


def test_a_server_with_more_than_predicted_grows_its_capacity() -> None:
    """After a shrink, a prompt the index forgot but A kept grows A's capacity by 10%."""
    plugin = producer()
    fill(plugin, 30)
    served(plugin, prompt(0), 0)  # 270
    fill(plugin, 40, start=100)  # prompt(0) and the oldest fall out of A's 270 blocks
    request = served(plugin, prompt(1), 160)
    assert predicted(request) == 0
    assert learner(plugin).of(A.hostport) == 297


def test_growth_stops_at_the_configured_capacity() -> None:
    """More cached than predicted, again and again: the capacity never passes
    ``lruCapacityPerServer`` (what bounds the index's memory)."""
    plugin = producer()
    for i in range(3):
        served(plugin, prompt(i), 160)  # more than predicted each time
    assert learner(plugin).of(A.hostport) == CEILING


def test_a_prediction_on_blocks_still_in_flight_is_not_an_eviction() -> None:
    """Two requests of one prompt at once: the second's prediction rests on blocks the first
    put in the index, which A may still be computing, so its 0 cached teaches nothing. Once
    the first is answered, the same 0 is an eviction."""
    plugin = producer()
    fill(plugin, 30)
    fresh = prompt(500)
    first = pick(plugin, fresh, A)
    second = pick(plugin, fresh, A)
    answer(plugin, second, 0)
    assert learner(plugin).capacity == {}
    answer(plugin, first, 0)
    served(plugin, fresh, 0)
    assert learner(plugin).of(A.hostport) == int(0.9 * 310)


@pytest.mark.parametrize("usage", [None, Usage(160, 5, None), Usage(None, 5, 0)])
def test_a_response_without_cached_tokens_teaches_nothing(usage: Usage | None) -> None:
    """Engines that do not report cached tokens keep the configured capacity."""
    plugin = producer()
    fill(plugin, 30)
    request = pick(plugin, prompt(0), A)
    plugin.response_complete(request, A.hostport, usage)
    assert learner(plugin).capacity == {}


def test_a_server_served_other_than_the_pick_teaches_nothing() -> None:
    """The gateway served elsewhere (a fallback): the prediction was for the pick, so the
    other server's cached tokens say nothing about either's size."""
    plugin = producer()
    fill(plugin, 30)
    request = pick(plugin, prompt(0), A)
    plugin.response_complete(request, B.hostport, Usage(160, 5, 0))
    assert learner(plugin).capacity == {}


def test_a_server_that_taught_nothing_starts_from_the_others() -> None:
    """The servers of a pool are usually alike: B, which taught nothing yet, is given the
    median of what the others learned."""
    plugin = producer()
    fill(plugin, 30)
    served(plugin, prompt(0), 0)
    request = pick(plugin, prompt(77), B)
    assert plugin.index.capacity(B.hostport) == 270
    plugin.response_complete(request, B.hostport, Usage(160, 5, 0))


def test_a_reported_cache_size_wins() -> None:
    """With ``autoTune``, a server that reports its block count is indexed by it."""
    plugin = producer()
    fill(plugin, 30)
    served(plugin, prompt(0), 0)
    pick(plugin, prompt(1), A, cache_block_size=16, cache_num_blocks=500)
    assert plugin.index.capacity(A.hostport) == 500


def test_off_by_default() -> None:
    """The router's producer learns nothing: the configured capacity stays."""
    plugin: ApproxPrefixCacheProducer = configured(
        "approx-prefix-cache-producer", {"lruCapacityPerServer": CEILING}
    )
    assert plugin.learner is None
    fill(plugin, 30)
    served(plugin, prompt(0), 0)
    assert plugin.index.capacity(A.hostport) == CEILING


def test_the_parameter_is_checked() -> None:
    """``learnCapacity`` must be a boolean; the error names the plugin and the field."""
    with pytest.raises(ConfigError, match=r"plugin 'p' .*learnCapacity: expected bool"):
        configured("approx-prefix-cache-producer", {"learnCapacity": "yes"})
