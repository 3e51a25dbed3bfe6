"""``bench.request_metrics`` at smoke size: the streams it counts are the ones it claims."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from bench import request_metrics
from bench.instructions import WireStream


@pytest.mark.parametrize("kind", list(request_metrics.STREAM_KINDS))
def test_each_counted_stream_is_served_whole_at_its_level(kind: str) -> None:
    """Every message of the stream is answered (a streamed response chunk by chunk), and the
    ``response`` level records the response it heard."""
    level, response = request_metrics.STREAM_KINDS[kind]
    registry = CollectorRegistry()
    handler = request_metrics.picker(level, registry)
    stream = WireStream(request_metrics.wire(response))
    asyncio.run(handler(stream))
    assert not stream.pending
    tokens = registry.get_sample_value(
        "llm_d_epp_request_output_tokens_sum",
        {"model_name": "", "target_model_name": "", "fairness_id": "default-flow", "priority": "0"},
    )
    assert tokens == (request_metrics.TOKENS if level == "response" else None)
