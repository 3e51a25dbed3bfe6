"""Bodies as the picker's plugins see them: the request parsed read-only, the response's usage.

Both are optional work. The request body is parsed only when a configured
plugin says it ``needs_body`` (into the read-only view BBR's plugins get too,
``plugin_api.frozen``); the response body is read only when a plugin hooks the
response's end, and then only for its ``usage`` object.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from lwepp.contracts import Usage
from plugin_api.frozen import FrozenDict, parse_object
from wire.exchange import MAX_BODY_BYTES


def parse_request(body: bytes) -> FrozenDict | None:
    """The body as a read-only JSON object, or None when it is not one (empty, not JSON, ...)."""
    try:
        return FrozenDict(parse_object(body))
    except ValueError:
        return None


# --- the response's token usage ---------------------------------------------------

SSE_TAIL: Final = 64 * 1024
"""How much of an event stream is kept: its usage event comes last, just before ``[DONE]``."""


def _count(value: Any) -> int | None:
    return value if type(value) is int else None


def usage_of(document: Any) -> Usage | None:
    """The ``usage`` object of a completion, chat or responses answer, when it has one.

    Chat and completions name the counts ``prompt_tokens``/``completion_tokens``
    with ``prompt_tokens_details.cached_tokens``; the Responses API names
    them ``input_tokens``/``output_tokens`` with ``input_tokens_details``.
    """
    usage = document.get("usage") if isinstance(document, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens", usage.get("input_tokens"))),
        completion_tokens=_count(usage.get("completion_tokens", usage.get("output_tokens"))),
        cached_tokens=_count(cached),
    )


def response_usage(body: bytes, event_stream: bool) -> Usage | None:
    """Token usage from a whole JSON answer, or from the last usage event of a stream (SSE).

    A streamed answer carries usage only when the client asked for it
    (``stream_options.include_usage``), in the last ``data:`` event before
    ``data: [DONE]``; ``body`` may be just the stream's tail.
    """
    if not event_stream:
        try:
            return usage_of(orjson.loads(body))
        except orjson.JSONDecodeError:
            return None
    for line in reversed(body.splitlines()):
        data = line.strip()
        if not data.startswith(b"data:"):
            continue
        data = data[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            usage = usage_of(orjson.loads(data))
        except orjson.JSONDecodeError:
            continue  # the tail may begin mid-event
        if usage is not None:
            return usage
    return None


class UsageReader:
    """What a response's usage is read from, kept as its body passes: a JSON answer whole
    (up to ``MAX_BODY_BYTES``: a larger one reports no usage), an event stream's tail."""

    __slots__ = ("body", "event_stream")

    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self.body: bytearray | None = bytearray()

    def add(self, chunk: bytes) -> None:
        if self.body is None:
            return
        self.body += chunk
        if self.event_stream:
            del self.body[:-SSE_TAIL]  # the usage event is at the end
        elif len(self.body) > MAX_BODY_BYTES:
            self.body = None  # too big to parse for its usage: report none

    def usage(self) -> Usage | None:
        """The usage the body carried, read once at its end (None: none, or not kept)."""
        body, self.body = self.body, None
        return response_usage(bytes(body), self.event_stream) if body else None
