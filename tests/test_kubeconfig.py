"""Reaching the API server: in-cluster service-account files, kubeconfig files, tokens sent."""

from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pods.kubeapi import (
    ClusterConfig,
    KubeApi,
    KubeconfigError,
    in_cluster_config,
    in_cluster_namespace,
    kubeconfig_config,
)
from tests.fake_kube import FakeKube, ThreadedFakeKube

PODS = "/api/v1/namespaces/default/pods"


def self_signed(directory: Path) -> Path:
    """A CA certificate made with the openssl command line (a real PEM for ssl to load)."""
    cert = directory / "ca.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=test-ca", "-keyout", str(directory / "ca.key"), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert


def test_in_cluster_reads_the_service_account_mount(tmp_path: Path) -> None:
    """KUBERNETES_SERVICE_HOST/PORT, the token, CA and namespace files make the config."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a CA certificate")
    self_signed(tmp_path)
    (tmp_path / "token").write_text("token-1\n")
    (tmp_path / "namespace").write_text("models")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    config = in_cluster_config(env, tmp_path)
    assert config.server == "https://[fd00::1]:443"
    assert config.namespace == "models"
    assert isinstance(config.ssl, ssl.SSLContext)
    assert asyncio.run(config.token()) == "token-1"
    (tmp_path / "token").write_text("token-2")  # the kubelet rotated it
    assert asyncio.run(config.token()) == "token-2"


def test_outside_a_cluster_the_error_says_what_to_do(tmp_path: Path) -> None:
    """Outside a cluster (or with no service-account token) the error says to give --kubeconfig or what is missing."""
    with pytest.raises(KubeconfigError, match="give --kubeconfig"):
        in_cluster_config({}, tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeconfigError, match="token: missing"):
        in_cluster_config(env, tmp_path)
    assert in_cluster_namespace(tmp_path) is None


def kubeconfig(tmp_path: Path, server: str, user: str) -> Path:
    path = tmp_path / "config"
    path.write_text(
        f"""
apiVersion: v1
kind: Config
current-context: dev
contexts:
- name: dev
  context: {{cluster: c, user: u, namespace: models}}
- name: other
  context: {{cluster: c}}
clusters:
- name: c
  cluster: {{server: "{server}", insecure-skip-tls-verify: true}}
users:
- name: u
  user: {user}
"""
    )
    return path


def sent_token(config: ClusterConfig, fake: FakeKube) -> str:
    async def call() -> None:
        async with KubeApi(config) as api:
            await api.list(PODS)

    asyncio.run(call())
    return fake.requests[-1].authorization


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    """A fake API server on a loop in a background thread, for these synchronous tests."""
    with ThreadedFakeKube() as threaded:
        yield threaded.fake


def test_kubeconfig_token_and_namespace(tmp_path: Path, fake: FakeKube) -> None:
    """A kubeconfig's token is sent as a bearer token; the context's namespace is used (default when none)."""
    config = kubeconfig_config(kubeconfig(tmp_path, fake.url, "{token: abc}"))
    assert config.namespace == "models"
    assert config.ssl is False  # insecure-skip-tls-verify
    assert sent_token(config, fake) == "Bearer abc"
    assert kubeconfig_config(tmp_path / "config", context="other").namespace == "default"


def test_kubeconfig_token_file_is_relative_to_the_kubeconfig(
    tmp_path: Path, fake: FakeKube
) -> None:
    """A tokenFile is read relative to the kubeconfig's directory."""
    (tmp_path / "tok").write_text("from-file\n")
    config = kubeconfig_config(kubeconfig(tmp_path, fake.url, "{tokenFile: tok}"))
    assert sent_token(config, fake) == "Bearer from-file"


def test_kubeconfig_exec_plugin_token(tmp_path: Path, fake: FakeKube) -> None:
    """An exec credential plugin (as cloud providers use) is run and its token sent."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json\n"
        'print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", '
        '"kind": "ExecCredential", "status": {"token": "from-exec"}}))\n'
    )
    user = f'{{exec: {{apiVersion: client.authentication.k8s.io/v1, command: "{sys.executable}", args: ["{plugin}"]}}}}'
    config = kubeconfig_config(kubeconfig(tmp_path, fake.url, user))
    assert sent_token(config, fake) == "Bearer from-exec"


def test_kubeconfig_ca_data_is_loaded(tmp_path: Path) -> None:
    """certificate-authority-data becomes the TLS context's one trusted CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a CA certificate")
    ca = base64.b64encode(self_signed(tmp_path).read_bytes()).decode()
    path = tmp_path / "config"
    path.write_text(
        "current-context: x\ncontexts: [{name: x, context: {cluster: c}}]\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://k:6443', certificate-authority-data: {ca}}}}}]\n"
    )
    config = kubeconfig_config(path)
    assert isinstance(config.ssl, ssl.SSLContext)
    assert config.ssl.cert_store_stats()["x509_ca"] == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("current-context: x\n", "contexts: no entry named 'x'"),
        ("clusters: []\n", "no current-context"),
        ("[1, 2]\n", "not a kubeconfig"),
        (": :\n", "not valid YAML"),
    ],
    ids=["unknown-context", "no-context", "not-a-mapping", "bad-yaml"],
)
def test_broken_kubeconfig_is_named(tmp_path: Path, text: str, message: str) -> None:
    """A kubeconfig that is unreadable, not YAML, not a mapping or missing its context is refused, saying which."""
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(KubeconfigError, match=message):
        kubeconfig_config(path)
    with pytest.raises(KubeconfigError, match="cannot read"):
        kubeconfig_config(tmp_path / "missing")
