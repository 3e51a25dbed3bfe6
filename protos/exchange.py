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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import orjson

from protos import extproc
from protos.extproc import BodyMode, Phase, ProcessingRequest, ProcessingResponse

MAX_BODY_BYTES: Final = 10 * 1024 * 1024
"""The default cap on a held body (``--max-body-bytes``): 10 MiB."""

CODES: Final = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    413: "PayloadTooLarge",
    429: "ResourceExhausted",
    500: "Internal",
    503: "ServiceUnavailable",
}
"""GIE's names for its error codes, by the HTTP status each maps to (413 is ours)."""

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


@dataclass(slots=True)
class Half:
    """One direction of the exchange, request or response: its headers, body mode and held body."""

    phase: Phase
    mode: int
    """The body send mode Envoy runs this direction with (``BodyMode``)."""
    limit: int = MAX_BODY_BYTES
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    held: bool = False
    """Our answer to the headers waits for the end of the body."""

    @property
    def streamed(self) -> bool:
        """``FULL_DUPLEX_STREAMED``: Envoy forwards only the body we send back."""
        return bool(self.mode == BodyMode.FULL_DUPLEX_STREAMED)

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
            self.request.mode, self.response.mode = modes

    @property
    def request_id(self) -> str | None:
        """The request's ``x-request-id``, for logs (None before the headers came)."""
        return extproc.first_header(self.request.headers, "x-request-id")
