"""llm-d's own files, as its users copy them: each loads and picks, or is refused in one line that
names what Switchyard does not implement.

``tests/data/upstream/`` holds them verbatim, with where each came from
(``SOURCES.md``: repository, commit, path) and the Apache-2.0 licence they
are under: the llm-d guides' router values (``guides/*/router/*.values.yaml``),
the router's perf values (``test/perf/config/router-configs``) and
integration configurations (``test/integration/epp/testdata``), and the YAML
blocks of the router's plugin READMEs and ``docs/discovery.md``
(``*.examples.yaml``, one block a document, each headed by where it is).
A values file's configurations are the strings under
``router.epp.pluginsCustomConfig`` (``bench.upstream``); a README block that
is a fragment (a list of plugins, one plugin, or sections without
``apiVersion``) is completed with the header the router's files carry.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from bench.upstream import OPTIMIZED_BASELINE, UPSTREAM, guide_config, guide_configs
from lwepp import router_compat as compat
from lwepp.__main__ import build_parser
from lwepp.attributes import AttributeStore
from lwepp.config import ConfigErrors, PickerConfig, load_text
from lwepp.picking import RequestInfo
from lwepp.plugins.affinity import PrefixCacheAffinityFilter
from pods.model import Endpoint

COPIED = (UPSTREAM / "llm-d", UPSTREAM / "llm-d-router")
"""The trees of upstream's files, as SOURCES.md lists them (the files beside them, the flags'
and manifests' arguments, name their sources in their own headers)."""
HEADER = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}
SECTIONS = {"plugins", "schedulingProfiles", "featureGates", "dataLayer", "flowControl",
            "requestHandler", "saturationDetector", "parser", "data"}  # fmt: skip


def _example(document: Any) -> str | None:
    """A README block as a whole configuration (None: not one, e.g. an engine's flags)."""
    plugins = document if isinstance(document, list) else [document]
    if plugins and all(isinstance(d, dict) and isinstance(d.get("type"), str) for d in plugins):
        return yaml.safe_dump({**HEADER, "plugins": plugins}, sort_keys=False)
    keys = set(document) if isinstance(document, dict) else set()
    if keys & SECTIONS and keys <= SECTIONS | set(HEADER):
        return yaml.safe_dump({**HEADER, **document}, sort_keys=False)
    return None


def _copied(pattern: str) -> list[Path]:
    return [path for tree in COPIED for path in tree.rglob(pattern)]


def every_config() -> Iterator[tuple[str, str | None]]:
    """Every configuration under ``UPSTREAM``, by ``<path>`` or ``<path>#<key or block>``."""
    for path in sorted(_copied("*.yaml")):
        name = str(path.relative_to(UPSTREAM))
        if path.name.endswith(".examples.yaml"):
            for number, document in enumerate(yaml.safe_load_all(path.read_text()), 1):
                yield f"{name}#{number}", _example(document)
        elif "router" in (yaml.safe_load(path.read_text()) or {}):
            for key, text in guide_configs(path).items():
                yield f"{name}#{key}", text
        else:
            yield name, path.read_text()


CONFIGS = dict(every_config())

