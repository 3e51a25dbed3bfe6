"""A scorer of one's own for Switchyard's endpoint picker: keep each client in its zone.

Nothing here is part of Switchyard. The module imports the plugin contracts
(``lwepp.contracts``) and the parameter decoder (``plugin_api.Params``), and is
named in the picker's configuration by dotted path — no fork, no registration::

    - type: examples.custom_scorer.zone_affinity.ZoneAffinityScorer
      name: zone
      parameters: {header: x-client-zone, label: zone}

LWEPP imports the module when it loads the file and calls the class as
``ZoneAffinityScorer(name, params)``; reading every parameter there lets the
configuration check refuse a misspelt one before anything runs.

Formula: a request whose ``header`` names a zone scores 1 on endpoints whose
pod label ``label`` is that zone and 0 elsewhere; a request without the
header scores 0 everywhere (all tie), leaving the choice to the other scorers.
It reads no endpoint attributes (pod labels come with the endpoint) and not
the body, so it costs a dictionary lookup per candidate and keeps picking on
the request headers alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from lwepp.contracts import Candidate, LLMRequest
from plugin_api import Params


class ZoneAffinityScorer:
    """Prefer the endpoints in the zone the request names (a ``Scorer``, ``lwepp.contracts``)."""

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.header = params.get("header", str, "x-client-zone").lower()
        self.label = params.get("label", str, "topology.kubernetes.io/zone")

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> Sequence[float]:
        zone = request.headers.get(self.header)
        if zone is None:
            return [0.0] * len(candidates)
        return [1.0 if c.endpoint.labels.get(self.label) == zone else 0.0 for c in candidates]
