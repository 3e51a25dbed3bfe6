"""A server for ``bench.streams``: ``python -m bench.server KIND`` prints its port and serves."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from bbr.server import BodyBasedRouter
from bench.hooks import STREAM_KINDS
from bench.hooks import service as picker_service
from onehop.server import OneHop
from serving.logs import configure_logging
from wire import extproc
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse
from wire.stream import EXT_PROC_SERVICE, Handler, Stream, ext_proc_handler


def _noop_replies(message: ProcessingRequest) -> list[ProcessingResponse]:
    """The do-nothing answer, same shapes as a picker's: headers reply, then the body back."""
    match extproc.kind(message):
        case "request_body" if message.request_body.end_of_stream:
            return [
                extproc.headers_response("request"),
                extproc.body_response(
                    "request", streamed_body=message.request_body.body, end_of_stream=True
                ),
            ]
        case "request_headers" if message.request_headers.end_of_stream:
            return [extproc.headers_response("request")]
    return []


async def noop(stream: Stream) -> None:
    while (message := await stream.recv()) is not None:
        for reply in _noop_replies(message):
            await stream.send(reply)


class Passthrough:
    """A do-nothing hop for every phase Envoy may send: the gateway benchmarks' baseline.

    It answers in the processing modes of ``demo/envoy.py``'s filters with the
    same message shapes a service sends, and changes nothing: the request
    headers reply is held until the body ends (FULL_DUPLEX_STREAMED forwards
    only what comes back), then the body goes back whole; response headers
    and trailers are acknowledged empty. One per stream; ``replies`` is all
    of it, so the same hop runs on either of grpc's server loops.
    """

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.held = False

    def replies(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        match extproc.kind(message):
            case "request_headers":
                modes = extproc.body_modes(message)
                streamed = modes is None or modes[0] == BodyMode.FULL_DUPLEX_STREAMED
                self.held = streamed and not message.request_headers.end_of_stream
                return [] if self.held else [extproc.headers_response("request")]
            case "request_body":
                chunk = message.request_body
                if not self.held:  # Envoy keeps the body: acknowledge it
                    return [extproc.body_response("request")]
                self.chunks.append(chunk.body)
                return self.release(end_of_stream=True) if chunk.end_of_stream else []
            case "request_trailers":
                body = self.release(end_of_stream=False) if self.held else []  # they end it
                return [*body, extproc.trailers_response("request")]
            case "response_headers":
                return [extproc.headers_response("response")]
            case "response_body":
                return [extproc.body_response("response")]
            case "response_trailers":
                return [extproc.trailers_response("response")]
        return []

    def release(self, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """The held headers reply, then the body back."""
        self.held = False
        body, self.chunks = b"".join(self.chunks), []
        return [
            extproc.headers_response("request"),
            *extproc.streamed_body_responses("request", body, end_of_stream=end_of_stream),
        ]


async def passthrough(stream: Stream) -> None:
    """``passthrough``: the do-nothing hop on grpc.aio, the services' server loop."""
    hop = Passthrough()
    while (message := await stream.recv()) is not None:
        for reply in hop.replies(message):
            await stream.send(reply)


def _process_handler(process: Callable[[Any, Any], Any]) -> grpc.GenericRpcHandler:
    """``process`` (requests, context) as ext_proc's ``Process`` method, on the messages of
    xds-protos: the loops below are written for the server directly, not as a ``Handler``."""
    method = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method})


def generator_handler() -> grpc.GenericRpcHandler:
    """The same do-nothing server written as an async generator over the request stream."""

    async def process(requests: AsyncIterator[Any], _context: Any) -> AsyncIterator[Any]:
        async for message in requests:
            for reply in _noop_replies(message):
                yield reply

    return _process_handler(process)


def sync_handler() -> grpc.GenericRpcHandler:
    """The same do-nothing server for grpc's synchronous server: a thread per stream.

    The other server loop grpc offers in Python. ``bench/overhead.py`` measures it
    against ``noop-rw`` (grpc.aio, what ``serving.server`` runs) on whole
    full-duplex streams, the mode every filter of the gateway uses.
    """

    def process(requests: Iterator[Any], _context: Any) -> Iterator[Any]:
        for message in requests:
            yield from _noop_replies(message)

    return _process_handler(process)


def sync_passthrough_handler() -> grpc.GenericRpcHandler:
    """``passthrough-sync``: the do-nothing hop on grpc's synchronous server (``bench.floor``)."""

    def process(requests: Iterator[Any], _context: Any) -> Iterator[Any]:
        hop = Passthrough()
        for message in requests:
            yield from hop.replies(message)

    return _process_handler(process)


def serve_sync(handler: grpc.GenericRpcHandler) -> None:
    """``noop-sync`` and ``passthrough-sync``: the synchronous server, with threads enough
    for the benchmarks' streams."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def handler_for(kind: str) -> grpc.GenericRpcHandler:
    service: Handler
    match kind:
        case "noop-rw":
            service = noop
        case "noop-gen":
            return generator_handler()
        case "passthrough":
            service = passthrough
        case "lwepp":
            service = picker_service(None)
        case "bbr":
            service = BodyBasedRouter(CollectorRegistry())
        case "onehop":  # BBR's chain, then LWEPP's round-robin pick, in one stream
            service = OneHop(BodyBasedRouter(CollectorRegistry()), {"*": picker_service(None)})
        case hooked if hooked in STREAM_KINDS:  # the pipelines of bench/hooks.py
            service = picker_service(int(hooked.removeprefix("lwepp-hooks-")))
        case _:
            raise SystemExit(f"unknown server kind {kind!r}")
    return ext_proc_handler(service)


async def main(kind: str) -> None:
    configure_logging("warning")  # stdout carries the port; per-request logs would only cost
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler_for(kind),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    if sys.argv[1] == "noop-sync":
        serve_sync(sync_handler())
    elif sys.argv[1] == "passthrough-sync":
        serve_sync(sync_passthrough_handler())
    else:
        asyncio.run(main(sys.argv[1]))
