"""What one ext_proc stream holds between messages, for both services: two halves and a refusal.

Envoy opens one stream per HTTP exchange and sends its parts in order:
request headers, request body chunks, request trailers, then the same for
the response. Both services keep the same record of it, an ``Exchange``
with a ``Half`` for each direction (each service adds the few fields only it
needs in a subclass: LWEPP its candidates and the pick's response side, BBR
whether the response is passing through):

- the **headers** Envoy sent, as ``(name, value)`` pairs;
- the **body mode** Envoy runs that direction with (from ``protocol_config``,
  or the service's default for a proxy that does not send it). In
  ``FULL_DUPLEX_STREAMED`` Envoy forwards only the body the processor sends
  back, so a service that needs the whole body holds its headers answer
  (``held``) and the chunks until the body ends;
- the **held body**: the chunks so far and their size, never more than the
  service's cap. One byte over is a ``Refusal`` with HTTP 413.

``Refusal`` is the one error that stops a request with an HTTP status. Raise
it anywhere on the request path (a service, a plugin, a picking strategy);
each service turns it into an Envoy ``ImmediateResponse`` in exactly one
place (with ``Refusal.answer``), and the stream then ends normally. The
answer's body is an OpenAI-style error object (``error_body``), the shape
the gateway's own answers share, so a client's OpenAI SDK raises its
matching exception whoever refused.

Header changes are checked before they leave (``header_value_problem``,
``check_headers_fit``): Envoy refuses a mutation with a control character in
a value, or one that makes the headers outgrow its limits, and then answers
the client 500 with an empty body. Found first, a client's bad value is a
400 naming the header, and headers that would grow too large a 431.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Sequence
from typing import Final

import orjson

from wire import extproc
from wire.extproc import BodyMode, Phase, ProcessingRequest, ProcessingResponse

_FULL_DUPLEX: Final = int(BodyMode.FULL_DUPLEX_STREAMED)

MAX_BODY_BYTES: Final = 10 * 1024 * 1024
"""The default cap on a held body (``--max-body-bytes``): 10 MiB."""

CODES: Final = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
    429: "ResourceExhausted",
    431: "HeadersTooLarge",
    500: "Internal",
    502: "BadGateway",
    503: "ServiceUnavailable",
}
"""GIE's names for its error codes, by HTTP status (413, 415, 431 and 502 are ours)."""


HEADER_VALUE_LIMIT: Final = 4096
"""Longest header value (UTF-8 bytes) a service sets from what a client sent.

Envoy itself caps only the whole header map, but the value travels on to the
model server, and common servers cap a header line near 8 KiB (nginx's
``large_client_header_buffers``, aiohttp's 8,190 bytes); a model name is
never near this long.
"""

HEADERS_SIZE_LIMIT: Final = 60 * 1024
"""Envoy's default ``max_request_headers_kb`` (and ``max_response_headers_kb``): 60 KiB.

After a mutation Envoy checks that the names and values together stay within
it (``MutationUtils::headerMutationResultCheck``); a gateway configured with
a larger limit still gets this one from us.
"""

HEADERS_COUNT_LIMIT: Final = 100
"""Envoy's default ``max_headers_count``, checked after a mutation the same way."""

_NOT_IN_A_VALUE: Final = re.compile("[\x00-\x08\x0a-\x1f\x7f]")
"""What Envoy refuses in a header value: control characters but tab, and DEL.

Envoy's ``HeaderUtility::headerValueIsValid`` allows tab, visible ASCII, space
and any byte from 0x80 (``obs-text``, so UTF-8 passes); CR and LF above all
must never reach a header, where they would end it.
"""


def header_value_problem(value: str) -> str | None:
    """What Envoy (or the server behind it) would refuse in header value ``value``; None if none."""
    if bad := _NOT_IN_A_VALUE.search(value):
        return f"contains the control character {bad.group()!r} at offset {bad.start()}"
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        return "is not valid Unicode text (it holds a lone surrogate)"
    if size > HEADER_VALUE_LIMIT:
        return f"is {size} bytes long, over the {HEADER_VALUE_LIMIT}-byte limit of a header value"
    return None


