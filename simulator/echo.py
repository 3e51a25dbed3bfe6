"""The Gateway API conformance echo (echo-basic) as a replica answers it, over either protocol.

A pod port serves the echo through aiohttp (``simulator.server``: every path
the OpenAI API does not take) or, on an h2c port, through ``simulator.h2c``'s
own HTTP/2 server. Both take the echo's JSON and the headers stamped on every
response from ``EchoBasic``, so the two answer alike, and the h2c server needs
nothing from the aiohttp one (which starts it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from pods.model import Pod, join_host_port

ECHO_HTTP_PORT: Final = 3000
"""echo-basic's HTTP port when its ``HTTP_PORT`` is not set."""

_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
_FRAMING: Final = frozenset({"content-length", "transfer-encoding", "connection"})


def _canonical(name: str) -> str:
    """Go's canonical header form (``x-gateway-model-name`` → ``X-Gateway-Model-Name``).

    The conformance echo server is written in Go, whose ``http.Header`` keys
    look like this; the echo JSON uses the same keys so tests written for it
    pass unchanged.
    """
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def echo_set_headers(values: Iterable[str]) -> dict[str, str]:
    """The response headers asked for by ``X-Echo-Set-Header`` values.

    As echo-basic does: each value is split on ``,``, each item cut at the
    first ``:`` into a name and a value, and a name given twice gets its
    values joined with ``,``. Items without a valid header name, and the
    headers that frame the HTTP message itself, are ignored.
    """
    headers: dict[str, str] = {}
    for value in values:
        for item in value.split(","):
            name, _, text = item.strip().partition(":")
            name, text = name.strip(), text.strip()
            if _HEADER_NAME.fullmatch(name) and name.lower() not in _FRAMING:
                headers[name] = f"{headers[name]},{text}" if name in headers else text
    return headers


@dataclass(frozen=True, slots=True)
class EchoBasic:
    """One replica's echo: who it says it is, in its JSON and in the headers it stamps."""

    pod: Pod
    port: int
    """The replica's own port: echo-basic's ``httpPort`` unless an answer names another."""
    namespace: str = ""
    """What the echo reports as the pod's namespace (echo-basic's NAMESPACE)."""

    @property
    def endpoint(self) -> str:
        """``ip:port``, as ``x-sim-endpoint`` reports it."""
        return join_host_port(self.pod.address, self.port)

    def body(
        self,
        method: str,
        path: str,
        host: str,
        proto: str,
        request_headers: Iterable[tuple[str, str]],
        *,
        http_port: int | None = None,
    ) -> dict[str, Any]:
        """echo-basic's JSON for one request, whatever the HTTP version it came over.

        ``httpPort`` is echo-basic's HTTP port (its ``HTTP_PORT``): this
        replica's port, unless ``http_port`` names another (an h2c port
        reports its pod's HTTP port, as echo-basic's does).
        """
        headers: dict[str, list[str]] = {}
        for name, value in request_headers:
            if name.lower() != "host":  # Go moves Host out of the header map
                headers.setdefault(_canonical(name), []).append(value)
        return {
            "path": path,
            "host": host,
            "method": method,
            "proto": proto,
            "headers": headers,
            "namespace": self.namespace,
            "ingress": "",
            "service": "",
            "pod": self.pod.name,
            "httpPort": str(self.port if http_port is None else http_port),
        }

    def stamp_headers(
        self, request_headers: Iterable[tuple[str, str]], model: str | None = None
    ) -> list[tuple[str, str]]:
        """The headers every response carries, given the request's (and the model its body
        named): identity, the model, received, echoed (``simulator.server``'s module docstring)."""
        request_headers = list(request_headers)
        stamp = [("x-sim-pod", self.pod.name), ("x-sim-endpoint", self.endpoint)]
        if model is not None:
            stamp.append(("x-sim-served-model", model))
        stamp += [
            (f"x-sim-received-{name.lower()}", value)
            for name, value in request_headers
            if name.lower().startswith(("x-gateway-", "x-conformance-"))
        ]
        asked = [value for name, value in request_headers if name.lower() == "x-echo-set-header"]
        return stamp + list(echo_set_headers(asked).items())