LOADS = {
    "llm-d/guides/coord-disaggregation/router/coord-disaggregation-decode.values.yaml#coordinator-plugins.yaml",
    "llm-d/guides/coord-disaggregation/router/coord-disaggregation-encode.values.yaml#coordinator-plugins.yaml",
    "llm-d/guides/coord-disaggregation/router/coord-disaggregation-prefill.values.yaml#coordinator-plugins.yaml",
    "llm-d/guides/fast-model-actuation-base/router/fast-model-actuation-base.values.yaml#fast-model-actuation-plugins.yaml",
    "llm-d/guides/fast-model-actuation-keda/router/fast-model-actuation-keda.values.yaml#fast-model-actuation-keda-plugins.yaml",
    "llm-d/guides/fast-model-actuation/router/fast-model-actuation.values.yaml#fast-model-actuation-plugins.yaml",
    "llm-d/guides/flow-control/router/flow-control.values.yaml#custom-plugins.yaml",
    "llm-d/guides/hyperconverged-cephfs/router/hyperconverged-cephfs.values.yaml#hyperconverged-cephfs-plugins.yaml",
    "llm-d/guides/omni-serving/router/image-to-image.values.yaml#i2i.yaml",
    "llm-d/guides/omni-serving/router/omni.values.yaml#omni-serving.yaml",
    "llm-d/guides/omni-serving/router/text-to-image.values.yaml#t2i.yaml",
    "llm-d/guides/omni-serving/router/text-to-speech.values.yaml#tts.yaml",
    "llm-d/guides/optimized-baseline/router/npu.rbln.values.yaml#optimized-baseline-plugins.yaml",
    "llm-d/guides/optimized-baseline/router/npu.values.yaml#optimized-baseline-plugins.yaml",
    "llm-d/guides/optimized-baseline/router/optimized-baseline-trtllm.values.yaml#optimized-baseline-plugins.yaml",
    "llm-d/guides/optimized-baseline/router/optimized-baseline.values.yaml#optimized-baseline-plugins.yaml",
    "llm-d/guides/pod-snapshot/router/pod-snapshot.values.yaml#pod-snapshot-plugins.yaml",
    "llm-d/guides/precise-prefix-cache-routing/router/precise-prefix-cache-routing-gpt-oss-120b.values.yaml#precise-prefix-cache-routing-plugins.yaml",
    "llm-d/guides/precise-prefix-cache-routing/router/sglang.values.yaml#precise-prefix-cache-routing-plugins.yaml",
    "llm-d/guides/precise-prefix-cache-routing/router/xpu.values.yaml#precise-prefix-cache-routing-plugins.yaml",
    "llm-d/guides/predicted-latency-routing/router/predicted-latency-multimodal.values.yaml#multimodal-latency-predictor-plugins.yaml",
    "llm-d/guides/predicted-latency-routing/router/predicted-latency.values.yaml#predicted-latency-plugins.yaml",
    "llm-d/guides/predicted-latency-routing/router/predicted-latency-slo.values.yaml#predicted-latency-slo-plugins.yaml",
    "llm-d/guides/spec-decoding/router/spec-decoding.values.yaml#spec-decoding-plugins.yaml",
    "llm-d/guides/tiered-prefix-cache/router/mooncake-offloading.values.yaml#tiered-prefix-cache-mooncake-plugins.yaml",
    "llm-d/guides/wide-ep-lws/router/xpu-qwen3-235b.values.yaml#wide-ep-lws-config.yaml",
    "llm-d/guides/wide-ep/router/wide-ep-aggregated.values.yaml#wide-ep-aggregated-config.yaml",
    "llm-d-router/test/integration/epp/testdata/default-config.yaml",
    "llm-d-router/test/perf/config/router-configs/optimized-baseline.yaml#optimized-baseline-plugins.yaml",
    "llm-d-router/test/perf/config/router-configs/precise-prefix.yaml#precise-baseline-plugins.yaml",
    "llm-d-router/test/perf/config/router-configs/random-only-default-parsers.yaml#optimized-baseline-plugins.yaml",
    "llm-d-router/test/perf/config/router-configs/random-passthrough-parser.yaml#optimized-baseline-plugins.yaml",
}  # fmt: skip
"""Guides' and the router's own files that load (README blocks that do: ``EXAMPLES_LOADING``)."""

GUIDES_REFUSED = {
    "agentic-serving/router/agentic-serving-gpu-program-aware": "agent identity",
    "agentic-serving/router/agentic-serving-gpu.": "prefill/decode",
    "agentic-serving/router/agentic-serving-tpu-disagg": "prefill/decode",
    "agentic-serving/router/agentic-serving.": "agent identity",
    "coord-disaggregation/router/coord-disaggregation.": "prefill/decode",
    "coordinator-epd/router/coordinator-epd": "prefill/decode",
    "deepseek-v4/router/deepseek-v4": "prefill/decode",
    "glm-5-2/router/glm-5-2": "prefill/decode",
    "glm-5-2/router/precise-routing": "prefill/decode",
    "multi-cluster-routing/router/hub-latency": "multi-cluster",
    "multi-cluster-routing/router/hub-load": "multi-cluster",
    "p2p-kv-cache-sharing/router/p2p-kv-cache-sharing": "P2P source",
    "pd-disaggregation/router/pd-disaggregation-iluvatar": "prefill/decode",
    "pd-disaggregation/router/pd-disaggregation.": "prefill/decode",
    "pd-disaggregation/router/pd-multi-tier": "prefill/decode",
    "precise-prefix-cache-routing/router/lmetric": "LMetric",
    "precise-prefix-cache-routing/router/precise-prefix-cache-routing.": "tokenizer sidecar",
    "predicted-latency-routing/router/predicted-latency-pd": "prefill/decode",
    "turn-priority-fairness/router/turn-priority-fairness": "agent identity",
    "wide-ep-lws/router/precise-routing": "prefill/decode",
    "wide-ep-lws/router/wide-ep-lws.": "prefill/decode",
    "wide-ep/router/amd": "prefill/decode",
    "wide-ep/router/base": "prefill/decode",
    "wide-ep/router/glm-5.2-overrides": "prefill/decode",
    "wide-ep/router/precise-routing": "prefill/decode",
    "wide-ep/router/wide-ep.": "prefill/decode",
}
"""Guides refused, by the start of their path under ``guides/``, and the feature named."""

