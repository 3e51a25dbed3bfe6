"""Which endpoints may serve a request, and which one does: candidates and the one seam.

Picking happens in two steps, kept apart on purpose:

1. **Candidates.** Every ready endpoint of the pool, narrowed when the gateway
   (or a conformance test) restricts the choice. The GIE endpoint-picker
   protocol lets the data plane send a *subset hint* in filter metadata
   ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``; GIE's
   conformance tests pin requests with the ``test-epp-endpoint-selection``
   header instead. Both hold ``ip`` or ``ip:port`` entries.
2. **The choice.** A ``Strategy`` gets the request and the candidates and
   returns a ``Choice``: endpoints in order of preference and, when it wants
   to hear the response, a ``Followup``. Round-robin is the default; the
   filter/scorer pipeline (``lwepp.pipeline``) is another strategy, and plugs
   in here, and only here, without touching the stream handling around it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from pods.model import Endpoint, Pod, PodSource, endpoints_of
from pods.selector import LabelSelector

SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
TEST_SELECTION_HEADER: Final = "test-epp-endpoint-selection"


class RequestInfo(NamedTuple):
    """What a strategy may look at: the request headers (and the body, when it was held).

    Like ``Choice``, a named tuple: immutable, and made on every request.
    """

    headers: Sequence[tuple[str, str]]
    body: bytes | None = None


class Followup(Protocol):
    """What a strategy hears of the response to its choice; the core calls it as the response
    passes.

    ``headers`` once, when the response headers arrive; ``chunk`` for each
    piece of the response body Envoy sends (only in a body mode other than
    ``NONE``); ``end`` exactly once, when the response is over: at the end of
    the body, at the trailers, or right after ``headers`` when no body comes.
    A response that breaks off (the client went away) never ends.
    """

    def headers(self, served: str | None, headers: Mapping[str, str]) -> Sequence[tuple[str, str]]:
        """Headers to add to the response. ``served`` is the ``ip:port`` the gateway reports
        in ``envoy.lb`` metadata (None if none); ``headers`` the response's, first value each."""
        ...

    def chunk(self, chunk: bytes) -> bytes | None:
        """A piece of the response body; the bytes to send on instead (a request control
        rewriting the response; ``b""`` holds them back for a later chunk), or None to send
        it as it came."""
        ...

    def end(self) -> None: ...


class Choice(NamedTuple):
    """What a strategy chose: endpoints best first (the first is the destination, the others
    fallbacks in order), and the followup to call on the response, if any.

    A named tuple rather than a frozen dataclass: as immutable, and one is made on every
    request, where the dataclass's checked ``__init__`` costs half again as much.
    """

    endpoints: Sequence[Endpoint]
    followup: Followup | None = None


class Admitted(NamedTuple):
    """A request as the request controls let it through: what the choice sees (``request``),
    the body to send upstream instead of the client's (``body``; None: unchanged), and the
    followups that hear the response, and may rewrite its body (``followups``)."""

    request: RequestInfo
    body: bytes | None = None
    followups: tuple[Followup, ...] = ()


class RequestControl(Protocol):
    """Decides whether, when and as what a request is served, before its choice.

    The second thing the core calls, and only when the service runs some:
    what the llm-d router's director does around its scheduler (a model
    rewrite, the request's objective and flow control, request metrics).
    ``admit`` runs once per request, when the request is whole (its body held,
    in full-duplex mode; its headers, in the others), each control in order
    given what the one before let through; then the strategy chooses. A
    service with no control runs exactly as without this seam.
    """

    @property
    def hears_response(self) -> bool:
        """Whether a followup of its may need the response headers."""
        ...

    @property
    def reads_response_body(self) -> bool:
        """Whether a followup of its reads (or rewrites) the response body: the gateway must
        then send it, streamed through the picker."""
        ...

    async def admit(self, admitted: Admitted) -> Admitted:
        """Let the request through, as it is or changed (a new body, a followup added); wait
        first (a queue); or refuse it (raise ``wire.exchange.Refusal``)."""
        ...


