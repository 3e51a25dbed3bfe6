"""Session affinity in the router's current shape: the filter, session ids, the producer."""

from __future__ import annotations

import pytest

from lwepp.config import ConfigErrors, load_text
from lwepp.contracts import Candidate, LLMRequest
from lwepp.plugins.session_affinity import (
    SessionAffinityFilter,
    SessionAffinityScorer,
    SessionIdProducer,
    token,
)
from plugin_api import Params
from pods.model import Endpoint

A = Endpoint("a", "10.0.0.1", 8000, namespace="inference")
B = Endpoint("b", "10.0.0.2", 8000, namespace="inference")
POOL = [Candidate(A), Candidate(B)]


def made(kind: type, **parameters: object) -> SessionAffinityFilter | SessionAffinityScorer:
    plugin: SessionAffinityFilter | SessionAffinityScorer = kind(
        "s", Params(parameters or None, "plugin 's'")
    )
    return plugin


def test_the_filter_pins_the_session_s_pod_and_never_empties() -> None:
    """A token naming B keeps B alone; a token naming a pod that left keeps everyone."""
    pin = made(SessionAffinityFilter)
    assert isinstance(pin, SessionAffinityFilter)
    req = LLMRequest("r", {"x-session-token": token("b", "inference")})
    assert [c.endpoint for c in pin.filter(req, POOL, 0.0)] == [B]
    gone = LLMRequest("r", {"x-session-token": token("c", "inference")})
    assert [c.endpoint for c in pin.filter(gone, POOL, 0.0)] == [A, B]


def test_the_namespace_is_part_of_the_pod_s_identity() -> None:
    """A token for the same name in another namespace is another pod."""
    pin = made(SessionAffinityFilter)
    assert isinstance(pin, SessionAffinityFilter)
    req = LLMRequest("r", {"x-session-token": token("b", "other")})
    assert [c.endpoint for c in pin.filter(req, POOL, 0.0)] == [A, B]


def test_the_response_header_can_be_renamed() -> None:
    """encodedEndpointHeaderConfig.header names the header read and written (lower-cased)."""
    scorer = made(SessionAffinityScorer, encodedEndpointHeaderConfig={"header": "X-Sticky"})
    req = LLMRequest("r", {"x-sticky": token("a", "inference")})
    assert isinstance(scorer, SessionAffinityScorer)
    assert list(scorer.score(req, POOL, 0.0)) == [1.0, 0.0]
    scorer.picked(req, [B])
    assert scorer.response_headers(req, B.hostport, {}) == {"x-sticky": token("b", "inference")}


def test_session_ids_bind_where_the_session_went_until_unused_for_the_ttl() -> None:
    """session_id: the first request has no preference and binds to its pick; the next one goes
    there; after evictionTtlSeconds unused, no preference again. Nothing is written back."""
    scorer = made(
        SessionAffinityScorer,
        strategy="session_id",
        sessionIdConfig={"evictionTtlSeconds": 30, "evictionSweepSeconds": 5},
    )
    assert isinstance(scorer, SessionAffinityScorer)

    def turn(now: float, pick: Endpoint) -> list[float]:
        req = LLMRequest("r", {"x-session-id": "chat-7"})
        scores = list(scorer.score(req, POOL, now))
        scorer.picked(req, [pick])
        assert scorer.response_headers(req, pick.hostport, {}) == {}
        return scores

    assert turn(0.0, B) == [0.0, 0.0]
    assert turn(20.0, B) == [0.0, 1.0]
    assert turn(49.0, A) == [0.0, 1.0]  # used at 20: still bound; the pick moves it to A
    assert turn(60.0, A) == [1.0, 0.0]
    assert turn(91.0, B) == [0.0, 0.0]  # unused since 60: dropped


def test_session_ids_from_the_producer_s_attribute_or_a_cookie() -> None:
    """session-id-producer reads a cookie; a source naming its attribute reads what it left."""
    producer = SessionIdProducer("ids", Params({"cookieName": "llm-d-session"}, "p"))
    pin = made(
        SessionAffinityFilter,
        strategy="session_id",
        sessionIdConfig={"sources": [{"attribute": "SessionIDDataKey", "producer": "ids"}]},
    )
    assert isinstance(pin, SessionAffinityFilter)
    for pick in (A, A):
        req = LLMRequest("r", {"cookie": "theme=dark; llm-d-session=abc"})
        producer.prepare(req)
        kept = [c.endpoint for c in pin.filter(req, POOL, 0.0)]
        pin.picked(req, [pick])
    assert kept == [A]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("{strategy: cookie}", "strategy: expected one of encoded_endpoint_header, session_id"),
        ("{profileName: prefill}", "does not implement: several scheduling profiles per request"),
        (
            "{sessionIdConfig: {sources: [{header: a, attribute: b}]}}",
            "sources[0].header: set exactly one of header and attribute",
        ),
        ("{sessionIdConfig: {evictionTtlSeconds: 0}}", "evictionTtlSeconds: must be > 0"),
    ],
    ids=["strategy", "profile", "source", "ttl"],
)
def test_bad_parameters_name_the_field(parameters: str, message: str) -> None:
    """Each bad parameter is refused at load, naming the field (profileName: the feature)."""
    with pytest.raises(ConfigErrors, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
            f"- type: session-affinity-filter\n  parameters: {parameters}\n"
        )
