"""The gateway's Envoy bootstrap: accepted by the real Envoy, and holding the pieces the design needs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demo.envoy import STREAM_IDLE_TIMEOUT, Gateway, GatewayPool, bootstrap, write_bootstrap
from demo.topology import free_ports, start_envoy, stop_all, wait_envoy_ready
from lwepp.config import load_config

ENVOY = Path(sys.executable).parent / "envoy"

GATEWAY = Gateway(
    port=8080,
    admin_port=9901,
    bbr_port=9004,
    pools=(
        GatewayPool("a", ("model-a",), picker_port=9002, health_port=9003),
        GatewayPool(
            "b",
            ("model-b", "model-b-lora"),
            picker_port=9012,
            health_port=9013,
            endpoints=("127.0.0.1:8201", "127.0.0.1:8202"),
            fail_open=True,
        ),
    ),
    access_log="/dev/null",
    created=1700000000,
)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return bootstrap(GATEWAY)


def manager(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    result: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return result


def http_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [f for f in manager(config)["http_filters"] if f["name"] == name]
    result: dict[str, Any] = found["typed_config"]
    return result


def routes(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (host,) = manager(config)["route_config"]["virtual_hosts"]
    return {r["name"]: r for r in host["routes"]}


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    result: dict[str, Any] = found
    return result


def headers_of(route: dict[str, Any]) -> dict[str, Any]:
    return {
        h["name"]: h.get("string_match", {}).get("exact", h.get("present_match"))
        for h in route["match"].get("headers", [])
    }


def test_real_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    """``envoy --mode validate`` loads every extension and checks every field and rule."""
    path = write_bootstrap(GATEWAY, tmp_path / "bootstrap.json")
    result = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "OK" in result.stdout


def test_filters_run_bbr_then_pickers_then_served_report_then_router(
    config: dict[str, Any],
) -> None:
    """Responses pass the chain backwards: the served report must sit after the pickers."""
    names = [f["name"] for f in manager(config)["http_filters"]]
    assert names == [
        "strip-client-routing",
        "bbr",
        "lwepp-a",
        "lwepp-b",
        "served-endpoint",
        "envoy.filters.http.router",
    ]


def test_bbr_sees_the_whole_request_and_nothing_of_the_response(config: dict[str, Any]) -> None:
    """BBR's filter streams the request (headers, body, trailers), skips the response and fails closed."""
    bbr = http_filter(config, "bbr")
    assert bbr["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }  # response_body_mode NONE is the default, so JSON leaves it out
    assert bbr.get("failure_mode_allow", False) is False
    assert bbr["grpc_service"]["envoy_grpc"]["cluster_name"] == "bbr"
    assert bbr["message_timeout"] == "2s"


@pytest.mark.parametrize(
    ("pool", "fail_open"), [("a", False), ("b", True)], ids=["FailClose", "FailOpen"]
)
def test_each_picker_follows_gie_reference_mode_and_its_failure_mode(
    config: dict[str, Any], pool: str, fail_open: bool
) -> None:
    """Each picker's filter uses GIE's processing mode and metadata namespaces, failing open or closed as its pool says."""
    picker = http_filter(config, f"lwepp-{pool}")
    assert picker["grpc_service"]["envoy_grpc"]["cluster_name"] == f"lwepp-{pool}"
    assert picker["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_trailer_mode": "SKIP",
    }
    assert picker["metadata_options"] == {
        "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
    }
    assert picker.get("failure_mode_allow", False) is fail_open
    assert picker["status_on_error"] == {"code": "ServiceUnavailable"}


def test_served_endpoint_goes_from_upstream_host_to_envoy_lb_metadata(
    config: dict[str, Any],
) -> None:
    """The upstream host is put in a response header, moved into envoy.lb metadata, and the header removed."""
    (host,) = manager(config)["route_config"]["virtual_hosts"]
    (added,) = host["response_headers_to_add"]
    assert added["header"] == {
        "key": "x-gateway-destination-endpoint-served",
        "value": "%UPSTREAM_HOST%",
    }
    assert added["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
    (rule,) = http_filter(config, "served-endpoint")["response_rules"]
    assert rule["header"] == "x-gateway-destination-endpoint-served"
    assert rule["on_header_present"] == {
        "metadata_namespace": "envoy.lb",
        "key": "x-gateway-destination-endpoint-served",
    }
    assert rule["remove"] is True


def test_client_cannot_set_the_gateways_own_headers(config: dict[str, Any]) -> None:
    """The first filter removes every request header only the gateway may set."""
    mutations = http_filter(config, "strip-client-routing")["mutations"]
    assert mutations["request_mutations"] == [
        {"remove": "x-gateway-destination-endpoint"},
        {"remove": "x-gateway-model-name"},
        {"remove": "x-gateway-destination-endpoint-served"},
        {"remove": "x-conformance-test-served-endpoint"},
        {"remove": "x-echo-set-header"},
    ]


def test_routes_by_model_with_fail_open_fallback_then_404s(config: dict[str, Any]) -> None:
    """Order matters: Envoy takes the first match, so the catch-alls come last."""
    table = routes(config)
    assert list(table) == [
        "health",
        "models",
        "models/model-a",
        "models/model-b",
        "models/model-b-lora",
        "models/unknown",
        "a/model-a",
        "b/model-b",
        "b/model-b/fail-open",
        "b/model-b-lora",
        "b/model-b-lora/fail-open",
        "unknown-model",
        "no-model",
    ]
    assert headers_of(table["a/model-a"]) == {"x-gateway-model-name": "model-a"}
    assert table["a/model-a"]["route"] == {"cluster": "pool-a", "timeout": "300s"}
    assert headers_of(table["b/model-b"]) == {
        "x-gateway-model-name": "model-b",
        "x-gateway-destination-endpoint": True,
    }
    assert table["b/model-b"]["route"]["cluster"] == "pool-b"
    assert headers_of(table["b/model-b/fail-open"]) == {"x-gateway-model-name": "model-b"}
    assert table["b/model-b/fail-open"]["route"]["cluster"] == "pool-b-fallback"
    for name in ("unknown-model", "no-model", "models/unknown"):
        assert table[name]["direct_response"]["status"] == 404
        body = table[name]["direct_response"]["body_format"]["json_format"]
        assert set(body["error"]) == {"message", "type", "code"}
        assert body["error"]["code"] == "model_not_found"
        assert "GET /v1/models" in body["error"]["message"]


def test_health_is_envoys_own_200_before_any_other_route(config: dict[str, Any]) -> None:
    """/health is the first route: a 200 Envoy answers itself, with BBR off, so a load
    generator's start-up check (guidellm's GET /health) passes without a model."""
    (host,) = manager(config)["route_config"]["virtual_hosts"]
    first = host["routes"][0]
    assert first["name"] == "health"
    assert first["match"] == {"path": "/health"}
    assert first["direct_response"] == {"status": 200}
    assert set(first["typed_per_filter_config"]) == {"bbr"}


def test_the_gateway_lists_the_pools_models_itself_with_bbr_off(config: dict[str, Any]) -> None:
    """GET /v1/models is OpenAI's list of every pool's models, each owned by its pool, and
    /v1/models/{id} one card: fixed JSON answered by Envoy, BBR switched off on those routes."""
    table = routes(config)
    listing = table["models"]
    assert listing["match"] == {"path": "/v1/models"}
    body = json.loads(listing["direct_response"]["body"]["inline_string"])
    assert body == {
        "object": "list",
        "data": [
            {"id": "model-a", "object": "model", "created": 1700000000, "owned_by": "a"},
            {"id": "model-b", "object": "model", "created": 1700000000, "owned_by": "b"},
            {"id": "model-b-lora", "object": "model", "created": 1700000000, "owned_by": "b"},
        ],
    }
    card = table["models/model-b-lora"]
    assert card["match"] == {"path": "/v1/models/model-b-lora"}
    assert json.loads(card["direct_response"]["body"]["inline_string"]) == body["data"][2]
    bbr_off = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "disabled": True,
    }
    for name in ("models", "models/model-a", "models/unknown"):
        assert table[name]["typed_per_filter_config"] == {"bbr": bbr_off}
    for name in ("models", "models/model-a"):
        (header,) = table[name]["response_headers_to_add"]
        assert header["header"] == {"key": "content-type", "value": "application/json"}
    assert table["models/unknown"]["match"] == {"prefix": "/v1/models/"}


def test_a_model_id_with_a_slash_is_matched_as_sent_and_percent_encoded() -> None:
    """A Hugging Face id (org/name) is one card at /v1/models/org/name and at the path an
    SDK that percent-encodes the id asks for, /v1/models/org%2Fname."""
    gateway = Gateway(8080, 9901, 9004, (GatewayPool("h", ("meta/llama-3",), 9002),))
    table = routes(bootstrap(gateway))
    assert [name for name in table if name.startswith("models/")] == [
        "models/meta/llama-3",
        "models/meta%2Fllama-3",
        "models/unknown",
    ]
    assert table["models/meta%2Fllama-3"]["match"] == {"path": "/v1/models/meta%2Fllama-3"}


def test_envoy_own_failures_are_rewritten_as_openai_errors(config: dict[str, Any]) -> None:
    """Local replies: an ext_proc service failing, then any reply with a response flag
    (5xx first: server_error, then invalid_request_error), get an OpenAI-style JSON body;
    the services' refusals (no flag) are left as they are."""
    first, server, client = manager(config)["local_reply_config"]["mappers"]
    cel = first["filter"]["extension_filter"]["typed_config"]
    assert cel["expression"] == "response.code_details.startsWith('ext_proc_error')"
    assert first["body_format_override"]["json_format"]["error"] == {
        "message": "a gateway service (BBR or the pool's endpoint picker) failed: "
        "%RESPONSE_CODE_DETAILS%",
        "type": "server_error",
        "code": "ext_proc_error",
    }
    flagged, status = server["filter"]["and_filter"]["filters"]
    assert flagged == {"response_flag_filter": {}}
    assert status["status_code_filter"]["comparison"]["op"] == "GE"
    assert status["status_code_filter"]["comparison"]["value"]["default_value"] == 500
    assert server["body_format_override"]["json_format"]["error"] == {
        "message": "%LOCAL_REPLY_BODY%",
        "type": "server_error",
        "code": "%RESPONSE_FLAGS_LONG%",
    }
    assert client["filter"] == {"response_flag_filter": {}}
    assert client["body_format_override"]["json_format"]["error"]["type"] == (
        "invalid_request_error"
    )


def test_each_picker_is_off_except_on_its_own_pools_routes(config: dict[str, Any]) -> None:
    """Each picker is disabled on the virtual host and enabled only on its own pool's routes."""
    (host,) = manager(config)["route_config"]["virtual_hosts"]
    off = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "disabled": True,
    }
    assert host["typed_per_filter_config"] == {"lwepp-a": off, "lwepp-b": off}
    for name, route in routes(config).items():
        enabled = set(route.get("typed_per_filter_config", {})) - {"bbr"}
        pool = name.split("/")[0]
        expected = {f"lwepp-{pool}"} if "/" in name and pool != "models" else set()
        assert enabled == expected, name


