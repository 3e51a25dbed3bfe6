"""``python -m images.build``: the three service images as one OCI layout, with no Docker daemon.

The same images the Dockerfile describes, from this machine's package sources:

1. **Base layer**: a Debian root filesystem made by ``mmdebstrap`` from
   Debian's packages (``python3.11-minimal``, ``libpython3.11-stdlib``,
   ``ca-certificates`` and the Essential set), without docs, man pages,
   locales, apt lists or device nodes.
2. **Application layer**: ``/opt/switchyard/lib`` with the pinned
   dependencies (``images/requirements.lock``, wheels only, hashes checked)
   and the project's own wheel, byte-compiled; a ``nonroot`` user (65532)
   in ``/etc/passwd``. No compiler, pip or build tool is in either layer.
3. **Images** ``lwepp``, ``bbr`` and ``simulator``: the two layers shared,
   each with its own entrypoint, user 65532:65532 and ports.

Timestamps are clamped to ``SOURCE_DATE_EPOCH`` (default: the last commit's
time), so a rebuild from the same packages gives the same digests. Debian's
archive moves on; pin ``--mirror`` to a snapshot for bit-for-bit rebuilds
later. Needs root (or user namespaces, which mmdebstrap picks by itself).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from images.oci import ImageConfig, Layout, retar, tar_directory

ROOT: Final = Path(__file__).resolve().parent.parent
LOCK: Final = ROOT / "images" / "requirements.lock"
VERSION: Final = "0.1.0"
PYTHON: Final = "/usr/bin/python3.11"
USER: Final = "65532:65532"
# libstdc++6: grpcio's extension is C++.
PACKAGES: Final = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "ca-certificates")
# Wheels for CPython 3.11 on glibc x86_64 (Debian 12 has glibc 2.36).
WHEEL_TAGS: Final = (
    "--python-version=3.11",
    "--implementation=cp",
    "--abi=cp311",
    *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                  "manylinux2014_x86_64", "manylinux1_x86_64",
                                  "manylinux_2_5_x86_64")),
)  # fmt: skip
ENV: Final = (
    "PATH=/usr/local/bin:/usr/bin:/bin",
    "PYTHONPATH=/opt/switchyard/lib",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
)
SERVICES: Final = {
    # name: (entrypoint after the interpreter, ports), as the Dockerfile's targets
    "lwepp": (("-m", "lwepp", "--host=0.0.0.0"), (9002, 9003, 9090)),
    "bbr": (("-m", "bbr", "--host=0.0.0.0"), (9004, 9005, 9091)),
    "simulator": (("-m", "simulator"), (8000,)),
}
_DROPPED: Final = ("dev/", "var/cache/apt/", "var/lib/apt/lists/", "var/log/", "run/")


def commit() -> str:
    """The commit the images are built from (their ``*_info`` metrics report it), or unknown."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def commit_epoch() -> int:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def debian_rootfs(target: Path, suite: str, mirror: str, epoch: int) -> None:
    """Run mmdebstrap: a minimal Debian with Python 3.11, as a tarball."""
    excluded = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")
    subprocess.run(
        [
            "mmdebstrap",
            "--quiet",
            "--variant=essential",
            f"--include={','.join(PACKAGES)}",
            *(f"--dpkgopt=path-exclude={pattern}" for pattern in excluded),
            suite,
            str(target),
            f"deb {mirror} {suite} main",
            f"deb {mirror}-security {suite}-security main",
        ],
        check=True,
        env={"SOURCE_DATE_EPOCH": str(epoch), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )


def keep_in_base(member: tarfile.TarInfo) -> bool:
    name = member.name.removeprefix("./")
    if member.ischr() or member.isblk() or member.isfifo():
        return False  # runtimes provide /dev
    return not any(name.startswith(p) and name != p.rstrip("/") for p in _DROPPED)


def application(staging: Path, base: Path, work: Path) -> None:
    """``/opt/switchyard/lib`` (locked wheels, the project) and a nonroot user, in ``staging``."""
    lib = staging / "opt" / "switchyard" / "lib"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    install = [*pip, "install", "--target", str(lib), "--no-deps", "--no-compile"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--wheel-dir", str(work / "dist"), str(ROOT)], check=True
    )
    [wheel] = (work / "dist").glob("switchyard-*.whl")
    subprocess.run(
        [*install, "--only-binary=:all:", "--require-hashes", *WHEEL_TAGS, "-r", str(LOCK)],
        check=True,
    )  # fmt: skip
    shutil.rmtree(lib / "bin", ignore_errors=True)  # so the next --target install need not merge
    subprocess.run([*install, str(wheel)], check=True)
    # PEP 610's direct_url.json records the scratch path the wheel came from:
    # drop it (and its RECORD line) so the layer does not depend on it.
    [dist_info] = lib.glob("switchyard-*.dist-info")
    (dist_info / "direct_url.json").unlink()
    record = dist_info / "RECORD"
    lines = record.read_text().splitlines(keepends=True)
    record.write_text("".join(line for line in lines if "direct_url.json" not in line))
    shutil.rmtree(lib / "bin", ignore_errors=True)  # console scripts with this host's shebang
    # Byte-compile as the image's path (-s/-p: no scratch directory inside the
    # .pyc files), checked by hash rather than mtime: reproducible, and fast to
    # start on a read-only root filesystem.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-f", "--invalidation-mode=unchecked-hash",
         "-s", str(lib), "-p", "/opt/switchyard/lib", str(lib)],
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},  # set constants marshal in a fixed order
    )  # fmt: skip
    # The non-root user the images run as, named so that tools show a name.
    with tarfile.open(base) as tar:
        passwd = (
            _read(tar, "etc/passwd")
            + "nonroot:x:65532:65532:nonroot:/nonexistent:/usr/sbin/nologin\n"
        )
        group = _read(tar, "etc/group") + "nonroot:x:65532:\n"
    (staging / "etc").mkdir()
    (staging / "etc" / "passwd").write_text(passwd)
    (staging / "etc" / "group").write_text(group)


