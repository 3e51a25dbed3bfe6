"""The picker under test as a command template: any ext_proc picker can be held to GIE's tests.

GIE's suite deploys one picker per InferencePool (``base.yaml``: ext_proc on
9002 over TLS, gRPC health on 9003, probed on the ``inference-extension``
service; each lwepp told ``--pool-name`` and ``--pool-namespace``, so that it
reads the pool and its pods from the cluster) and the gateway under test
calls it. Here the gateway is fixed (Envoy, ``conformance.envoy``) and the
picker is what varies: the harness starts one process per pool from a
template such as::

    my-picker --listen {host}:{grpc_port} --health-port {health_port} \\
        --pool {pool} --namespace {namespace} --kubeconfig {kubeconfig}

Each ``{field}`` is filled in per pool (``FIELDS`` says with what); ``{{``
and ``}}`` stand for literal braces. The template is split into words as a
POSIX shell would (``shlex``), and the fields are filled into each word, so
a path with spaces stays one argument and nothing is run through a shell
(write ``sh -c '...'`` to get one).

How the picker learns its endpoints follows from the fields it names
(``Discovery``): ``{kubeconfig}``, and it reads its InferencePool and the
pods from the harness's Kubernetes API server, as in a cluster, so the
selector and the target ports are its own work; ``{endpoints}`` or
``{pods}``, and the harness hands it the endpoints it computed. A template
naming both kinds, or neither, is refused.
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

FIELDS: Final = {
    "python": "the Python interpreter running the harness (for a picker written in Python)",
    "host": "the address the picker must listen on: its own 127.X.Y.Z, as a pod IP",
    "grpc_port": "the ext_proc port (9002, as in GIE's base.yaml), TLS unless --picker-plaintext",
    "secure_serving": "true, or false with --picker-plaintext: whether the ext_proc port must "
    "serve TLS (GIE's lwepp flag --secure-serving takes it as it is)",
    "health_port": "the gRPC health port (9003, plaintext), asked about the "
    "inference-extension service as GIE's probes ask",
    "metrics_port": "a metrics port (9090), if the picker serves one",
    "pool": "the InferencePool's name",
    "namespace": "the pool's namespace, inference-conformance-app-backend",
    "kubeconfig": "a kubeconfig for the harness's Kubernetes API server, which serves the "
    "InferencePools and the pods: the picker finds its endpoints itself, as in a cluster",
    "endpoints": "instead: the pool's endpoints, ip:port,ip:port,... (each pod × each target "
    "port, computed by the harness)",
    "pods": "instead: the same as a YAML file of the pool's pods (pods/file.py's format): "
    "name, address, the pool's target ports, labels",
    "selector": "with {endpoints} or {pods}: the pool's selector, app=<label>",
}
"""The fields a picker template may use, and what each is filled with."""

POOL_FIELDS: Final = frozenset({"kubeconfig"})
"""The fields of a picker that reads its InferencePool from the API server."""
HANDED_FIELDS: Final = frozenset({"endpoints", "pods", "selector"})
"""The fields of a picker the harness hands its endpoints to."""


class Discovery(StrEnum):
    """How the pickers learn their endpoints, which the reports name.

    ``POOL``: each reads its InferencePool and the pods from the harness's
    Kubernetes API server, as GIE's lwepp does in the suite's cluster
    (``--pool-name``), so its selector and target ports are its own work.
    ``HANDED``: the harness computes each pool's endpoints and hands them over
    (a list, or a pod file); the picker's own discovery is not tested.
    """

    POOL = "pool"
    HANDED = "handed"

    def describe(self) -> str:
        if self is Discovery.POOL:
            return (
                "each picker read its InferencePool and the pods from the harness's Kubernetes "
                "API server, as in a cluster"
            )
        return (
            "each picker was handed its pool's endpoints by the harness (pods × target ports), "
            "so its own discovery was not tested"
        )


SWITCHYARD: Final = (
    "{python} -m lwepp --pool-name {pool} --pool-namespace {namespace} --kubeconfig {kubeconfig} "
    "--host {host} --grpc-port {grpc_port} --grpc-health-port {health_port} "
    "--metrics-port {metrics_port} --secure-serving={secure_serving} --log-level info "
    "--enable-test-selection-header --report-served-endpoint"
)
"""Switchyard's LWEPP, as GIE's manifests run lwepp: ``--pool-name`` and ``--pool-namespace``
(it reads the pool and its pods from the API server), GIE's ports, TLS unless the run is
plaintext. GIE's tests pin replicas with ``test-epp-endpoint-selection`` and read
``x-conformance-test-served-endpoint``, two things GIE's lwepp always does and Switchyard does
only when asked: the last two flags turn them on."""

SWITCHYARD_HANDED: Final = (
    "{python} -m lwepp --pods {pods} --selector {selector} --host {host} "
    "--grpc-port {grpc_port} --grpc-health-port {health_port} --metrics-port {metrics_port} "
    "--secure-serving={secure_serving} --log-level info "
    "--enable-test-selection-header --report-served-endpoint"
)
"""The same LWEPP handed its endpoints as a pod file, as a picker that cannot read the API
would be run."""

ONE_HOP: Final = (
    'sh -c \'exec "$0" -m onehop --pods "$1" --pool-label app --pool "${{2#app=}}=*" '
    '--host "$3" --grpc-port "$4" --grpc-health-port "$5" --metrics-port "$6" '
    '--secure-serving="$7" --enable-test-selection-header --report-served-endpoint '
    "--log-level info' "
    "{python} {pods} {selector} {host} {grpc_port} {health_port} {metrics_port} {secure_serving}"
)
"""Switchyard's one-hop service (``onehop``: BBR's chain, then the pick) as each pool's
picker, taking any model (``--pool NAME=*``, NAME the pool's ``app`` label, which the shell cuts
from ``{selector}``). The suite's gateway routes by HTTPRoute, so its one ext_proc filter per pool
is the one hop: the tests then check the pick, and the model header rides along. It reads pod
files only, so it is handed its endpoints."""


class TemplateError(ValueError):
    """A picker template that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class PickerCommand:
    """A checked picker template, ready to be filled in for each pool; ``discovery``: how the
    pickers it starts learn their endpoints, from the fields it names."""

    template: str
    words: tuple[str, ...]
    discovery: Discovery

    @classmethod
    def parse(cls, template: str, extra: Sequence[str] = ()) -> PickerCommand:
        """Check ``template`` (and ``extra`` words appended to it); raise ``TemplateError``."""
        try:
            words = (*shlex.split(template), *extra)
        except ValueError as error:  # an unclosed quote
            raise TemplateError(f"picker template {template!r}: {error}") from None
        if not words:
            raise TemplateError("picker template is empty")
        used = {field for word in words for field in _check(word)}
        shown = " ".join([template, *(shlex.quote(word) for word in extra)])
        return cls(shown, words, _discovery(shown, used))

    def argv(self, values: Mapping[str, str]) -> list[str]:
        """The command for one pool: every field filled in."""
        return [word.format_map(values) for word in self.words]


def _discovery(template: str, used: set[str]) -> Discovery:
    """The mode the fields name: the API server's, or the harness's endpoints; not both."""
    reads, handed = used & POOL_FIELDS, used & HANDED_FIELDS
    if reads and handed:
        fields = ", ".join(f"{{{name}}}" for name in sorted(handed))
        raise TemplateError(
            f"picker template {template!r}: {{kubeconfig}} (the picker reads its InferencePool) "
            f"and {fields} (the harness hands it its endpoints) exclude each other"
        )
    if reads:
        return Discovery.POOL
    if used & {"endpoints", "pods"}:
        return Discovery.HANDED
    raise TemplateError(
        f"picker template {template!r}: the picker cannot learn its endpoints; name "
        "{kubeconfig} (it reads its InferencePool from the harness's API server) or "
        "{endpoints} or {pods} (the harness hands them over)"
    )


def _check(word: str) -> list[str]:
    """The fields in ``word``; each must be known, without conversion or format spec."""
    try:
        parts = list(string.Formatter().parse(word))
    except ValueError as error:  # a lone { or }
        hint = "write {{ or }} for a literal brace"
        raise TemplateError(f"picker template word {word!r}: {error} ({hint})") from None
    fields = []
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
        fields.append(field)
    return fields
