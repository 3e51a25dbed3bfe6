"""The picker under test as a command template: any ext_proc picker can be held to GIE's tests.

GIE's suite deploys one picker per InferencePool (``base.yaml``: ext_proc on
9002, gRPC health on 9003, probed on the ``inference-extension`` service)
and the gateway under test calls it. Here the gateway is fixed (Envoy,
``conformance.envoy``) and the picker is what varies: the harness starts one
process per pool from a template such as::

    my-picker --listen {host}:{grpc_port} --health-port {health_port} --endpoints {endpoints}

Each ``{field}`` is filled in per pool (``FIELDS`` says with what); ``{{``
and ``}}`` stand for literal braces. The template is split into words as a
POSIX shell would (``shlex``), and the fields are filled into each word, so
a path with spaces stays one argument and nothing is run through a shell
(write ``sh -c '...'`` to get one).
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

FIELDS: Final = {
    "python": "the Python interpreter running the harness (for a picker written in Python)",
    "host": "the address the picker must listen on: its own 127.X.Y.Z, as a pod IP",
    "grpc_port": "the ext_proc port (9002, as in GIE's base.yaml); plaintext gRPC",
    "health_port": "the gRPC health port (9003), asked about --picker-health-service",
    "metrics_port": "a metrics port (9090), if the picker serves one",
    "pods": "a YAML file of the pool's pods (pods/file.py's format): name, address, the "
    "pool's target ports, labels",
    "endpoints": "the pool's endpoints, ip:port,ip:port,... (each pod × each target port)",
    "selector": "the pool's selector, app=<label>",
    "pool": "the InferencePool's name",
    "namespace": "the pool's namespace, inference-conformance-app-backend",
}
"""The fields a picker template may use, and what each is filled with."""

SWITCHYARD: Final = (
    "{python} -m lwepp --pods {pods} --selector {selector} --host {host} "
    "--grpc-port {grpc_port} --grpc-health-port {health_port} --metrics-port {metrics_port} "
    "--secure-serving=false --log-level info "
    "--enable-test-selection-header --report-served-endpoint"
)
"""Switchyard's LWEPP, with the ports GIE's manifests give lwepp. Plaintext: this harness's
gateway and picker client dial every picker under test in plaintext (GIE's gateways dial TLS;
the demo and the end-to-end tests cover that hop). GIE's tests pin replicas with
``test-epp-endpoint-selection`` and read ``x-conformance-test-served-endpoint``, two things
GIE's lwepp always does and Switchyard does only when asked: both flags turn them on."""

ONE_HOP: Final = (
    'sh -c \'exec "$0" -m onehop --pods "$1" --pool-label app --pool "${{2#app=}}=*" '
    '--host "$3" --grpc-port "$4" --grpc-health-port "$5" --metrics-port "$6" '
    "--enable-test-selection-header --report-served-endpoint "
    "--secure-serving=false --log-level info' "
    "{python} {pods} {selector} {host} {grpc_port} {health_port} {metrics_port}"
)
"""Switchyard's one-hop service (``onehop``: BBR's chain, then the pick) as each pool's
picker, taking any model (``--pool NAME=*``, NAME the pool's ``app`` label, which the shell cuts
from ``{selector}``). The suite's gateway routes by HTTPRoute, so its one ext_proc filter per pool
is the one hop: the tests then check the pick, and the model header rides along."""


class TemplateError(ValueError):
    """A picker template that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class PickerCommand:
    """A checked picker template, ready to be filled in for each pool."""

    template: str
    words: tuple[str, ...]

    @classmethod
    def parse(cls, template: str, extra: Sequence[str] = ()) -> PickerCommand:
        """Check ``template`` (and ``extra`` words appended to it); raise ``TemplateError``."""
        try:
            words = (*shlex.split(template), *extra)
        except ValueError as error:  # an unclosed quote
            raise TemplateError(f"picker template {template!r}: {error}") from None
        if not words:
            raise TemplateError("picker template is empty")
        for word in words:
            _check(word)
        shown = " ".join([template, *(shlex.quote(word) for word in extra)])
        return cls(shown, words)

    def argv(self, values: Mapping[str, str]) -> list[str]:
        """The command for one pool: every field filled in."""
        return [word.format_map(values) for word in self.words]


def _check(word: str) -> None:
    """Every ``{...}`` in ``word`` must be a known field, without conversion or format spec."""
    try:
        parts = list(string.Formatter().parse(word))
    except ValueError as error:  # a lone { or }
        hint = "write {{ or }} for a literal brace"
        raise TemplateError(f"picker template word {word!r}: {error} ({hint})") from None
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in FIELDS:
            known = ", ".join(f"{{{name}}}" for name in FIELDS)
            raise TemplateError(
                f"picker template word {word!r}: unknown field {{{field}}}; known: {known}"
            )
        if spec or conversion:
            raise TemplateError(
                f"picker template word {word!r}: write {{{field}}} without ! or : after it"
            )
