"""TLS on the ext_proc port, as GIE's lwepp and the llm-d router serve it.

Both originals serve their ext_proc gRPC port over TLS by default
(``--secure-serving``, true unless set false), and gateways configured for
them dial TLS:

- with no ``--cert-path``, the service makes a self-signed certificate when it
  starts (GIE's ``CreateSelfSignedTLSCertificate``: organisation "Inference
  Ext", valid ten years). Nothing verifies it: a gateway that dials such a
  picker encrypts without checking who answers (Istio's ``insecureSkipVerify``),
  which is what GIE's guides configure. Here the key is ECDSA P-256, not RSA
  4096: the same protection for a connection, made in milliseconds instead of
  seconds at every start;
- with ``--cert-path DIR``, it serves ``DIR/tls.crt`` (the chain, leaf first)
  with ``DIR/tls.key``, the layout of a Kubernetes ``kubernetes.io/tls``
  Secret mounted as a volume (cert-manager writes the same);
- with ``--enable-cert-reload`` as well, a changed pair is picked up without
  a restart (the llm-d router's ``CertReloader``): before each new connection
  the files are checked (a ``stat`` of each), and a pair that reads back as a
  matching key and certificate replaces the one served. Connections already
  open keep theirs, as in Go, where the certificate is chosen per handshake. A
  half-written pair (a Secret update renames files one at a time) is not
  loaded; the check repeats at the next connection.

The health port stays plaintext in every case: kubelet's gRPC probes do not
speak TLS, and neither original encrypts it.

``--workers N`` runs N processes on one port: they must present one
certificate, or a client that pinned the first (as the tests do) would fail
on the next. The supervisor makes the self-signed pair once and hands it to
each worker in its environment (``PAIR_ENV``), readable by that user only.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = structlog.get_logger()

CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
PAIR_ENV: Final = "SWITCHYARD_TLS_PAIR"
"""Set by ``run_workers`` for each worker: the supervisor's self-signed key and certificate."""

ORGANIZATION: Final = "Inference Ext"
"""The subject GIE's self-signed certificates carry."""


class TLSError(ValueError):
    """A certificate or key that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A private key and its certificate chain, both PEM."""

    key: bytes
    chain: bytes

    def pem(self) -> str:
        return (self.key + self.chain).decode()

    @classmethod
    def from_pem(cls, text: str) -> KeyPair:
        """The inverse of ``pem``: a PEM private key followed by the chain."""
        marker = "-----BEGIN CERTIFICATE-----"
        head, found, tail = text.partition(marker)
        if not found:
            raise TLSError(f"{PAIR_ENV}: no certificate")
        return cls(head.encode(), (found + tail).encode())


def self_signed(hostname: str | None = None) -> KeyPair:
    """A new self-signed certificate for this host, valid for ten years (GIE's choice).

    Its names (``localhost`` and the host name) only matter to a client that
    verifies; one that trusts this very certificate (``serving.testing``) asks
    for ``localhost``.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)])
    now = datetime.datetime.now(datetime.UTC)
    names = dict.fromkeys(["localhost", hostname or socket.gethostname()])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks that lag a little
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        certificate.public_bytes(serialization.Encoding.PEM),
    )


def load_pair(directory: str | os.PathLike[str]) -> KeyPair:
    """``DIR/tls.crt`` and ``DIR/tls.key``, checked: both parse and the key is the leaf's."""
    where = Path(directory)
    contents = {}
    for name in (CERT_FILE, KEY_FILE):
        try:
            contents[name] = (where / name).read_bytes()
        except OSError as error:
            raise TLSError(f"{where / name}: cannot read: {error.strerror or error}") from None
    try:
        chain = x509.load_pem_x509_certificates(contents[CERT_FILE])
    except ValueError:
        raise TLSError(f"{where / CERT_FILE}: not a PEM certificate") from None
    try:
        key: Any = serialization.load_pem_private_key(contents[KEY_FILE], password=None)
    except (ValueError, TypeError):
        raise TLSError(f"{where / KEY_FILE}: not an unencrypted PEM private key") from None
    if _public(key.public_key()) != _public(chain[0].public_key()):
        raise TLSError(f"{where / KEY_FILE}: does not match the certificate in {CERT_FILE}")
    return KeyPair(contents[KEY_FILE], contents[CERT_FILE])


def _public(key: Any) -> bytes:
    return bytes(
        key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """What the ext_proc port serves: a fixed pair, or the pair in a directory (maybe reloaded)."""

    pair: KeyPair
    directory: Path | None = None
    reload: bool = False

    @classmethod
    def configure(cls, cert_path: str | None, reload: bool) -> ServerTLS:
        """The pair to serve: ``cert_path``'s, a worker's inherited one, or a new self-signed one.

        Raises ``TLSError`` naming the file at fault.
        """
        if cert_path is not None:
            return cls(load_pair(cert_path), Path(cert_path), reload)
        inherited = os.environ.get(PAIR_ENV)
        return cls(KeyPair.from_pem(inherited) if inherited else self_signed())

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; with ``reload``, checked again before each new connection."""
        first = grpc.ssl_server_certificate_configuration([(self.pair.key, self.pair.chain)])
        if self.directory is None or not self.reload:
            return grpc.dynamic_ssl_server_credentials(first, lambda: None)
        return grpc.dynamic_ssl_server_credentials(first, Reloader(self.directory))


class Reloader:
    """grpc's certificate fetcher: a new configuration when the files changed, else None.

    grpc calls it before every new connection's handshake. A ``stat`` of each
    file says whether anything changed (modification time, size, inode: a
    Secret volume swaps a symlink, so the inode changes); only then are the
    files read. A pair that does not load is logged and retried next time; the
    old pair is served meanwhile.
    """

    __slots__ = ("_directory", "_seen")

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for name in (CERT_FILE, KEY_FILE):
            try:
                status = (self._directory / name).stat()
            except OSError:
                return ()
            stamps.append((status.st_mtime_ns, status.st_size, status.st_ino))
        return tuple(stamps)

    def __call__(self) -> Any:
        stamp = self._stamp()
        if stamp == self._seen or not stamp:
            return None
        try:
            pair = load_pair(self._directory)
        except TLSError as error:
            log.warning("certificate not reloaded", error=str(error))
            return None
        self._seen = stamp
        log.info("certificate reloaded", path=str(self._directory))
        return grpc.ssl_server_certificate_configuration([(pair.key, pair.chain)])


def shared_tls(tls: ServerTLS | None) -> dict[str, str]:
    """What ``run_workers`` adds to each worker's environment so that all serve one pair.

    Only a self-signed pair needs passing on: with ``--cert-path`` each worker
    reads (and reloads) the same files itself.
    """
    if tls is None or tls.directory is not None:
        return {}
    return {PAIR_ENV: tls.pair.pem()}
