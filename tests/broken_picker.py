"""A deliberately broken endpoint picker: the proof that the conformance harness can fail a picker.

It keeps the ext_proc protocol (it names one endpoint, in the
``x-gateway-destination-endpoint`` header and in ``envoy.lb`` metadata,
clears the route cache, and returns the body it held in full-duplex mode),
but breaks two of GIE's picker rules:

- it ignores the subset hint and the ``test-epp-endpoint-selection``
  header, and takes every endpoint of its pool in turn (round robin);
- it never reports the served endpoint: no
  ``x-conformance-test-served-endpoint`` on the response, and no
  ``X-Echo-Set-Header`` asking the echo server to set it.

Held to GIE's tests with the harness::

    make conformance PICKER='{python} tests/broken_picker.py --host {host} \\
        --port {grpc_port} --health-port {health_port} --endpoints {endpoints}'

it fails exactly the tests that pin requests to pods or read the served
report, and passes the rest (``tests/test_conformance_pickers.py`` checks
which). Its flags are its own, unlike LWEPP's, as another picker's would be.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from serving.options import Ports, ServingOptions
from serving.server import Health, Service, serve
from wire import extproc
from wire.stream import Stream

DESTINATION = "x-gateway-destination-endpoint"


class IgnoresHints:
    """Round robin over every endpoint, whatever the request allows; reports nothing back."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self._turn = itertools.cycle(endpoints)

    def _route(self) -> extproc.ProcessingResponse:
        endpoint = next(self._turn)
        return extproc.headers_response(
            "request",
            [(DESTINATION, endpoint)],
            clear_route_cache=True,
            dynamic_metadata={extproc.LB_NAMESPACE: {DESTINATION: endpoint}},
        )

    async def __call__(self, stream: Stream) -> None:
        body: list[bytes] = []
        while (message := await stream.recv()) is not None:
            match extproc.kind(message):
                case "request_headers":
                    if message.request_headers.end_of_stream:
                        await stream.send(self._route())
                    # Otherwise the body follows (full duplex): pick at its end.
                case "request_body":
                    body.append(message.request_body.body)
                    if message.request_body.end_of_stream:
                        await stream.send(self._route())
                        for reply in extproc.streamed_body_responses("request", b"".join(body)):
                            await stream.send(reply)
                case "request_trailers":
                    await stream.send(extproc.trailers_response("request"))
                case "response_headers":
                    await stream.send(extproc.headers_response("response", []))  # no report
                case "response_body":
                    await stream.send(extproc.body_response("response"))
                case "response_trailers":
                    await stream.send(extproc.trailers_response("response"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="ext_proc (plaintext gRPC)")
    parser.add_argument("--health-port", type=int, required=True, help="gRPC health")
    parser.add_argument("--endpoints", required=True, help="ip:port,ip:port,...")
    parser.add_argument(
        "--health-service",
        default="inference-extension",
        help="the one gRPC health service it reports SERVING (default: %(default)s)",
    )
    args = parser.parse_args()
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if not endpoints:
        parser.error("--endpoints: no endpoint")
    ports = Ports(args.host, args.port, args.health_port, 0)
    health = Health([args.health_service])
    service = Service("broken-picker", IgnoresHints(endpoints), health, CollectorRegistry())
    asyncio.run(serve(service, ServingOptions(ports)))


if __name__ == "__main__":
    main()
