"""Structured logs for every Switchyard process: JSON lines on stderr.

A leaf module (structlog only), so processes that serve no gRPC, such as the
simulator, share the same log shape without loading grpcio.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (a test may have swapped it since
    logging was set up), written to in one call per line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _Stderr()


def configure_logging(level: str = "info", encoder: str = "json") -> None:
    """Log lines on stderr, one per event, with level and timestamp: JSON objects, or with
    ``encoder="console"`` aligned text for people (the originals' ``--zap-encoder``)."""
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if encoder == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([] if encoder == "console" else [structlog.processors.format_exc_info]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line: stderr is unbuffered, and print() writes the line and its
        # newline apart, so the workers of --workers, sharing one stderr, interleaved them.
        logger_factory=structlog.WriteLoggerFactory(cast(TextIO, _STDERR)),
        cache_logger_on_first_use=True,
    )
