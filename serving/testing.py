"""Playing Envoy's side of an ext_proc stream, for tests, benchmarks and the docs.

``request_headers(...)``, ``request_body(...)`` and friends build the messages
Envoy would send; ``ExtProcClient`` opens real gRPC streams to a service, so a
test exercises exactly the code path Envoy does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from serving.metrics_auth import MetricsAuth
from serving.options import Ports, ServingOptions
from serving.server import Health, JsonRoutes, Service, serve
from serving.tls import ServerTLS
from wire.extproc import BodyMode, ProcessingRequest, ProcessingResponse, SendMode, struct
from wire.stream import EXT_PROC_SERVICE, Handler

Headers = Mapping[str, str] | Sequence[tuple[str, str]]


def _header_map(headers: Headers) -> Any:
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def request_headers(
    headers: Headers,
    *,
    end_of_stream: bool = False,
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
    body_modes: tuple[int, int] | None = (
        BodyMode.FULL_DUPLEX_STREAMED,
        BodyMode.NONE,
    ),
) -> ProcessingRequest:
    """The first message of a stream, as Envoy 1.40 sends it.

    ``body_modes`` fills ``protocol_config`` (request, response body modes);
    None leaves it out, as older proxies do.
    """
    message = ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=_header_map(headers), end_of_stream=end_of_stream)
    )
    if metadata:
        for namespace, values in metadata.items():
            message.metadata_context.filter_metadata[namespace].CopyFrom(struct(values))
    if body_modes is not None:
        message.protocol_config.request_body_mode = SendMode(body_modes[0])
        message.protocol_config.response_body_mode = SendMode(body_modes[1])
    return message


def request_body(data: bytes, *, end_of_stream: bool = True) -> ProcessingRequest:
    return ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def response_headers(
    headers: Headers,
    *,
    end_of_stream: bool = False,
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> ProcessingRequest:
    message = ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=_header_map(headers), end_of_stream=end_of_stream)
    )
    if metadata:
        for namespace, values in metadata.items():
            message.metadata_context.filter_metadata[namespace].CopyFrom(struct(values))
    return message


def response_body(data: bytes, *, end_of_stream: bool = True) -> ProcessingRequest:
    return ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def request_trailers() -> ProcessingRequest:
    return ProcessingRequest(request_trailers=pb.HttpTrailers())


def set_headers(response: ProcessingResponse) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs a headers or body response sets, in order."""
    phase = response.WhichOneof("response")
    if phase is None:
        raise ValueError("an empty ProcessingResponse sets no headers")
    common = getattr(response, phase).response
    return [
        (h.header.key, h.header.raw_value.decode() or h.header.value)
        for h in common.header_mutation.set_headers
    ]


class ClientStream:
    """One open ``Process`` call, from Envoy's side: send a message, read the answers."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def send(self, message: ProcessingRequest) -> None:
        await self._call.write(message)

    async def recv(self) -> ProcessingResponse | None:
        answer = await self._call.read()
        return None if answer is grpc.aio.EOF else answer

    async def close(self) -> None:
        """Half-close, as Envoy does when the HTTP exchange is over."""
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()

    async def code(self) -> Any:
        return await self._call.code()


def pinned_credentials(target: str) -> tuple[Any, list[tuple[str, str]]]:
    """Channel credentials that trust exactly the certificate ``target`` presents now.

    What a gateway that does not verify the picker's self-signed certificate
    gets, for a client (grpc's) that always verifies: the certificate is read
    from a plain TLS handshake first and then trusted alone, under the name it
    carries (``localhost`` in Switchyard's self-signed ones). Use it only
    where the first answer can be trusted: in tests, on loopback.
    """
    host, _, port = target.rpartition(":")
    pem = ssl.get_server_certificate((host.strip("[]"), int(port)))
    certificate = x509.load_pem_x509_certificate(pem.encode())
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        name = names.value.get_values_for_type(x509.DNSName)[0]
    except (x509.ExtensionNotFound, IndexError):
        name = host
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    return credentials, [("grpc.ssl_target_name_override", name)]


class ExtProcClient:
    """A gRPC channel to a service's ext_proc port; with ``tls``, over TLS to the certificate
    the service presents (``pinned_credentials``)."""

    def __init__(self, target: str, *, tls: bool = False) -> None:
        if tls:
            credentials, options = pinned_credentials(target)
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target)
        self._process = self._channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )

    def open(self) -> ClientStream:
        return ClientStream(self._process())

    async def exchange(self, messages: Iterable[ProcessingRequest]) -> list[ProcessingResponse]:
        """Send every message, half-close, and collect every answer until the end."""
        stream = self.open()
        for message in messages:
            await stream.send(message)
        await stream.close()
        answers = []
        while (answer := await stream.recv()) is not None:
            answers.append(answer)
        return answers

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ExtProcClient:
        return self

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        await self.close()


@contextlib.asynccontextmanager
async def running(
    name: str,
    handler: Handler,
    health: Health | None = None,
    registry: CollectorRegistry | None = None,
    *,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    grace: float = 2.0,
    json_routes: JsonRoutes | None = None,
    tls: ServerTLS | None = None,
    metrics_auth: MetricsAuth | None = None,
) -> AsyncIterator[Ports]:
    """Serve ``handler`` in this event loop on free 127.0.0.1 ports; stop on exit.

    ``json_routes``: debug pages, served (None: none, as without ``--enable-debug-pages``).
    """
    stop = asyncio.Event()
    listening: asyncio.Future[Ports] = asyncio.get_running_loop().create_future()
    service = Service(
        name,
        handler,
        health or Health([""]),
        registry or CollectorRegistry(),
        background=background,
        debug_pages=json_routes or {},
    )
    options = ServingOptions(
        Ports("127.0.0.1", 0, 0, 0),
        grace=grace,
        debug_pages=json_routes is not None,
        tls=tls,
        metrics_auth=metrics_auth,
    )
    task = asyncio.create_task(
        serve(service, options, stop=stop, on_listening=listening.set_result)
    )
    waiting: list[asyncio.Future[Any]] = [task, listening]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # raises what stopped the server from starting
    try:
        yield listening.result()
    finally:
        stop.set()
        await task


async def exchange_with(
    name: str, handler: Handler, messages: Iterable[ProcessingRequest]
) -> list[ProcessingResponse]:
    """One stream to ``handler``, served on free ports for it alone: every answer to
    ``messages`` (``ExtProcClient.exchange``)."""
    async with running(name, handler) as ports, ExtProcClient(f"127.0.0.1:{ports.grpc}") as client:
        return await client.exchange(messages)