ALSO_REFUSED = {
    "llm-d/guides/turn-priority-fairness/router/turn-priority-fairness.values.yaml"
    "#turn-priority-plugins.yaml": [
        "flowControl.priorityBands[0]: unknown field 'defaultRequestTTL' (known: "
        "fairnessPolicyRef, maxBytes, maxRequests, orderingPolicyRef, priority)"
    ],
}
"""Errors besides the feature's, where a guide writes a field the router's schema has not (its
decoder drops unknown fields of the file's sections; Switchyard's names them)."""

EXAMPLES = "llm-d-router/pkg/epp/framework/plugins/"
NOT_THE_ROUTER_S = {
    "llm-d-router/docs/discovery.examples.yaml#8": "my-discovery: a plugin type the doc has "
    "users write themselves",
    f"{EXAMPLES}datalayer/source/dcgm/README.examples.yaml#1": "two plugins named alike "
    "(the router refuses duplicate names too)",
    f"{EXAMPLES}datalayer/source/notifications/README.examples.yaml#1": "a data: section, which "
    "the router's schema has not (dataLayer:), and a user-provided extractor type",
    f"{EXAMPLES}datalayer/source/notifications/README.examples.yaml#2": "the same",
    f"{EXAMPLES}requestcontrol/dataproducer/burstprefix/README.examples.yaml#1": "a fragment: "
    "its producer is in another block",
    f"{EXAMPLES}requestcontrol/dataproducer/preciseprefixcache/README.examples.yaml#1": "a "
    "fragment: its producer is in another block",
    f"{EXAMPLES}requestcontrol/dataproducer/multimodal/README.examples.yaml#1": "a fragment: "
    "its profile names scorers it does not list",
    f"{EXAMPLES}requestcontrol/dataproducer/multimodal/README.examples.yaml#2": "vllm.http, a "
    "field the router's token-producer has not (vllm.url)",
    f"{EXAMPLES}scheduling/scorer/loadaware/README.examples.yaml#1": "config:, a field the "
    "router's plugin entries have not (parameters:)",
}
"""README blocks the router would not run either, and why (each is reported as an error)."""


def outcome(name: str, text: str | None) -> tuple[str, list[str]]:
    """``loads``, ``refused`` or ``skipped`` (not a configuration), and the errors."""
    if text is None:
        return "skipped", []
    try:
        load_text(text, name)
    except ConfigErrors as refused:
        return "refused", refused.errors
    return "loads", []


FEATURES = [*compat.UNSUPPORTED, *(f for fields in compat.UNSUPPORTED_PARAMETERS.values()
                                   for _, f in fields.values())]  # fmt: skip
REFUSAL = re.compile(r"needs what Switchyard does not implement: (.*)$")
EXAMPLES_LOADING = [
    n for n in CONFIGS if ".examples.yaml#" in n and outcome(n, CONFIGS[n])[0] == "loads"
]


def test_every_file_is_listed_with_its_source_and_the_licence_is_kept() -> None:
    """SOURCES.md names each file (repository, commit, path); the licence notice is there."""
    sources = (UPSTREAM / "SOURCES.md").read_text()
    for path in _copied("*.yaml"):
        assert f"`{path.relative_to(UPSTREAM)}`" in sources, path
    assert "Apache License" in (UPSTREAM / "LICENSE.apache-2.0.txt").read_text()


def test_the_guides_and_the_router_s_files_load_or_are_refused_naming_the_feature() -> None:
    """Every guide's and router file's configuration is accounted for: it loads (``LOADS``), or
    its one error names the feature (``GUIDES_REFUSED`` for the guides)."""
    guides = {n for n in CONFIGS if n.startswith("llm-d/guides/")}
    assert len(guides) == 53
    refused_guides = {n for n in guides if n not in LOADS}
    for name in sorted(n for n in CONFIGS if ".examples.yaml#" not in n):
        result, errors = outcome(name, CONFIGS[name])
        if name in LOADS:
            assert result == "loads", (name, errors)
            continue
        assert result == "refused", name
        [error, *more] = errors
        assert [m.split(": ", 1)[1] for m in more] == ALSO_REFUSED.get(name, []), more
        assert (match := REFUSAL.search(error)), error
        assert any(match[1].startswith(f) for f in FEATURES), error
        if name in refused_guides:
            [feature] = [f for k, f in GUIDES_REFUSED.items() if name[len("llm-d/guides/") :]
                         .startswith(k)]  # fmt: skip
            assert feature in error, (name, error)
    assert len(refused_guides) == len(GUIDES_REFUSED)


