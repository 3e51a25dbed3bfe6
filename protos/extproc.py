"""Reading Envoy's ext_proc requests and building its responses.

Envoy's External Processing filter (``envoy.filters.http.ext_proc``) opens one
bidirectional gRPC stream, ``envoy.service.ext_proc.v3.ExternalProcessor/Process``,
per HTTP request. Envoy sends a ``ProcessingRequest`` for each phase it is
configured to share (request headers, request body chunks, response headers,
...), and the processor answers each with a ``ProcessingResponse`` of the same
phase, or ends the exchange early with an ``ImmediateResponse``.

This module is the only place that knows the message classes. They come from
``xds-protos`` (Envoy's own generated code on the upb protobuf runtime), which
parses a header message in microseconds; ``envoy-data-plane``'s pure-Python
classes cost about a millisecond for the same message, too much for a hop that
sits on every request (``bench/codec.py`` measures both).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

if TYPE_CHECKING:
    # xds-protos ships no type information, so to mypy its classes are Any;
    # the names still document what flows where, and tests check the fields.
    ProcessingRequest: TypeAlias = Any
    ProcessingResponse: TypeAlias = Any
else:
    ProcessingRequest = pb.ProcessingRequest
    ProcessingResponse = pb.ProcessingResponse

Phase = Literal["request", "response"]
"""Which half of the HTTP exchange a headers or body message belongs to."""

_SEND_MODES = processing_mode_pb2.ProcessingMode.BodySendMode


class BodyMode(enum.IntEnum):
    """Envoy's body send modes (``ProcessingMode.BodySendMode``), as the ints on the wire.

    A Python enum of the protobuf's values rather than the protobuf's own enum
    wrapper: reading a member of that wrapper runs Python code on every access,
    which showed up in a stream's cost; these are plain class attributes.
    """

    NONE = _SEND_MODES.Value("NONE")
    STREAMED = _SEND_MODES.Value("STREAMED")
    BUFFERED = _SEND_MODES.Value("BUFFERED")
    BUFFERED_PARTIAL = _SEND_MODES.Value("BUFFERED_PARTIAL")
    FULL_DUPLEX_STREAMED = _SEND_MODES.Value("FULL_DUPLEX_STREAMED")
    GRPC = _SEND_MODES.Value("GRPC")


CHUNK_LIMIT: Final = 62_000
"""Largest body chunk sent back in one ``streamed_response``.

GIE's shared Envoy helpers use the same figure: a margin under the 64 KiB that
a gRPC message to Envoy's ext_proc filter comfortably carries.
"""

LB_NAMESPACE: Final = "envoy.lb"
"""Metadata namespace that Envoy's load balancing reads (and where it reports back)."""


# --- reading ---------------------------------------------------------------------


def kind(request: ProcessingRequest) -> str:
    """The phase this message carries: ``"request_headers"``, ``"request_body"``, ...

    It is the name of the ``request`` oneof field that is set, so a servicer can
    ``match`` on it.
    """
    return request.WhichOneof("request") or ""


