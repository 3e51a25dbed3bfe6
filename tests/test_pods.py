"""The pod list: decoding the pod file, endpoints per port, reloads that keep the last good list."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pods.file import FileSource, PodFileError, dump_pods, load_pods, parse_pods
from pods.model import Pod, endpoints_of, join_host_port, parse_selector
from tests.fakes import pod

GOOD = """
pods:
- name: a-0
  address: 10.0.0.1
  ports: [8000]
  labels: {pool: a}
- name: a-1
  address: 10.0.0.2
  ports: [3000, 3002, 3004]
  labels: {pool: a}
- name: b-0
  address: 10.0.0.3
  ports: 8000
  labels: {pool: b}
  ready: false
"""


def test_parse_reads_every_field() -> None:
    """A pod file decodes to pods with their ports, labels and readiness."""
    pods = parse_pods(GOOD, "pods.yaml")
    assert [p.name for p in pods] == ["a-0", "a-1", "b-0"]
    assert pods[1].ports == (3000, 3002, 3004)
    assert pods[2].ports == (8000,)
    assert dict(pods[0].labels) == {"pool": "a"}
    assert pods[2].ready is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pods: [{name: x, address: 10.0.0.1}]", "pods[0].ports: required"),
        ("pods: [{name: x, address: nowhere, ports: [1]}]", "pods[0].address: expected an IP"),
        ("pods: [{name: x, address: 10.0.0.1, ports: [0]}]", "pods[0].ports[0]: expected a port"),
        ("pods: [{name: x, address: 10.0.0.1, ports: [1], zone: z}]", "unknown field 'zone'"),
        ("pods: [{name: x, address: 10.0.0.1, ports: [1], ready: yes please}]", "ready"),
        (
            "pods: [{name: x, address: 10.0.0.1, ports: [1]}, {name: x, address: 10.0.0.2, ports: [1]}]",
            "pods[1].name: duplicate",
        ),
        ("pods:\n- name: x\n  address: [", "line 3"),
        ("pod: []", "single key 'pods'"),
    ],
    ids=[
        "no-ports",
        "bad-address",
        "port-zero",
        "unknown-field",
        "ready-type",
        "dup",
        "yaml",
        "top",
    ],
)
def test_parse_errors_name_the_field(text: str, message: str) -> None:
    """Each decoding error names the file and the offending field or line."""
    with pytest.raises(PodFileError, match=r"pods\.yaml") as error:
        parse_pods(text, "pods.yaml")
    assert message in str(error.value)


MINE = """\
pods:
- name: llama-0
  address: 10.0.0.7
  ports: [8000]
- name: llama-1
  address: 10.0.0.8
  ports: [8000]
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "pods:\n- name: a\n  address: 10.0.0.1\n  ports:\n  - 8000\n  - 99999\n",
            "pods.yaml:6: pods[0].ports[1]: expected a port 1-65535, got 99999",
        ),
        ("pods:\n- name: a\n  ports: [1]\n", "pods.yaml:2: pods[0].address: required"),
        (
            "pods:\n- name: a\n  address: 10.0.0.1\n  ports: [1]\n  zone: z\n",
            "pods.yaml:5: pods[0].zone: unknown field 'zone'",
        ),
    ],
    ids=["bad-port", "missing-field", "unknown-field"],
)
def test_parse_errors_name_the_line(text: str, message: str) -> None:
    """A field that does not decode is named with its line (a missing one, its pod's line)."""
    with pytest.raises(PodFileError) as error:
        parse_pods(text, "pods.yaml")
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            MINE + "- name: llama-2\n  address: 10.0.0.7\n  ports: [8001, 8000]\n",
            "mine.yaml:10: pods[2].ports: 10.0.0.7:8000 is listed twice (first: pods[0])",
        ),
        (
            MINE.replace("10.0.0.8", "gpu-1.local"),
            "mine.yaml:6: pods[1].address: expected an IP address, got 'gpu-1.local'",
        ),
        (
            MINE.replace("llama-1", "llama-0"),
            "mine.yaml:5: pods[1].name: duplicate pod name 'llama-0' (first: pods[0])",
        ),
        (MINE + "- [10.0.0.9, 8000]\n", "mine.yaml:8: pods[2]: expected a mapping"),
    ],
    ids=["server-twice", "not-an-ip", "name-twice", "not-a-mapping"],
)
def test_errors_give_the_line_of_the_offending_field(text: str, message: str) -> None:
    """A server named twice, an address that is not an IP...: the error gives the file, the
    line of the field (or of the entry) and the field, and where the first mention was."""
    with pytest.raises(PodFileError) as error:
        parse_pods(text, "mine.yaml")
    assert str(error.value) == message


