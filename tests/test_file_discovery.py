"""The llm-d router's endpoints file and its file-discovery plugin: read, refused, reloaded."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lwepp.config import load_text
from lwepp.plugins.discovery import FileDiscovery
from plugin_api import Params
from pods.file import FileSource, PodFileError, dump_pods, load_pods, parse_pods
from pods.model import Pod, endpoints_of
from serving.testing import ExtProcClient, request_headers, set_headers
from tests.processes import service

ENDPOINTS = """\
endpoints:
  - name: vllm-0
    address: "10.0.0.1"
    port: "8000"
    labels:
      model: llama-3-8b
  - name: vllm-1
    namespace: inference
    address: "10.0.0.2"
    port: "8001"
"""


def test_the_router_s_endpoints_file_is_a_pod_list() -> None:
    """Each entry is one pod on one port, in its namespace (default ``default``), labelled."""
    a, b = parse_pods(ENDPOINTS)
    assert a == Pod("vllm-0", "10.0.0.1", (8000,), {"model": "llama-3-8b"}, True, "default")
    assert (b.namespace, b.ports, dict(b.labels)) == ("inference", (8001,), {})
    [endpoint, _] = endpoints_of((a, b), {})
    assert (endpoint.hostport, endpoint.namespace) == ("10.0.0.1:8000", "default")


def test_a_name_listed_again_in_its_namespace_is_replaced() -> None:
    """The router upserts entries top to bottom: the last one of a namespace/name wins."""
    text = ENDPOINTS + '  - {name: vllm-0, address: "10.0.0.9", port: "9000"}\n'
    pods = parse_pods(text)
    assert [(p.name, p.address) for p in pods] == [("vllm-1", "10.0.0.2"), ("vllm-0", "10.0.0.9")]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            '{name: x, address: "::1", port: "80"}',
            "endpoints.yaml:2: endpoints[0].address: expected an IPv4",
        ),
        ('{name: x, address: host.local, port: "80"}', "expected an IPv4 address, got 'host"),
        ('{name: x, address: "10.0.0.1", port: "0"}', "port: expected a port 1-65535"),
        ('{name: x, address: "10.0.0.1", port: "8a"}', "got '8a'"),
        ('{name: x, address: "10.0.0.1"}', "endpoints[0].port: required"),
        ('{name: x, address: "10.0.0.1", port: "1", zone: a}', "unknown field 'zone'"),
        ('{name: x, namespace: "", address: "10.0.0.1", port: "1"}', "namespace: expected a"),
    ],
    ids=["ipv6", "hostname", "port-0", "port-text", "no-port", "unknown", "empty-namespace"],
)
def test_a_bad_entry_is_refused_naming_its_line(entry: str, message: str) -> None:
    """What the router refuses at start is refused here too, with the file's line and field."""
    with pytest.raises(PodFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_pods(f"endpoints:\n  - {entry}\n", "endpoints.yaml")


def test_a_file_over_one_mebibyte_is_refused(tmp_path: Path) -> None:
    """The router's 1 MiB cap."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(ENDPOINTS + "#" * (1 << 20))
    with pytest.raises(PodFileError, match="larger than 1 MiB"):
        load_pods(path)


def test_a_changed_file_adds_and_removes_endpoints(tmp_path: Path) -> None:
    """Reload: new entries appear, entries that left are gone; a broken edit keeps the list."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(ENDPOINTS)
    source = FileSource(path)
    assert source.reload()
    path.write_text('endpoints:\n  - {name: vllm-2, address: "10.0.0.3", port: "8000"}\n')
    assert source.reload()
    assert [p.name for p in source.pods] == ["vllm-2"]
    path.write_text('endpoints:\n  - {name: vllm-2, address: "10.0.0.3", port: "x"}\n')
    assert not source.reload()
    assert [p.name for p in source.pods] == ["vllm-2"]
    assert source.error is not None
    assert "port" in source.error


def test_the_pod_file_keeps_a_namespace() -> None:
    """Switchyard's own pod file carries the namespace too, so a rewritten file loses nothing."""
    pods = parse_pods(ENDPOINTS)
    assert parse_pods(dump_pods(pods)) == pods


def test_without_watch_file_the_file_is_read_once(tmp_path: Path) -> None:
    """watchFile false (the router's default): run() reads the file and then never again."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(ENDPOINTS)
    discovery = FileDiscovery("f", Params({"path": str(path)}, "plugin 'f'"))
    source = discovery.pod_source(interval=0.0)
    assert not source.watch

    async def scenario() -> None:
        task = asyncio.create_task(source.run())
        await asyncio.sleep(0)  # run() reads the file before its first await
        assert source.synced
        path.write_text('endpoints:\n  - {name: vllm-2, address: "10.0.0.3", port: "8000"}\n')
        for _ in range(100):  # interval 0: a watching source would have re-read by now
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(scenario())
    assert [p.name for p in source.pods] == ["vllm-0", "vllm-1"]


CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: file-discovery
  parameters:
    path: {path}
    watchFile: true
- type: random-picker
dataLayer:
  discovery:
    pluginRef: file-discovery
"""


def test_the_configuration_names_its_discovery() -> None:
    """dataLayer.discovery's plugin is the configuration's discovery, with no warning."""
    config = load_text(CONFIG.format(path="/etc/epp/endpoints.yaml"))
    assert isinstance(config.discovery, FileDiscovery)
    assert (config.discovery.path, config.discovery.watch) == ("/etc/epp/endpoints.yaml", True)
    assert config.warnings == ()


async def _pick(port: int) -> str:
    async with ExtProcClient(f"127.0.0.1:{port}") as client:
        replies = await client.exchange(
            [request_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)]
        )
    return dict(set_headers(replies[0]))["x-gateway-destination-endpoint"]


def test_lwepp_serves_the_file_without_pod_flags_and_follows_its_edits(tmp_path: Path) -> None:
    """``python -m lwepp --config`` with file-discovery: no --pods; picks the file's endpoint;
    after an edit replacing it, picks the new one only."""
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text('endpoints:\n  - {name: a, address: "10.9.0.1", port: "8000"}\n')
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(path=endpoints))
    with service("lwepp", "--config", str(config), "--pods-interval", "0.05") as (_, ports):
        assert asyncio.run(_pick(ports["grpc_port"])) == "10.9.0.1:8000"
        endpoints.write_text('endpoints:\n  - {name: b, address: "10.9.0.2", port: "8001"}\n')
        deadline = time.monotonic() + 10
        while asyncio.run(_pick(ports["grpc_port"])) != "10.9.0.2:8001":
            assert time.monotonic() < deadline, "the edit was never applied"
        assert {asyncio.run(_pick(ports["grpc_port"])) for _ in range(5)} == {"10.9.0.2:8001"}


def test_pods_given_twice_is_refused(tmp_path: Path) -> None:
    """--pods beside a file-discovery configuration: one message naming both."""
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(ENDPOINTS)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(path=endpoints))
    result = subprocess.run(
        [sys.executable, "-m", "lwepp", "--config", str(config), "--pods", str(endpoints)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "--pods and the configuration's file-discovery both name the pods" in result.stderr


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--ha-enable-leader-election=false", False),
        ("--ha-enable-leader-election=true", True),
        ("--ha-enable-leader-election", True),
        ("--leader-elect", True),
    ],
)
def test_leader_election_is_a_go_boolean(flag: str, expected: bool) -> None:
    """The router's chart and perf values pass --ha-enable-leader-election=false: it is off."""
    from lwepp.__main__ import build_parser

    assert build_parser().parse_args(["--pods", "p.yaml", flag]).leader_elect is expected
