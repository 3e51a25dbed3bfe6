"""LWEPP, the lightweight endpoint picker: names the model-server endpoint for each request.

``python -m lwepp`` serves one pool. What other packages build on (the one
hop, ``onehop``, serves several pools' pickers behind BBR's chain in one
stream) is this package's API, the names below; nothing else of ``lwepp`` is
meant to be imported from outside it:

``add_picker_flags``, ``PickerOptions``, ``assemble``, ``Assembly``
    The picking flags, decoded, and the one function that builds a pool's
    picker from them (``lwepp.assembly``), with its request controls
    (InferenceObjectives, flow control) and what to call when it stops.
``HEALTH_SERVICES``
    The gRPC health names a picker reports.
``Pool``
    One pool's endpoints, from a pod source and a label selector.
``EndpointPickerService``, ``PickerState``
    The stream handler and what one stream holds. Beside serving a stream
    whole (``__call__``), its steps serve a stream that a composing handler
    reads itself: ``candidates_for`` (the endpoints a request may go to),
    ``admit_request`` (the request controls on the whole request, before the
    choice: a model rewrite, flow control, which may hold or refuse it here),
    ``destination`` (the strategy's choice, counted), ``on_response_headers``,
    ``on_response_body`` and ``end_response`` (the response side), and
    ``refuse`` (a refusal counted and answered), with ``hears_response`` and
    ``report_served`` (what the gateway must send it, and what it adds).
``routing_headers``, ``pass_chunk``, ``DESTINATION``, ``MODEL_HEADER``
    The headers that name a destination, a body chunk let through, the
    destination header's name, and the model header BBR sets.
"""

from lwepp.assembly import HEALTH_SERVICES, Assembly, PickerOptions, add_picker_flags, assemble
from lwepp.metrics import MODEL_HEADER
from lwepp.picking import Pool
from lwepp.server import (
    DESTINATION,
    EndpointPickerService,
    PickerState,
    pass_chunk,
    routing_headers,
)

__all__ = [
    "DESTINATION",
    "HEALTH_SERVICES",
    "MODEL_HEADER",
    "Assembly",
    "EndpointPickerService",
    "PickerOptions",
    "PickerState",
    "Pool",
    "add_picker_flags",
    "assemble",
    "pass_chunk",
    "routing_headers",
]
