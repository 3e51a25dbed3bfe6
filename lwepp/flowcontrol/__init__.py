"""Governing requests, not only placing them: priority, admission and flow control.

The llm-d router decides *whether and when* a request is served before it
decides *where*: an InferenceObjective gives the request a priority
(``lwepp.objectives``), a saturation detector says how full the pool is
(``lwepp.plugins.saturation``), and, with the ``flowControl`` feature gate
on, requests wait in priority bands and per-tenant flows until the pool has
room. Switchyard does the same, in these modules:

``config``      the ``flowControl`` section (and the deprecated ``saturationDetector``), decoded
``queues``      what waits: items, flows, bands
``policies``    fairness, ordering and usage-limit policies, as plugins
``controller``  the flow controller: submit, one dispatch cycle, expiry, cancel, close
``admission``   the request control (``lwepp.picking.RequestControl``) and its dispatcher task
``metrics``     ``llm_d_epp_flow_control_*``
``governance``  ``govern``: all of it for one picker

``govern`` builds what one picker needs from its configuration: the request
control to pass to ``EndpointPickerService(controls=...)``, the background
task that runs dispatch cycles, and what to call when the picker stops.
Where it sits on the request path, and what it costs, is in
``docs/hooks.md``.
"""
