"""What build a process is, for the ``*_info`` metrics (``bbr_info``, ``llm_d_epp_info``)."""

from __future__ import annotations

import importlib.metadata
import os


def build_info() -> tuple[str, str]:
    """``(commit, build_ref)`` for the services' ``*_info`` metrics: the commit an image was
    built from (``SWITCHYARD_COMMIT``, which the image builds set) and the package version."""
    try:
        version = importlib.metadata.version("switchyard")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return os.environ.get("SWITCHYARD_COMMIT", "unknown"), version
