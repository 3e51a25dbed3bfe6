"""The gateway's Envoy bootstrap, built from Envoy's typed API (envoy-data-plane).

One listener, one HTTP connection manager (HCM), and this filter chain::

    client ─► strip-client-routing ─► bbr ─► lwepp-<pool>… ─► served-endpoint ─► router ─► replica
    client ◄──────────────────────── bbr ◄─ lwepp-<pool>… ◄─ served-endpoint ◄─ router ◄─ replica

Requests pass the filters top to bottom and responses bottom to top, so the
filter placed just before the router is the first to see the response.

1. ``bbr`` (ext_proc) reads the OpenAI body and sets ``x-gateway-model-name``;
   it clears the route cache, so Envoy matches the routes again, now by model.
2. ``lwepp-<pool>`` (ext_proc, one per pool) runs only on its pool's routes:
   the endpoint picker names ``ip:port`` in ``x-gateway-destination-endpoint``,
   and the pool's ORIGINAL_DST cluster connects there.
3. ``served-endpoint`` turns a response header the routes add from
   ``%UPSTREAM_HOST%`` into ``envoy.lb`` dynamic metadata, which the picker
   reads with the response headers: the GIE protocol's "the data plane
   reports the endpoint that actually served the request".

Some answers come from the gateway itself, without calling any service:
``/health`` (200, empty, as vLLM answers it); and, as OpenAI-style JSON
errors or lists (``wire.exchange.error_body``), ``GET /v1/models`` and
``/v1/models/{id}`` (the union of the models the pools serve) and the 404s
for a model no pool serves; and Envoy's own failures (a replica that
refuses connections, a service that is down), rewritten by the HCM's
``local_reply_config``.

The module aliases follow Envoy's type names (``cluster.Cluster`` is
``envoy.config.cluster.v3.Cluster``), so each object can be looked up in
Envoy's API reference under the same name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import betterproto2
from envoy_data_plane.envoy.config.accesslog import v3 as accesslog
from envoy_data_plane.envoy.config.bootstrap import v3 as bootstrap_
from envoy_data_plane.envoy.config.cluster import v3 as cluster
from envoy_data_plane.envoy.config.common.mutation_rules import v3 as mutation_rules
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.config.endpoint import v3 as endpoint
from envoy_data_plane.envoy.config.listener import v3 as listener
from envoy_data_plane.envoy.config.route import v3 as route
from envoy_data_plane.envoy.extensions.access_loggers.file import v3 as file_log
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel import v3 as cel
from envoy_data_plane.envoy.extensions.filters.http.ext_proc import v3 as ext_proc
from envoy_data_plane.envoy.extensions.filters.http.header_mutation import v3 as header_mutation
from envoy_data_plane.envoy.extensions.filters.http.header_to_metadata import v3 as to_metadata
from envoy_data_plane.envoy.extensions.filters.http.router import v3 as router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import v3 as hcm
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts import v3 as previous_hosts
from envoy_data_plane.envoy.extensions.transport_sockets.raw_buffer import v3 as raw_buffer
from envoy_data_plane.envoy.extensions.transport_sockets.tls import v3 as tls_v3
from envoy_data_plane.envoy.extensions.upstreams.http import v3 as upstream_http
from envoy_data_plane.envoy.type import v3 as types
from envoy_data_plane.envoy.type.matcher import v3 as matcher
from envoy_data_plane.google.protobuf import Any as AnyMessage
from envoy_data_plane.google.protobuf import Struct

from wire.exchange import error_body

MODEL_HEADER: Final = "x-gateway-model-name"
"""Set by BBR from the body's ``model``; the routes match on it (GIE's BBR guide)."""

ENDPOINT_HEADER: Final = "x-gateway-destination-endpoint"
"""Set by the picker to the chosen ``ip:port`` (GIE endpoint picker protocol)."""

SERVED_KEY: Final = "x-gateway-destination-endpoint-served"
"""``envoy.lb`` metadata key for the endpoint that really served the request."""

HEALTH_SERVICE: Final = "inference-extension"
"""The gRPC health service GIE's picker reports and its Kubernetes probes ask for."""

ROUTE_TIMEOUT: Final = timedelta(seconds=300)
"""Whole-response timeout, as GIE's InferencePool HTTPRoute: room for long streams."""

MODELS_PATH: Final = "/v1/models"
"""OpenAI's model list (``GET``); ``/v1/models/{id}`` is one model's card."""

HEALTH_PATH: Final = "/health"
"""Where vLLM, SGLang and their routers answer 200 when up; load generators ask it first."""

MESSAGE_TIMEOUT: Final = timedelta(seconds=2)
"""How long Envoy waits for an ext_proc reply it times (Envoy's default is 200 ms).

Envoy does not time the messages of a FULL_DUPLEX_STREAMED body, where the
processor may hold the headers until the body ends. What is timed here is
the picker's reply to the response headers; ``KEEPALIVE`` notices a hung service.
A request without a body would be answered at its headers, a timed message,
but behind BBR no such request reaches a pool's picker (it names no model).
"""

STREAM_IDLE_TIMEOUT: Final = timedelta(seconds=300)
"""How long a request may go without a byte either way: Envoy's default, set here because it
is the one Envoy timer that runs while a request waits in a picker's flow control.

Measured against this Envoy (a picker holding a request, each timer shortened in turn): the
picker's held headers reply is not timed (``MESSAGE_TIMEOUT``, full duplex), and the route's
``timeout`` (``ROUTE_TIMEOUT``) starts only when the picker lets the request go, but a
request held silent this long is answered 504 ``StreamIdleTimeout`` and its ext_proc streams
reset (the picker then frees its place: ``rejected-context-cancelled``). A flow-control
configuration's ``defaultRequestTTL`` and ``noEndpointRequestTTL`` must stay below it
(``tests/test_envoy_config.py`` checks the demo's), so the picker answers first, with its
reason.
"""

