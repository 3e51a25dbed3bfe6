"""The API versions a run reports, read from the CRDs its objects belong to, as GIE's suite does.

GIE's suite does not write a version of its own into its report: it reads
the installed CRDs. ``GatewayAPIInferenceExtensionVersion`` is the
``inference.networking.k8s.io/bundle-version`` annotation every GIE CRD
carries (one value, or the run stops: GIE's
``getGatewayInferenceExtensionVersion``); ``gatewayAPIVersion`` and
``gatewayAPIChannel`` are the ``gateway.networking.k8s.io/bundle-version``
and ``/channel`` annotations of the Gateway API CRDs, which must agree with
each other and with the release of the conformance helpers in use
(``client.HELPERS_VERSION``; Gateway API's ``getAPIVersionAndChannel``).

The harness has no API server; ``crds.yaml`` holds the heads of the CRDs a
cluster would have installed for the objects it applies (GatewayClass,
Gateway, HTTPRoute, InferencePool, all ``v1``), and this module reads them
by the same rules, so the report says what the harness actually modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from conformance.client import HELPERS_VERSION

CRDS: Final = Path(__file__).with_name("crds.yaml")

GIE_VERSION_ANNOTATION: Final = "inference.networking.k8s.io/bundle-version"
GATEWAY_API_VERSION_ANNOTATION: Final = "gateway.networking.k8s.io/bundle-version"
GATEWAY_API_CHANNEL_ANNOTATION: Final = "gateway.networking.k8s.io/channel"

APPLIED: Final = {
    "GatewayClass": "gateway.networking.k8s.io/v1",
    "Gateway": "gateway.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
}
"""The kinds the harness applies (``conformance.envoy`` turns them into Envoy's configuration),
at the API versions GIE's manifests use."""


class CrdError(ValueError):
    """CRDs that do not say which versions are installed; the message names the file."""


@dataclass(frozen=True, slots=True)
class Versions:
    """What the report says it was run against."""

    inference_extension: str
    gateway_api: str
    gateway_api_channel: str


def _annotations(crd: Any) -> Mapping[str, str]:
    metadata = crd.get("metadata") if isinstance(crd, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    return annotations if isinstance(annotations, dict) else {}


def _served(crd: Any) -> set[str]:
    """``group/version`` of each version the CRD serves, for its kind."""
    spec = crd.get("spec") if isinstance(crd, dict) else None
    if not isinstance(spec, dict):
        return set()
    versions = spec.get("versions") or []
    return {
        f"{spec.get('group')}/{version.get('name')}"
        for version in versions
        if isinstance(version, dict) and version.get("served")
    }


def _kind(crd: Any) -> str | None:
    spec = crd.get("spec") if isinstance(crd, dict) else None
    names = spec.get("names") if isinstance(spec, dict) else None
    kind = names.get("kind") if isinstance(names, dict) else None
    return kind if isinstance(kind, str) else None


def installed_versions(path: Path = CRDS) -> Versions:
    """Read ``path``'s CRDs: check they serve every kind the harness applies, and return the
    versions their annotations name; raise ``CrdError`` as GIE's and Gateway API's suites
    refuse to run."""
    try:
        documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except (OSError, yaml.YAMLError) as error:
        raise CrdError(f"{path}: {error}") from None
    crds = [doc for doc in documents if isinstance(doc, dict)]
    if len(crds) != len(documents) or any(
        doc.get("kind") != "CustomResourceDefinition" for doc in crds
    ):
        raise CrdError(f"{path}: every document must be a CustomResourceDefinition")
    for kind, api_version in APPLIED.items():
        if not any(_kind(crd) == kind and api_version in _served(crd) for crd in crds):
            raise CrdError(f"{path}: no CRD serves {kind} {api_version}, which the harness applies")

    # GIE: every annotated CRD names the same version.
    gie = {str(v) for crd in crds if (v := _annotations(crd).get(GIE_VERSION_ANNOTATION))}
    if len(gie) > 1:
        raise CrdError(f"{path}: multiple gateway api inference extension CRDs versions detected")
    if not gie:
        raise CrdError(
            f"{path}: no gateway api inference extension CRDs with the proper annotations found"
        )

    # Gateway API: version and channel together, one of each, and the helpers' release.
    versions: set[str] = set()
    channels: set[str] = set()
    for crd in crds:
        annotations = _annotations(crd)
        version = annotations.get(GATEWAY_API_VERSION_ANNOTATION)
        channel = annotations.get(GATEWAY_API_CHANNEL_ANNOTATION)
        if version is None and channel is None:
            continue
        if version is None or channel is None:
            raise CrdError(f"{path}: detected CRDs with partial version and channel annotations")
        versions.add(str(version))
        channels.add(str(channel))
    if len(versions) > 1:
        raise CrdError(f"{path}: multiple gateway API CRDs versions detected")
    if len(channels) > 1:
        raise CrdError(f"{path}: multiple gateway API CRDs channels detected")
    if not versions:
        raise CrdError(f"{path}: no Gateway API CRDs with the proper annotations found")
    (version,), (channel,) = versions, channels
    if version != HELPERS_VERSION:
        raise CrdError(
            f"{path}: the installed CRDs version ({version}) is different from the suite "
            f"version ({HELPERS_VERSION})"
        )
    (inference_extension,) = gie
    return Versions(inference_extension, version, channel)
