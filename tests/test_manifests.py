"""The Kubernetes manifests, built by a real kubectl: every overlay and component, the kinds and
names each yields, names and ports that agree, flags the services accept, RBAC that matches the
code."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bbr.__main__ import parser as bbr_parser
from bbr.server import HEALTH_SERVICES as BBR_HEALTH
from lwepp.__main__ import build_parser as lwepp_parser
from lwepp.assembly import HEALTH_SERVICES as LWEPP_HEALTH
from lwepp.assembly import PickerOptions
from lwepp.config import load_config
from lwepp.leader import LeaderElector
from lwepp.objectives import ObjectiveWatch
from lwepp.rewrites import API_VERSIONS
from pods.kubeapi import ClusterConfig, KubeApi
from serving.metrics_auth import MetricsAuth
from tests.fake_kube import FakeKube, eventually
from tests.test_kubernetes import NS, PODS, POOLS, k8s_pod, k8s_pool, tracking
from tests.test_rewrite_sources import watching as watching_rewrites

ROOT = Path(__file__).parent.parent
MANIFESTS = ROOT / "manifests"
KUBECTL = Path(os.environ.get("SWITCHYARD_KUBECTL", ROOT / ".venv" / "bin" / "kubectl"))
Doc = dict[str, Any]


@functools.cache
def kubectl() -> Path:
    """The real kubectl ``make kubectl`` installs (``make test`` does it first): never skipped."""
    if not os.access(KUBECTL, os.X_OK):
        pytest.fail(f"no kubectl at {KUBECTL}: run `make kubectl` (make test does it for you)")
    return KUBECTL


def kustomize(directory: Path) -> list[Doc]:
    """``kubectl kustomize DIRECTORY``: the objects the overlay builds, as ``kubectl apply -k``."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def with_components(tmp: Path, resource: str, *components: str) -> list[Doc]:
    """Build ``resource`` (a directory of manifests/) with ``components`` added, as a user's
    overlay would list them."""
    relative = os.path.relpath(MANIFESTS, tmp)
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{relative}/{resource}"],
                "components": [f"{relative}/{c}" for c in components],
            }
        )
    )
    return kustomize(tmp)


