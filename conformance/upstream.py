"""Changes pending upstream that alter how the suite runs, and the switch that runs either way.

The harness follows GIE's released tests (v1.6.0, unchanged on main at
84436a96) on Gateway API's released helpers (v1.6.1). Two changes under way
upstream would make a run behave differently; ``--upstream next`` runs them
as they would be, so that their effect can be seen before they land:

- **GIE PR #3053** (open, "Remove probabilistic weighted-pool warmup"):
  GatewayWeightedAcrossTwoInferencePools warms each of its six pods up with a
  request pinned to that pod, each until three pass in a row; the route picks
  the pool 70/30 before the picker runs, so a request pinned to a secondary
  pod passes only when the split sends it there, and the warm-up takes most
  of a run (the PR measured about 200 s in CI; here about 160 s). The PR
  removes that loop; the eventually-consistent request with all six pods
  allowed, and the traffic loop's retries, remain. (GIE's release-1.3 branch
  dropped the same loop in PR #2316, e5d37f32, released in v1.3.1; main kept
  it.)
- **Gateway API main, c21fb1ab** (PR #5150, "conformance: use timeout config
  more consistently", in no release yet): ``AwaitConvergence`` waits
  ``TimeoutConfig.DefaultPollInterval`` after a failed attempt, 100 ms by
  default, where v1.6.1 waits a fixed 1 s.

Neither changes what a conformant gateway and picker must do; both change
how long a run takes, the warm-up's removal also what a run sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Upstream:
    """One way of running the suite: ``weighted_warmup`` (the per-pod warm-up of
    GatewayWeightedAcrossTwoInferencePools) and ``delay_after_failure`` (the wait after a
    failed attempt of an eventually-consistent check, in seconds)."""

    name: str
    weighted_warmup: bool
    delay_after_failure: float
    summary: str


RELEASED: Final = Upstream(
    "released",
    weighted_warmup=True,
    delay_after_failure=1.0,
    summary="GIE v1.6.0's tests on Gateway API's conformance helpers v1.6.1, as released",
)
NEXT: Final = Upstream(
    "next",
    weighted_warmup=False,
    delay_after_failure=0.1,
    summary=(
        "with the changes pending upstream: GIE PR #3053 (no per-pod warm-up in "
        "GatewayWeightedAcrossTwoInferencePools) and Gateway API main's c21fb1ab (PR #5150: "
        "100 ms after a failed attempt, not 1 s)"
    ),
)
UPSTREAMS: Final = {upstream.name: upstream for upstream in (RELEASED, NEXT)}