def header_pairs(headers: Any) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of an ``HttpHeaders`` message, duplicates kept.

    Envoy fills ``raw_value`` (bytes) and leaves ``value`` empty; older proxies
    did the opposite. As in GIE, a non-empty ``raw_value`` wins. Envoy already
    lower-cases header names (HTTP/2 and HTTP/3 require it, and it normalises
    HTTP/1.1 the same way).
    """
    return [
        (h.key, raw.decode("utf-8", "replace") if (raw := h.raw_value) else h.value)
        for h in headers.headers.headers
    ]


def first_header(pairs: Iterable[tuple[str, str]], name: str) -> str | None:
    """The first value of header ``name`` (compared case-insensitively), or None."""
    name = name.lower()
    for key, value in pairs:
        if key.lower() == name:
            return value
    return None


def filter_metadata(request: ProcessingRequest, namespace: str) -> dict[str, Any] | None:
    """``metadata_context.filter_metadata[namespace]`` as plain Python values.

    Returns None when the namespace is absent, so callers can tell "not sent"
    apart from "sent empty". Numbers come back as floats and lists as lists,
    the way protobuf's ``Struct`` carries them.
    """
    entries = request.metadata_context.filter_metadata
    if namespace not in entries:
        return None
    value: dict[str, Any] = json_format.MessageToDict(entries[namespace])
    return value


def body_modes(request: ProcessingRequest) -> tuple[int, int] | None:
    """The (request, response) body modes Envoy says it runs with, if it says.

    Envoy puts a ``ProtocolConfiguration`` in the first message of each stream
    so that one processor can serve filters configured differently. None means
    the proxy did not send it (Envoy before 1.34).
    """
    if not request.HasField("protocol_config"):
        return None
    config = request.protocol_config
    return config.request_body_mode, config.response_body_mode


# --- building --------------------------------------------------------------------


def header_mutation(set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()) -> Any:
    """A ``HeaderMutation`` that overwrites each header in ``set_headers``, in order.

    Values travel as ``raw_value`` bytes; the ``append`` fields stay unset, so
    Envoy's default for ext_proc (overwrite if the header exists, add if it does
    not) applies. Overwriting matters: appending would duplicate a header such
    as ``x-conformance-test-served-endpoint`` and break an equality check.
    """
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=name, raw_value=value.encode())
            )
            for name, value in set_headers
        ],
        remove_headers=list(remove),
    )


def common_response(
    set_headers: Sequence[tuple[str, str]] = (),
    remove: Sequence[str] = (),
    *,
    clear_route_cache: bool = False,
    body: bytes | None = None,
    streamed_body: bytes | None = None,
    end_of_stream: bool = False,
) -> Any:
    """A ``CommonResponse``: header changes, an optional body change, route cache.

    ``body`` replaces a buffered body whole; ``streamed_body`` is one chunk of a
    body sent back in ``FULL_DUPLEX_STREAMED`` mode, where Envoy forwards only
    what the processor returns. ``clear_route_cache`` makes Envoy re-run route
    matching after this mutation, which is how a header set here can choose the
    route (BBR's model header) or the endpoint.
    """
    response = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if set_headers or remove:
        response.header_mutation.CopyFrom(header_mutation(set_headers, remove))
    if body is not None:
        response.body_mutation.body = body
    elif streamed_body is not None:
        response.body_mutation.streamed_response.body = streamed_body
        response.body_mutation.streamed_response.end_of_stream = end_of_stream
    return response


def struct(values: Mapping[str, Mapping[str, Any]]) -> struct_pb2.Struct:
    """A ``google.protobuf.Struct`` from nested plain values (dynamic metadata)."""
    message = struct_pb2.Struct()
    message.update(values)
    return message


def headers_response(
    phase: Phase,
    set_headers: Sequence[tuple[str, str]] = (),
    remove: Sequence[str] = (),
    *,
    clear_route_cache: bool = False,
    dynamic_metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> ProcessingResponse:
    """The answer to a ``request_headers`` or ``response_headers`` message."""
    common = common_response(set_headers, remove, clear_route_cache=clear_route_cache)
    response = ProcessingResponse(**{f"{phase}_headers": pb.HeadersResponse(response=common)})
    if dynamic_metadata:
        response.dynamic_metadata.CopyFrom(struct(dynamic_metadata))
    return response


def body_response(
    phase: Phase,
    set_headers: Sequence[tuple[str, str]] = (),
    remove: Sequence[str] = (),
    *,
    clear_route_cache: bool = False,
    body: bytes | None = None,
    streamed_body: bytes | None = None,
    end_of_stream: bool = False,
) -> ProcessingResponse:
    """The answer to a ``request_body`` or ``response_body`` message.

    With no arguments it is a plain acknowledgement: Envoy continues with the
    chunk unchanged (in the buffered and streamed modes).
    """
    common = common_response(
        set_headers,
        remove,
        clear_route_cache=clear_route_cache,
        body=body,
        streamed_body=streamed_body,
        end_of_stream=end_of_stream,
    )
    return ProcessingResponse(**{f"{phase}_body": pb.BodyResponse(response=common)})


def chunks(body: bytes, limit: int = CHUNK_LIMIT) -> Iterator[bytes]:
    """``body`` cut into pieces of at most ``limit`` bytes; an empty body is one empty piece."""
    if not body:
        yield b""
        return
    for start in range(0, len(body), limit):
        yield body[start : start + limit]


def streamed_body_responses(
    phase: Phase, body: bytes, *, end_of_stream: bool = True
) -> list[ProcessingResponse]:
    """A whole body sent back as ``streamed_response`` chunks (FULL_DUPLEX_STREAMED).

    Only the last chunk carries ``end_of_stream``, and only if asked: the
    stream's end is the proxy's to announce when trailers follow. An empty
    body that does not end the stream is no message at all (headers, then
    trailers, with no body between: there is nothing to send back).
    """
    if not body and not end_of_stream:
        return []
    pieces = list(chunks(body))
    last = len(pieces) - 1
    return [
        body_response(phase, streamed_body=piece, end_of_stream=end_of_stream and i == last)
        for i, piece in enumerate(pieces)
    ]


def trailers_response(phase: Phase) -> ProcessingResponse:
    """An empty answer to a trailers message: continue unchanged."""
    return ProcessingResponse(**{f"{phase}_trailers": pb.TrailersResponse()})


def immediate_response(
    status: int, body: str | bytes, headers: Sequence[tuple[str, str]] = ()
) -> ProcessingResponse:
    """Stop processing and have Envoy answer the client directly.

    This is the protocol's way to refuse a request with a real HTTP status (400
    for a malformed body, 503 when no endpoint may serve it, ...) instead of
    breaking the gRPC stream, which leaves the status to the gateway's failure
    mode.
    """
    return ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            body=body.encode() if isinstance(body, str) else body,
            headers=header_mutation(headers),
        )
    )