@functools.cache
def built(overlay: str) -> list[Doc]:
    return kustomize(MANIFESTS / overlay)


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = find(docs, kind, name)
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def names(docs: list[Doc]) -> set[tuple[str, str]]:
    """(kind, name) of each object; a generated ConfigMap's content hash is cut off."""
    found = set()
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] == "ConfigMap" and name.startswith("picker-config-"):
            name = "picker-config-<hash>"
        found.add((doc["kind"], name))
    return found


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` (or ``--name value``) in a container's args."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


def container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- what each overlay and component builds ---------------------------------------------------

BASE = {
    ("Namespace", "switchyard"),
    ("ServiceAccount", "lwepp"),
    ("ServiceAccount", "bbr"),
    ("Role", "lwepp"),
    ("RoleBinding", "lwepp"),
    ("ClusterRole", "switchyard-metrics-auth"),
    ("ClusterRoleBinding", "switchyard-metrics-auth"),
    ("ClusterRole", "switchyard-metrics-reader"),
    ("ConfigMap", "simulated-models"),
    ("Service", "bbr"),
    ("Service", "lwepp-llama"),
    ("Service", "lwepp-mistral"),
    ("Deployment", "bbr"),
    ("Deployment", "lwepp-llama"),
    ("Deployment", "lwepp-mistral"),
    ("Deployment", "llama"),
    ("Deployment", "mistral"),
    ("InferencePool", "llama"),
    ("InferencePool", "mistral"),
    ("HTTPRoute", "llama"),
    ("HTTPRoute", "mistral"),
}
ENVOY_GATEWAY = BASE | {
    ("Gateway", "inference-gateway"),
    ("EnvoyExtensionPolicy", "bbr"),
    ("HTTPRoute", "no-model"),
    ("HTTPRouteFilter", "no-model"),
    ("HTTPRoute", "models"),
    ("HTTPRouteFilter", "models"),
    ("HTTPRouteFilter", "models-llama-3-8b"),
    ("HTTPRouteFilter", "models-mistral-7b"),
    ("HTTPRouteFilter", "model-not-found"),
    ("HTTPRoute", "health"),
    ("HTTPRouteFilter", "health"),
}
ISTIO = BASE | {
    ("Gateway", "inference-gateway"),
    ("EnvoyFilter", "bbr"),
    ("EnvoyFilter", "models"),
    ("EnvoyFilter", "health"),
    ("DestinationRule", "bbr"),
    ("DestinationRule", "lwepp-llama"),
    ("DestinationRule", "lwepp-mistral"),
}
OVERLAYS = {
    "base": BASE,
    "envoy-gateway": ENVOY_GATEWAY,
    "istio": ISTIO,
    "prefix-aware": ENVOY_GATEWAY | {("ConfigMap", "picker-config-<hash>")},
}
COMPONENTS = {
    "leader-election": {
        ("Role", "lwepp-leader-election"),
        ("RoleBinding", "lwepp-leader-election"),
    },
    "picker-config": {("ConfigMap", "picker-config-<hash>")},
    "active-active": {("Deployment", "lwepp-state"), ("Service", "lwepp-state")},
    "monitoring": {
        ("ServiceMonitor", "switchyard"),
        ("ConfigMap", "switchyard-dashboard"),
        ("ServiceAccount", "switchyard-metrics-reader"),
        ("Secret", "switchyard-metrics-reader-token"),
        ("ClusterRoleBinding", "switchyard-metrics-reader"),
    },
}


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_each_overlay_builds_with_kubectl_into_the_objects_it_promises(overlay: str) -> None:
    """``kubectl kustomize`` builds the overlay (no cycle), every namespaced object in namespace
    switchyard."""
    docs = built(overlay)
    assert names(docs) == OVERLAYS[overlay]
    assert len(docs) == len(OVERLAYS[overlay])  # no object twice
    cluster_scoped = ("Namespace", "ClusterRole", "ClusterRoleBinding")
    namespaced = [d for d in docs if d["kind"] not in cluster_scoped]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"switchyard"}


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_each_component_builds_onto_the_base(component: str, tmp_path: Path) -> None:
    """A component listed under ``components:`` adds exactly its objects to the base."""
    docs = with_components(tmp_path, "base", f"components/{component}")
    assert names(docs) == BASE | COMPONENTS[component]


def test_every_file_is_built_by_some_overlay_or_component() -> None:
    """No manifest file lies unused: each one is named by a kustomization that the tests build."""
    used: set[Path] = set()
    directories = [MANIFESTS / o for o in OVERLAYS] + [
        MANIFESTS / "components" / c for c in COMPONENTS
    ]
    for directory in directories:
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used.add(directory / "kustomization.yaml")
        listed = [*spec.get("resources", [])]
        for generator in spec.get("configMapGenerator", []):
            listed += [f.split("=")[-1] for f in generator.get("files", [])]
        used |= {(directory / r).resolve() for r in listed if not (directory / r).is_dir()}
    files = {p for p in MANIFESTS.rglob("*") if p.suffix in (".yaml", ".json")}
    assert files == used


def documents(path: Path) -> Iterator[Doc]:
    return (doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in MANIFESTS.rglob("*.yaml") if p.name != "epp-config.yaml"),
    ids=lambda p: str(p.relative_to(MANIFESTS)),
)
def test_every_object_leaves_its_namespace_to_the_kustomization(path: Path) -> None:
    """Objects name no namespace of their own: one ``namespace:`` in the kustomization sets it."""
    for doc in documents(path):
        assert {"apiVersion", "kind"} <= set(doc)
        if doc["kind"] not in ("Kustomization", "Component"):
            assert "namespace" not in doc["metadata"]


# --- names and ports agree --------------------------------------------------------------------

POOL_NAMES = ["llama", "mistral"]


@pytest.mark.parametrize("pool_name", POOL_NAMES)
def test_pool_points_at_its_own_picker_service_and_port(pool_name: str) -> None:
    """endpointPickerRef names a Service whose port reaches the picker's --grpc-port."""
    docs = built("base")
    pool = one(docs, "InferencePool", pool_name)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", ref["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "http2"  # gRPC: HTTP/2 to the picker
    pickers = [
        d
        for d in find(docs, "Deployment")
        if labels_match(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(pickers) == 1
    args = container(pickers[0])["args"]
    assert flag(args, "--pool-name") == pool_name
    assert int(flag(args, "--grpc-port")) == port["targetPort"]
    assert flag(args, "--host") == "0.0.0.0"


@pytest.mark.parametrize("pool_name", POOL_NAMES)
def test_pool_selects_model_servers_on_their_port(pool_name: str) -> None:
    """The pool's selector matches a model-server Deployment serving on the target port."""
    docs = built("base")
    pool = one(docs, "InferencePool", pool_name)
    selector = pool["spec"]["selector"]["matchLabels"]
    servers = [
        d
        for d in find(docs, "Deployment")
        if labels_match(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(servers) == 1
    ports = {p["containerPort"] for p in container(servers[0])["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    # The simulator's pod file entry for its --selector serves on the same port.
    configmap = one(docs, "ConfigMap", "simulated-models")
    entries = yaml.safe_load(configmap["data"]["pods.yaml"])["pods"]
    key, value = flag(container(servers[0])["args"], "--selector").split("=")
    [entry] = [e for e in entries if e["labels"].get(key) == value]
    assert entry["ports"] == [p["number"] for p in pool["spec"]["targetPorts"]]


@pytest.mark.parametrize("pool_name", POOL_NAMES)
def test_each_model_routes_to_its_pool(pool_name: str) -> None:
    """An HTTPRoute matches X-Gateway-Model-Name = the pool's model and backs onto the pool."""
    docs = built("base")
    routes = [
        r
        for r in find(docs, "HTTPRoute")
        for rule in r["spec"]["rules"]
        for ref in rule["backendRefs"]
        if ref["kind"] == "InferencePool" and ref["name"] == pool_name
    ]
    assert len(routes) == 1
    [rule] = routes[0]["spec"]["rules"]
    assert rule["backendRefs"][0]["group"] == "inference.networking.k8s.io"
    [header] = rule["matches"][0]["headers"]
    assert header["name"] == "X-Gateway-Model-Name"
    assert header["type"] == "Exact"
    server = one(docs, "Deployment", pool_name)
    assert flag(container(server)["args"], "--selector") == f"model={header['value']}"
    assert routes[0]["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def served_models() -> dict[str, str]:
    """Model → pool, as the base's HTTPRoutes route them."""
    return {
        rule["matches"][0]["headers"][0]["value"]: rule["backendRefs"][0]["name"]
        for route in find(built("base"), "HTTPRoute")
        for rule in route["spec"]["rules"]
    }


def model_answers_eg() -> dict[tuple[str, str], tuple[int, Any]]:
    """Envoy Gateway overlay: (path match type, value) → (status, parsed JSON body)."""
    eg = built("envoy-gateway")
    answers = {}
    for rule in one(eg, "HTTPRoute", "models")["spec"]["rules"]:
        [match] = rule["matches"]
        ref = rule["filters"][0]["extensionRef"]
        direct = one(eg, ref["kind"], ref["name"])["spec"]["directResponse"]
        assert direct["contentType"] == "application/json"
        body = json.loads(direct["body"]["inline"])
        answers[(match["path"]["type"], match["path"]["value"])] = (direct["statusCode"], body)
    return answers


def model_answers_istio() -> dict[tuple[str, str], tuple[int, Any]]:
    """Istio overlay: (Exact for path, PathPrefix for prefix, value) → (status, JSON body),
    in the order the routes end up (INSERT_FIRST: the last patch comes first)."""
    patches = one(built("istio"), "EnvoyFilter", "models")["spec"]["configPatches"]
    answers = {}
    for patch in reversed(patches):
        assert patch["applyTo"] == "HTTP_ROUTE"
        assert patch["patch"]["operation"] == "INSERT_FIRST"
        route = patch["patch"]["value"]
        [(kind, value)] = route["match"].items()
        direct = route["direct_response"]
        [header] = route["response_headers_to_add"]
        assert header["header"] == {"key": "content-type", "value": "application/json"}
        body = json.loads(direct["body"]["inline_string"])
        key = ("Exact" if kind == "path" else "PathPrefix", value)
        answers[key] = (direct["status"], body)
    return answers


def test_each_gateway_answers_health_itself_with_an_empty_200() -> None:
    """GET /health, which load generators ask before a run, is the gateway's own 200 with
    no body in both overlays (as the demo answers it), not the catch-all no-model 404."""
    eg = built("envoy-gateway")
    [rule] = one(eg, "HTTPRoute", "health")["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "Exact", "value": "/health"}}]
    ref = rule["filters"][0]["extensionRef"]
    assert one(eg, ref["kind"], ref["name"])["spec"] == {"directResponse": {"statusCode": 200}}
    [patch] = one(built("istio"), "EnvoyFilter", "health")["spec"]["configPatches"]
    assert (patch["applyTo"], patch["patch"]["operation"]) == ("HTTP_ROUTE", "INSERT_FIRST")
    route = patch["patch"]["value"]
    assert route["match"] == {"path": "/health"}
    assert route["direct_response"] == {"status": 200}


@pytest.mark.parametrize(
    "answers", [model_answers_eg, model_answers_istio], ids=["envoy-gateway", "istio"]
)
def test_each_gateway_lists_the_routed_models_as_openai_does(
    answers: Callable[[], dict[tuple[str, str], tuple[int, Any]]],
) -> None:
    """GET /v1/models lists exactly the models the HTTPRoutes route, each owned by its pool;
    /v1/models/{id} is that card; any other /v1/models/... is a 404 model_not_found: the
    demo gateway's answers, in both overlays."""
    found = answers()
    models = served_models()
    cards = [
        {"id": model, "object": "model", "created": 0, "owned_by": pool}
        for model, pool in models.items()
    ]
    assert list(found) == [
        ("Exact", "/v1/models"),
        *(("Exact", f"/v1/models/{model}") for model in models),
        ("PathPrefix", "/v1/models/"),
    ]
    assert found[("Exact", "/v1/models")] == (200, {"object": "list", "data": cards})
    for card in cards:
        assert found[("Exact", f"/v1/models/{card['id']}")] == (200, card)
    status, error = found[("PathPrefix", "/v1/models/")]
    assert status == 404
    assert set(error["error"]) == {"message", "type", "code"}
    assert error["error"]["code"] == "model_not_found"


def test_probes_hit_the_health_ports_and_services_the_code_reports() -> None:
    """Each gRPC probe targets the health port and a health service the code reports; every port is declared."""
    for deployment in find(built("base"), "Deployment"):
        spec = container(deployment)
        if "livenessProbe" not in spec or "grpc" not in spec["livenessProbe"]:
            continue
        health_port = int(flag(spec["args"], "--grpc-health-port"))
        known = LWEPP_HEALTH if spec["image"].startswith("switchyard/lwepp") else BBR_HEALTH
        for probe in (spec["livenessProbe"], spec["readinessProbe"]):
            assert probe["grpc"]["port"] == health_port
            assert probe["grpc"].get("service", "") in known
        declared = {p["containerPort"] for p in spec["ports"]}
        ports = {int(flag(spec["args"], f)) for f in ("--grpc-port", "--metrics-port")}
        assert ports | {health_port} <= declared


def every_deployment(tmp_path: Path) -> Iterator[Doc]:
    """Each Deployment of every overlay, and of the base with every component."""
    for overlay in OVERLAYS:
        yield from find(built(overlay), "Deployment")
    every = [f"components/{c}" for c in COMPONENTS]
    yield from find(with_components(tmp_path, "envoy-gateway", *every), "Deployment")


def test_container_args_are_flags_the_services_accept(tmp_path: Path) -> None:
    """Every Deployment's args, as built, parse with the real argument parser (or are in --help)."""
    simulator_help = subprocess.run(
        [sys.executable, "-m", "simulator", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for deployment in every_deployment(tmp_path):
        spec = container(deployment)
        image = spec["image"].rsplit(":", 1)[0]
        match image:
            case "switchyard/lwepp":
                parsed = lwepp_parser().parse_args(spec["args"])
                assert parsed.pool_name
            case "switchyard/bbr":
                bbr_parser().parse_args(spec["args"])
            case "switchyard/simulator":
                for arg in spec["args"]:
                    assert arg.split("=")[0] in simulator_help
            case "redis":  # the active-active store (components/active-active): a cache
                assert spec["args"][:4] == ["--save", "", "--appendonly", "no"]
            case other:
                raise AssertionError(f"unknown image {other}")


def test_the_mounted_picker_configuration_loads_and_every_picker_reads_it(tmp_path: Path) -> None:
    """The ConfigMap's EndpointPickerConfig loads in LWEPP, and each picker mounts and names it."""
    docs = built("prefix-aware")
    [configmap] = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].startswith("picker")]
    [(key, text)] = configmap["data"].items()
    (tmp_path / key).write_text(text)
    config = load_config(tmp_path / key)
    assert [(s.name, w) for s, w in config.pipeline().scorers] == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ]
    pickers = [d for d in find(docs, "Deployment") if d["metadata"]["name"].startswith("lwepp-")]
    assert len(pickers) == len(POOL_NAMES)
    for picker in pickers:
        pod = picker["spec"]["template"]["spec"]
        [volume] = pod["volumes"]
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        [mount] = container(picker)["volumeMounts"]
        assert mount["name"] == volume["name"]
        assert flag(container(picker)["args"], "--config-file") == f"{mount['mountPath']}/{key}"


def test_bbr_is_wired_into_each_gateway() -> None:
    """Envoy Gateway's policy and Istio's filter both call the BBR Service on its ext_proc port."""
    base = built("base")
    service = one(base, "Service", "bbr")
    [grpc_port] = [p for p in service["spec"]["ports"] if p.get("appProtocol") == "http2"]
    bbr_args = container(one(base, "Deployment", "bbr"))["args"]
    assert int(flag(bbr_args, "--grpc-port")) == grpc_port["targetPort"]
    assert "--streaming" in bbr_args

    eg = built("envoy-gateway")
    [policy] = find(eg, "EnvoyExtensionPolicy")
    assert policy["spec"]["targetRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "inference-gateway",
    }
    [ext_proc] = policy["spec"]["extProc"]
    assert ext_proc["backendRefs"] == [{"name": "bbr", "port": grpc_port["port"]}]
    assert ext_proc["processingMode"]["request"]["body"] == "FullDuplexStreamed"
    # The policy dials BBR in plaintext: the overlay turns BBR's TLS off, and only there.
    assert "--secure-serving=false" in container(one(eg, "Deployment", "bbr"))["args"]
    assert "--secure-serving=false" not in bbr_args
    fallback = one(eg, "HTTPRoute", "no-model")
    ref = fallback["spec"]["rules"][0]["filters"][0]["extensionRef"]
    direct = one(eg, ref["kind"], ref["name"])["spec"]["directResponse"]
    assert direct["statusCode"] == 404
    error = json.loads(direct["body"]["inline"])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")

    envoy_filter = one(built("istio"), "EnvoyFilter", "bbr")
    value = envoy_filter["spec"]["configPatches"][0]["patch"]["value"]
    cluster = value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert cluster == f"outbound|{grpc_port['port']}||bbr.switchyard.svc.cluster.local"
    assert value["typed_config"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    selector = envoy_filter["spec"]["workloadSelector"]["labels"]
    assert selector == {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}


def test_istio_dials_every_tls_service_with_tls() -> None:
    """Each ext_proc Service (BBR and the pickers, TLS by default) has a DestinationRule for it."""
    docs = built("istio")
    ext_proc = {
        s["metadata"]["name"]
        for s in find(docs, "Service")
        if any(p.get("appProtocol") == "http2" for p in s["spec"]["ports"])
    }
    rules = {
        d["spec"]["host"]: d["spec"]["trafficPolicy"]["tls"] for d in find(docs, "DestinationRule")
    }
    assert set(rules) == {f"{name}.switchyard.svc.cluster.local" for name in ext_proc}
    assert all(tls["mode"] == "SIMPLE" for tls in rules.values())
    for deployment in find(docs, "Deployment"):
        assert "--secure-serving=false" not in container(deployment).get("args", [])


def test_leader_election_component_patches_every_picker(tmp_path: Path) -> None:
    """The leader-election component gives every picker --leader-elect, two replicas and the liveness/readiness services."""
    docs = with_components(tmp_path, "base", "components/leader-election")
    pickers = [d for d in find(docs, "Deployment") if d["metadata"]["name"].startswith("lwepp-")]
    assert len(pickers) == len(POOL_NAMES)
    for deployment in pickers:
        spec = container(deployment)
        assert "--leader-elect" in spec["args"]
        assert deployment["spec"]["replicas"] == 2
        assert spec["livenessProbe"]["grpc"]["service"] == "liveness"
        assert spec["readinessProbe"]["grpc"]["service"] == "readiness"
        # Timings for a failover under 2 s (docs/scale-out.md), the probe at its least period.
        assert "--leader-elect-lease-duration=1s" in spec["args"]
        assert "--leader-elect-retry-period=0.25s" in spec["args"]
        assert spec["readinessProbe"]["periodSeconds"] == 1


def test_active_active_component_runs_three_serving_replicas_on_one_store(tmp_path: Path) -> None:
    """The active-active component: three replicas per picker, no Lease, all on one Redis."""
    docs = with_components(tmp_path, "base", "components/active-active")
    pickers = [d for d in find(docs, "Deployment") if d["metadata"]["name"].startswith("lwepp-")]
    pickers = [d for d in pickers if d["metadata"]["name"] != "lwepp-state"]
    assert len(pickers) == len(POOL_NAMES)
    for deployment in pickers:
        args = container(deployment)["args"]
        assert deployment["spec"]["replicas"] == 3
        assert "--shared-store-address=redis://lwepp-state:6379" in args
        assert "--leader-elect" not in args


# --- RBAC grants exactly what the code calls --------------------------------------------------


def granted(docs: list[Doc], service_account: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) the Roles bound to ``service_account`` grant."""
    rights: set[tuple[str, str, str]] = set()
    for binding in find(docs, "RoleBinding"):
        subjects = [(s["kind"], s["name"]) for s in binding["subjects"]]
        if ("ServiceAccount", service_account) not in subjects:
            continue
        role = one(docs, "Role", binding["roleRef"]["name"])
        for rule in role["rules"]:
            rights |= {
                (g, r, v)
                for g in rule["apiGroups"]
                for r in rule["resources"]
                for v in rule["verbs"]
            }
    return rights


async def read_rewrites(fake: FakeKube, version: str) -> None:
    """The pool's InferenceModelRewrites listed and watched, with only ``version`` served."""
    fake.served = {version: ["inferencemodelrewrites"]}
    watched = f"/apis/{version}/namespaces/{NS}/inferencemodelrewrites"
    async with watching_rewrites(fake):
        await eventually(lambda: fake.watching(watched) == 1, f"a watch of {watched}")


def objectives(group: str) -> str:
    return f"/apis/{group}/v1alpha2/namespaces/models/inferenceobjectives"


def used_by_the_code() -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """The (group, resource, verb) requests the pod source, the model rewrites and the
    InferenceObjective watch (of either group), then the elector, really make.

    Recorded by the fake API server while each runs through its paths: list,
    watch, resume, relist after 410; the rewrites in either group; acquire,
    renew, lose, take over, release.
    """

    async def scenario() -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
        async with FakeKube() as fake:
            fake.put(POOLS, k8s_pool())
            fake.put(PODS, k8s_pod("a", "10.0.0.1"))
            async with tracking(fake) as source:
                await eventually(lambda: len(source.pods) == 1)
                fake.put(POOLS, k8s_pool(ports=(9000,), app="other"))
                fake.drop_watches()
                fake.compact()
                fake.put(PODS, k8s_pod("b", "10.0.0.2", app="other"))
                await eventually(lambda: len(source.pods) == 1 and source.pods[0].name == "b")
            for version in API_VERSIONS:  # the current group, then the older one alone
                await read_rewrites(fake, version)
            for group in ("llm-d.ai", "inference.networking.x-k8s.io"):  # each, on its own
                fake.uninstalled = {"llm-d.ai/v1alpha2"} if group != "llm-d.ai" else set()
                watch = ObjectiveWatch(ClusterConfig(fake.url), "llama", "models")
                task = asyncio.create_task(watch.run())
                watched = objectives(group)
                await eventually(lambda: fake.watching(watched) == 1, "watching")  # noqa: B023
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            fake.uninstalled = set()
            source_verbs = fake.verbs()
            fake.requests.clear()
            now = [0.0]
            config = ClusterConfig(fake.url)
            a = LeaderElector(config, "models", "l", "a", clock=lambda: now[0])
            b = LeaderElector(config, "models", "l", "b", clock=lambda: now[0])
            async with KubeApi(config) as api:
                assert await a.step(api)
                assert not await b.step(api)
                now[0] += 20
                assert await b.step(api)
                await b.release(api)
            return source_verbs, fake.verbs()

    return asyncio.run(asyncio.wait_for(scenario(), 20))


def test_rbac_grants_exactly_what_the_code_calls(tmp_path: Path) -> None:
    """Base RBAC = the pod source's requests; the component adds the elector's, nothing more."""
    source_verbs, elector_verbs = used_by_the_code()
    base = built("base")
    deployment = one(base, "Deployment", f"lwepp-{POOL_NAMES[0]}")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    elected = with_components(tmp_path, "base", "components/leader-election")
    assert granted(base, account) == source_verbs
    assert granted(elected, account) == source_verbs | elector_verbs
    assert granted(base, "bbr") == set()
    assert one(base, "ServiceAccount", "bbr")["automountServiceAccountToken"] is False


def cluster_granted(docs: list[Doc], service_account: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) the ClusterRoles bound to ``service_account`` grant."""
    rights: set[tuple[str, str, str]] = set()
    for binding in find(docs, "ClusterRoleBinding"):
        if ("ServiceAccount", service_account) in [
            (s["kind"], s["name"]) for s in binding["subjects"]
        ]:
            role = one(docs, "ClusterRole", binding["roleRef"]["name"])
            for rule in role["rules"]:
                rights |= {
                    (g, r, v)
                    for g in rule["apiGroups"]
                    for r in rule["resources"]
                    for v in rule["verbs"]
                }
    return rights


def used_by_metrics_auth() -> set[tuple[str, str, str]]:
    """The (group, resource, verb) requests one allowed and one refused scrape make."""

    async def scenario() -> set[tuple[str, str, str]]:
        async with FakeKube() as fake:
            fake.tokens = {"t": {"username": "prometheus"}}
            fake.allowed = {("prometheus", "/metrics", "get")}
            auth = MetricsAuth(ClusterConfig(fake.url))
            assert await auth.check("Bearer t", "GET", "/metrics") is None
            assert await auth.check("Bearer t", "GET", "/debug/runtime") is not None
            return fake.verbs()

    return asyncio.run(asyncio.wait_for(scenario(), 20))


def test_the_pickers_guard_their_metrics_with_exactly_the_rbac_it_needs(tmp_path: Path) -> None:
    """Every picker runs --metrics-endpoint-auth with the closed defaults; its account may
    create the two reviews the guard makes, and nothing more cluster-wide; the monitoring
    component's scrapes carry, as the llm-d router's chart writes it (``authorization``
    from a Secret, no deprecated ``bearerTokenFile``), the token of an account allowed to
    GET /metrics and nothing else."""
    monitored = with_components(tmp_path, "base", "components/monitoring")
    (endpoint,) = one(monitored, "ServiceMonitor", "switchyard")["spec"]["endpoints"]
    assert "bearerTokenFile" not in endpoint
    credentials = endpoint["authorization"]["credentials"]
    assert credentials["key"] == "token"
    secret = one(monitored, "Secret", credentials["name"])
    assert secret["type"] == "kubernetes.io/service-account-token"
    reader = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    one(monitored, "ServiceAccount", reader)
    readers = [
        binding["roleRef"]["name"]
        for binding in find(monitored, "ClusterRoleBinding")
        if ("ServiceAccount", reader) in [(s["kind"], s["name"]) for s in binding["subjects"]]
    ]
    assert readers == ["switchyard-metrics-reader"]
    base = built("base")
    for deployment in find(base, "Deployment"):
        if not deployment["metadata"]["name"].startswith("lwepp-"):
            continue
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = lwepp_parser().parse_args(container["args"])
        assert args.metrics_endpoint_auth is True
        on = [args.test_selection, args.report_served_endpoint, args.enable_debug_pages]
        assert on == [False, False, False]
        assert PickerOptions.from_args(args).explain == "off"
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        assert cluster_granted(base, account) == used_by_metrics_auth()
    reader = one(base, "ClusterRole", "switchyard-metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]


def test_the_service_monitor_scrapes_every_service_s_metrics_port(tmp_path: Path) -> None:
    """The port is named as the llm-d router's chart names it, ``http-metrics``; BBR's and
    every picker's Service has it, and it reaches the container's ``--metrics-port``."""
    monitored = with_components(tmp_path, "base", "components/monitoring")
    (endpoint,) = one(monitored, "ServiceMonitor", "switchyard")["spec"]["endpoints"]
    assert endpoint["port"] == "http-metrics"
    selector = one(monitored, "ServiceMonitor", "switchyard")["spec"]["selector"]["matchLabels"]
    scraped = 0
    for deployment in find(monitored, "Deployment"):
        name = deployment["metadata"]["name"]
        if not (name == "bbr" or name.startswith("lwepp-")):
            continue
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (port,) = [int(a.split("=")[1]) for a in container["args"] if "--metrics-port=" in a]
        service = one(monitored, "Service", name)
        assert selector.items() <= service["metadata"]["labels"].items()
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["http-metrics"]["targetPort"] == port, name
        scraped += 1
    assert scraped == 3
