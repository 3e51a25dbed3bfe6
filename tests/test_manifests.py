"""The Kubernetes manifests: they parse, their names and ports agree, RBAC matches the code."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bbr.__main__ import parser as bbr_parser
from bbr.server import HEALTH_SERVICES as BBR_HEALTH
from lwepp.__main__ import HEALTH_SERVICES as LWEPP_HEALTH
from lwepp.__main__ import build_parser as lwepp_parser
from lwepp.leader import LeaderElector
from pods.kubeapi import ClusterConfig, KubeApi
from tests.fake_kube import FakeKube, eventually
from tests.test_kubernetes import PODS, POOLS, k8s_pod, k8s_pool, tracking

MANIFESTS = Path(__file__).parent.parent / "manifests"
Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(directory: Path) -> Doc:
    return documents(directory / "kustomization.yaml")[0]


def objects(directory: Path) -> list[Doc]:
    """The objects a kustomization lists (resources, recursively), before its patches."""
    found: list[Doc] = []
    for resource in kustomization(directory).get("resources", []):
        target = (directory / resource).resolve()
        found += objects(target) if target.is_dir() else documents(target)
    return found


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = find(docs, kind, name)
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


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


def apply_json_patch(doc: Doc, ops: list[Doc]) -> Doc:
    """The two RFC 6902 operations the component uses: add (with ``-`` to append) and replace."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node: Any = doc
        for step in parents:
            node = node[int(step)] if isinstance(node, list) else node[step]
        if isinstance(node, list) and last == "-":
            assert op["op"] == "add"
            node.append(op["value"])
        else:
            key: Any = int(last) if isinstance(node, list) else last
            assert op["op"] == "add" or key in node or isinstance(node, list), op["path"]
            node[key] = op["value"]
    return doc


BASE = objects(MANIFESTS)
OVERLAYS = ["envoy-gateway", "istio"]


def leader_elected() -> list[Doc]:
    """The base with the leader-election component applied (its patches and resources)."""
    component = kustomization(MANIFESTS / "leader-election")
    assert component["kind"] == "Component"
    docs = BASE + [
        d for r in component["resources"] for d in documents(MANIFESTS / "leader-election" / r)
    ]
    patched: list[Doc] = []
    for doc in docs:
        for patch in component["patches"]:
            target = patch["target"]
            key, value = target["labelSelector"].split("=")
            if (
                doc["kind"] == target["kind"]
                and doc["metadata"].get("labels", {}).get(key) == value
            ):
                doc = apply_json_patch(doc, yaml.safe_load(patch["patch"]))
        patched.append(doc)
    return patched


# --- every file ------------------------------------------------------------------------------


def all_yaml() -> Iterator[Path]:
    return iter(sorted(MANIFESTS.rglob("*.yaml")))


