"""Per-message cost of the two Envoy codecs: xds-protos (upb) against envoy-data-plane.

Both encode the same protobuf schema, so both must produce byte-identical
messages; this checks that first, then times parsing a request-headers
message and building + serialising a routing headers response.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from dataclasses import dataclass

import envoy_data_plane.envoy.config.core.v3 as edp_core
import envoy_data_plane.envoy.service.ext_proc.v3 as edp
from envoy_data_plane.google.protobuf import Struct as EdpStruct

from bench.streams import HEADERS
from serving.testing import request_headers
from wire import extproc

ENDPOINT = "10.0.0.7:8000"


def xds_build() -> bytes:
    response = extproc.headers_response(
        "request",
        [
            ("x-gateway-destination-endpoint", ENDPOINT),
            ("X-Echo-Set-Header", f"x-conformance-test-served-endpoint:{ENDPOINT}"),
        ],
        clear_route_cache=True,
        dynamic_metadata={"envoy.lb": {"x-gateway-destination-endpoint": ENDPOINT}},
    )
    data: bytes = response.SerializeToString()
    return data


def edp_build() -> bytes:
    mutation = edp.HeaderMutation(
        set_headers=[
            edp_core.HeaderValueOption(header=edp_core.HeaderValue(key=k, raw_value=v.encode()))
            for k, v in (
                ("x-gateway-destination-endpoint", ENDPOINT),
                ("X-Echo-Set-Header", f"x-conformance-test-served-endpoint:{ENDPOINT}"),
            )
        ]
    )
    metadata = EdpStruct.from_dict({"envoy.lb": {"x-gateway-destination-endpoint": ENDPOINT}})
    response = edp.ProcessingResponse(
        request_headers=edp.HeadersResponse(
            response=edp.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )
    return bytes(response)


@dataclass(frozen=True, slots=True)
class Row:
    what: str
    xds_us: float
    edp_us: float


def per_call_us(fn: Callable[[], object], budget: float) -> float:
    """Best-of-5 microseconds per call, each run sized to about ``budget`` seconds."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    number = max(1, int(number * budget / 0.2))
    return min(timer.repeat(5, number)) / number * 1e6


def run(budget: float = 0.5) -> list[Row]:
    wire = request_headers(HEADERS, end_of_stream=False).SerializeToString()
    parsed = edp.ProcessingRequest.parse(wire)
    assert bytes(parsed) == wire, "envoy-data-plane re-encodes the request differently"
    assert edp_build() == xds_build(), "the two codecs disagree on the response bytes"
    return [
        Row(
            "parse request_headers (15 headers)",
            per_call_us(lambda: extproc.ProcessingRequest.FromString(wire), budget),
            per_call_us(lambda: edp.ProcessingRequest.parse(wire), budget),
        ),
        Row(
            "build + serialise routing headers response",
            per_call_us(xds_build, budget),
            per_call_us(edp_build, budget),
        ),
    ]


def table(rows: list[Row]) -> str:
    lines = [
        "| message | xds-protos µs | envoy-data-plane µs | envoy-data-plane / xds-protos |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.what} | {row.xds_us:.2f} | {row.edp_us:.1f} | {row.edp_us / row.xds_us:.0f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
