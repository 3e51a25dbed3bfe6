"""The endpoint picker alone: the tests' requests as the ext_proc streams Envoy would open.

Run against the picker only, a test tells the two halves of the request path
apart. If it passes here and fails through the gateway, the gateway's wiring
(routes, the ORIGINAL_DST cluster, the served-endpoint report, failure
modes) is at fault; if it fails here, the picker is.

For each request this transport does what the conformance gateway would:
find the route (``conformance.envoy.resolve``) and so the pool whose picker
runs, open that picker's ``Process`` stream (over TLS, as the gateway dials
it, unless the run is plaintext), and send the messages Envoy 1.40 sends in
the gateway's processing mode (request headers with ``protocol_config``
FULL_DUPLEX_STREAMED, the body, then the response headers with the served
endpoint in ``envoy.lb`` metadata). It checks what the protocol requires of
the picker on the way:

- the endpoint is named twice, in the ``x-gateway-destination-endpoint``
  header and in ``envoy.lb`` dynamic metadata, with the same value: one
  ``ip:port``, or an ordered fallback list ``ip:port,ip:port`` (protocol
  v0.4.0), whose first entry serves (the gateway takes the next ones only
  on retries, which GIE's tests never make);
- in full-duplex mode the body comes back whole (Envoy forwards only what
  the processor returns);
- the served-endpoint report (``x-conformance-test-served-endpoint``) repeats
  what the gateway said served the request.

The ``Observation`` it returns stands in for the backend's answer: status 200
and the pod and port of the chosen endpoint, or the status of the picker's
ImmediateResponse (503 when no endpoint may serve).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from google.protobuf import json_format

from conformance.client import Failed, Observation, Request, Unreachable
from conformance.envoy import Gateway, HTTPRoute, resolve
from pods.model import is_ip
from serving.testing import (
    ClientStream,
    ExtProcClient,
    request_body,
    request_headers,
    response_headers,
    set_headers,
)
from wire.extproc import BodyMode

# The protocol's names, spelled out here rather than imported from the picker under test.
DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
LB_NAMESPACE: Final = "envoy.lb"
SERVED_REPORT: Final = "x-conformance-test-served-endpoint"


class NotForPicker(Exception):
    """A request whose outcome is the gateway's alone (no route, or a split across pools)."""


