"""Bodies as the picker's plugins see them: the request parsed read-only, the response's usage.

Both are optional work. The request body is parsed only when a configured
plugin says it ``needs_body``; the response body is read only when a plugin
hooks the response, and then only for its ``usage`` object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NoReturn

import orjson

from lwepp.hooks import Usage


class ReadOnlyDict(dict[str, Any]):
    """A JSON object shared by every plugin of a request: reading works, changing raises.

    A ``dict`` subclass, so it serialises (orjson, json) and copies
    (``dict(view)``) like the object it came from. A plugin that wants a
    changed body builds its own.
    """

    __slots__ = ()

    def _refuse(self, *_args: object, **_kwargs: object) -> NoReturn:
        raise TypeError("the parsed request body is shared by all plugins and read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse


def freeze(value: Any) -> Any:
    """A parsed JSON value made read-only throughout: objects → ``ReadOnlyDict``, arrays → tuples.

    Done once, eagerly: a request body is a small tree (a prompt is one
    string, a chat a few dozen nodes), cheaper to freeze than to wrap on
    every access.
    """
    if type(value) is dict:
        return ReadOnlyDict({key: freeze(item) for key, item in value.items()})
    if type(value) is list:
        return tuple(freeze(item) for item in value)
    return value


def parse_request(body: bytes) -> Mapping[str, Any] | None:
    """The body as a read-only JSON object, or None when it is not one (empty, not JSON, ...)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return freeze(value) if type(value) is dict else None


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
