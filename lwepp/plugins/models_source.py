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

from collections.abc import Callable, Sequence
from typing import ClassVar, Final

import aiohttp
import orjson

from lwepp.hooks import AttributeWriter
from lwepp.plugins import polling
from lwepp.plugins.params import Params
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


class ModelsDataSource:
    """Polls ``/v1/models`` of every endpoint; see the module docstring."""

    produces: ClassVar[frozenset[str]] = frozenset({"served_models"})

    def __init__(
        self,
        name: str,
        *,
        interval: float = DEFAULT_INTERVAL,
        timeout: float = 1.0,
        scheme: str = "http",
        path: str = "/v1/models",
        verify_tls: bool = False,
    ) -> None:
        self.name = name
        self.interval = interval
        self.timeout = timeout
        self.scheme = scheme
        self.path = path
        self.verify_tls = verify_tls

    async def fetch(
        self, session: aiohttp.ClientSession, endpoint: Endpoint
    ) -> dict[str, float | frozenset[str]]:
        """Ask one endpoint once; raises on a refused connection, timeout, non-200 or bad JSON."""
        async with session.get(polling.url(endpoint, self.scheme, self.path)) as response:
            response.raise_for_status()
            return {"served_models": served_models(orjson.loads(await response.read()))}

    async def run(
        self,
        endpoints: Callable[[], Sequence[Endpoint]],
        store: AttributeWriter,
        clock: Callable[[], float],
    ) -> None:
        await polling.poll_endpoints(
            endpoints,
            store,
            clock,
            self.fetch,
            interval=self.interval,
            request_timeout=self.timeout,
            verify_tls=self.verify_tls,
            what="model list",
        )


def build(name: str, params: Params) -> ModelsDataSource:
    """The registry's factory for ``models-data-source``."""
    scheme, path, interval, timeout, verify = polling.http_params(
        params, "/v1/models", DEFAULT_INTERVAL, 1.0
    )
    params.done()
    return ModelsDataSource(
        name, interval=interval, timeout=timeout, scheme=scheme, path=path, verify_tls=verify
    )