@pytest.mark.parametrize("path", list(all_yaml()), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_manifest_parses_and_names_its_kind(path: Path) -> None:
    docs = documents(path)
    assert docs
    for doc in docs:
        assert {"apiVersion", "kind"} <= set(doc)
        if doc["kind"] not in ("Kustomization", "Component"):
            assert doc["metadata"]["name"]
            assert "namespace" not in doc["metadata"]  # set once, by the kustomization


def test_every_file_is_used_by_a_kustomization() -> None:
    used: set[Path] = set()
    for directory in [MANIFESTS, *(MANIFESTS / o for o in [*OVERLAYS, "leader-election"])]:
        used.add(directory / "kustomization.yaml")
        for resource in kustomization(directory).get("resources", []):
            target = (directory / resource).resolve()
            if not target.is_dir():
                used.add(target)
    assert set(all_yaml()) == used


def test_overlays_build_on_the_base_in_one_namespace() -> None:
    namespace = kustomization(MANIFESTS)["namespace"]
    assert one(BASE, "Namespace", namespace)
    for overlay in OVERLAYS:
        spec = kustomization(MANIFESTS / overlay)
        assert spec["namespace"] == namespace
        assert ".." in spec["resources"]
        docs = objects(MANIFESTS / overlay)
        assert one(docs, "Gateway", "inference-gateway")


# --- names and ports agree ------------------------------------------------------------------


POOL_NAMES = [d["metadata"]["name"] for d in find(BASE, "InferencePool")]


@pytest.mark.parametrize("pool_name", POOL_NAMES)
def test_pool_points_at_its_own_picker_service_and_port(pool_name: str) -> None:
    """endpointPickerRef names a Service whose port reaches the picker's --grpc-port."""
    pool = one(BASE, "InferencePool", pool_name)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    service = one(BASE, "Service", ref["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "http2"  # gRPC: HTTP/2 to the picker
    pickers = [
        d
        for d in find(BASE, "Deployment")
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
    pool = one(BASE, "InferencePool", pool_name)
    selector = pool["spec"]["selector"]["matchLabels"]
    servers = [
        d
        for d in find(BASE, "Deployment")
        if labels_match(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(servers) == 1
    ports = {p["containerPort"] for p in container(servers[0])["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    # The simulator's pod file entry for its --selector serves on the same port.
    configmap = one(BASE, "ConfigMap", "simulated-models")
    entries = yaml.safe_load(configmap["data"]["pods.yaml"])["pods"]
    key, value = flag(container(servers[0])["args"], "--selector").split("=")
    [entry] = [e for e in entries if e["labels"].get(key) == value]
    assert entry["ports"] == [p["number"] for p in pool["spec"]["targetPorts"]]


@pytest.mark.parametrize("pool_name", POOL_NAMES)
def test_each_model_routes_to_its_pool(pool_name: str) -> None:
    """An HTTPRoute matches X-Gateway-Model-Name = the pool's model and backs onto the pool."""
    routes = [
        r
        for r in find(BASE, "HTTPRoute")
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
    server = one(BASE, "Deployment", pool_name)
    assert flag(container(server)["args"], "--selector") == f"model={header['value']}"
    assert routes[0]["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def test_probes_hit_the_health_ports_and_services_the_code_reports() -> None:
    for deployment in find(BASE, "Deployment"):
        spec = container(deployment)
        if "livenessProbe" not in spec or "grpc" not in spec["livenessProbe"]:
            continue
        health_port = int(flag(spec["args"], "--grpc-health-port"))
        known = LWEPP_HEALTH if spec["image"] == "switchyard/lwepp" else BBR_HEALTH
        for probe in (spec["livenessProbe"], spec["readinessProbe"]):
            assert probe["grpc"]["port"] == health_port
            assert probe["grpc"].get("service", "") in known
        declared = {p["containerPort"] for p in spec["ports"]}
        ports = {int(flag(spec["args"], f)) for f in ("--grpc-port", "--metrics-port")}
        assert ports | {health_port} <= declared


def test_container_args_are_flags_the_services_accept() -> None:
    """Every Deployment's args parse with the real argument parser (or appear in --help)."""
    simulator_help = subprocess.run(
        [sys.executable, "-m", "simulator", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for deployment in [*BASE, *leader_elected()]:
        if deployment["kind"] != "Deployment":
            continue
        spec = container(deployment)
        match spec["image"]:
            case "switchyard/lwepp":
                parsed = lwepp_parser().parse_args(spec["args"])
                assert parsed.pool_name
            case "switchyard/bbr":
                bbr_parser().parse_args(spec["args"])
            case "switchyard/simulator":
                for arg in spec["args"]:
                    assert arg.split("=")[0] in simulator_help
            case other:
                raise AssertionError(f"unknown image {other}")


def test_bbr_is_wired_into_each_gateway() -> None:
    """Envoy Gateway's policy and Istio's filter both call the BBR Service on its ext_proc port."""
    service = one(BASE, "Service", "bbr")
    [grpc_port] = [p for p in service["spec"]["ports"] if p.get("appProtocol") == "http2"]
    assert (
        int(flag(container(one(BASE, "Deployment", "bbr"))["args"], "--grpc-port"))
        == (grpc_port["targetPort"])
    )
    assert "--streaming" in container(one(BASE, "Deployment", "bbr"))["args"]

    eg = objects(MANIFESTS / "envoy-gateway")
    [policy] = find(eg, "EnvoyExtensionPolicy")
    assert policy["spec"]["targetRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "inference-gateway",
    }
    [ext_proc] = policy["spec"]["extProc"]
    assert ext_proc["backendRefs"] == [{"name": "bbr", "port": grpc_port["port"]}]
    assert ext_proc["processingMode"]["request"]["body"] == "FullDuplexStreamed"
    fallback = one(eg, "HTTPRoute", "no-model")
    ref = fallback["spec"]["rules"][0]["filters"][0]["extensionRef"]
    direct = one(eg, ref["kind"], ref["name"])["spec"]["directResponse"]
    assert direct["statusCode"] == 404
    error = json.loads(direct["body"]["inline"])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")

    namespace = kustomization(MANIFESTS)["namespace"]
    envoy_filter = one(objects(MANIFESTS / "istio"), "EnvoyFilter", "bbr")
    value = envoy_filter["spec"]["configPatches"][0]["patch"]["value"]
    cluster = value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert cluster == f"outbound|{grpc_port['port']}||bbr.{namespace}.svc.cluster.local"
    assert value["typed_config"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    selector = envoy_filter["spec"]["workloadSelector"]["labels"]
    assert selector == {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}


def served_models() -> dict[str, str]:
    """Model → pool, as the base's HTTPRoutes route them."""
    return {
        rule["matches"][0]["headers"][0]["value"]: rule["backendRefs"][0]["name"]
        for route in find(BASE, "HTTPRoute")
        for rule in route["spec"]["rules"]
    }


def model_answers_eg() -> dict[tuple[str, str], tuple[int, Any]]:
    """Envoy Gateway overlay: (path match type, value) → (status, parsed JSON body)."""
    eg = objects(MANIFESTS / "envoy-gateway")
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
    patches = one(objects(MANIFESTS / "istio"), "EnvoyFilter", "models")["spec"]["configPatches"]
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


def test_leader_election_component_patches_every_picker() -> None:
    for deployment in find(leader_elected(), "Deployment"):
        spec = container(deployment)
        if spec["image"] != "switchyard/lwepp":
            continue
        assert "--leader-elect" in spec["args"]
        assert deployment["spec"]["replicas"] == 2
        assert spec["livenessProbe"]["grpc"]["service"] == "liveness"
        assert spec["readinessProbe"]["grpc"]["service"] == "inference-extension"


# --- RBAC grants exactly what the code calls --------------------------------------------------


def granted(docs: list[Doc], service_account: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) the Roles bound to ``service_account`` grant."""
    rights: set[tuple[str, str, str]] = set()
    for binding in find(docs, "RoleBinding"):
        if {"kind": "ServiceAccount", "name": service_account} not in binding["subjects"]:
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


def used_by_the_code() -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """The (group, resource, verb) requests the pod source, then the elector, really make.

    Recorded by the fake API server while each runs through its paths: list,
    watch, resume, relist after 410; acquire, renew, lose, take over, release.
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


def test_rbac_grants_exactly_what_the_code_calls() -> None:
    """Base RBAC = the pod source's requests; the component adds the elector's, nothing more."""
    source_verbs, elector_verbs = used_by_the_code()
    deployment = one(BASE, "Deployment", f"lwepp-{POOL_NAMES[0]}")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert granted(BASE, account) == source_verbs
    assert granted(leader_elected(), account) == source_verbs | elector_verbs
    assert granted(BASE, "bbr") == set()
    assert one(BASE, "ServiceAccount", "bbr")["automountServiceAccountToken"] is False
