"""A server for ``bench.streams``: ``python -m bench.server KIND`` prints its port and serves."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from bbr.server import BodyBasedRouter
from lwepp.picking import Pool, RoundRobin
from lwepp.server import EndpointPickerService, Metrics
from pods.model import Pod, StaticSource
from protos import extproc
from protos.extproc import ProcessingRequest, ProcessingResponse
from protos.logs import configure_logging
from protos.server import EXT_PROC_SERVICE, Handler, Stream, ext_proc_handler

PODS = tuple(Pod(f"pod-{i}", f"10.0.0.{i + 1}", (8000,), {"pool": "a"}) for i in range(8))


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


def generator_handler() -> grpc.GenericRpcHandler:
    """The same do-nothing server written as an async generator over the request stream."""

    async def process(requests: AsyncIterator[Any], _context: Any) -> AsyncIterator[Any]:
        async for message in requests:
            for reply in _noop_replies(message):
                yield reply

    method = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method})


def handler_for(kind: str) -> grpc.GenericRpcHandler:
    service: Handler
    match kind:
        case "noop-rw":
            service = noop
        case "noop-gen":
            return generator_handler()
        case "lwepp":
            pool = Pool(StaticSource(*PODS), {"pool": "a"})
            service = EndpointPickerService(pool, RoundRobin(), Metrics(CollectorRegistry()))
        case "bbr":
            service = BodyBasedRouter(CollectorRegistry())
        case hooked if hooked.startswith("lwepp-hooks-"):  # the pipeline (bench/hooks.py)
            from bench.hooks import service as pipeline_service

            service = pipeline_service(int(hooked.removeprefix("lwepp-hooks-")))
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
    asyncio.run(main(sys.argv[1]))
