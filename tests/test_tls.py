"""TLS on the ext_proc port as GIE's lwepp and the llm-d router serve it, and the router's drain."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from serving.options import Ports, ServingOptions
from serving.server import Health, Service, serve
from serving.testing import ExtProcClient, request_headers
from serving.tls import (
    CERT_FILE,
    KEY_FILE,
    ORGANIZATION,
    KeyPair,
    Reloader,
    ServerTLS,
    TLSError,
    load_pair,
    self_signed,
)
from tests.processes import service
from wire import extproc
from wire.stream import Stream

PODS = "pods:\n- {name: a, address: 10.0.0.1, ports: [8000]}\n"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def write_pair(directory: Path, pair: KeyPair) -> None:
    directory.mkdir(exist_ok=True)
    (directory / CERT_FILE).write_bytes(pair.chain)
    (directory / KEY_FILE).write_bytes(pair.key)


def served(port: int) -> x509.Certificate:
    """The certificate a new connection to ``port`` is shown."""
    return x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", port)).encode())


async def pick(port: int, *, tls: bool) -> str:
    async with ExtProcClient(f"127.0.0.1:{port}", tls=tls) as client:
        [reply] = await client.exchange([request_headers({":path": "/"}, end_of_stream=True)])
    return str(reply.request_headers.response.header_mutation.set_headers[0].header.raw_value)


def organization(certificate: x509.Certificate) -> str:
    [name] = certificate.subject.get_attributes_for_oid(x509.oid.NameOID.ORGANIZATION_NAME)
    return str(name.value)


# --- the services ----------------------------------------------------------------------------


def test_tls_is_on_by_default_with_a_self_signed_certificate(tmp_path: Path) -> None:
    """No flag: the ext_proc port speaks TLS only, with a certificate made at start (GIE's
    subject); the health port stays plaintext for kubelet's probes."""
    (tmp_path / "pods.yaml").write_text(PODS)
    with service("lwepp", "--pods", str(tmp_path / "pods.yaml"), tls=True) as (_, ports):
        assert ports["tls"] is True
        certificate = served(ports["grpc_port"])
        assert organization(certificate) == ORGANIZATION
        assert certificate.issuer == certificate.subject  # self-signed
        assert "10.0.0.1:8000" in asyncio.run(pick(ports["grpc_port"], tls=True))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(pick(ports["grpc_port"], tls=False))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        async def health() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['health_port']}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                return int(answer.status)

        assert asyncio.run(health()) in (SERVING, NOT_SERVING)  # answered, in plaintext


def test_secure_serving_false_serves_plaintext(tmp_path: Path) -> None:
    """--secure-serving=false serves the ext_proc port in plaintext (no TLS handshake)."""
    (tmp_path / "pods.yaml").write_text(PODS)
    with service("bbr", "--secure-serving=false") as (_, ports):
        assert ports["tls"] is False
        with pytest.raises(ssl.SSLError):
            ssl.get_server_certificate(("127.0.0.1", ports["grpc_port"]), timeout=5)


def test_cert_path_serves_the_mounted_pair_and_reloads_it(tmp_path: Path) -> None:
    """``--cert-path DIR`` serves DIR/tls.crt with DIR/tls.key; with ``--enable-cert-reload`` a
    replaced pair reaches new connections without a restart, and a half-written one never."""
    first, second = self_signed("first.test"), self_signed("second.test")
    write_pair(tmp_path / "certs", first)
    args = ("--cert-path", str(tmp_path / "certs"), "--enable-cert-reload")
    with service("bbr", *args, tls=True) as (_, ports):
        port = ports["grpc_port"]
        assert served(port) == x509.load_pem_x509_certificate(first.chain)
        # A Secret update is not atomic per file: a new certificate with the old key first.
        (tmp_path / "certs" / CERT_FILE).write_bytes(second.chain)
        assert served(port) == x509.load_pem_x509_certificate(first.chain)
        (tmp_path / "certs" / KEY_FILE).write_bytes(second.key)
        assert served(port) == x509.load_pem_x509_certificate(second.chain)


