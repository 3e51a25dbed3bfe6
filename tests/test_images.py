"""Container images: the lock, the Dockerfile, the OCI layout writer, and (opt-in) a real build.

The real, daemonless build (Debian packages via mmdebstrap, about a minute
with a warm network) runs with ``make images-test``, which sets
``SWITCHYARD_IMAGE_TEST=1``; ``make test`` checks everything else here in
well under a second.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from images.build import ENV, LOCK, PYTHON, ROOT, SERVICES, USER, build, keep_in_base
from images.oci import ImageConfig, Layout, read_image, retar, tar_directory, unpack

DOCKERFILE = ROOT / "Dockerfile"


def locked() -> dict[str, str]:
    text = LOCK.read_text()
    pins = dict(
        re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}$", text, re.M)
    )
    assert len(pins) == len(re.findall(r"^[A-Za-z0-9]", text, re.M)), "an entry without a hash"
    return {name.lower().replace("_", "-"): version for name, version in pins.items()}


def test_the_lock_pins_every_project_dependency_at_its_version() -> None:
    """requirements.lock holds pyproject's pins (same versions) and their closure, all hashed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = locked()
    for requirement in project["dependencies"]:
        name, version = requirement.split("==")
        assert pins.get(name.lower().replace("_", "-")) == version, (
            f"{requirement} is not in images/requirements.lock: run `make lock`"
        )
    assert len(pins) > len(project["dependencies"])  # the transitive ones too


def dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = ""
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        if match := re.match(r"FROM\s+(?:--platform=\S+\s+)?\S+\s+AS\s+(\S+)", line):
            current = match[1]
            stages[current] = []
        elif current and line.strip() and not line.startswith("#"):
            stages[current].append(line.strip())
    return stages


def test_dockerfile_targets_match_the_daemonless_images() -> None:
    """Each service target has the entrypoint, ports and user the OCI build gives it."""
    stages = dockerfile_stages()
    assert f"USER {USER}" in stages["runtime"]
    for variable in ENV[1:]:
        assert variable.split("=")[0] in " ".join(stages["runtime"])
    for name, (entrypoint, ports) in SERVICES.items():
        lines = stages[name]
        [entry] = [
            json.loads(line.split(None, 1)[1]) for line in lines if line.startswith("ENTRYPOINT")
        ]
        assert entry == ["python", *entrypoint]
        [exposed] = [line.split()[1:] for line in lines if line.startswith("EXPOSE")]
        assert [int(port) for port in exposed] == list(ports)


def test_dockerfile_final_stages_carry_no_build_tools() -> None:
    """Only the build stage runs pip install/wheel; the runtime removes pip itself."""
    stages = dockerfile_stages()
    runtime = " ".join(stages["runtime"])
    assert "pip uninstall --yes --quiet pip setuptools wheel" in runtime
    for name in ["runtime", *SERVICES]:
        text = " ".join(stages[name])
        assert "pip install" not in text
        assert "apt-get" not in text
        assert not re.search(r"\b(gcc|build-essential|make)\b", text)
    assert "--require-hashes" in " ".join(stages["build"])


def test_manifest_container_ports_are_exposed_by_their_image() -> None:
    """Every port a manifest's container declares is one its image exposes, for all five of
    Switchyard's Deployments (the active-active component's Redis is Redis's own image)."""
    deployments = 0
    for path in (ROOT / "manifests").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "Deployment":
                continue
            [container] = doc["spec"]["template"]["spec"]["containers"]
            if not container["image"].startswith("switchyard/"):
                continue
            image = container["image"].removeprefix("switchyard/")
            declared = {port["containerPort"] for port in container["ports"]}
            assert declared <= set(SERVICES[image][1]), (path.name, image)
            deployments += 1
    assert deployments == 5  # BBR, two pickers, two model servers: none left unchecked