KEEPALIVE: Final = timedelta(seconds=5)
"""How often Envoy pings each ext_proc service's HTTP/2 connection, and how long it
waits for the answer before closing it.

Envoy does not time a FULL_DUPLEX_STREAMED exchange (``MESSAGE_TIMEOUT``), so a
service that hangs with its connection open (stopped, or stuck outside the
event loop) would hold the requests it has until Envoy's 5-minute stream
idle timeout. An unanswered ping closes the connection within two of these:
those requests then fail as when the service dies (503 ``ext_proc_error``, or
the FailOpen route), and health checks keep new ones away.

The services must welcome these pings on a *quiet* stream too: a picker that
hears the response has nothing to send while the model server works on a
non-streamed answer, and gRPC's default policy takes three pings in that
state for abuse (GOAWAY "too_many_pings": every request on the connection
fails). They accept a ping every ``serving.server.MIN_PING_INTERVAL_MS`` (1 s);
Envoy adds up to 15% jitter to the interval, never subtracts, so a keepalive
of 1 s or more is always welcome. ``Gateway.keepalive`` changes it (tests).
"""

PICKER_CONNECT_TIMEOUT: Final = timedelta(milliseconds=250)
"""How long Envoy waits to connect to one of several pickers before trying another.

On one node a dead picker's port refuses at once; in a cluster a vanished pod's
address may drop the connection attempt silently, and every request handed to it
waits this long before the retry (``FAILOVER_RETRY``) sends its stream elsewhere.
A live picker on the pod network answers in well under a millisecond.
"""

FAILOVER_RETRY: Final = "connect-failure,refused-stream,reset,unavailable"
"""When Envoy opens a request's ext_proc stream again on another picker of the pool.

``GrpcService.retry_policy`` (Envoy 1.40's gRPC async client applies it to the
streams it starts, and ext_proc asks it to buffer what it sent for a retry): a
stream whose connection is refused, reset before the picker answered anything,
or closed ``UNAVAILABLE`` is replayed, its buffered messages included, to a host
it has not tried (``previous_hosts``). A stream the picker already answered
(its headers reply sent) cannot be retried: Envoy acted on the answer. So a
request is lost only if its picker dies between answering and the response's
end, the streams in flight on it.
"""

CONCURRENCY_LIMIT: Final = 100_000
"""Each cluster's circuit breakers: connections, pending and concurrent requests, retries.

Envoy's default is 1,024 of each per cluster, and every request is one stream
to BBR's cluster and one to the picker's: past 1,024 requests in flight Envoy
would refuse the rest with 503 (``upstream_rq_active_overflow``) before any
service saw them. The gateway is meant to queue them instead, as the peers do;
the model servers' own queues are where load should show.
"""


@dataclass(frozen=True, slots=True)
class GatewayPool:
    """One InferencePool as the gateway sees it.

    ``models``: the values of ``x-gateway-model-name`` routed here.
    ``picker_port`` / ``health_port``: its LWEPP's ext_proc and gRPC health ports.
    ``endpoints``: its replicas (``ip:port``), for FailOpen traffic.
    ``fail_open``: GIE's ``failureMode: FailOpen`` (the default is FailClose).
    ``response_headers``: send the picker the response headers (GIE's reference
    gateway always does); False when the picker says it needs none.
    ``response_body``: stream the response body through the picker too (its
    request controls read or rewrite it: ``lwepp.picking.RequestControl``).
    """

    name: str
    models: tuple[str, ...]
    picker_port: int
    health_port: int | None = None
    endpoints: tuple[str, ...] = ()
    fail_open: bool = False
    response_headers: bool = True
    response_body: bool = False
    more_pickers: tuple[tuple[int, int | None], ...] = ()
    """More replicas of its picker (ext_proc port, health port): hosts of the same cluster."""


@dataclass(frozen=True, slots=True)
class Gateway:
    """Everything the bootstrap depends on; port 0 lets the OS choose.

    ``created``: the ``created`` time (Unix seconds) of the models ``/v1/models``
    lists, as OpenAI's model objects carry one: when the gateway was configured.
    """

    port: int
    admin_port: int
    bbr_port: int
    pools: tuple[GatewayPool, ...]
    host: str = "127.0.0.1"
    access_log: str | None = None
    created: int = 0
    tls: bool = True
    """Dial BBR and the pickers over TLS (they serve it by default, as GIE's lwepp)."""
    one_hop_port: int | None = None
    """The one-hop service's port (``onehop``): one ext_proc filter in place of BBR
    and the pickers (``bbr_port`` and the pools' picker ports are then unused)."""
    one_hop_response_headers: bool = True
    """Send the one-hop service the response headers (``GatewayPool.response_headers``)."""
    one_hop_response_body: bool = False
    """Stream the response body through the one-hop service (``GatewayPool.response_body``)."""
    keepalive: timedelta = KEEPALIVE
    """The ext_proc connections' PING interval and timeout (``KEEPALIVE``)."""
    bbr_response: bool = False
    """Send BBR the response too (it runs response plugins: ``bbr_filter``)."""


def _any(message: betterproto2.Message) -> AnyMessage:
    """A ``typed_config``: the message plus its ``@type`` URL, which selects the extension."""
    return AnyMessage.pack(message)