JSON: Final = ("content-type", "application/json")


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: its two broad kinds.

    OpenAI's API answers a request the client got wrong (a bad body, an
    unknown model) with ``invalid_request_error`` and its own failures with
    ``server_error``; the SDKs choose the exception class by status alone.
    """
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, code: str) -> dict[str, dict[str, str]]:
    """An error as OpenAI's API words it: ``{"error": {"message", "type", "code"}}``.

    ``message`` is for people; ``code`` is a short machine label (the
    refusal's reason, ``model_not_found``...). The OpenAI SDKs read these
    three fields into their exceptions (``.message``, ``.type``, ``.code``).
    The gateway's Envoy builds its own answers from this too, with Envoy
    format strings as values.
    """
    return {"error": {"message": message, "type": error_type(status), "code": code}}


class Refusal(Exception):
    """Stop this request and answer the client with ``status`` instead of forwarding it.

    ``message`` says what is wrong, for the client. ``reason`` labels the
    service's error counter (default: GIE's name for the status, ``code``);
    ``headers`` go on the answer (LWEPP's explained 503 carries its decision).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.reason = reason or self.code

    @property
    def code(self) -> str:
        """GIE's name for the status: ``BadRequest``, ``ServiceUnavailable``, ..."""
        return CODES.get(self.status, str(self.status))

    def answer(self) -> ProcessingResponse:
        """This refusal as Envoy's ``ImmediateResponse``: the status, an OpenAI-style JSON
        error (``error_body``, ``code`` the reason) and the refusal's own headers."""
        body = orjson.dumps(error_body(self.status, self.message, self.reason))
        return extproc.immediate_response(self.status, body, [JSON, *self.headers])


def check_headers_fit(
    phase: Phase,
    headers: Collection[tuple[str, str]],
    set_headers: Sequence[tuple[str, str]],
    remove: Sequence[str] = (),
) -> None:
    """Refuse a mutation that would take ``headers`` past Envoy's default limits.

    Counted as Envoy counts (``HeaderMap::byteSize``: every name and value,
    pseudo-headers included, the headers Envoy sent us being its whole map);
    a set header replaces the first of that name and adds one if absent. A
    request is answered 431 (its headers are too large once routed), a
    response 502 (the gateway cannot pass it on).
    """
    # Replacing or removing a header never makes the map larger, so when every header
    # sent and every header set fit together (names and values in UTF-8 bytes, never
    # less than the exact count), so does the result. That sum is one join in C; the
    # exact count below walks the headers in Python, and this runs on every request.
    if len(headers) + len(set_headers) <= HEADERS_COUNT_LIMIT:
        everything = itertools.chain.from_iterable((*headers, *set_headers))
        if len("".join(everything).encode(errors="surrogatepass")) <= HEADERS_SIZE_LIMIT:
            return
    replaced = {name.lower() for name, _ in set_headers}
    removed = {name.lower() for name in remove}
    size = count = 0
    for name, value in headers:
        key = name.lower()
        if key in removed:
            continue
        if key in replaced:
            replaced.discard(key)  # the first of that name is overwritten, counted below
            continue
        size += len(name) + _utf8_length(value)
        count += 1
    size += sum(len(name) + _utf8_length(value) for name, value in set_headers)
    count += len(set_headers)
    if size > HEADERS_SIZE_LIMIT or count > HEADERS_COUNT_LIMIT:
        names = ", ".join(name for name, _ in set_headers)
        raise Refusal(
            431 if phase == "request" else 502,
            f"{phase} headers too large: setting {names} would make them {count} headers of "
            f"{size} bytes, over the gateway's limits ({HEADERS_COUNT_LIMIT} headers, "
            f"{HEADERS_SIZE_LIMIT} bytes)",
            reason="headers_too_large",
        )


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode(errors="surrogatepass"))


class Half:
    """One direction of the exchange, request or response: its headers, body mode and held body.

    ``headers`` are Envoy's ``(name, value)`` pairs; ``mode`` the body send
    mode Envoy runs this direction with (``BodyMode``), and ``streamed``
    whether that is ``FULL_DUPLEX_STREAMED``, where Envoy forwards only the
    body we send back; ``chunks`` and ``size`` the body held so far, at most
    ``limit`` bytes; ``held`` whether our answer to the headers waits for the
    end of the body.
    """

    __slots__ = ("chunks", "headers", "held", "limit", "mode", "phase", "size", "streamed")

    def __init__(self, phase: Phase, mode: int, limit: int = MAX_BODY_BYTES) -> None:
        # Plain code, not a dataclass's __init__ nor a call to use(): two halves are made
        # for every stream, and each Python call there is a measurable share of a stream.
        self.phase, self.limit, self.mode = phase, limit, mode
        self.streamed = mode == _FULL_DUPLEX
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.held = False

    def use(self, mode: int) -> None:
        """Run with body mode ``mode`` (``streamed`` is kept with it: it is read per chunk)."""
        self.mode = mode
        self.streamed = mode == _FULL_DUPLEX

    def fits(self, chunk: bytes) -> bool:
        """Whether ``chunk`` can join the held body without going over the cap."""
        return self.size + len(chunk) <= self.limit

    def hold(self, chunk: bytes) -> None:
        """Keep ``chunk``; a body that outgrows the cap is refused with 413."""
        if not self.fits(chunk):
            raise Refusal(
                413,
                f"{self.phase} body exceeds the {self.limit}-byte limit (--max-body-bytes)",
                reason="body_too_large",
            )
        self.chunks.append(chunk)
        self.size += len(chunk)

    def take(self) -> bytes:
        """The held body, whole; the half holds nothing afterwards."""
        body = b"".join(self.chunks)
        self.chunks, self.size = [], 0
        return body


class Exchange:
    """One stream's record: the request half and the response half.

    ``modes`` are the body modes to assume when Envoy does not say (a proxy
    before 1.34 sends no ``protocol_config``); ``limit`` caps each held body.
    """

    __slots__ = ("request", "response")

    def __init__(self, modes: tuple[int, int], limit: int = MAX_BODY_BYTES) -> None:
        self.request = Half("request", modes[0], limit)
        self.response = Half("response", modes[1], limit)

    def use_modes(self, message: ProcessingRequest) -> None:
        """Take each direction's body mode from ``protocol_config``, when Envoy sends it."""
        if (modes := extproc.body_modes(message)) is not None:
            self.request.use(modes[0])
            self.response.use(modes[1])

    @property
    def request_id(self) -> str | None:
        """The request's ``x-request-id``, for logs (None before the headers came)."""
        return extproc.first_header(self.request.headers, "x-request-id")
