"""The BBR handler as ``bench.server`` runs it: the default plugin chain."""

from __future__ import annotations

from protos.server import Handler


def bbr_handler() -> Handler:
    raise SystemExit("bbr benchmark not wired yet")
