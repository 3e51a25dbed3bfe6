"""The body-based router (BBR): an ext_proc service that routes on the request body's ``model``.

``python -m bbr`` serves it. What other packages build on (the one hop,
``onehop``, runs BBR's request chain before its picks in one stream) is this
package's API, the names below; nothing else of ``bbr`` is meant to be
imported from outside it:

``add_router_flags``, ``router_of``
    BBR's flags (``--plugin``, ``--streaming``) and the router they make, its
    plugins fed (``background``: their sources, to run beside it) and the
    warnings they give at start (``bbr.assembly``).
``BodyBasedRouter``
    The stream handler. Beside serving a stream whole (``__call__``), a
    composing handler may use ``read_request`` (the request chain run on a
    held body: the parsed, possibly changed ``Message``), ``refusal`` (an
    error answered and counted as BBR counts it) and ``metrics``.
``HEALTH_SERVICES``
    The gRPC health names BBR reports.
"""

from bbr.assembly import add_router_flags, router_of
from bbr.server import HEALTH_SERVICES, BodyBasedRouter

__all__ = ["HEALTH_SERVICES", "BodyBasedRouter", "add_router_flags", "router_of"]