def test_the_services_import_nothing_from_the_demo_extra() -> None:
    """The images carry the project's dependencies only: every service starts (``--help``
    imports all it serves with) with the demo extra's packages made unimportable."""
    blocked = ("envoy_data_plane", "betterproto2", "pydantic", "grpclib")
    guard = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(f'{name} is not in the images')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runpy\n"
        "sys.argv = [sys.argv[1], '--help']\n"
        "runpy.run_module(sys.argv[0], run_name='__main__')\n"
    )
    for module in SERVICES:
        result = subprocess.run(
            [sys.executable, "-c", guard, module], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, (module, result.stderr[-2000:])
        assert result.stdout.startswith(f"usage: python -m {module}")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not {p.split("==")[0] for p in project["dependencies"]} & {"envoy-data-plane"}
    assert not set(locked()) & {"envoy-data-plane", "betterproto2", "pydantic", "grpclib"}


# --- the OCI layout writer, on a tiny root filesystem --------------------------------------


def tiny_layout(tmp_path: Path, out: str, epoch: int) -> Path:
    root = tmp_path / "root"
    if not root.exists():
        (root / "usr" / "bin").mkdir(parents=True)
        (root / "usr" / "bin" / "hello").write_text("#!/bin/sh\necho hello\n")
        (root / "usr" / "bin" / "hello").chmod(0o755)
        (root / "bin").symlink_to("usr/bin")
    layout = Layout(tmp_path / out)
    layer = layout.layer(tar_directory(root, epoch), "tiny")
    config = ImageConfig(entrypoint=("/usr/bin/hello",), user=USER, exposed_ports=(9002,))
    layout.image("hello", [layer], config, epoch)
    layout.finish()
    return tmp_path / out


def test_oci_layout_is_reproducible_and_self_consistent(tmp_path: Path) -> None:
    """Same files, same epoch → same digests; every descriptor matches its blob."""
    first = tiny_layout(tmp_path, "a", 1_700_000_000)
    second = tiny_layout(tmp_path, "b", 1_700_000_000)
    os.utime(tmp_path / "root" / "usr" / "bin" / "hello")  # touched later: clamped to the epoch
    third = tiny_layout(tmp_path, "c", 1_700_000_000)
    indexes = [(path / "index.json").read_text() for path in (first, second, third)]
    assert indexes[0] == indexes[1] == indexes[2]
    assert json.loads((first / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    manifest, config = read_image(first, "hello")
    assert config["config"]["User"] == USER
    assert config["config"]["Entrypoint"] == ["/usr/bin/hello"]
    assert config["config"]["ExposedPorts"] == {"9002/tcp": {}}
    assert config["created"] == "2023-11-14T22:13:20Z"
    [layer] = manifest["layers"]
    blob = (first / "blobs" / "sha256" / layer["digest"][7:]).read_bytes()
    raw = gzip.decompress(blob)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        names = tar.getnames()
        assert names == sorted(names)
        assert {m.uid for m in tar.getmembers()} == {0}
        assert {m.mtime for m in tar.getmembers()} == {1_700_000_000}
    target = tmp_path / "unpacked"
    unpack(first, manifest, target)
    assert (target / "bin" / "hello").read_text().startswith("#!/bin/sh")
    if shutil.which("skopeo"):  # an independent reader of the layout, when installed
        out = subprocess.run(
            ["skopeo", "inspect", "--config", f"oci:{first}:hello"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(out)["config"]["User"] == USER


def test_base_layer_drops_device_nodes_and_apt_lists(tmp_path: Path) -> None:
    """Rewriting the base layer drops device nodes and apt's lists and stamps one fixed mtime."""
    source = tmp_path / "rootfs.tar"
    with tarfile.open(source, "w") as tar:
        for name, kind in [
            ("./dev", tarfile.DIRTYPE),
            ("./dev/null", tarfile.CHRTYPE),
            ("./var/lib/apt/lists", tarfile.DIRTYPE),
            ("./var/lib/apt/lists/deb.debian.org_Packages", tarfile.REGTYPE),
            ("./etc/hostname", tarfile.REGTYPE),
        ]:
            member = tarfile.TarInfo(name)
            member.type, member.mtime = kind, 2_000_000_000
            tar.addfile(member, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    with tarfile.open(fileobj=io.BytesIO(retar(source, 1_700_000_000, keep_in_base))) as tar:
        assert tar.getnames() == ["dev", "etc/hostname", "var/lib/apt/lists"]
        assert {m.mtime for m in tar.getmembers()} == {1_700_000_000}


# --- the real images (make images-test) ----------------------------------------------------


@pytest.mark.skipif(
    os.environ.get("SWITCHYARD_IMAGE_TEST") != "1",
    reason="builds Debian-based images (about a minute): run `make images-test`",
)
def test_built_images_run_their_service_as_nonroot(tmp_path: Path) -> None:
    """Build all three images daemonlessly, open each, and run ``--help`` inside as 65532."""
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        pytest.fail("the image test needs root and mmdebstrap (apt-get install mmdebstrap)")
    layout = Path(os.environ.get("SWITCHYARD_OCI", tmp_path / "oci"))
    if not (layout / "index.json").exists():
        build(layout, "bookworm", "http://deb.debian.org/debian", epoch=1_700_000_000)
    for name, (entrypoint, _ports) in SERVICES.items():
        manifest, config = read_image(layout, name)
        runtime = config["config"]
        assert runtime["Entrypoint"] == [PYTHON, *entrypoint]
        assert runtime["User"] == USER
        assert len(manifest["layers"]) == 2
        rootfs = tmp_path / name
        unpack(layout, manifest, rootfs)
        assert "nonroot:x:65532:65532" in (rootfs / "etc" / "passwd").read_text()
        assert not list((rootfs / "usr" / "bin").glob("gcc*"))
        assert not (rootfs / "usr" / "bin" / "pip").exists()
        # The image's own entrypoint and environment, as its user, in its root filesystem.
        result = subprocess.run(
            ["chroot", f"--userspec={USER}", str(rootfs), "/usr/bin/env", "-i",
             *runtime["Env"], *runtime["Entrypoint"], "--help"],
            capture_output=True,
            text=True,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python -m {name}")