def _address(host: str, port: int) -> core.Address:
    return core.Address(socket_address=core.SocketAddress(address=host, port_value=port))


# --- clusters: where Envoy connects --------------------------------------------------


def _endpoint(host: str, port: int, health_port: int | None = None) -> endpoint.LbEndpoint:
    health = endpoint.EndpointHealthCheckConfig(port_value=health_port) if health_port else None
    return endpoint.LbEndpoint(
        endpoint=endpoint.Endpoint(address=_address(host, port), health_check_config=health)
    )


def _static_cluster(name: str, endpoints: Sequence[endpoint.LbEndpoint]) -> cluster.Cluster:
    """A fixed list of endpoints, balanced round-robin (Envoy's default ``lb_policy``)."""
    return cluster.Cluster(
        name=name,
        type=cluster.ClusterDiscoveryType.STATIC,
        connect_timeout=timedelta(seconds=1),
        circuit_breakers=circuit_breakers(),
        load_assignment=endpoint.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint.LocalityLbEndpoints(lb_endpoints=list(endpoints))],
        ),
    )


def circuit_breakers() -> cluster.CircuitBreakers:
    """Every limit at ``CONCURRENCY_LIMIT``, for the default priority (the only one used)."""
    limit = CONCURRENCY_LIMIT
    return cluster.CircuitBreakers(
        thresholds=[
            cluster.CircuitBreakersThresholds(
                max_connections=limit,
                max_pending_requests=limit,
                max_requests=limit,
                max_retries=limit,
            )
        ]
    )


def grpc_cluster(
    name: str,
    host: str,
    port: int,
    health_port: int | None = None,
    *,
    tls: bool = False,
    keepalive: timedelta = KEEPALIVE,
    more: Sequence[tuple[int, int | None]] = (),
) -> cluster.Cluster:
    """An ext_proc service: gRPC, hence HTTP/2 (Envoy speaks HTTP/1.1 upstream unless told).

    ``more``: more replicas of it on ``host`` (port, health port), hosts of the one
    cluster as a gateway lists a picker Service's endpoints: Envoy's round-robin hands
    each request's stream to one of them, and the health check takes a dead one out.

    With ``tls``, Envoy dials the service over TLS (``upstream_tls``), as gateways
    dial GIE's pickers, which serve TLS by default; its health checks still go
    to the plaintext health port (``plaintext_health``).

    With ``health_port``, Envoy asks the service's gRPC health endpoint (its
    own port, as GIE's picker serves it) every second. That is what makes
    FailOpen work with a FULL_DUPLEX_STREAMED body: Envoy 1.40's ext_proc
    ignores ``failure_mode_allow`` once body bytes went into the stream
    (``Filter::failureModeAllow``), and a refused connection is noticed only
    after that. A cluster with no healthy host fails the stream at once,
    before any body, like GIE's conformance test, which takes the picker's
    Service down to zero endpoints. ``healthy_panic_threshold: 0`` stops
    Envoy from "panicking" and trying the unhealthy host anyway.
    """
    hosts = [(port, health_port), *more]
    result = _static_cluster(name, [_endpoint(host, p, h) for p, h in hosts])
    result.typed_extension_protocol_options = http2_upstream(
        core.KeepaliveSettings(interval=keepalive, timeout=keepalive)
    )
    if health_port:
        second = timedelta(seconds=1)
        check = core.HealthCheck(
            timeout=second,
            interval=second,
            no_traffic_interval=second,  # default 60 s while the cluster carries no traffic
            unhealthy_threshold=1,
            healthy_threshold=1,
            grpc_health_check=core.HealthCheckGrpcHealthCheck(service_name=HEALTH_SERVICE),
        )
        result.health_checks = [check]
        result.common_lb_config = cluster.ClusterCommonLbConfig(
            healthy_panic_threshold=types.Percent(value=0)
        )
    if more:
        # A replica killed between two health checks fails the streams it is handed (FailClose
        # answers them 503): eject a host at its first failed stream (a refused connection is
        # one), for as long as the health check takes to confirm it (it readmits the host).
        # Split: a refused or reset connection is a local-origin failure, counted apart from
        # the replica's own answers (its 5xx), and one of them is enough.
        result.connect_timeout = PICKER_CONNECT_TIMEOUT
        result.outlier_detection = cluster.OutlierDetection(
            split_external_local_origin_errors=True,
            consecutive_local_origin_failure=1,
            enforcing_consecutive_local_origin_failure=100,
            consecutive_gateway_failure=1,
            enforcing_consecutive_gateway_failure=100,
            base_ejection_time=timedelta(seconds=5),
            max_ejection_percent=50,
            successful_active_health_check_uneject_host=True,
        )
    if tls:
        result.transport_socket = upstream_tls()
        if health_port:
            plaintext_health(result)
    return result


def upstream_tls() -> core.TransportSocket:
    """TLS to the service, trusting whatever certificate it presents.

    No ``validation_context``: the services make a self-signed certificate at
    start that nothing could verify, and GIE's gateways dial its pickers the
    same way (Istio's ``insecureSkipVerify``): the link is encrypted, not
    authenticated. ALPN ``h2``: gRPC over TLS. With certificates of your own
    (``--cert-path``), add a ``validation_context`` with their CA.
    """
    context = tls_v3.UpstreamTlsContext(
        common_tls_context=tls_v3.CommonTlsContext(alpn_protocols=["h2"])
    )
    return core.TransportSocket(name="envoy.transport_sockets.tls", typed_config=_any(context))


PLAINTEXT: Final = {"transport": "plaintext"}
"""The match criteria that select a cluster's plaintext transport socket."""