def test_workers_present_one_certificate(tmp_path: Path) -> None:
    """``--workers 2``: the supervisor's self-signed pair is every worker's, so a client that
    trusts the certificate it was shown once is shown the same by either worker."""
    (tmp_path / "pods.yaml").write_text(PODS)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "lwepp", "--pods", str(tmp_path / "pods.yaml")),
            *("--workers", "2", "--grpc-port=0", "--grpc-health-port=0", "--metrics-port=0"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        listening = []
        for line in process.stderr:
            if '"listening"' in line:
                listening.append(line)
                if len(listening) == 2:
                    break
        port = int(listening[0].split('"grpc_port": ')[1].split(",")[0])
        # Were the workers' certificates different, 16 connections would see both but with
        # a chance of 2 in 2**16 (all on one worker).
        certificates = {served(port).fingerprint(hashes.SHA256()) for _ in range(16)}
        assert len(certificates) == 1
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
        process.stderr.close()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "tls.crt: cannot read"),
        ({CERT_FILE: b"nonsense", KEY_FILE: b"nonsense"}, "tls.crt: not a PEM certificate"),
        ("mismatch", "tls.key: does not match the certificate in tls.crt"),
    ],
    ids=["missing", "not-pem", "mismatch"],
)
def test_a_bad_pair_stops_the_start_naming_the_file(
    tmp_path: Path, files: dict[str, bytes] | str, message: str
) -> None:
    """A missing, non-PEM or mismatched certificate pair stops the start with exit 1, naming the file."""
    directory = tmp_path / "certs"
    directory.mkdir()
    if files == "mismatch":
        (directory / CERT_FILE).write_bytes(self_signed().chain)
        (directory / KEY_FILE).write_bytes(self_signed().key)
    else:
        assert isinstance(files, dict)
        for name, content in files.items():
            (directory / name).write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "bbr", "--cert-path", str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert message in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cert-path", "/x", "--secure-serving=false"], "--cert-path: needs --secure-serving"),
        (["--enable-cert-reload"], "--enable-cert-reload: needs --cert-path"),
        (["--tls-min-version", "TLS1.3"], "expected one of VersionTLS10"),
        (["--secure-serving=maybe"], "'maybe' is not a boolean"),
    ],
    ids=["cert-path-without-tls", "reload-without-path", "tls-version", "not-a-bool"],
)
def test_tls_flags_are_checked(args: list[str], message: str) -> None:
    """TLS flags that need another, a bad TLS version or a non-boolean are refused with exit 2."""
    result = subprocess.run(
        [sys.executable, "-m", "bbr", *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert message in result.stderr


# --- the pieces ------------------------------------------------------------------------------


def test_the_reloader_answers_only_a_changed_loadable_pair(tmp_path: Path) -> None:
    """grpc's fetcher: None while nothing changed or the pair is half-written; the new
    configuration once it reads back whole, then None again."""
    write_pair(tmp_path, self_signed())
    reload = Reloader(tmp_path)
    assert reload() is None
    second = self_signed()
    (tmp_path / CERT_FILE).write_bytes(second.chain)
    assert reload() is None  # the old key does not match the new certificate
    (tmp_path / KEY_FILE).write_bytes(second.key)
    assert reload() is not None
    assert reload() is None


def test_a_pair_round_trips_through_a_worker_s_environment() -> None:
    """A key pair survives its PEM form (how workers inherit it); a key alone is refused."""
    pair = self_signed()
    assert KeyPair.from_pem(pair.pem()) == pair
    with pytest.raises(TLSError):
        KeyPair.from_pem(pair.key.decode())


def test_load_pair_checks_the_key_belongs_to_the_leaf(tmp_path: Path) -> None:
    """Loading a pair checks the key belongs to the leaf certificate."""
    write_pair(tmp_path, self_signed())
    assert load_pair(tmp_path).chain == (tmp_path / CERT_FILE).read_bytes()
    (tmp_path / KEY_FILE).write_bytes(self_signed().key)
    with pytest.raises(TLSError, match="does not match"):
        load_pair(tmp_path)


# --- the drain ------------------------------------------------------------------------------


class Answering:
    """A handler that answers every stream's first message itself (a 200): something to count."""

    def __init__(self) -> None:
        self.streams = 0

    async def __call__(self, stream: Stream) -> None:
        if await stream.recv() is not None:
            self.streams += 1
            await stream.send(extproc.immediate_response(200, "ok"))


def test_drain_keeps_serving_with_readiness_off_until_it_ends() -> None:
    """``--drain-timeout``: after the stop, readiness names go NOT_SERVING and liveness stays
    SERVING while new streams are still served; a second stop ends the drain early."""

    async def scenario() -> None:
        stop = asyncio.Event()
        listening: asyncio.Future[Ports] = asyncio.get_running_loop().create_future()
        handler = Answering()
        health = Health(["", "readiness"], live=["liveness"])
        task = asyncio.create_task(
            serve(
                Service("t", handler, health, CollectorRegistry()),
                ServingOptions(Ports("127.0.0.1", 0, 0, 0), drain=600, grace=1),
                stop=stop,
                on_listening=listening.set_result,
            )
        )
        ports = await listening
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.health}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                return int(answer.status)

            deadline = time.monotonic() + 10
            while await status("readiness") != SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            stop.set()
            while await status("readiness") != NOT_SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert await status("") == NOT_SERVING
            assert await status("liveness") == SERVING
            async with ExtProcClient(f"127.0.0.1:{ports.grpc}") as client:
                await client.exchange([request_headers({":path": "/"}, end_of_stream=True)])
            assert handler.streams == 1  # served, in the drain
            stop.set()  # a second signal: stop draining now
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())


def test_server_tls_configures_from_flags_environment_or_a_new_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS uses the mounted pair when given, else the inherited one, else a fresh self-signed pair."""
    monkeypatch.delenv("SWITCHYARD_TLS_PAIR", raising=False)
    fresh = ServerTLS.configure(None, False)
    assert fresh.directory is None
    monkeypatch.setenv("SWITCHYARD_TLS_PAIR", fresh.pair.pem())
    assert ServerTLS.configure(None, False).pair == fresh.pair  # a worker's, inherited
    write_pair(tmp_path, self_signed())
    mounted = ServerTLS.configure(str(tmp_path), True)
    assert (mounted.directory, mounted.reload) == (tmp_path, True)
