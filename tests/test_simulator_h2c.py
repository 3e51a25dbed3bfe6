"""The conformance echo on an h2c port (``--h2c-port``): echo-basic's answers, over either protocol."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamEnded

from demo.topology import free_ports
from pods.model import Pod
from simulator import Replica, Settings, serve_pods


async def h2c_request(
    replica: Replica, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
) -> tuple[dict[str, str], bytes]:
    """One request over HTTP/2 with prior knowledge, as Envoy sends it upstream."""
    host, port = replica.pod.address, replica.port
    reader, writer = await asyncio.open_connection(host, port)
    client = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    request = [(":method", method), (":path", path), (":scheme", "http")]
    request += [(":authority", "gateway.example.com"), *headers]
    client.send_headers(1, request, end_stream=not body)
    if body:
        client.send_data(1, body, end_stream=True)
    writer.write(client.data_to_send())
    response: dict[str, str] = {}
    received = b""
    try:
        while True:
            data = await reader.read(65536)
            assert data, "connection closed before the response ended"
            for event in client.receive_data(data):
                if isinstance(event, ResponseReceived):
                    response = {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, DataReceived):
                    received += event.data
                    client.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, StreamEnded):
                    return response, received
            writer.write(client.data_to_send())
    finally:
        writer.close()
        await writer.wait_closed()


def run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


def test_h2c_port_echoes_over_http2_with_prior_knowledge() -> None:
    """The h2c port answers echo-basic's JSON (proto HTTP/2.0, the pod's HTTP port as httpPort,
    the namespace) and honours X-Echo-Set-Header; the other port of the pod is still HTTP/1.1."""

    async def test() -> None:
        plain, second = free_ports(2)
        pod = Pod("appprotocol-0", "127.0.0.1", (plain, second), {"app": "appprotocol"})
        async with serve_pods(
            [pod], Settings(time_scale=0), namespace="ns-a", h2c_ports={second}
        ) as (
            http1,
            h2c,
        ):
            headers, body = await h2c_request(
                h2c,
                "POST",
                "/inferencepool-app-protocol-h2c?q=1",
                [
                    ("test-epp-endpoint-selection", "127.0.0.1:3001"),
                    ("x-echo-set-header", "x-a:1,x-b:2"),
                ],
                b'{"model": "m"}',
            )
            assert headers[":status"] == "200"
            assert headers["content-type"] == "application/json"
            assert (headers["x-a"], headers["x-b"]) == ("1", "2")
            assert headers["x-sim-pod"] == "appprotocol-0"
            echoed = json.loads(body)
            assert echoed["proto"] == "HTTP/2.0"
            assert echoed["method"] == "POST"
            assert echoed["path"] == "/inferencepool-app-protocol-h2c?q=1"
            assert echoed["host"] == "gateway.example.com"
            assert echoed["httpPort"] == str(plain)  # echo-basic's HTTP_PORT, not the h2c port
            assert echoed["namespace"] == "ns-a"
            assert echoed["pod"] == "appprotocol-0"
            assert echoed["headers"]["Test-Epp-Endpoint-Selection"] == ["127.0.0.1:3001"]
            async with (
                aiohttp.ClientSession() as session,
                session.get(http1.url + "/x") as plain_reply,
            ):
                assert plain_reply.status == 200
                assert (await plain_reply.json())["proto"] == "HTTP/1.1"

    run(test)


def test_http1_on_the_h2c_port_gets_echo_basics_400() -> None:
    """An HTTP/1.1 request on the h2c port is refused as echo-basic refuses it."""

    async def test() -> None:
        async with (
            serve_pods([Pod("p", "127.0.0.1", (0,))], Settings(time_scale=0), h2c_ports={0}) as (
                replica,
            ),
            aiohttp.ClientSession() as session,
            session.get(replica.url + "/") as reply,
        ):
            assert reply.status == 400
            assert await reply.text() == "Expected h2c request"

    run(test)


def test_large_h2c_bodies_respect_flow_control() -> None:
    """Echoing many large headers produces a body bigger than one HTTP/2 frame; it all arrives."""

    async def test() -> None:
        async with serve_pods(
            [Pod("p", "127.0.0.1", (0,))], Settings(time_scale=0), h2c_ports={0}
        ) as (replica,):
            many = [(f"x-filler-{i}", "v" * 1000) for i in range(40)]
            headers, body = await h2c_request(replica, "GET", "/", many)
            assert headers[":status"] == "200"
            assert int(headers["content-length"]) == len(body) > 16384
            assert json.loads(body)["headers"]["X-Filler-39"] == ["v" * 1000]

    run(test)


def test_http1_with_upgrade_h2c_but_no_settings_gets_the_echo_over_http1() -> None:
    """``Upgrade: h2c`` that does not ask for the switch (no HTTP2-Settings) passes echo-basic's
    check: the echo, over HTTP/1.1, with every port of an all-h2c pod reporting httpPort 3000."""

    async def test() -> None:
        async with (
            serve_pods([Pod("p", "127.0.0.1", (0,))], Settings(time_scale=0), h2c_ports={0}) as (
                replica,
            ),
            aiohttp.ClientSession() as session,
            session.get(replica.url + "/up", headers={"Upgrade": "h2c"}) as reply,
        ):
            assert reply.status == 200
            echoed = await reply.json()
            assert (echoed["proto"], echoed["path"], echoed["httpPort"]) == (
                "HTTP/1.1",
                "/up",
                "3000",
            )

    run(test)


async def upgrade(replica: Replica, settings: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """An RFC 7540 section 3.2 upgrade: the HTTP/1.1 status line, then the stream-1 answer."""
    reader, writer = await asyncio.open_connection(replica.pod.address, replica.port)
    client = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_upgrade_connection()  # stream 1 is the upgrading request
    writer.write(
        b"GET /upgraded?x=1 HTTP/1.1\r\nHost: h.example\r\nUpgrade: h2c\r\n"
        b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: " + settings + b"\r\n"
        b"X-Echo-Set-Header: x-a:1\r\n\r\n"
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        writer.close()
        return head, {}, b""
    writer.write(client.data_to_send())  # the preface and our SETTINGS
    response: dict[str, str] = {}
    received = b""
    try:
        while True:
            data = await reader.read(65536)
            assert data, "connection closed before the response ended"
            for event in client.receive_data(data):
                if isinstance(event, ResponseReceived) and event.stream_id == 1:
                    response = {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, DataReceived):
                    received += event.data
                    client.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, StreamEnded) and event.stream_id == 1:
                    return head, response, received
            writer.write(client.data_to_send())
    finally:
        writer.close()


def test_an_h2c_upgrade_switches_to_http2_and_answers_on_stream_1() -> None:
    """HTTP/1.1 with Upgrade: h2c and HTTP2-Settings: 101, then the echo of the upgrading request
    on stream 1 over HTTP/2 (its proto still HTTP/1.1, as Go hands over the original request)."""

    async def test() -> None:
        async with serve_pods(
            [Pod("p", "127.0.0.1", (0,))], Settings(time_scale=0), h2c_ports={0}
        ) as (replica,):
            settings = H2Connection(H2Configuration(client_side=True)).initiate_upgrade_connection()
            assert settings is not None
            head, headers, body = await upgrade(replica, settings)
            assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
            assert b"upgrade: h2c" in head.lower()
            assert (headers[":status"], headers["x-a"]) == ("200", "1")
            echoed = json.loads(body)
            assert (echoed["proto"], echoed["path"], echoed["host"]) == (
                "HTTP/1.1",
                "/upgraded?x=1",
                "h.example",
            )
            assert echoed["headers"]["Upgrade"] == ["h2c"]

    run(test)


@pytest.mark.parametrize(
    "settings", [b"not*base64", b"AAMAAABkAAQAAP__=="], ids=["not-base64url", "padded"]
)
def test_an_upgrade_with_bad_http2_settings_gets_500(settings: bytes) -> None:
    """HTTP2-Settings must be unpadded base64url (Go's RawURLEncoding); otherwise 500, no switch."""

    async def test() -> None:
        async with serve_pods(
            [Pod("p", "127.0.0.1", (0,))], Settings(time_scale=0), h2c_ports={0}
        ) as (replica,):
            head, _, _ = await upgrade(replica, settings)
            assert head.startswith(b"HTTP/1.1 500 ")

    run(test)