def test_endpoints_are_ready_matching_pods_times_ports() -> None:
    """Each port of each ready pod matching the selector is one endpoint, in file order."""
    pods = parse_pods(GOOD)
    assert [e.hostport for e in endpoints_of(pods, {"pool": "a"})] == [
        "10.0.0.1:8000",
        "10.0.0.2:3000",
        "10.0.0.2:3002",
        "10.0.0.2:3004",
    ]
    assert endpoints_of(pods, {"pool": "b"}) == ()  # not ready
    assert len(endpoints_of(pods, {})) == 4


def test_ipv6_endpoints_are_bracketed() -> None:
    """IPv6 addresses are written ``[addr]:port``, as Go's JoinHostPort does."""
    assert join_host_port("fd00::1", 80) == "[fd00::1]:80"
    assert endpoints_of((pod("v6", "fd00::1", 80),), {})[0].hostport == "[fd00::1]:80"


def test_snapshots_are_immutable() -> None:
    """Pods and endpoints cannot be changed in place, labels included."""
    endpoint = endpoints_of(parse_pods(GOOD), {})[0]
    with pytest.raises(AttributeError):
        endpoint.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        endpoint.labels["pool"] = "b"  # type: ignore[index]


def _write(path: Path, text: str, stamp: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(stamp, stamp))


def test_file_source_reloads_and_keeps_last_good(tmp_path: Path) -> None:
    """An edit is picked up; a broken edit keeps the previous pods and reports the error."""
    path = tmp_path / "pods.yaml"
    _write(path, GOOD, 1_000_000_000)
    assert not FileSource(path).synced  # nothing read yet
    source = FileSource(path)
    assert source.reload() is True
    assert source.synced
    assert len(source.pods) == 3
    assert source.reload() is False  # unchanged file: nothing to do

    _write(path, "pods: [{name: x}]", 2_000_000_000)
    assert source.reload() is False
    assert len(source.pods) == 3
    assert source.error is not None
    assert "pods[0].address: required" in source.error

    _write(path, "pods: [{name: x, address: 10.0.0.9, ports: [1]}]", 3_000_000_000)
    assert source.reload() is True
    assert [p.name for p in source.pods] == ["x"]
    assert source.error is None


def test_file_source_missing_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """A missing file leaves the source unsynced with an error naming the path."""
    source = FileSource(tmp_path / "absent.yaml")
    assert source.reload() is False
    assert not source.synced
    assert source.error is not None
    assert "absent.yaml" in source.error


@pytest.mark.parametrize(
    ("text", "selector"),
    [("", {}), ("pool=a", {"pool": "a"}), ("pool=a, model=m", {"pool": "a", "model": "m"})],
    ids=["empty", "one", "two"],
)
def test_selector_parsing(text: str, selector: dict[str, str]) -> None:
    """A selector is comma-separated key=value pairs, as the CLIs' --selector takes it."""
    assert parse_selector(text) == selector


def test_selector_without_value_is_an_error() -> None:
    """A pair without ``=`` is refused with the offending item."""
    with pytest.raises(ValueError, match="expected key=value, got 'pool'"):
        parse_selector("pool")


def test_dump_writes_a_file_parse_reads_back() -> None:
    """A pod list written with dump_pods parses back to the same pods, labels and readiness
    included; a ready pod's file leaves ``ready`` out, as hand-written files do."""
    pods = (
        Pod("a", "127.0.0.1", (8000, 8001), {"pool": "p", "model": "m"}),
        Pod("b", "::1", (9000,), ready=False),
    )

    text = dump_pods(pods)

    assert parse_pods(text) == pods
    assert [dict(p.labels) for p in parse_pods(text)] == [{"pool": "p", "model": "m"}, {}]
    assert text.count("ready") == 1


def test_a_pod_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A binary or Latin-1 pod file is a PodFileError naming file:line:column and the byte."""
    path = tmp_path / "pods.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PodFileError, match=r"pods\.yaml:1:1: not UTF-8 text \(byte 0xff\)$"):
        load_pods(path)
