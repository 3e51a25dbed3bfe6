"""Session affinity, as the llm-d router has it: a session's requests go back where it was served.

Two plugins with the same parameters: ``session-affinity-scorer`` (a soft
preference: the session's endpoint scores 1, every other 0, and the other
scorers may outweigh it) and ``session-affinity-filter`` (a hard pin: when
the session's endpoint is a candidate, it is the only one left; otherwise
every candidate stays, so the filter never empties the list). Each keeps its
own state, as the router's do. ``strategy`` picks how a session is known:

- ``encoded_endpoint_header`` (the default): stateless. The request header
  ``encodedEndpointHeaderConfig.header`` (``x-session-token``) holds standard
  base64 of the pod's ``namespace/name``, as the router writes it (a pod with
  no namespace, from Switchyard's pod file, is ``default``'s, the router's
  file-discovery default); the response carries the token of the pod that
  served it, which the client echoes back. A token of the bare pod name
  (Switchyard's before) still matches by name. Every port of a
  data-parallel pod is that pod.
- ``session_id``: stateful. The session is an opaque id read from
  ``sessionIdConfig.sources`` in order, the first non-empty one winning: a
  request header (``{header: x-session-id}``, the default) or a request
  attribute an earlier plugin published (``{attribute: KEY, producer:
  NAME}``: ``session-id-producer``'s is ``SessionIDDataKey``). The plugin
  binds the id to the endpoint each request of it was sent to (the primary
  pick); a binding unused for ``evictionTtlSeconds`` (300) is dropped, in a
  sweep every ``evictionSweepSeconds`` (10) on the pipeline's clock. An
  unbound id, or one bound to an endpoint that is no longer a candidate,
  expresses no preference (and is bound again where it goes). Nothing is
  written back.

``profileName`` names the scheduling profile whose pick to remember (the
router's prefill profile, under disaggregation); Switchyard runs one profile,
so only the empty default is accepted.

``session-id-producer`` (``headerName`` or ``cookieName``, exactly one)
publishes the session id from that header or cookie for the plugins after it
(``request.state["<name>.SessionIDDataKey"]``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Final

from lwepp.contracts import Candidate, LLMRequest
from plugin_api import NO_PARAMS, Params
from pods.model import Endpoint

HEADER: Final = "x-session-token"
SESSION_HEADER: Final = "x-session-id"
STRATEGIES: Final = ("encoded_endpoint_header", "session_id")
SESSION_KEY: Final = "SessionIDDataKey"
"""The attribute ``session-id-producer`` publishes (the router's data key name)."""
DEFAULT_NAMESPACE: Final = "default"


def token(pod: str, namespace: str = "") -> str:
    """The session token of ``pod``: base64 of ``namespace/name`` (``default`` if none)."""
    return base64.b64encode(f"{namespace or DEFAULT_NAMESPACE}/{pod}".encode()).decode("ascii")


def pod_of(value: str) -> tuple[str | None, str] | None:
    """The (namespace, name) a token names (namespace None: a bare name), or None."""
    try:
        decoded = base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    namespace, slash, name = decoded.rpartition("/")
    return (namespace, name) if slash else (None, decoded)


def _is(endpoint: Endpoint, pod: tuple[str | None, str]) -> bool:
    namespace, name = pod
    return endpoint.pod == name and namespace in (None, endpoint.namespace or DEFAULT_NAMESPACE)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a session id is read: a request header, or an attribute a plugin published."""

    header: str = ""
    attribute: str = ""
    producer: str = ""

    def read(self, request: LLMRequest) -> str:
        if self.header:
            return request.headers.get(self.header, "")
        key = f"{self.producer}.{self.attribute}" if self.producer else self.attribute
        value = request.state.get(key)
        return value if isinstance(value, str) else ""


class SessionAffinity:
    """What the scorer and the filter share: the parameters, which endpoints are the session's
    (``session``), and what to remember of a pick."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.strategy = params.get("strategy", str, STRATEGIES[0])
        if self.strategy not in STRATEGIES:
            raise params.error("strategy", f"expected one of {', '.join(STRATEGIES)}")
        if params.get("profileName", str, ""):
            raise params.error(
                "profileName",
                "Switchyard runs one scheduling profile (no prefill/decode disaggregation): "
                "leave it empty",
            )
        encoded = params.entry(
            "encodedEndpointHeaderConfig", params.get("encodedEndpointHeaderConfig", dict, {})
        )
        self.header = encoded.get("header", str, "").strip().lower() or HEADER
        encoded.done()
        ids = params.entry("sessionIdConfig", params.get("sessionIdConfig", dict, {}))
        self.sources = [_source(entry) for entry in ids.entries("sources")] or [
            Source(header=SESSION_HEADER)
        ]
        self.ttl = ids.get("evictionTtlSeconds", float, 300.0, above=0)
        self.sweep_every = ids.get("evictionSweepSeconds", float, 10.0, above=0)
        ids.done()
        self.bound: dict[str, tuple[str, float]] = {}
        """session_id: session id → (endpoint ``ip:port``, when it was last used)."""
        self._swept = 0.0
        self._picked, self._now = f"{name}.picked", f"{name}.now"

    def session(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[bool]:
        """For each candidate: is it where the request's session was served?"""
        if self.strategy == "session_id":
            request.state[self._now] = now
            key = self._session_id(request)
            hostport = self._bound(key, now) if key else None
            return [c.endpoint.hostport == hostport for c in candidates]
        value = request.headers.get(self.header)
        pod = pod_of(value) if value else None
        return [pod is not None and _is(c.endpoint, pod) for c in candidates]

    def _session_id(self, request: LLMRequest) -> str:
        return next((found for source in self.sources if (found := source.read(request))), "")

    def _bound(self, key: str, now: float) -> str | None:
        if now - self._swept >= self.sweep_every:
            self.bound = {k: v for k, v in self.bound.items() if now - v[1] < self.ttl}
            self._swept = now
        binding = self.bound.get(key)
        return binding[0] if binding is not None and now - binding[1] < self.ttl else None

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        request.state[self._picked] = endpoints
        if self.strategy == "session_id" and endpoints and (key := self._session_id(request)):
            self.bound[key] = (endpoints[0].hostport, request.state.get(self._now, 0.0))

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        """The served endpoint's pod's token (else the primary pick's), in the header."""
        picked: Sequence[Endpoint] = request.state.get(self._picked, ())
        if not picked or self.strategy != "encoded_endpoint_header":
            return {}
        endpoint = next((e for e in picked if e.hostport == served), picked[0])
        return {self.header: token(endpoint.pod, endpoint.namespace)}


def _source(entry: Params) -> Source:
    found = Source(
        entry.get("header", str, "").strip().lower(),
        entry.get("attribute", str, ""),
        entry.get("producer", str, ""),
    )
    entry.done()
    if bool(found.header) == bool(found.attribute):
        raise entry.error("header", "set exactly one of header and attribute")
    return found


class SessionAffinityScorer(SessionAffinity):
    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        return [1.0 if ours else 0.0 for ours in self.session(request, candidates, now)]


class SessionAffinityFilter(SessionAffinity):
    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        ours = [c for c, is_ours in zip(candidates, self.session(request, candidates, now),
                                        strict=True) if is_ours]  # fmt: skip
        return ours or candidates


class SessionIdProducer:
    """The router's ``session-id-producer``: the session id from a header or a cookie."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.header = params.get("headerName", str, "").strip().lower()
        self.cookie = params.get("cookieName", str, "")
        if bool(self.header) == bool(self.cookie):
            raise params.error("headerName", "set exactly one of headerName and cookieName")
        self._key = f"{name}.{SESSION_KEY}"

    def prepare(self, request: LLMRequest) -> None:
        found = request.headers.get(self.header, "") if self.header else self._cookie(request)
        if found:
            request.state[self._key] = found

    def _cookie(self, request: LLMRequest) -> str:
        jar = SimpleCookie()
        try:
            jar.load(request.headers.get("cookie", ""))
        except CookieError:
            return ""
        morsel = jar.get(self.cookie)
        return morsel.value if morsel is not None else ""
