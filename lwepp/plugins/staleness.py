"""When a measurement is too old to use: the ``maxAgeSeconds`` parameter attribute readers share.

A plugin that reads endpoint attributes takes ``maxAgeSeconds`` and passes
it to ``Candidate.value``/``Candidate.names``: an older measurement counts as
unknown, and the plugin's docstring says what it does then.

The default, 1 s, is ten scrapes of the metrics source's default interval:
one lost scrape or a busy event loop does not blank an endpoint's data, and
an endpoint that stopped answering its metrics is unknown within a second.
"""

from __future__ import annotations

from typing import Final

from plugin_api import NO_PARAMS, Params

MAX_AGE_SECONDS: Final = 1.0


def max_age(params: Params) -> float:
    """The plugin's ``maxAgeSeconds`` (default ``MAX_AGE_SECONDS``); it must be > 0."""
    return params.get("maxAgeSeconds", float, MAX_AGE_SECONDS, above=0)


class ReadsMeasurements:
    """What the attribute readers share: a name, and the age past which a measurement is
    unknown (``maxAgeSeconds``). Their own parameters, if any, follow in their ``__init__``."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.max_age = max_age(params)
