"""A deliberately broken endpoint picker: the proof that the conformance harness can fail a picker.

Without a fault it is a minimal correct picker: it names one endpoint, in
the ``x-gateway-destination-endpoint`` header and in ``envoy.lb`` metadata,
clears the route cache, returns the body it held in full-duplex mode, keeps
to the endpoints ``test-epp-endpoint-selection`` allows (a bare IP: any of
its ports; ``ip:port``: that one; none left: 503), and reports the served
endpoint (``x-conformance-test-served-endpoint``). Each ``--fault`` breaks
one of GIE's picker rules:

- ``ignores-hints``: every endpoint of its pool in turn (round robin),
  whatever the selection header allows;
- ``no-report``: no ``x-conformance-test-served-endpoint`` on the response;
- ``header-only``: the endpoint in the header, not in ``envoy.lb`` metadata
  (a gateway that routes on the metadata, as Istio's does, cannot follow it);
- ``container-port``: read from its InferencePool (``--pool-name``), it
  takes each pod's first container port instead of the pool's target ports.

With ``--fallbacks N`` it names up to N of the allowed endpoints, the
chosen one first, as an ordered fallback list (``ip:port,ip:port``, which
the protocol allows since v0.4.0): not a fault.

It learns its endpoints as the harness offers them: ``--endpoints`` (handed
over), or ``--kubeconfig`` with ``--pool-name`` and ``--pool-namespace``
(the pool and its pods, read once at start from the API server). Held to
GIE's tests with the harness, for example::

    make conformance PICKER='{python} tests/broken_picker.py --host {host} \\
        --port {grpc_port} --health-port {health_port} --secure-serving {secure_serving} \\
        --endpoints {endpoints} --fault ignores-hints --fault no-report'

it fails exactly the tests that check what its faults break, and passes the
rest (``tests/test_conformance_pickers.py`` checks which). Its flags are its
own, unlike LWEPP's, as another picker's would be.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry

from pods.kubeapi import KubeApi, load_kubeconfig
from serving.options import Ports, ServingOptions
from serving.server import Health, Service, serve
from serving.tls import ServerTLS, self_signed
from wire import extproc
from wire.stream import Stream

DESTINATION = "x-gateway-destination-endpoint"
SELECTION = "test-epp-endpoint-selection"
SERVED = "x-gateway-destination-endpoint-served"
REPORT = "x-conformance-test-served-endpoint"
FAULTS = ("ignores-hints", "no-report", "header-only", "container-port")


def allowed(selection: str, endpoint: str) -> bool:
    """Whether the selection header (comma-separated IPs or ``ip:port``) allows ``endpoint``."""
    ip = endpoint.rpartition(":")[0]
    return any(token.strip() in (ip, endpoint) for token in selection.split(","))


class Picker:
    """Picks as its faults let it: among the allowed endpoints in turn, or all of them."""

    def __init__(self, endpoints: Sequence[str], faults: Sequence[str], fallbacks: int = 1) -> None:
        self._endpoints = list(endpoints)
        self._faults = set(faults)
        self._fallbacks = fallbacks
        self._turn: Iterator[int] = itertools.count()

    def _route(self, selection: str | None) -> extproc.ProcessingResponse:
        candidates = self._endpoints
        if selection is not None and "ignores-hints" not in self._faults:
            candidates = [e for e in candidates if allowed(selection, e)]
        if not candidates:
            return extproc.immediate_response(503, "no endpoint is allowed")
        first = next(self._turn)
        count = min(self._fallbacks, len(candidates))
        endpoint = ",".join(candidates[(first + i) % len(candidates)] for i in range(count))
        metadata = {} if "header-only" in self._faults else {DESTINATION: endpoint}
        return extproc.headers_response(
            "request",
            [(DESTINATION, endpoint)],
            clear_route_cache=True,
            dynamic_metadata={extproc.LB_NAMESPACE: metadata} if metadata else None,
        )

    def _report(self, message: extproc.ProcessingRequest) -> extproc.ProcessingResponse:
        if "no-report" in self._faults:
            return extproc.headers_response("response", [])
        lb = extproc.filter_metadata(message, extproc.LB_NAMESPACE) or {}
        served = lb.get(SERVED) or "fail: missing destination endpoint served metadata"
        return extproc.headers_response("response", [(REPORT, str(served))])

    async def __call__(self, stream: Stream) -> None:
        body: list[bytes] = []
        selection: str | None = None
        while (message := await stream.recv()) is not None:
            match extproc.kind(message):
                case "request_headers":
                    pairs = extproc.header_pairs(message.request_headers)
                    selection = extproc.first_header(pairs, SELECTION)
                    if message.request_headers.end_of_stream:
                        await stream.send(self._route(selection))
                    # Otherwise the body follows (full duplex): pick at its end.
                case "request_body":
                    body.append(message.request_body.body)
                    if message.request_body.end_of_stream:
                        route = self._route(selection)
                        await stream.send(route)
                        if route.WhichOneof("response") == "request_headers":
                            for reply in extproc.streamed_body_responses("request", b"".join(body)):
                                await stream.send(reply)
                case "request_trailers":
                    await stream.send(extproc.trailers_response("request"))
                case "response_headers":
                    await stream.send(self._report(message))
                case "response_body":
                    await stream.send(extproc.body_response("response"))
                case "response_trailers":
                    await stream.send(extproc.trailers_response("response"))


async def read_pool(kubeconfig: str, name: str, namespace: str, faults: Sequence[str]) -> list[str]:
    """The pool's endpoints from the API server: its pods × its target ports (or, with the
    ``container-port`` fault, × each pod's first container port)."""
    base = "/apis/inference.networking.k8s.io/v1"
    async with KubeApi(load_kubeconfig(kubeconfig)) as api:
        pool = await api.request("GET", f"{base}/namespaces/{namespace}/inferencepools/{name}")
        labels = pool["spec"]["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = await api.list(f"/api/v1/namespaces/{namespace}/pods", {"labelSelector": selector})
    ports = [entry["number"] for entry in pool["spec"]["targetPorts"]]
    found = []
    for pod in pods.items:
        if "container-port" in faults:
            ports = [pod["spec"]["containers"][0]["ports"][0]["containerPort"]]
        found += [f"{pod['status']['podIP']}:{port}" for port in ports]
    return found


async def run(args: argparse.Namespace) -> None:
    if args.endpoints is not None:
        endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    else:
        endpoints = await read_pool(
            args.kubeconfig, args.pool_name, args.pool_namespace, args.fault
        )
    tls = ServerTLS(self_signed()) if args.secure_serving == "true" else None
    ports = Ports(args.host, args.port, args.health_port, 0)
    health = Health(["inference-extension"])
    picker = Picker(endpoints, args.fault, args.fallbacks)
    service = Service("broken-picker", picker, health, CollectorRegistry())
    await serve(service, ServingOptions(ports, tls=tls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="ext_proc")
    parser.add_argument("--health-port", type=int, required=True, help="gRPC health, plaintext")
    parser.add_argument("--secure-serving", choices=("true", "false"), default="true")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--endpoints", help="ip:port,ip:port,...")
    source.add_argument("--kubeconfig", help="read --pool-name from this API server")
    parser.add_argument("--pool-name")
    parser.add_argument("--pool-namespace")
    parser.add_argument("--fault", action="append", default=[], choices=FAULTS)
    parser.add_argument("--fallbacks", type=int, default=1, help="endpoints named, at most")
    args = parser.parse_args()
    if args.kubeconfig is not None and not (args.pool_name and args.pool_namespace):
        parser.error("--kubeconfig needs --pool-name and --pool-namespace")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