def _read(tar: tarfile.TarFile, name: str) -> str:
    for candidate in (name, f"./{name}"):
        try:
            member = tar.getmember(candidate)
        except KeyError:
            continue
        data = tar.extractfile(member)
        if data is not None:
            return data.read().decode()
    raise FileNotFoundError(name)


def build(out: Path, suite: str, mirror: str, epoch: int, base_tar: Path | None = None) -> None:
    """Write the OCI layout of all three images to ``out`` (replaced if present)."""
    shutil.rmtree(out, ignore_errors=True)
    revision = commit()
    with tempfile.TemporaryDirectory(prefix="switchyard-image-") as scratch:
        work = Path(scratch)
        if base_tar is None:
            base_tar = work / "rootfs.tar"
            debian_rootfs(base_tar, suite, mirror, epoch)
        staging = work / "app"
        staging.mkdir()
        application(staging, base_tar, work)
        layout = Layout(out)
        base = layout.layer(retar(base_tar, epoch, keep_in_base), f"debian {suite}: {PACKAGES}")
        app = layout.layer(tar_directory(staging, epoch), f"switchyard {VERSION}")
        for name, (entrypoint, ports) in SERVICES.items():
            config = ImageConfig(
                entrypoint=(PYTHON, *entrypoint),
                user=USER,
                env=(*ENV, f"SWITCHYARD_COMMIT={revision}"),
                exposed_ports=ports,
                labels={
                    "org.opencontainers.image.title": f"switchyard-{name}",
                    "org.opencontainers.image.version": VERSION,
                    "org.opencontainers.image.licenses": "Apache-2.0",
                },
            )
            layout.image(name, (base, app), config, epoch)
        layout.finish()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m images.build", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "build" / "oci", help="OCI layout directory"
    )
    parser.add_argument("--suite", default="bookworm", help="Debian suite (default %(default)s)")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror")
    parser.add_argument(
        "--base-tar",
        type=Path,
        help="reuse a root filesystem tarball from an earlier mmdebstrap run",
    )
    parser.add_argument(
        "--epoch", type=int, default=None, help="SOURCE_DATE_EPOCH (default: last commit)"
    )
    args = parser.parse_args(argv)
    if args.base_tar is None and shutil.which("mmdebstrap") is None:
        sys.exit("images.build: mmdebstrap not found (apt-get install mmdebstrap)")
    epoch = args.epoch if args.epoch is not None else commit_epoch()
    build(args.out, args.suite, args.mirror, epoch, args.base_tar)
    print(f"OCI layout written to {args.out}: images lwepp, bbr, simulator ({VERSION})")


if __name__ == "__main__":
    main()