class PickerTransport:
    """Requests straight to the picker of the pool the gateway would route them to."""

    checks_backend: Final = False

    def __init__(
        self,
        gateways: Mapping[str, Gateway],
        pickers: Mapping[str, str],
        pods_by_ip: Mapping[str, str],
        *,
        tls: bool = False,
    ) -> None:
        """``pickers``: pool → its ext_proc ``host:port``; ``pods_by_ip``: ip → pod name;
        ``tls``: dial the pickers over TLS, trusting the certificate each presents, as a
        gateway that dials GIE's self-signed pickers does."""
        self._gateways = gateways
        self._pickers = pickers
        self._tls = tls
        self._clients: dict[str, ExtProcClient] = {}
        self._pods_by_ip = pods_by_ip
        self.routes: Sequence[HTTPRoute] = ()
        """The HTTPRoutes in force, as the runner applies them to the gateway."""

    def pool_for(self, request: Request) -> str:
        rule = resolve(self._gateways[request.gateway], self.routes, request.host, request.path)
        if rule is None:
            raise NotForPicker(f"no route for {request.host or ''}{request.path}")
        if len(rule.backends) != 1:
            raise NotForPicker("the route splits traffic across pools: the gateway chooses")
        return rule.backends[0].pool

    async def send(self, request: Request, pool: str | None = None) -> Observation:
        """One request to ``pool``'s picker (by default the pool its route names)."""
        pool = pool or self.pool_for(request)
        target = self._pickers.get(pool)
        if target is None:
            raise Unreachable(f"pool {pool} has no endpoint picker")
        client = self._clients.get(pool)
        if client is None:
            try:  # with TLS, the picker's certificate is read now, to be trusted
                client = self._clients[pool] = ExtProcClient(target, tls=self._tls)
            except OSError as error:
                raise Unreachable(f"{type(error).__name__}: {error}") from None
        return await self._exchange(client, request)

    async def _exchange(self, client: ExtProcClient, request: Request) -> Observation:
        body = request.body.encode()
        headers = [
            (":authority", request.host or "gateway"),
            (":path", request.path),
            (":method", request.method),
            (":scheme", "http"),
            *((name.lower(), value) for name, value in request.headers.items()),
            ("x-echo-set-header", ""),
            ("x-request-id", str(uuid.uuid4())),
        ]
        modes = (BodyMode.FULL_DUPLEX_STREAMED, BodyMode.NONE)
        stream = client.open()
        with sorted_failures(stream):
            await stream.send(request_headers(headers, end_of_stream=not body, body_modes=modes))
            if body:
                await stream.send(request_body(body, end_of_stream=True))
            first = await stream.recv()
            if first is None:
                raise Failed("the picker ended the stream without answering the request headers")
            if first.WhichOneof("response") == "immediate_response":
                refused = first.immediate_response
                note = refused.body[:300].decode(errors="replace").strip()
                return Observation(refused.status.code, note=note)
            endpoint = _routing(first)
            if body:
                _check_body(body, await _body_replies(stream))
            served = {LB_NAMESPACE: {SERVED: endpoint}}
            reply_headers = [(":status", "200"), ("content-type", "application/json")]
            await stream.send(response_headers(reply_headers, metadata=served))
            reply = await stream.recv()
            if reply is None or reply.WhichOneof("response") != "response_headers":
                raise Failed(f"expected a response_headers reply, got {reply}")
            report = [value for name, value in set_headers(reply) if name.lower() == SERVED_REPORT]
            await stream.close()
            while await stream.recv() is not None:
                pass
        ip, _, port = endpoint.rpartition(":")
        ip = ip.strip("[]")
        pod = self._pods_by_ip.get(ip, f"<not a pod: {ip}>")
        return Observation(200, {SERVED_REPORT: report} if report else {}, pod, port)

    async def close(self) -> None:
        """Close the channels; the next request opens new ones (to a restarted picker, which
        presents a new certificate)."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


def _routing(reply: Any) -> str:
    """The endpoint that serves: the first a request-headers reply names. The header and the
    metadata must say the same, one ``ip:port`` or a fallback list of them."""
    if reply.WhichOneof("response") != "request_headers":
        raise Failed(f"expected a request_headers reply first, got {reply.WhichOneof('response')}")
    named = [value for name, value in set_headers(reply) if name.lower() == DESTINATION]
    metadata: dict[str, Any] = json_format.MessageToDict(reply.dynamic_metadata)
    in_metadata = metadata.get(LB_NAMESPACE, {}).get(DESTINATION)
    if len(named) != 1:
        raise Failed(f"expected one {DESTINATION} header, got {named}")
    if in_metadata != named[0]:
        raise Failed(
            f"{DESTINATION}: header {named[0]!r} and envoy.lb metadata {in_metadata!r} differ"
        )
    if not reply.request_headers.response.clear_route_cache:
        raise Failed("the routing reply does not clear the route cache")
    return named_endpoints(named[0])[0]


def named_endpoints(value: str) -> list[str]:
    """The endpoints of a destination value, in order: ``ip:port``, or a fallback list
    ``ip:port,ip:port`` (spaces around an entry allowed, as Envoy's parser strips them;
    an IPv6 address in brackets). Raise ``Failed`` naming an entry that is not one."""
    entries = [entry.strip() for entry in value.split(",")]
    for entry in entries:
        host, colon, port = entry.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        address = host[1:-1] if bracketed else host
        valid = (
            colon
            and port.isdigit()
            and 0 < int(port) < 65536
            and is_ip(address)
            and (":" in address) == bracketed  # IPv6 in brackets, IPv4 without
        )
        if not valid:
            raise Failed(f"{DESTINATION} {value!r}: {entry!r} is not ip:port")
    return entries


async def _body_replies(stream: Any) -> list[Any]:
    replies = []
    while True:
        reply = await stream.recv()
        if reply is None or reply.WhichOneof("response") != "request_body":
            raise Failed(f"expected the body back, got {reply}")
        replies.append(reply)
        if reply.request_body.response.body_mutation.streamed_response.end_of_stream:
            return replies


def _check_body(sent: bytes, replies: list[Any]) -> None:
    back = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies)
    if back != sent:
        raise Failed(f"the body came back altered: {len(sent)} bytes sent, {len(back)} returned")


@contextlib.contextmanager
def sorted_failures(stream: ClientStream) -> Iterator[None]:
    """One exchange with a picker, its failures sorted: ``Failed`` (the picker answered against
    the protocol) goes on as it is, any other error (grpc's: the picker is not there, or broke
    the stream) as ``Unreachable``; either way the stream is cancelled."""
    try:
        yield
    except Failed:
        stream.cancel()
        raise
    except Exception as error:
        stream.cancel()
        raise Unreachable(f"{type(error).__name__}: {error}") from None