def plaintext_health(result: cluster.Cluster) -> None:
    """Health-check a TLS cluster's hosts on their plaintext health port.

    A health check connects with the cluster's transport socket unless its
    ``transport_socket_match_criteria`` picks another from the cluster's
    ``transport_socket_matches`` (Envoy's documented way to check a plaintext
    port of a TLS service): the health port speaks no TLS, for kubelet's sake.
    """
    raw = core.TransportSocket(
        name="envoy.transport_sockets.raw_buffer", typed_config=_any(raw_buffer.RawBuffer())
    )
    result.transport_socket_matches = [
        cluster.ClusterTransportSocketMatch(
            name="plaintext-health", match=Struct.from_dict(PLAINTEXT), transport_socket=raw
        )
    ]
    for check in result.health_checks:
        check.transport_socket_match_criteria = Struct.from_dict(PLAINTEXT)


def http2_upstream(keepalive: core.KeepaliveSettings | None = None) -> dict[str, AnyMessage]:
    """A cluster's ``typed_extension_protocol_options`` for HTTP/2 to its hosts.

    HTTP/2 from the first byte ("prior knowledge"), without TLS: what gRPC
    needs, and what an ``appProtocol: kubernetes.io/h2c`` InferencePool asks
    for its model servers. ``keepalive``: Envoy's PINGs on each connection.
    """
    http2 = upstream_http.HttpProtocolOptions(
        explicit_http_config=upstream_http.HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=core.Http2ProtocolOptions(connection_keepalive=keepalive)
        )
    )
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(http2)}


def picked_endpoint_cluster(pool: GatewayPool) -> cluster.Cluster:
    """Connect to whatever ``ip:port`` the picker wrote in ``x-gateway-destination-endpoint``.

    ORIGINAL_DST with ``use_http_header`` is how GIE's reference Envoy follows
    the picker: the cluster has no endpoint list, the header is the whole
    load-balancing decision (so ``lb_policy`` must be CLUSTER_PROVIDED).
    Without the header Envoy finds no host and answers 503.
    """
    return cluster.Cluster(
        name=f"pool-{pool.name}",
        type=cluster.ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=cluster.ClusterLbPolicy.CLUSTER_PROVIDED,
        connect_timeout=timedelta(seconds=2),
        circuit_breakers=circuit_breakers(),
        original_dst_lb_config=cluster.ClusterOriginalDstLbConfig(
            use_http_header=True, http_header_name=ENDPOINT_HEADER
        ),
    )