def test_picked_endpoints_go_to_an_original_dst_cluster(config: dict[str, Any]) -> None:
    """Each pool routes to an ORIGINAL_DST cluster keyed by the picked endpoint header; only the fail-open pool has a fallback."""
    for pool in ("a", "b"):
        picked = cluster(config, f"pool-{pool}")
        assert picked["type"] == "ORIGINAL_DST"
        assert picked["lb_policy"] == "CLUSTER_PROVIDED"
        assert picked["original_dst_lb_config"] == {
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        }
    fallback = cluster(config, "pool-b-fallback")
    (locality,) = fallback["load_assignment"]["endpoints"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in locality["lb_endpoints"]
    ]
    assert ports == [8201, 8202]
    assert "pool-a-fallback" not in {c["name"] for c in config["static_resources"]["clusters"]}


@pytest.mark.parametrize(
    ("name", "port", "health"),
    [("bbr", 9004, None), ("lwepp-a", 9002, 9003), ("lwepp-b", 9012, 9013)],
)
def test_processor_clusters_speak_http2_and_pickers_are_health_checked(
    config: dict[str, Any], name: str, port: int, health: int | None
) -> None:
    """The ext_proc clusters speak HTTP/2 to 127.0.0.1 and ping it every 5 s (a hung service's
    connection closes); pickers are gRPC health-checked on their health port, no panic routing."""
    processor = cluster(config, name)
    options = processor["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["explicit_http_config"] == {
        "http2_protocol_options": {"connection_keepalive": {"interval": "5s", "timeout": "5s"}}
    }
    (locality,) = processor["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": port,
    }
    if health is None:
        assert "health_checks" not in processor
        return
    assert endpoint["endpoint"]["health_check_config"] == {"port_value": health}
    (check,) = processor["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "inference-extension"}
    # An empty Percent is 0 %: proto3 JSON leaves out a zero value.
    assert processor["common_lb_config"]["healthy_panic_threshold"].get("value", 0) == 0


def test_picker_replicas_are_hosts_of_one_health_checked_cluster() -> None:
    """``--picker-replicas``: a pool's pickers are the hosts of its one ext_proc cluster, each
    with its own health port, balanced round-robin as a gateway balances a picker Service."""
    pool = dataclasses.replace(GATEWAY.pools[0], more_pickers=((9102, 9103), (9202, 9203)))
    config = bootstrap(dataclasses.replace(GATEWAY, pools=(pool,)))
    picker = cluster(config, "lwepp-a")
    (locality,) = picker["load_assignment"]["endpoints"]
    hosts = [
        (
            e["endpoint"]["address"]["socket_address"]["port_value"],
            e["endpoint"]["health_check_config"]["port_value"],
        )
        for e in locality["lb_endpoints"]
    ]
    assert hosts == [(9002, 9003), (9102, 9103), (9202, 9203)]
    assert picker.get("lb_policy", "ROUND_ROBIN") == "ROUND_ROBIN"
    # A replica killed between health checks is ejected at its first failed stream, a refused
    # or reset connection (local origin) as much as an error it answers.
    detection = picker["outlier_detection"]
    assert detection["consecutive_gateway_failure"] == 1
    assert detection["enforcing_consecutive_gateway_failure"] == 100
    assert detection["split_external_local_origin_errors"] is True
    assert detection["consecutive_local_origin_failure"] == 1
    assert detection["enforcing_consecutive_local_origin_failure"] == 100
    # A stream the dead replica never answered is opened again on another one.
    retry = http_filter(config, "lwepp-a")["grpc_service"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) >= {"connect-failure", "reset", "unavailable"}
    assert retry["num_retries"] == 2
    (predicate,) = retry["retry_host_predicate"]
    assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
    one = bootstrap(GATEWAY)
    assert "outlier_detection" not in cluster(one, "lwepp-a")  # one host: nothing to eject it for
    assert "retry_policy" not in http_filter(one, "lwepp-a")["grpc_service"]


def test_no_cluster_refuses_requests_past_envoys_default_of_1024(config: dict[str, Any]) -> None:
    """Every cluster's circuit breakers are raised to 100,000 connections, pending and active
    requests and retries: a burst queues instead of being answered 503 by Envoy itself."""
    limit = {
        "max_connections": 100_000,
        "max_pending_requests": 100_000,
        "max_requests": 100_000,
        "max_retries": 100_000,
    }
    clusters = config["static_resources"]["clusters"]
    assert len(clusters) == 6  # BBR, two pickers, two picked-endpoint clusters, one fallback
    for each in clusters:
        assert each["circuit_breakers"] == {"thresholds": [limit]}, each["name"]


def test_a_second_gateway_on_the_same_port_fails_instead_of_sharing_it(tmp_path: Path) -> None:
    """The listener binds without SO_REUSEPORT: a second real Envoy on a port the first holds
    exits with 'Address already in use' rather than taking half the connections."""
    port = free_ports(1)[0]
    gateway = dataclasses.replace(GATEWAY, port=port, admin_port=0)
    assert bootstrap(gateway)["static_resources"]["listeners"][0]["enable_reuse_port"] is False
    services = []
    try:
        for number in (1, 2):
            work = tmp_path / str(number)
            work.mkdir()
            path = write_bootstrap(gateway, work / "envoy-bootstrap.json")
            services.append(start_envoy(work, path))
            if number == 1:
                wait_envoy_ready(services[0], work, 30)
        second = services[1]
        assert second.process.wait(30) != 0
        assert "Address already in use" in second.log.read_text()
        assert services[0].running()
    finally:
        stop_all(services)


def test_admin_and_listener_bind_loopback(config: dict[str, Any]) -> None:
    """Envoy's admin and listener bind 127.0.0.1 only."""
    assert config["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8080}


def test_one_hop_puts_one_ext_proc_filter_where_bbr_and_the_pickers_were() -> None:
    """With a one-hop port: one ext_proc filter and cluster, no picker switched per route, and
    the model list switches the one hop off as it does BBR."""
    config = bootstrap(dataclasses.replace(GATEWAY, one_hop_port=9100))
    names = [f["name"] for f in manager(config)["http_filters"]]
    assert names == [
        "strip-client-routing",
        "onehop",
        "served-endpoint",
        "envoy.filters.http.router",
    ]
    mode = http_filter(config, "onehop")["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_header_mode"] == "SEND"
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert clusters == {"onehop", "pool-a", "pool-b", "pool-b-fallback"}
    found = routes(config)
    assert set(found["models"]["typed_per_filter_config"]) == {"onehop"}
    assert set(found["health"]["typed_per_filter_config"]) == {"onehop"}
    assert found["a/model-a"].get("typed_per_filter_config", {}) == {}


def test_a_picker_that_needs_no_response_headers_is_not_sent_them() -> None:
    """A pool (or the one hop) whose picker hears nothing of the response gets
    response_header_mode SKIP; the rest of GIE's mode is unchanged."""
    pools = tuple(dataclasses.replace(p, response_headers=p.name == "a") for p in GATEWAY.pools)
    config = bootstrap(dataclasses.replace(GATEWAY, pools=pools))
    assert http_filter(config, "lwepp-a")["processing_mode"]["response_header_mode"] == "SEND"
    skipped = http_filter(config, "lwepp-b")["processing_mode"]
    assert skipped["response_header_mode"] == "SKIP"
    assert skipped["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    one_hop = dataclasses.replace(GATEWAY, one_hop_port=9100, one_hop_response_headers=False)
    mode = http_filter(bootstrap(one_hop), "onehop")["processing_mode"]
    assert mode["response_header_mode"] == "SKIP"


def test_a_request_waiting_in_flow_control_is_answered_by_the_picker_before_envoy_cuts_it(
    config: dict[str, Any],
) -> None:
    """The one Envoy timer running while a picker holds a request is the stream idle timeout
    (``demo.envoy.STREAM_IDLE_TIMEOUT``, set explicitly); every demo configuration's
    queue-wait budgets stay below it, so flow control answers first, with its reason."""
    assert manager(config)["stream_idle_timeout"] == "300s"
    configs = sorted((Path(__file__).parent.parent / "demo" / "configs").glob("*.yaml"))
    governed = [load_config(path).flow.settings for path in configs]
    budgets = [b for s in governed if s is not None for b in (s.ttl, s.no_endpoint_ttl)]
    assert budgets, "a demo configuration runs flow control"
    assert max(budgets) < STREAM_IDLE_TIMEOUT.total_seconds()
