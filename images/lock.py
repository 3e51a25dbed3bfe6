"""``python -m images.lock``: pin the images' runtime dependencies, with hashes.

Asks pip to resolve the project's dependencies as if installing into an empty
environment (``--dry-run --ignore-installed --report``) for the images'
interpreter and platform (CPython 3.11, the manylinux tags of
``images.build.WHEEL_TAGS``), and writes every package of
the closure as ``name==version --hash=sha256:…`` to images/requirements.lock.
The Dockerfile and ``images.build`` install from that file with
``--require-hashes``, so an image gets exactly these files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from images.build import LOCK, ROOT, WHEEL_TAGS

HEADER = """\
# Pinned runtime dependencies of the images (every package, every version, the
# x86_64 CPython 3.11 wheel hashes). Regenerate with `make lock` after changing
# pyproject.toml's dependencies; tests/test_images.py checks the two agree.
"""


def render(report: dict[str, Any]) -> str:
    lines = []
    for item in sorted(report["install"], key=lambda i: str(i["metadata"]["name"]).lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name == "switchyard":
            continue
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}")
    return HEADER + "\n".join(lines) + "\n"


def main() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    with tempfile.TemporaryDirectory() as scratch:
        report, requirements = Path(scratch) / "report.json", Path(scratch) / "requirements.txt"
        requirements.write_text("\n".join(dependencies) + "\n")
        # The images' wheel tags, not this host's: a package with a wheel for a newer glibc
        # than the images' build allows (cryptography's manylinux_2_34) would lock a file
        # the image build never picks, and its hash would not match.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--only-binary=:all:", *WHEEL_TAGS, "--report", str(report),
             "-r", str(requirements)],
            check=True,
        )  # fmt: skip
        LOCK.write_text(render(json.loads(report.read_text())))
    print(f"wrote {LOCK}")


if __name__ == "__main__":
    main()
