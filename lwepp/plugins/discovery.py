"""``file-discovery``: the llm-d router's endpoints file as the picker's pod list, no Kubernetes.

The router's no-Kubernetes mode (``docs/discovery.md`` there): a plugin of
type ``file-discovery`` names a file of endpoints, and
``dataLayer.discovery.pluginRef`` names the plugin; the router then starts
no controller manager and serves what the file lists::

    plugins:
    - type: file-discovery
      parameters: {path: /etc/epp/endpoints.yaml, watchFile: true}
    dataLayer:
      discovery: {pluginRef: file-discovery}

Here it is the same: ``python -m lwepp --config that.yaml`` needs no
``--pods``, ``--pool-name`` or ``--endpoint-selector`` (giving one as well is
an error), and reads the file with the pod-file source (``pods.file``, which
takes the router's ``endpoints:`` format as well as Switchyard's ``pods:``):
a file that cannot be read or decoded stops the start, naming the line; with
``watchFile`` (default false, as the router's) every change is applied,
entries that left removed and new ones added, and a broken edit is logged
while the last good list stays. The pool is named by ``--pool-name`` (default
``epp``, the router's) and its namespace is ``--pool-namespace``, else
``$NAMESPACE``, else ``default``.

Parameters: ``path`` (required: relative paths are read from the picker's
working directory) and ``watchFile``.

``endpoint-notification-source`` is the router's data source of endpoint
lifecycle events (an endpoint added, one deleted) for the extractors
``dataLayer.sources`` pairs with it: here the precise prefix producer, which
subscribes to each endpoint's KV-event publisher as it comes
(``kvEventsConfig.discoverPods``) and drops it as it goes. Here the pool's
endpoint list is those events: the plugin takes no parameters and is handed
to its extractors (``lwepp.contracts.Want``).
"""

from __future__ import annotations

from typing import Final

from lwepp.contracts import ENDPOINT_EVENTS, ENDPOINTS
from plugin_api import NO_PARAMS, Params
from pods.file import FileSource

POOL_NAME: Final = "epp"
"""The pool's name when the router runs from a file and ``--pool-name`` is not given."""


class FileDiscovery:
    """Names the endpoints file; the picker's command line builds the source (``pod_source``)."""

    provides: Final = frozenset({ENDPOINTS})
    """The endpoints, to the command line that builds the pool (``dataLayer.discovery``)."""

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        self.path = params.require("path", str)
        if not self.path:
            raise params.error("path", "must not be empty")
        self.watch = params.get("watchFile", bool, False)

    def pod_source(self, interval: float = 1.0) -> FileSource:
        """The file as a pod source: read once, or watched every ``interval`` seconds."""
        return FileSource(self.path, interval, watch=self.watch)


class EndpointNotificationSource:
    """The router's ``endpoint-notification-source``: the pool's endpoints, as they change, to
    the extractors paired with it."""

    provides: Final = frozenset({ENDPOINT_EVENTS})

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
