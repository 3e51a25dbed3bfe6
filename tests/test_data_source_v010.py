"""metrics-data-source as llm-d router v0.10 configures it, and a source that reads nothing usable.

Servers are aiohttp servers on 127.0.0.1 free ports (TLS ones with a CA made here), stopped
after each test; tests wait for what the store received, bounded only against hangs.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry

from lwepp.config import ConfigErrors, load_text
from lwepp.plugins.metrics_source import MetricsDataSource
from plugin_api import Params
from pods.model import Endpoint
from tests.fakes import RecordingStore
from tests.test_metrics_source import SGLANG, VLLM, Clock, Page, endpoint, running, serving


async def until(condition: Callable[[], bool]) -> None:
    """Wait for what a source's polling task does next (the test's own bound stops a hang)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


def source(**parameters: Any) -> MetricsDataSource:
    return MetricsDataSource("m", Params({"refreshIntervalSeconds": 0.005, **parameters}, "m"))


def test_interval_is_a_go_duration() -> None:
    """v0.10's ``interval`` ("1s", "250ms") sets the scrape period."""
    assert source(interval="250ms").interval == 0.25
    with pytest.raises(Exception, match="interval"):
        source(interval="soon")


def test_port_scrapes_every_endpoint_on_another_port() -> None:
    """``port``: the engines serve metrics on a port of their own; the endpoints are elsewhere."""

    async def test() -> None:
        store = RecordingStore()
        async with serving(Page(VLLM)) as [port]:
            made = source(port=port)
            where = Endpoint("p", "127.0.0.1", 1)  # nothing listens on port 1
            async with running(made, lambda: [where], store, Clock()):
                await store.until(lambda: where.hostport in store.attributes)
        assert store.attributes[where.hostport]["queue_depth"].value == 7.0

    asyncio.run(asyncio.wait_for(test(), 10))


def test_custom_metrics_and_the_triton_engine() -> None:
    """``customMetrics`` add attributes of the configuration's naming; ``triton`` is built in."""
    made = source(
        engineConfigs=[
            {
                "name": "vllm",
                "queuedRequestsSpec": "vllm:num_requests_waiting",
                "customMetrics": [
                    {"attributeKey": "custom.running", "metricSpec": "vllm:num_requests_running"}
                ],
            }
        ]
    )
    assert "custom.running" in made.produces
    assert made.read(endpoint(), VLLM) == {"queue_depth": 7.0, "custom.running": 4.0}
    triton = "nv_inference_pending_request_count 3\nnv_inference_exec_count 9\n"
    page = made.read(endpoint(8000, "t", **{"llm-d.ai/engine-type": "triton"}), triton)
    assert page == {"queue_depth": 3.0, "running_requests": 9.0}


# --- TLS to the engines ------------------------------------------------------------------


def _certificate(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, Any] | None, ca: bool
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    signer_name, signer_key = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        address = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        builder = builder.add_extension(x509.SubjectAlternativeName([address]), critical=False)
    return builder.sign(signer_key, hashes.SHA256())


def _write(directory: Path, name: str, key: Any, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.crt"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def pki(directory: Path) -> dict[str, tuple[str, str]]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test ca", ca_key, None, ca=True)
    files = {"ca": _write(directory, "ca", ca_key, ca)}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = _write(
            directory, name, key, _certificate(name, key, (ca.subject, ca_key), False)
        )
    return files


@asynccontextmanager
async def mutual_tls(files: dict[str, tuple[str, str]]) -> AsyncIterator[int]:
    """A /metrics server that requires a client certificate signed by the CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=files["ca"][0])
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(*files["server"])
    app = web.Application()
    app.router.add_get("/metrics", Page(VLLM).handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def test_mutual_tls_to_the_engines(tmp_path: Path) -> None:
    """https with caCertPath, clientCertPath and clientKeyPath scrapes an engine that requires a
    client certificate; without the client certificate the scrape fails, and is named."""
    files = pki(tmp_path)
    tls = {"scheme": "https", "insecureSkipVerify": False, "caCertPath": files["ca"][0]}

    async def test() -> None:
        async with mutual_tls(files) as port:
            where = Endpoint("p", "127.0.0.1", port)
            store = RecordingStore()
            client = {"clientCertPath": files["client"][0], "clientKeyPath": files["client"][1]}
            async with running(source(**tls, **client), lambda: [where], store, Clock()):
                await store.until(lambda: where.hostport in store.attributes)
            assert store.attributes[where.hostport]["queue_depth"].value == 7.0
            refused = source(**tls)
            async with running(refused, lambda: [where], RecordingStore(), Clock()):
                await until(lambda: bool(refused.problems))
            assert "metrics scrape failed" in refused.problems[where.hostport]

    asyncio.run(asyncio.wait_for(test(), 20))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("{insecureSkipVerify: false, caCertPath: /no/such.pem}", "caCertPath: cannot load"),
        ("{clientCertPath: /a.pem}", "clientCertPath: set clientCertPath and clientKeyPath"),
        ("{port: 70000}", "port: expected a port 1-65535"),
        ("{interval: 0s}", "interval: must be > 0"),
    ],
    ids=["ca", "half-pair", "port", "interval"],
)
def test_bad_tls_and_port_parameters_are_refused(parameters: str, message: str) -> None:
    """A missing CA file, half a client pair, a port out of range or a zero interval is refused
    at load, naming the field."""
    with pytest.raises(ConfigErrors, match=message):
        load_text(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
            f"- type: metrics-data-source\n  parameters: {parameters}\n"
        )


# --- a source that reads nothing usable ---------------------------------------------------

SGLANG_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
  parameters: {defaultEngine: sglang, refreshIntervalSeconds: 0.005}
- type: queue-scorer
- type: kv-cache-utilization-scorer
"""


def test_wrong_metric_names_are_named_in_the_log_and_a_metric() -> None:
    """sglang's names in front of a vLLM page: a warning naming the source, the endpoint, what
    the scorers lack and the engine the page looks like; the pipeline's gauge counts it; a
    page that has the names clears it."""
    registry = CollectorRegistry()
    pipeline = load_text(SGLANG_CONFIG).pipeline(registry=registry)
    [made] = pipeline.sources
    assert isinstance(made, MetricsDataSource)
    page = Page(VLLM)

    async def test() -> None:
        async with serving(page) as [port]:
            where = Endpoint("p", "127.0.0.1", port)
            with structlog.testing.capture_logs() as logs:
                async with running(made, lambda: [where], RecordingStore(), Clock()):
                    await until(lambda: bool(made.problems))
                    pipeline.refresh_metrics([where])
                    assert (
                        registry.get_sample_value(
                            "llm_d_epp_data_source_unusable_endpoints", {"plugin": made.name}
                        )
                        == 1
                    )
                    page.text = SGLANG
                    await until(lambda: not made.problems)
            [warning] = [e for e in logs if e["event"] == "metrics scrape reads nothing usable"]
            assert warning["endpoint"] == where.hostport
            assert "no kv_cache_usage, queue_depth" in warning["problem"]
            assert "which queue-scorer, kv-cache-utilization-scorer read" in warning["problem"]
            assert "it looks like 'vllm'" in warning["problem"]
        pipeline.refresh_metrics([])
        assert (
            registry.get_sample_value(
                "llm_d_epp_data_source_unusable_endpoints", {"plugin": made.name}
            )
            == 0
        )

    asyncio.run(asyncio.wait_for(test(), 10))
