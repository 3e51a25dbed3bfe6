"""The HTTP message the plugins see: headers, the parsed body, and a record of their changes.

GIE's BBR hands every plugin one ``InferenceMessage``: the headers, the body
parsed into a generic map, and bookkeeping of what the plugins changed, so the
service can answer Envoy with exactly those changes. ``Message`` is the same
idea with one rule added: the parsed body is *shared* (parsed once, read by
every plugin) and therefore *read-only*, enforced by the views of
``plugin_api.frozen`` (LWEPP's plugins get the same). A plugin that changes the
body takes its own copy (``body_copy()``) and returns new bytes.

To refuse a request, a plugin raises ``wire.exchange.Refusal`` with an HTTP
status: processing stops and the client gets that status (an Envoy
``ImmediateResponse``, built in one place: ``bbr.server``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final, final

from plugin_api.frozen import FrozenDict, parse_object
from wire.exchange import Refusal, header_value_problem
from wire.extproc import Phase

HEADER_NAME: Final = re.compile(r":?[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name Envoy accepts: an HTTP token (RFC 9110), or a pseudo-header (``:path``)."""


def parse(raw: bytes, phase: Phase) -> dict[str, Any]:
    """Parse a body that must be a JSON object, as GIE's BBR requires.

    Raises ``Refusal(400)`` with GIE's wording when it is empty, not JSON, or
    JSON but not an object.
    """
    try:
        return parse_object(raw)
    except ValueError as error:
        raise Refusal(400, f"failed to parse {phase} body: {error}") from None


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless Envoy would accept ``name`` in a header mutation."""
    if not HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid header name")


# --- the message -----------------------------------------------------------------


@final
class Message:
    """One HTTP request or response, as the plugin chain sees it.

    ``headers`` are the ones Envoy sent, read-only: names lower-case (Envoy
    lower-cases them), one value each, the last one winning, as in GIE.
    Plugins record header changes with ``set_header``/``remove_header``; a
    plugin that reads a header sees what the client sent, not an earlier
    plugin's pending change.
    """

    __slots__ = ("_parsed", "_removed", "_set", "body_mutated", "headers", "phase", "raw")

    def __init__(
        self, phase: Phase, headers: Mapping[str, str] | Iterable[tuple[str, str]], raw: bytes
    ) -> None:
        self.phase: Final = phase
        self.headers: Final = MappingProxyType({k.lower(): v for k, v in dict(headers).items()})
        self.raw = raw
        """The body as it will be sent on: the original bytes, or the last plugin's new ones."""
        self.body_mutated = False
        self._parsed: FrozenDict | None = None
        self._set: dict[str, tuple[str, str]] = {}  # lower-case name -> (name, value)
        self._removed: dict[str, None] = {}  # an ordered set of lower-case names

    # --- the body ---

    def parse(self) -> FrozenDict:
        """The shared parse of ``raw``: parsed with orjson on first use, then reused.

        Raises ``Refusal(400)`` when the body is not a JSON object, and
        ``Refusal(415)`` (*ours*) when a request's body does not parse because
        it was never JSON: compressed (``Content-Encoding: gzip``, say), which
        the gateway does not undo, or a form upload (``multipart/form-data``,
        as OpenAI's audio transcription endpoint takes). "Not valid UTF-8"
        would send the client looking in the wrong place; RFC 9110 §15.5.16
        gives 415 for a content coding or media type the server does not
        take. The headers are read only once parsing has failed.
        """
        if self._parsed is None:
            try:
                self._parsed = FrozenDict(parse(self.raw, self.phase))
            except Refusal:
                if self.phase == "request" and (why := self._not_json()):
                    raise Refusal(
                        415, f"{why}: the gateway reads the model from a JSON body"
                    ) from None
                raise
        return self._parsed

    def _not_json(self) -> str | None:
        """Why a request body that failed to parse was never JSON, if its headers say."""
        encoding = self.headers.get("content-encoding", "identity").strip()
        if encoding.lower() not in ("", "identity"):
            return f"the request body is compressed (content-encoding: {encoding})"
        media = self.headers.get("content-type", "").split(";")[0].strip()
        if media.lower().startswith("multipart/"):
            return f"the request body is a form (content-type: {media}), not JSON"
        return None

    @property
    def body(self) -> FrozenDict:
        """The body as a read-only JSON object, shared by all plugins (see ``parse``)."""
        return self.parse()

    def body_copy(self) -> dict[str, Any]:
        """A fresh, mutable parse of the body: the caller's own to change.

        Serialize it back (``orjson.dumps``) and return the bytes from the
        plugin; the service then forwards them with their Content-Length.
        """
        return parse(self.raw, self.phase)

    def replace_body(self, raw: bytes) -> None:
        """Adopt a plugin's new body; later plugins read (and parse) this one."""
        self.raw = raw
        self.body_mutated = True
        self._parsed = None

    # --- the headers ---

    def set_header(self, name: str, value: str) -> None:
        """Record that header ``name`` is to become ``value``.

        As GIE's ``SetHeader``: the change is recorded only when it differs
        from what the client sent, and it cancels an earlier removal. GIE
        compares the exact key; since Envoy hands us lower-case names while
        plugins write ``X-Gateway-Model-Name``, we compare names
        case-insensitively, so an unchanged header is not re-sent.

        A value Envoy would refuse (a control character such as CR or LF, or
        longer than ``wire.exchange.HEADER_VALUE_LIMIT``) is refused here,
        naming the header: with 400 on a request (the client sent it; Envoy
        would answer 500), 502 on a response. A name that is no HTTP token is
        a plugin's bug (``ValueError``).
        """
        check_name(name)
        if problem := header_value_problem(value):
            status = 400 if self.phase == "request" else 502
            raise Refusal(status, f"the value for header {name} {problem}")
        key = name.lower()
        self._removed.pop(key, None)
        if self.headers.get(key) == value:
            self._set.pop(key, None)
        else:
            self._set[key] = (name, value)

    def remove_header(self, name: str) -> None:
        """Record that header ``name`` is to go: drops a pending set; removes only what exists."""
        check_name(name)
        key = name.lower()
        self._set.pop(key, None)
        if key in self.headers:
            self._removed[key] = None

    def set_content_length(self) -> None:
        """Announce the length of ``raw`` in ``Content-Length``, whatever the client sent.

        The service's own header, so it is always sent: GIE's exact-key
        comparison never matches Envoy's lower-case ``content-length``, and
        when Envoy streams the body to us the length is ours to state.
        """
        self._removed.pop("content-length", None)
        self._set["content-length"] = ("Content-Length", str(len(self.raw)))

    def header_changes(self) -> tuple[list[tuple[str, str]], list[str]]:
        """The headers to set, as ``(name, value)``, and the names to remove, in order recorded."""
        return list(self._set.values()), list(self._removed)
