"""``session-affinity-scorer``: send a session's requests back to the pod that served it before.

The request header ``x-session-token`` holds base64 (standard alphabet) of a
pod's name; candidates on that pod score 1, all others 0. The llm-d router
encodes ``namespace/name``; Switchyard's pods have no namespace, so the token
is the plain pod name. Every port of a data-parallel pod scores 1 (the
token names the pod, as the router's does); the picker chooses among them.

As a response hook it sets ``x-session-token`` on the response to the pod
that served the request: the endpoint the gateway reports as served, found
among the endpoints picked (primary and fallbacks, which Envoy walks on
retries), or the primary pick when the gateway reports nothing known.
Clients echo the header back to keep the session.

Parameters: none. Unknown data: no header, a token that is not base64, or a
pod that is no longer a candidate: every candidate scores 0 (no preference).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Final

from lwepp.contracts import Candidate, LLMRequest
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint

HEADER: Final = "x-session-token"


def token(pod: str) -> str:
    """The session token of ``pod``."""
    return base64.b64encode(pod.encode()).decode("ascii")


def pod_of(value: str) -> str | None:
    """The pod a token names, or None if it is not a token."""
    try:
        return base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


class SessionAffinityScorer:
    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self._picked = f"{name}.picked"

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        value = request.headers.get(HEADER)
        pod = pod_of(value) if value else None
        return [1.0 if c.endpoint.pod == pod else 0.0 for c in candidates]

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        request.state[self._picked] = endpoints

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        picked: Sequence[Endpoint] = request.state.get(self._picked, ())
        if not picked:
            return {}
        pod = next((e.pod for e in picked if e.hostport == served), picked[0].pod)
        return {HEADER: token(pod)}
