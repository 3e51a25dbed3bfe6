"""The ext_proc stream as a handler sees it, and the gRPC method that carries it.

Envoy calls one bidirectional streaming method, ``ExternalProcessor/Process``,
once per HTTP request: it sends a ``ProcessingRequest`` per phase of the
request (headers, body chunks, trailers, then the response's) and reads one
``ProcessingResponse`` per phase back, in order. A service is a ``Handler``:
one async call per stream, reading with ``stream.recv()`` until None and
answering with ``stream.send()``. ``ext_proc_handler`` binds it to the method
with xds-protos' codec; ``serving.server`` serves it.
"""

from __future__ import annotations

import itertools
from typing import Any, Final, Protocol, TextIO

import grpc
from google.protobuf import text_format

from wire.extproc import ProcessingRequest, ProcessingResponse

EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC service name Envoy calls; also a health service name the GIE protocol lists."""


class Call(Protocol):
    """The two methods of grpc.aio's servicer context a stream uses (grpcio ships no types)."""

    async def read(self) -> Any:
        """The next request, decoded (a ``ProcessingRequest``), or ``grpc.aio.EOF``."""
        ...

    async def write(self, message: ProcessingResponse) -> None:
        """Send one response, encoded by the method's serializer."""
        ...


class Stream:
    """One ext_proc exchange as seen by a handler: receive requests, send responses.

    A thin wrapper over the call's context: ``context.read()`` and
    ``context.write()`` cost measurably less per message than iterating the
    request stream in an async generator (``bench/codec.py``), and a plain
    ``while`` loop over ``recv()`` reads just as clearly.
    """

    __slots__ = ("_context",)

    def __init__(self, context: Call) -> None:
        self._context = context

    async def recv(self) -> ProcessingRequest | None:
        """The next message from Envoy, or None once Envoy has half-closed the stream."""
        message = await self._context.read()
        return None if message is grpc.aio.EOF else message

    async def send(self, response: ProcessingResponse) -> None:
        """Send one response; responses must follow the order of the requests."""
        await self._context.write(response)


class TracedStream(Stream):
    """A stream that also writes every message, both ways, to a trace file.

    For learning and debugging (``--trace-messages``): each message appears
    in protobuf text format under a line naming the stream, the direction
    and the phase. Never on in production: it costs far more than the work.
    """

    __slots__ = ("_number", "_trace")

    def __init__(self, context: Call, trace: TextIO, number: int) -> None:
        super().__init__(context)
        self._trace, self._number = trace, number

    def _write(self, arrow: str, message: ProcessingRequest | ProcessingResponse) -> None:
        phase: str | None = (
            message.WhichOneof("request")
            if isinstance(message, ProcessingRequest)
            else message.WhichOneof("response")
        )
        text = text_format.MessageToString(message, as_utf8=True)
        self._trace.write(f"## stream {self._number} {arrow} {phase}\n{text}\n")
        self._trace.flush()

    async def recv(self) -> ProcessingRequest | None:
        message = await super().recv()
        if message is not None:
            self._write("<-", message)
        return message

    async def send(self, response: ProcessingResponse) -> None:
        self._write("->", response)
        await super().send(response)


class Handler(Protocol):
    """What a service provides: the whole life of one ext_proc stream."""

    async def __call__(self, stream: Stream) -> None:
        """Read messages with ``stream.recv()`` until None, answering each phase.

        Returning ends the call with OK. Raising ``grpc.aio.AbortError`` (from
        ``abort``) ends it with that status; any other exception is logged and
        ends it with ``UNKNOWN``.
        """
        ...


def ext_proc_handler(handler: Handler, trace: TextIO | None = None) -> grpc.GenericRpcHandler:
    """Bind ``handler`` to ``ExternalProcessor/Process`` with xds-protos' codec.

    With ``trace``, every message of every stream is also written there.
    """
    numbers = itertools.count(1)

    async def process(_requests: object, context: Call) -> None:
        if trace is None:
            await handler(Stream(context))
        else:
            await handler(TracedStream(context, trace, next(numbers)))

    method = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method})