def _host_port(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def fallback_cluster(pool: GatewayPool) -> cluster.Cluster:
    """A FailOpen pool's replicas, which Envoy round-robins itself while the picker is down."""
    replicas = [_endpoint(*_host_port(e)) for e in pool.endpoints]
    return _static_cluster(f"pool-{pool.name}-fallback", replicas)


def clusters(gateway: Gateway) -> list[cluster.Cluster]:
    """BBR, and per pool: its picker, its picked endpoints, and for FailOpen its replicas.

    One hop: the one service instead of BBR and the pickers.
    """
    host, tls, keepalive = gateway.host, gateway.tls, gateway.keepalive
    if gateway.one_hop_port is not None:
        result = [grpc_cluster(ONE_HOP, host, gateway.one_hop_port, tls=tls, keepalive=keepalive)]
        for pool in gateway.pools:
            result.append(picked_endpoint_cluster(pool))
            if pool.fail_open:
                result.append(fallback_cluster(pool))
        return result
    result = [grpc_cluster("bbr", host, gateway.bbr_port, tls=tls, keepalive=keepalive)]
    for pool in gateway.pools:
        picker = grpc_cluster(
            f"lwepp-{pool.name}",
            host,
            pool.picker_port,
            pool.health_port,
            tls=tls,
            keepalive=keepalive,
            more=pool.more_pickers,
        )
        result.append(picker)
        result.append(picked_endpoint_cluster(pool))
        if pool.fail_open:
            result.append(fallback_cluster(pool))
    return result


# --- HTTP filters: what runs on each request ------------------------------------------

_Send = ext_proc.ProcessingModeHeaderSendMode
_Body = ext_proc.ProcessingModeBodySendMode


def _ext_proc(
    name: str,
    mode: ext_proc.ProcessingMode,
    *,
    fail_open: bool,
    retry: core.RetryPolicy | None = None,
    **extra: Any,
) -> hcm.HttpFilter:
    config = ext_proc.ExternalProcessor(
        grpc_service=core.GrpcService(
            envoy_grpc=core.GrpcServiceEnvoyGrpc(cluster_name=name), retry_policy=retry
        ),
        processing_mode=mode,
        # false: an unreachable, failing or slow processor makes Envoy answer an
        # error itself (FailClose); true: the request goes on unprocessed.
        failure_mode_allow=fail_open,
        message_timeout=MESSAGE_TIMEOUT,
        stat_prefix=name,
        **extra,
    )
    return hcm.HttpFilter(name=name, typed_config=_any(config))


def bbr_filter(response: bool = False) -> hcm.HttpFilter:
    """BBR sees the request: headers, the whole body, trailers; and with
    ``response``, the response the same way.

    FULL_DUPLEX_STREAMED (GIE's BBR chart runs ``--streaming``) lets BBR hold
    the headers until it has read the body, then answer them (model header,
    ``clear_route_cache``) and stream the body back. Envoy requires trailer
    mode SEND with that body mode. FailClose, as the chart; an unreachable BBR
    is a 503 (``status_on_error``; Envoy's default is 500). ``response``: BBR
    runs response plugins (it says so when it starts); without any, sending it
    the response would only cost a round trip per chunk.
    """
    response_send, response_body = (
        (_Send.SEND, _Body.FULL_DUPLEX_STREAMED) if response else (_Send.SKIP, _Body.NONE)
    )
    mode = ext_proc.ProcessingMode(
        request_header_mode=_Send.SEND,
        request_body_mode=_Body.FULL_DUPLEX_STREAMED,
        request_trailer_mode=_Send.SEND,
        response_header_mode=response_send,
        response_body_mode=response_body,
        response_trailer_mode=response_send,
    )
    # BBR down is the gateway's trouble, not the request's: 503, as for a picker.
    unavailable = types.HttpStatus(code=types.StatusCode.ServiceUnavailable)
    return _ext_proc("bbr", mode, fail_open=False, status_on_error=unavailable)


def picker_filter(pool: GatewayPool) -> hcm.HttpFilter:
    """The pool's endpoint picker, in the processing mode of GIE's reference Envoy.

    The request side is BBR's (the picker defers its headers reply until the
    body ends). Response headers are sent too, as GIE's reference gateway
    does: they carry the served-endpoint report and end the picker's
    in-flight counts. A picker that needs neither (round-robin without the
    report; ``pool.response_headers`` False) is not sent them: one exchange
    fewer on every response's way to the client, a tenth to a fifth of what
    the hop adds (``docs/benchmarks.md``). The response body is not sent (NONE),
    so a streamed completion flows to the client untouched, unless the picker
    runs a request control that reads or rewrites it (``pool.response_body``):
    then it streams through the picker, FULL_DUPLEX_STREAMED as the request.

    ``metadata_options`` names the dynamic-metadata namespaces that cross the
    stream: Envoy forwards ``envoy.lb`` (the served endpoint) and
    ``envoy.lb.subset_hint`` (the protocol's candidate subset), and accepts
    ``envoy.lb`` back (the picked endpoint).

    An unreachable picker gets a 503 (``status_on_error``; Envoy's default is
    500) on a FailClose pool, and lets the request through on a FailOpen one.
    """
    mode = _picker_mode(pool.response_headers, pool.response_body)
    namespaces = ext_proc.MetadataOptionsMetadataNamespaces
    return _ext_proc(
        f"lwepp-{pool.name}",
        mode,
        fail_open=pool.fail_open,
        retry=failover_retry(len(pool.more_pickers)) if pool.more_pickers else None,
        metadata_options=ext_proc.MetadataOptions(
            forwarding_namespaces=namespaces(untyped=["envoy.lb", "envoy.lb.subset_hint"]),
            receiving_namespaces=namespaces(untyped=["envoy.lb"]),
        ),
        status_on_error=types.HttpStatus(code=types.StatusCode.ServiceUnavailable),
    )


def failover_retry(others: int) -> core.RetryPolicy:
    """A picker stream's retry to each of the ``others`` pickers once (``FAILOVER_RETRY``).

    Without it, a request handed to a picker killed since the last health check
    fails (503 on a FailClose pool) until outlier detection ejects the host, which
    takes that host's first failure on each of Envoy's worker threads.
    """
    return core.RetryPolicy(
        retry_on=FAILOVER_RETRY,
        num_retries=others,
        retry_back_off=core.BackoffStrategy(base_interval=timedelta(milliseconds=5)),
        retry_host_predicate=[
            core.RetryPolicyRetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=_any(previous_hosts.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
    )


ONE_HOP: Final = "onehop"
"""The one-hop filter's name, and its cluster's."""


def _picker_mode(response_headers: bool, response_body: bool = False) -> ext_proc.ProcessingMode:
    """The picker's processing mode; ``response_headers`` False skips the response's headers,
    ``response_body`` streams the response body through it (trailers too, as Envoy requires
    with that mode)."""
    return ext_proc.ProcessingMode(
        request_header_mode=_Send.SEND,
        request_body_mode=_Body.FULL_DUPLEX_STREAMED,
        request_trailer_mode=_Send.SEND,
        response_header_mode=_Send.SEND if response_headers or response_body else _Send.SKIP,
        response_body_mode=_Body.FULL_DUPLEX_STREAMED if response_body else _Body.NONE,
        response_trailer_mode=_Send.SEND if response_body else _Send.SKIP,
    )


def one_hop_filter(response_headers: bool = True, response_body: bool = False) -> hcm.HttpFilter:
    """BBR's job and the picker's in one filter (``onehop``): the picker's processing mode.

    The request body comes FULL_DUPLEX_STREAMED, as to both services: the
    service holds the headers answer until it has read the body, then sends
    the model header and the endpoint together. The response headers come
    too unless ``response_headers`` is False (no pool's picker needs them:
    ``picker_filter``), the response body does not. FailClose, as BBR: there
    is no request it could route without reading the body.
    """
    mode = _picker_mode(response_headers, response_body)
    namespaces = ext_proc.MetadataOptionsMetadataNamespaces
    return _ext_proc(
        ONE_HOP,
        mode,
        fail_open=False,
        metadata_options=ext_proc.MetadataOptions(
            forwarding_namespaces=namespaces(untyped=["envoy.lb", "envoy.lb.subset_hint"]),
            receiving_namespaces=namespaces(untyped=["envoy.lb"]),
        ),
        status_on_error=types.HttpStatus(code=types.StatusCode.ServiceUnavailable),
    )


GATEWAY_ONLY_HEADERS: Final = (
    ENDPOINT_HEADER,
    MODEL_HEADER,
    SERVED_KEY,
    "x-conformance-test-served-endpoint",
    "x-echo-set-header",
)
"""Request headers only the gateway may set, which a client's request loses at the door:
the destination (an ORIGINAL_DST cluster connects wherever it points), the model (routes
match on it; BBR sets it from the body), and the served-endpoint report with the conformance
echo server's request for it (the picker sets that, with ``--report-served-endpoint``)."""


def strip_client_routing_filter() -> hcm.HttpFilter:
    """Drop a client's own ``GATEWAY_ONLY_HEADERS`` before anything reads them.

    First in the chain, so every route sees the request without them: the
    picker's route, where BBR and the picker set them again, and a FailOpen
    pool's fallback with its picker down, where nothing does (otherwise a
    client's ``x-gateway-destination-endpoint`` would go straight to the
    router, and to whatever address it names).
    """
    removals = [mutation_rules.HeaderMutation(remove=name) for name in GATEWAY_ONLY_HEADERS]
    config = header_mutation.HeaderMutation(
        mutations=header_mutation.Mutations(request_mutations=removals)
    )
    return hcm.HttpFilter(name="strip-client-routing", typed_config=_any(config))


def served_endpoint_filter() -> hcm.HttpFilter:
    """Move the served-endpoint response header into ``envoy.lb`` metadata, and drop it.

    The virtual host adds that header from ``%UPSTREAM_HOST%``, the address
    the router really connected to, as the response arrives. This filter sits
    after the pickers, so on the way back it runs before them and their
    ``metadata_context`` carries the value.
    """
    rule = to_metadata.ConfigRule(
        header=SERVED_KEY,
        on_header_present=to_metadata.ConfigKeyValuePair(
            metadata_namespace="envoy.lb", key=SERVED_KEY
        ),
        remove=True,
    )
    config = to_metadata.Config(response_rules=[rule])
    return hcm.HttpFilter(name="served-endpoint", typed_config=_any(config))


def http_filters(gateway: Gateway) -> list[hcm.HttpFilter]:
    """The chain in request order; the router, which sends upstream, is last.

    One hop: the one-hop filter where BBR and the pickers would be.
    """
    processors = (
        [one_hop_filter(gateway.one_hop_response_headers, gateway.one_hop_response_body)]
        if gateway.one_hop_port is not None
        else [bbr_filter(gateway.bbr_response), *map(picker_filter, gateway.pools)]
    )
    return [
        strip_client_routing_filter(),
        *processors,
        served_endpoint_filter(),
        hcm.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router.Router())),
    ]


# --- routes: where each request goes ------------------------------------------------


def _header(name: str, exact: str | None = None) -> route.HeaderMatcher:
    """Header ``name`` is present, or, with ``exact``, equals it."""
    if exact is None:
        return route.HeaderMatcher(name=name, present_match=True)
    return route.HeaderMatcher(name=name, string_match=matcher.StringMatcher(exact=exact))


def pickers_off(pools: Sequence[GatewayPool]) -> dict[str, AnyMessage]:
    """Virtual-host default: every pool's picker is switched off."""
    off = _any(ext_proc.ExtProcPerRoute(disabled=True))
    return {f"lwepp-{pool.name}": off for pool in pools}


def picker_on(pool: GatewayPool) -> dict[str, AnyMessage]:
    """On this pool's routes, switch its picker back on.

    A set of ``overrides`` on a route, even an empty one, beats a ``disabled``
    from the virtual host (ExtProcPerRoute's documented merge). ext_proc reads
    it when its own turn comes, after BBR set the model header and the routes
    were matched again. The HCM's ``disabled`` flag with a per-route
    ``FilterConfig`` would not do: it is settled when the filter chain is
    built, on the route matched before BBR ran (a 404), and a later re-match
    cannot add a filter back (``FilterConfig.disabled`` docs; tried in 1.40).
    """
    return {
        f"lwepp-{pool.name}": _any(ext_proc.ExtProcPerRoute(overrides=ext_proc.ExtProcOverrides()))
    }


def _to_cluster(
    pool: GatewayPool, name: str, match: list[route.HeaderMatcher], target: str, one_hop: bool
) -> route.Route:
    return route.Route(
        name=name,
        match=route.RouteMatch(prefix="/", headers=match),
        route=route.RouteAction(cluster=target, timeout=ROUTE_TIMEOUT),
        typed_per_filter_config={} if one_hop else picker_on(pool),
    )


def _pool_routes(pool: GatewayPool, one_hop: bool = False) -> list[route.Route]:
    """Per model, a route to the picked endpoint; FailOpen pools get a fallback too.

    GIE FailOpen: when the picker is unavailable, the gateway picks an
    endpoint itself. The first route then requires the picker's header; the
    second takes the requests that came through without one and round-robins
    them over the pool's replicas.
    """
    routes = []
    for model in pool.models:
        by_model = _header(MODEL_HEADER, model)
        picked = [by_model, _header(ENDPOINT_HEADER)] if pool.fail_open else [by_model]
        target = f"pool-{pool.name}"
        routes.append(_to_cluster(pool, f"{pool.name}/{model}", picked, target, one_hop))
        if pool.fail_open:
            fallback = f"pool-{pool.name}-fallback"
            name = f"{pool.name}/{model}/fail-open"
            routes.append(_to_cluster(pool, name, [by_model], fallback, one_hop))
    return routes


def _not_found(
    name: str,
    message: str,
    match: route.RouteMatch,
    per_filter: dict[str, AnyMessage] | None = None,
) -> route.Route:
    """A 404 the gateway answers itself: an OpenAI-style error, code ``model_not_found``.

    ``json_format`` escapes what the formatters insert (the client's model
    name), so the body is always valid JSON.
    """
    body = error_body(404, message, "model_not_found")
    return route.Route(
        name=name,
        match=match,
        direct_response=route.DirectResponseAction(
            status=404,
            body_format=core.SubstitutionFormatString(json_format=Struct.from_dict(body)),
        ),
        typed_per_filter_config=per_filter or {},
    )


def model_card(model: str, pool: GatewayPool, created: int) -> dict[str, object]:
    """One model as OpenAI's ``/v1/models`` lists it; ``owned_by`` names the pool serving it."""
    return {"id": model, "object": "model", "created": created, "owned_by": pool.name}


def _json_answer(
    name: str, match: route.RouteMatch, body: object, front: str = "bbr"
) -> route.Route:
    """A fixed JSON answer (200) from Envoy itself, with BBR switched off on the route.

    The body is a literal (``body``, not a format string), so no character of a
    model name can be taken for a formatter. BBR is switched off because the
    route is chosen by path before any filter runs, and nothing on it needs
    the body read; a model list then answers even while BBR is down.
    """
    content_type = core.HeaderValueOption(
        header=core.HeaderValue(key="content-type", value="application/json"),
        append_action=core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    return route.Route(
        name=name,
        match=match,
        direct_response=route.DirectResponseAction(
            status=200, body=core.DataSource(inline_string=json.dumps(body))
        ),
        response_headers_to_add=[content_type],
        typed_per_filter_config=bbr_off(front),
    )


def bbr_off(front: str = "bbr") -> dict[str, AnyMessage]:
    """A route's ``typed_per_filter_config`` that switches BBR (or the one hop: ``front``) off."""
    return {front: _any(ext_proc.ExtProcPerRoute(disabled=True))}


def model_routes(
    pools: Sequence[GatewayPool], created: int, front: str = "bbr"
) -> list[route.Route]:
    """``GET /v1/models``: the union of the pools' models; ``/v1/models/{id}``: one of them.

    What clients ask first (the OpenAI SDK's ``models.list()``, LiteLLM's
    ``get_valid_models``). The gateway knows exactly which models it routes,
    the pools' routes, so it answers from them. An id with ``/`` in it (a
    Hugging Face name) is matched as sent and percent-encoded; any other
    ``/v1/models/...`` is a 404 naming the path.
    """
    cards = [model_card(model, pool, created) for pool in pools for model in pool.models]
    routes = [
        _json_answer(
            "models", route.RouteMatch(path=MODELS_PATH), {"object": "list", "data": cards}, front
        )
    ]
    for card in cards:
        model = str(card["id"])
        for path in dict.fromkeys((model, quote(model, safe=""))):
            match = route.RouteMatch(path=f"{MODELS_PATH}/{path}")
            routes.append(_json_answer(f"models/{path}", match, card, front))
    unknown = (
        f"no pool serves the model this path names, '%PATH(NQ)%' (GET {MODELS_PATH} lists them)"
    )
    match = route.RouteMatch(prefix=f"{MODELS_PATH}/")
    routes.append(_not_found("models/unknown", unknown, match, bbr_off(front)))
    return routes


def health_route(front: str = "bbr") -> route.Route:
    """``/health``: 200 with an empty body, from Envoy itself, as vLLM answers it.

    Benchmark clients ask it before they start (guidellm's backend check is a
    ``GET /health``, and stops the run on anything but 2xx); vLLM, SGLang,
    vllm-router and sglang-router all serve it. Here it says the gateway is up
    and routing: it calls no service and names no replica. Whether each
    pool has replicas to pick is its picker's to say (its gRPC health, its
    ``ready_endpoints`` gauge); a model's own requests get 503 when none is.
    """
    return route.Route(
        name="health",
        match=route.RouteMatch(path=HEALTH_PATH),
        direct_response=route.DirectResponseAction(status=200),
        typed_per_filter_config=bbr_off(front),
    )


def served_endpoint_header() -> core.HeaderValueOption:
    """For a virtual host's ``response_headers_to_add``: the address that really served.

    ``%UPSTREAM_HOST%`` is the ``ip:port`` the router connected to; the
    ``served-endpoint`` filter moves it into ``envoy.lb`` metadata.
    """
    return core.HeaderValueOption(
        header=core.HeaderValue(key=SERVED_KEY, value="%UPSTREAM_HOST%"),
        # Overwrite: a replica must not be able to claim another address.
        append_action=core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def route_config(
    pools: Sequence[GatewayPool], created: int = 0, *, one_hop: bool = False
) -> route.RouteConfiguration:
    """``/health``, the model list, the pool routes by model, then the two 404s; Envoy takes
    the first route that matches. ``one_hop``: no picker to switch on or off per route; the
    gateway's own answers switch the one-hop filter off, as they do BBR."""
    front = ONE_HOP if one_hop else "bbr"
    routes = [health_route(front), *model_routes(pools, created, front)]
    routes += [r for pool in pools for r in _pool_routes(pool, one_hop)]
    served = f"GET {MODELS_PATH} lists the served ones"
    unknown = f"no pool serves model '%REQ({MODEL_HEADER})%' ({served})"
    by_model = route.RouteMatch(prefix="/", headers=[_header(MODEL_HEADER)])
    routes.append(_not_found("unknown-model", unknown, by_model))
    no_model = f"the request names no model ({served})"
    routes.append(_not_found("no-model", no_model, route.RouteMatch(prefix="/")))
    gateway = route.VirtualHost(
        name="gateway",
        domains=["*"],
        routes=routes,
        response_headers_to_add=[served_endpoint_header()],
        typed_per_filter_config={} if one_hop else pickers_off(pools),
    )
    return route.RouteConfiguration(name="gateway", virtual_hosts=[gateway])


# --- the gateway's own failures ------------------------------------------------------

EXT_PROC_FAILED: Final = "response.code_details.startsWith('ext_proc_error')"
"""CEL: the answer Envoy gives when an ext_proc service fails (a FailClose picker or
BBR that is down or errs); Envoy's ext_proc filter names it in the response details."""


def _server_status() -> accesslog.AccessLogFilter:
    """Status 500 and above (the runtime key only names the threshold; nothing sets it)."""
    threshold = core.RuntimeUInt32(default_value=500, runtime_key="gateway.server_error_status")
    return accesslog.AccessLogFilter(
        status_code_filter=accesslog.StatusCodeFilter(
            comparison=accesslog.ComparisonFilter(
                op=accesslog.ComparisonFilterOp.GE, value=threshold
            )
        )
    )


def _error_format(status: int, message: str, code: str) -> core.SubstitutionFormatString:
    return core.SubstitutionFormatString(
        json_format=Struct.from_dict(error_body(status, message, code))
    )


def local_replies() -> hcm.LocalReplyConfig:
    """Envoy's own error answers, rewritten as OpenAI-style JSON errors (first match wins).

    1. An ext_proc service failed (its ``failure_mode_allow`` is false): Envoy
       would answer an empty 503. The message names the failure.
    2. Envoy failed on its own (a response flag is set: the picked replica
       refused the connection ``UF``, no healthy host ``UH``, a timeout
       ``UT``...): its text in ``message``, the flag's long name in ``code``;
       ``type`` by the status, as the services' refusals.

    The services' ImmediateResponses (already JSON) and the routes' direct
    answers carry no response flag and no ext_proc failure, so no mapper
    touches them.
    """
    ext_proc_failed = accesslog.AccessLogFilter(
        extension_filter=accesslog.ExtensionFilter(
            name="envoy.access_loggers.extension_filters.cel",
            typed_config=_any(cel.ExpressionFilter(expression=EXT_PROC_FAILED)),
        )
    )
    flagged = accesslog.AccessLogFilter(response_flag_filter=accesslog.ResponseFlagFilter())
    envoy_text, flag = "%LOCAL_REPLY_BODY%", "%RESPONSE_FLAGS_LONG%"
    service_down = (
        "a gateway service (BBR or the pool's endpoint picker) failed: %RESPONSE_CODE_DETAILS%"
    )
    return hcm.LocalReplyConfig(
        mappers=[
            hcm.ResponseMapper(
                filter=ext_proc_failed,
                body_format_override=_error_format(503, service_down, "ext_proc_error"),
            ),
            hcm.ResponseMapper(
                filter=accesslog.AccessLogFilter(
                    and_filter=accesslog.AndFilter(filters=[flagged, _server_status()])
                ),
                body_format_override=_error_format(503, envoy_text, flag),
            ),
            hcm.ResponseMapper(
                filter=flagged, body_format_override=_error_format(400, envoy_text, flag)
            ),
        ]
    )


# --- the whole bootstrap ------------------------------------------------------------


def access_log(path: str) -> accesslog.AccessLog:
    """One JSON line per request: what BBR and the picker decided, and what served it."""
    fields = {
        "time": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH)%",
        "model": f"%REQ({MODEL_HEADER})%",
        "route": "%ROUTE_NAME%",
        "picked": f"%REQ({ENDPOINT_HEADER})%",
        "served": f"%DYNAMIC_METADATA(envoy.lb:{SERVED_KEY})%",
        "status": "%RESPONSE_CODE%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "ms": "%DURATION%",
    }
    log_format = core.SubstitutionFormatString(json_format=Struct.from_dict(fields))
    config = file_log.FileAccessLog(path=path, log_format=log_format)
    return accesslog.AccessLog(name="envoy.access_loggers.file", typed_config=_any(config))


def bootstrap(gateway: Gateway) -> dict[str, Any]:
    """The whole static configuration, as the JSON object ``envoy -c`` reads."""
    one_hop = gateway.one_hop_port is not None
    manager = hcm.HttpConnectionManager(
        stat_prefix="gateway",
        stream_idle_timeout=STREAM_IDLE_TIMEOUT,
        route_config=route_config(gateway.pools, gateway.created, one_hop=one_hop),
        http_filters=http_filters(gateway),
        local_reply_config=local_replies(),
        access_log=[access_log(gateway.access_log)] if gateway.access_log else [],
    )
    network_filter = listener.Filter(
        name="envoy.filters.network.http_connection_manager", typed_config=_any(manager)
    )
    gateway_listener = listener.Listener(
        name="gateway",
        address=_address(gateway.host, gateway.port),
        filter_chains=[listener.FilterChain(filters=[network_filter])],
        # Envoy binds with SO_REUSEPORT by default on Linux: a second gateway on the
        # same port would start and share the connections. Without it, it fails to bind.
        enable_reuse_port=False,
    )
    config = bootstrap_.Bootstrap(
        admin=bootstrap_.Admin(address=_address(gateway.host, gateway.admin_port)),
        static_resources=bootstrap_.BootstrapStaticResources(
            listeners=[gateway_listener], clusters=clusters(gateway)
        ),
    )
    # Snake case, as in Envoy's docs; Envoy reads either spelling.
    return config.to_dict(casing=betterproto2.Casing.SNAKE)


def write_bootstrap(gateway: Gateway, path: Path) -> Path:
    """Write the bootstrap as JSON to ``path``."""
    path.write_text(json.dumps(bootstrap(gateway), indent=2) + "\n")
    return path
