"""``--metrics-endpoint-auth``: the metrics port answers only callers Kubernetes allows.

The llm-d router and GIE's services protect ``/metrics`` with
controller-runtime's ``filters.WithAuthenticationAndAuthorization``, which
delegates both questions to the API server; this module asks the same two,
in the same order, with the same answers:

1. **Who is calling?** The request must carry ``Authorization: Bearer
   <token>``. The token goes to the API server in a ``TokenReview``
   (``authentication.k8s.io/v1``); a missing or unauthenticated token is
   answered 401.
2. **May they read this path?** A ``SubjectAccessReview``
   (``authorization.k8s.io/v1``) asks whether that user, with its groups,
   uid and extra, may perform the verb (the HTTP method, lower-cased: ``get``)
   on the non-resource URL (the path, e.g. ``/metrics``). A refusal is 403.

When the API server cannot answer either question, the caller gets 500 and
the log says why (controller-runtime's rule: never open on failure).

RBAC that goes with it: the service's account may ``create`` ``tokenreviews``
and ``subjectaccessreviews``; the scraper's account needs a ClusterRole with
``nonResourceURLs: [/metrics]``, ``verbs: [get]`` (``manifests/base/rbac.yaml``).
Each check makes two API calls; a Prometheus scrape every few seconds is
the load this is sized for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import structlog

from pods.kubeapi import ApiError, ClusterConfig, KubeApi

log = structlog.get_logger()

TOKEN_REVIEWS: Final = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS: Final = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request to the metrics port is not answered: an HTTP status and a message."""

    status: int
    message: str


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None.

    The scheme is case-insensitive (RFC 7235 §2.1), as in Kubernetes' own
    bearer-token authenticator; an empty token is no token.
    """
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class MetricsAuth:
    """Checks a metrics-port request against the Kubernetes API (``check``)."""

    def __init__(self, cluster: ClusterConfig, timeout: float = 10.0) -> None:
        self.cluster = cluster
        self.timeout = timeout

    async def check(self, authorization: str, method: str, path: str) -> Denial | None:
        """None when the caller may ``method`` ``path``; otherwise the answer to give."""
        token = bearer_token(authorization)
        if token is None:
            return Denial(401, "Unauthorized")
        try:
            async with KubeApi(self.cluster, request_timeout=self.timeout) as api:
                review = await api.request("POST", TOKEN_REVIEWS, body=token_review(token))
                status = review.get("status") or {}
                if not status.get("authenticated"):
                    return Denial(401, "Unauthorized")
                user: dict[str, Any] = status.get("user") or {}
                name = str(user.get("username", ""))
                access = access_review(user, method.lower(), path)
                decision = await api.request("POST", ACCESS_REVIEWS, body=access)
        except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as error:
            log.error("metrics authentication failed", path=path, error=str(error))
            return Denial(500, "Authentication or authorization failed")
        if not (decision.get("status") or {}).get("allowed"):
            log.info("metrics access denied", user=name, path=path)
            return Denial(403, f"Authorization denied for user {name}")
        return None


def token_review(token: str) -> dict[str, Any]:
    """The ``TokenReview`` asking who ``token`` belongs to."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }


def access_review(user: dict[str, Any], verb: str, path: str) -> dict[str, Any]:
    """The ``SubjectAccessReview`` asking whether ``user`` (a TokenReview's) may ``verb``
    the non-resource URL ``path``."""
    spec: dict[str, Any] = {
        "user": user.get("username", ""),
        "nonResourceAttributes": {"path": path, "verb": verb},
    }
    for key in ("groups", "uid", "extra"):
        if user.get(key):
            spec[key] = user[key]
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": spec,
    }
