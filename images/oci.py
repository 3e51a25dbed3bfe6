"""Writing an OCI image layout by hand: layer tarballs, image configs, manifests, an index.

An OCI image (image-spec v1.1) is a handful of content-addressed files:

- each **layer** is a gzipped tar of files, stored as ``blobs/sha256/<digest
  of the gzip>``; the config lists it by ``diff_id``, the digest of the
  uncompressed tar;
- the **config** (JSON) says how to run it (entrypoint, user, env, ports) and
  lists the layers' ``diff_ids``;
- the **manifest** (JSON) points at the config and the layer blobs by digest
  and size;
- ``index.json`` names each manifest (``org.opencontainers.image.ref.name``)
  and ``oci-layout`` marks the directory.

Nothing here needs privileges or a daemon. Every timestamp is clamped to
``SOURCE_DATE_EPOCH`` and entries are written in sorted order with fixed
owners, so the same inputs give byte-identical blobs and digests. Registries
and runtimes read the layout directly (``skopeo copy oci:DIR:REF …``,
``podman load``, containerd's ``ctr image import``).
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
CONFIG: Final = "application/vnd.oci.image.config.v1+json"
LAYER: Final = "application/vnd.oci.image.layer.v1.tar+gzip"
INDEX: Final = "application/vnd.oci.image.index.v1+json"
REF_NAME: Final = "org.opencontainers.image.ref.name"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Blob:
    """Content stored under ``blobs/sha256/``: its media type, digest and size."""

    media_type: str
    digest: str
    size: int

    def descriptor(self, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
        found: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if annotations:
            found["annotations"] = dict(annotations)
        return found


@dataclass(frozen=True, slots=True)
class Layer:
    blob: Blob
    diff_id: str
    comment: str


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """What a runtime needs to start the image (the ``config`` object of the image config)."""

    entrypoint: Sequence[str]
    user: str
    env: Sequence[str] = ()
    cmd: Sequence[str] = ()
    working_dir: str = "/"
    exposed_ports: Sequence[int] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


def normalize(member: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    """Fixed owner names and timestamps no later than ``epoch`` (what makes a tar reproducible)."""
    member.mtime = min(int(member.mtime), epoch)
    member.uname = member.gname = ""
    member.pax_headers = {}
    return member


def tar_directory(root: Path, epoch: int, owner: tuple[int, int] = (0, 0)) -> bytes:
    """A reproducible tar of ``root``'s contents (paths relative to it), owned by ``owner``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            member = tar.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            member.uid, member.gid = owner
            normalize(member, epoch)
            if member.isfile():
                with path.open("rb") as data:
                    tar.addfile(member, data)
            else:
                tar.addfile(member)
    return buffer.getvalue()


def retar(
    source: Path, epoch: int, keep: Callable[[tarfile.TarInfo], bool] = lambda _m: True
) -> bytes:
    """Copy a tarball's members that ``keep`` accepts, sorted by name and normalized."""
    buffer = io.BytesIO()
    with (
        tarfile.open(source) as original,
        tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        members = sorted(original.getmembers(), key=lambda m: m.name)
        for member in members:
            if not keep(member):
                continue
            member.name = member.name.removeprefix("./")
            if not member.name:
                continue
            data = original.extractfile(member) if member.isfile() else None
            tar.addfile(normalize(member, epoch), data)
    return buffer.getvalue()


class Layout:
    """An OCI image layout directory being written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        self.manifests: list[dict[str, Any]] = []

    def put(self, media_type: str, data: bytes) -> Blob:
        digest = sha256(data)
        target = self.path / "blobs" / "sha256" / digest.removeprefix("sha256:")
        if not target.exists():
            target.write_bytes(data)
        return Blob(media_type, digest, len(data))

    def put_json(self, media_type: str, document: Mapping[str, Any]) -> Blob:
        return self.put(media_type, json.dumps(document, sort_keys=True).encode())

    def layer(self, tar: bytes, comment: str) -> Layer:
        """Gzip a layer tar (no name, mtime 0: reproducible) and store it."""
        compressed = gzip.compress(tar, compresslevel=6, mtime=0)
        return Layer(self.put(LAYER, compressed), sha256(tar), comment)

    def image(
        self,
        ref: str,
        layers: Iterable[Layer],
        config: ImageConfig,
        epoch: int,
        architecture: str = "amd64",
    ) -> Blob:
        """Write one image's config and manifest, and name it ``ref`` in the index."""
        layers = list(layers)
        created = _rfc3339(epoch)
        runtime: dict[str, Any] = {
            "User": config.user,
            "Entrypoint": list(config.entrypoint),
            "Env": list(config.env),
            "WorkingDir": config.working_dir,
        }
        if config.cmd:
            runtime["Cmd"] = list(config.cmd)
        if config.exposed_ports:
            runtime["ExposedPorts"] = {f"{port}/tcp": {} for port in config.exposed_ports}
        if config.labels:
            runtime["Labels"] = dict(config.labels)
        image_config = {
            "architecture": architecture,
            "os": "linux",
            "created": created,
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
            "history": [{"created": created, "comment": layer.comment} for layer in layers],
        }
        config_blob = self.put_json(CONFIG, image_config)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": config_blob.descriptor(),
            "layers": [layer.blob.descriptor() for layer in layers],
        }
        blob = self.put_json(MANIFEST, manifest)
        self.manifests.append(blob.descriptor({REF_NAME: ref}))
        return blob

    def finish(self) -> None:
        index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": self.manifests}
        (self.path / "index.json").write_text(json.dumps(index, sort_keys=True, indent=2))


def _rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_image(layout: Path, ref: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and config of image ``ref``, checking every digest on the way."""

    def blob(descriptor: Mapping[str, Any]) -> bytes:
        data = (layout / "blobs" / "sha256" / str(descriptor["digest"]).split(":")[1]).read_bytes()
        if sha256(data) != descriptor["digest"] or len(data) != descriptor["size"]:
            raise ValueError(f"blob {descriptor['digest']} does not match its descriptor")
        return data

    index = json.loads((layout / "index.json").read_text())
    [entry] = [m for m in index["manifests"] if m.get("annotations", {}).get(REF_NAME) == ref]
    manifest = json.loads(blob(entry))
    config = json.loads(blob(manifest["config"]))
    return manifest, config


def unpack(layout: Path, manifest: Mapping[str, Any], target: Path) -> None:
    """Extract an image's layers in order into ``target`` (a root filesystem to inspect or run)."""
    for layer in manifest["layers"]:
        path = layout / "blobs" / "sha256" / layer["digest"].split(":")[1]
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                if name.startswith(".wh."):  # whiteout: a file deleted by this layer
                    gone = target / os.path.dirname(member.name) / name.removeprefix(".wh.")
                    gone.unlink(missing_ok=True)
                    continue
                existing = target / member.name
                if existing.is_file() or existing.is_symlink():
                    existing.unlink()  # an upper layer replaces the file
                # Our own build's output: links into /etc/alternatives and
                # setuid bits are meant, so no extraction filter.
                tar.extract(member, target, filter="fully_trusted")
