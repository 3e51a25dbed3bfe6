"""``models-data-source``: the models and LoRA adapters each endpoint lists at ``/v1/models``.

Every ``refreshIntervalSeconds`` (default 2 s: the list changes when an
adapter is loaded, not per request) each endpoint is asked for
``<scheme>://<ip:port><path>`` on its own task (``polling``), and the ``id``
of every entry of the OpenAI-shaped answer ``{"data": [{"id": ..., "parent":
...}, ...]}`` goes into one set-valued attribute, ``served_models``: base
models and adapters alike (an adapter is an entry whose ``parent`` names its
base model).

Parameters: ``scheme`` (``http``), ``path`` (``/v1/models``) and
``insecureSkipVerify`` (true) as the llm-d router's ``models-data-source``;
``refreshIntervalSeconds`` (2.0) and ``timeoutSeconds`` (1.0) are Switchyard's.

Unknown and stale data: an endpoint that does not answer, answers non-200 or
answers something that is not a model list gets no write, so its last list
grows stale; an empty list is a real answer and is written.
"""

from __future__ import annotations

from typing import ClassVar, Final

import aiohttp
import orjson

from lwepp.plugins import polling
from pods.model import Endpoint

DEFAULT_INTERVAL: Final = 2.0


def served_models(answer: object) -> frozenset[str]:
    """The ids of a ``/v1/models`` answer; ValueError if it is not a model list."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list: no 'data' array")
    return frozenset(
        card["id"] for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)
    )


class ModelsDataSource(polling.HttpSource):
    """Polls ``/v1/models`` of every endpoint; see the module docstring."""

    produces: ClassVar[frozenset[str]] = frozenset({"served_models"})
    what: ClassVar[str] = "model list"
    default_path: ClassVar[str] = "/v1/models"
    default_interval: ClassVar[float] = DEFAULT_INTERVAL

    async def answer(
        self, endpoint: Endpoint, response: aiohttp.ClientResponse
    ) -> dict[str, float | frozenset[str]]:
        """The ids listed; ValueError if the answer is not a model list (or not JSON)."""
        return {"served_models": served_models(orjson.loads(await response.read()))}