class Strategy(Protocol):
    """Chooses endpoints for one request: the seam where smarter picking plugs in.

    ``RoundRobin`` is the default strategy; the filter/scorer pipeline is another.

    """

    @property
    def hears_response(self) -> bool:
        """Whether a choice may carry a ``Followup``. When none can, the gateway need not
        send the picker the response headers at all, which spares every request one
        exchange with the picker on its way back (``EndpointPickerService.hears_response``)."""
        ...

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        """Choose among ``candidates``: never empty, only endpoints the request may go to.

        A choice with no endpoints means none is acceptable: the service answers
        HTTP 503. A strategy may also raise ``wire.exchange.Refusal`` to
        answer with a status and headers of its own.
        """
        ...


class RoundRobin:
    """Each choice takes the next candidate in turn, with one counter for all streams.

    As in GIE's lwepp the counter is advanced before use, so the first request
    goes to the second candidate. Advancing an ``itertools.count`` is a single
    step for the interpreter, and the servers run on one event loop, so streams
    never see the same value twice.
    """

    hears_response: Final = False

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def choose(self, request: RequestInfo, candidates: Sequence[Endpoint]) -> Choice:
        return Choice((candidates[next(self._counter) % len(candidates)],))


class Pool:
    """The endpoints of one pool: the pods of a source that match a label selector.

    Like an InferencePool's ``spec.selector.matchLabels`` (or a full label
    selector, ``pods.selector``): each port of each ready matching pod is one
    endpoint. The tuple is rebuilt only when the source replaces its pod list,
    not on every request.
    """

    def __init__(self, source: PodSource, selector: Mapping[str, str] | LabelSelector) -> None:
        self.source = source
        self.selector = (
            selector if isinstance(selector, LabelSelector) else LabelSelector.from_labels(selector)
        )
        self._seen: tuple[Pod, ...] | None = None
        self._endpoints: tuple[Endpoint, ...] = ()

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        pods = self.source.pods
        if pods is not self._seen:
            self._seen, self._endpoints = pods, endpoints_of(pods, self.selector)
        return self._endpoints


def allowed_entries(
    subset_hint: Mapping[str, Any] | None, test_header: str | None
) -> list[str] | None:
    """The ``ip``/``ip:port`` entries a request is restricted to, or None if unrestricted.

    Follows GIE's lwepp: the metadata key being present activates the filter
    even when its list is empty (an empty list allows nothing); the value may
    be a list or a comma-separated string, and list items may themselves hold
    commas. A non-empty ``test-epp-endpoint-selection`` header replaces the
    metadata list.
    """
    entries: list[str] | None = None
    if subset_hint is not None and SUBSET_KEY in subset_hint:
        value = subset_hint[SUBSET_KEY]
        items = value if isinstance(value, list) else [value]
        entries = [
            part.strip() for item in items if isinstance(item, str) for part in item.split(",")
        ]
        entries = [entry for entry in entries if entry]
    if test_header:
        selected = [part.strip() for part in test_header.split(",") if part.strip()]
        if selected:
            entries = selected
    return entries


def _split_host_port(entry: str) -> tuple[str, str | None]:
    """``ip:port`` → (ip, port); a bare IP (v4, or v6 without brackets) → (ip, None)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, None


def candidates(endpoints: Sequence[Endpoint], allowed: list[str] | None) -> tuple[Endpoint, ...]:
    """The endpoints a request may use: all of them, or those ``allowed`` names.

    An entry with a port allows exactly that endpoint; a bare IP allows every
    port of that address (a data-parallel pod's engines).
    """
    if allowed is None:
        return tuple(endpoints)
    exact: set[tuple[str, str]] = set()
    any_port: set[str] = set()
    for entry in allowed:
        host, port = _split_host_port(entry)
        if port is None:
            any_port.add(host)
        else:
            exact.add((host, port))
    return tuple(e for e in endpoints if e.address in any_port or (e.address, str(e.port)) in exact)