def test_every_readme_example_loads_or_is_refused_naming_the_feature() -> None:
    """The plugin READMEs' and docs/discovery.md's blocks: each that is a configuration loads, or
    is refused in one error naming the feature; those the router would refuse too fail."""
    results: dict[str, str] = {}
    for name, text in CONFIGS.items():
        if ".examples.yaml#" not in name:
            continue
        result, errors = outcome(name, text)
        results[name] = result
        if name in NOT_THE_ROUTER_S:
            assert result == "refused", name
        elif result == "refused":
            [error] = errors
            assert (match := REFUSAL.search(error)), error
            assert any(match[1].startswith(f) for f in FEATURES), error
    counts = {r: sum(1 for v in results.values() if v == r) for r in ("loads", "refused")}
    assert counts == {"loads": 44, "refused": 44}
    assert sum(1 for v in results.values() if v == "skipped") == 23


LABELLED = {"inference-role": "decode", "hardware-type": "H100", "gpu.type": "a100"}
"""What the label filters' README examples select, on half the endpoints."""


def _endpoints() -> tuple[Endpoint, ...]:
    """Eight endpoints, two of each llm-d role, half with ``LABELLED``'s labels."""
    roles = ("decode", "prefill", "encode", "prefill-decode")
    return tuple(
        Endpoint(
            f"pod-{i}",
            f"10.0.0.{i + 1}",
            8000,
            {"llm-d.ai/role": role, "app": "vllm", **(LABELLED if i % 2 else {})},
        )
        for i, role in enumerate(roles * 2)
    )


def serve(config: PickerConfig, requests: int = 16) -> list[str]:
    """Route ``requests`` chat and completion requests through ``config``'s pipeline, as the
    service does (headers, body, the response's hooks); the endpoints picked."""
    now = [0.0]
    pipeline = config.pipeline(store=AttributeStore(), clock=lambda: now[0], explain="off")
    pool, picked = _endpoints(), []
    for i in range(requests):
        system = "You answer in one line. " * 40
        body: dict[str, Any] = (
            {"model": "m", "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": f"question {i}"}]}
            if i % 2 else {"model": "m", "prompt": system + f"question {i}", "max_tokens": 4}
        )  # fmt: skip
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        headers = ((":method", "POST"), (":path", path), ("content-type", "application/json"),
                   ("x-request-id", f"r{i}"))  # fmt: skip
        choice = pipeline.choose(RequestInfo(headers, orjson.dumps(body)), pool)
        served = choice.endpoints[0].hostport
        picked.append(served)
        if choice.followup is not None:
            choice.followup.headers(served, {":status": "200"})
            choice.followup.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
            choice.followup.end()
        now[0] += 0.05
    failures = [s for m in pipeline.plugin_errors.collect() for s in m.samples if s.value]
    assert not failures, failures
    return picked


@pytest.mark.parametrize("name", sorted(LOADS) + EXAMPLES_LOADING)
def test_each_file_that_loads_picks_for_every_request(name: str) -> None:
    """Each loaded configuration picks an endpoint for every request, with no plugin failing."""
    text = CONFIGS[name]
    assert text is not None
    picked = serve(load_text(text, name))
    assert len(picked) == 16


def test_the_chart_flags_of_the_values_files_are_taken() -> None:
    """``router.epp.flags`` (the chart renders --name=value) parse as python -m lwepp's flags."""
    parser = build_parser()
    for path in _copied("*.yaml"):
        if path.name.endswith(".examples.yaml"):
            continue
        values = yaml.safe_load(path.read_text())
        flags = ((values.get("router") or {}).get("epp") or {}).get("flags") or {}
        for flag, value in flags.items():
            argv = [f"--{flag}" if value in ("", None) else f"--{flag}={str(value).lower()}"]
            assert not parser.parse_known_args(argv)[1], (path, argv)


def test_optimized_baseline_runs_unchanged_with_its_affinity_filter_first() -> None:
    """llm-d's default: the filter, then token-load-scorer; requests sharing a long prompt stay
    on the endpoint that holds it while it has no more in flight than the rest."""
    config = guide_config(OPTIMIZED_BASELINE)
    pipeline = config.pipeline()
    assert [type(f) for f in pipeline.filters] == [PrefixCacheAffinityFilter]
    assert [s.name for s, _ in pipeline.scorers] == ["token-load-scorer"]
    picked = serve(config)
    assert len(set(picked)) < len(_endpoints())


def test_readme_examples_are_extracted_with_their_source() -> None:
    """Each block names the README it comes from, and the README is listed in SOURCES.md."""
    sources = (UPSTREAM / "SOURCES.md").read_text()
    for path in _copied("*.examples.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# "), path
        assert ", yaml block 1 of " in first, path
        readme = first[2:].split(",")[0]
        assert f"`{readme}`" in sources, readme


def test_the_examples_cover_every_block_of_their_readmes() -> None:
    """Block i of n: every block of each README is there."""
    for path in _copied("*.examples.yaml"):
        heads = [line for line in path.read_text().splitlines() if ", yaml block " in line]
        total = int(heads[0].rsplit(" ", 1)[1])
        assert len(heads) == total, path
