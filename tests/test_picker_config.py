"""The EndpointPickerConfig file: resolution, the router's defaults, strict errors, --check-config."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lwepp.config import ConfigErrors, PickerConfig, load_config
from lwepp.explain import DECISION_HEADER, EXPLAIN_HEADER
from lwepp.plugins import REGISTRY
from lwepp.plugins.pickers import MaxScorePicker, RandomPicker
from plugin_api import Role
from serving.testing import ExtProcClient, request_headers, response_headers, set_headers
from tests.plugin_fakes import (
    FakeFilter,
    FakeScorer,
    FakeSource,
    fake_filter,
    fake_scorer,
    fake_source,
)
from tests.processes import service
from wire.extproc import ProcessingResponse

TYPES = {
    **REGISTRY,
    "fake-scorer": fake_scorer,
    "fake-filter": fake_filter,
    "fake-source": fake_source,
}
HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "picker.yaml"
    path.write_text(header + textwrap.dedent(body))
    return path


def load(tmp_path: Path, body: str, header: str = HEADER) -> PickerConfig:
    return load_config(write(tmp_path, body, header), TYPES)


def test_a_router_style_file_resolves_into_stages_with_weights(tmp_path: Path) -> None:
    """Plugins land in their stages in profile order, with their weights and a default picker."""
    config = load(
        tmp_path,
        """
        plugins:
        - type: fake-source
          parameters: {values: {queue_depth: 1}}
        - type: fake-filter
          name: no-a
        - {type: fake-scorer, name: queue, parameters: {reads: [queue_depth]}}
        - type: fake-scorer
          name: other
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: other
          - pluginRef: queue
            weight: 2
          - pluginRef: no-a
        """,
    )
    pipeline = config.pipeline()
    assert [f.name for f in pipeline.filters] == ["no-a"]
    assert [(s.name, w) for s, w in pipeline.scorers] == [("other", 1.0), ("queue", 2.0)]
    assert isinstance(pipeline.picker, MaxScorePicker)
    assert not any(Role.PICK in p.roles for p in config.plugins)  # the default picker
    assert [s.name for s in pipeline.sources] == ["fake-source"]
    assert isinstance(pipeline.sources[0], FakeSource)
    assert config.warnings == ()
    assert config.profile == "default"


def test_without_profiles_every_filter_scorer_and_picker_runs_in_file_order(tmp_path: Path) -> None:
    """As the router: no schedulingProfiles builds a ``default`` profile of all of them."""
    config = load(
        tmp_path,
        """
        plugins:
        - type: fake-scorer
        - type: random-picker
        - type: fake-filter
        """,
    )
    pipeline = config.pipeline()
    assert config.profile == "default"
    assert isinstance(pipeline.scorers[0][0], FakeScorer)
    assert isinstance(pipeline.filters[0], FakeFilter)
    assert isinstance(pipeline.picker, RandomPicker)


def test_hooks_run_for_profile_plugins_and_hook_only_plugins(tmp_path: Path) -> None:
    """A hook-only plugin runs unlisted, after the profile's; a scorer left out does not run."""
    config = load(
        tmp_path,
        """
        plugins:
        - type: tests.plugin_fakes.HookOnly
          name: audit
        - type: tests.plugin_fakes.HookingScorer
          name: used
        - type: tests.plugin_fakes.HookingScorer
          name: unused
        schedulingProfiles:
        - name: p
          plugins: [{pluginRef: used}]
        """,
    )
    pipeline = config.pipeline()
    assert [h.name for h in pipeline.on_complete] == ["used", "audit"]
    assert [h.name for h in pipeline.picked] == ["used", "audit"]
    assert [s.name for s, _ in pipeline.scorers] == ["used"]
    (warning,) = config.warnings
    assert warning.endswith(
        "plugin 'unused' (tests.plugin_fakes.HookingScorer): not in profile 'p': it does not run"
    )


def test_a_user_plugin_is_built_by_dotted_path_class_or_classmethod(tmp_path: Path) -> None:
    """``pkg.module.Class`` is called as Class(name, params); a classmethod path works too."""
    config = load(
        tmp_path,
        """
        plugins:
        - type: tests.plugin_fakes.fake_scorer
          name: by-function
          parameters: {default: 0.5}
        - type: tests.plugin_fakes.HookingScorer.from_params
          name: by-classmethod
        """,
    )
    assert [s.name for s, _ in config.pipeline().scorers] == ["by-function", "by-classmethod"]


def test_deprecated_api_version_and_unimplemented_sections_are_warned_about(tmp_path: Path) -> None:
    """The old group, gates and sections without effect here load, each with a warning saying so."""
    config = load(
        tmp_path,
        """
        featureGates: [haPopulateNonLeaderDatastore=true]
        plugins:
        - type: fake-source
        - type: single-profile-handler
        - type: openai-parser
        requestHandler: {parsers: [{pluginRef: openai-parser}], propagatePriority: true}
        dataLayer:
          sources: [{pluginRef: fake-source, extractors: []}]
          crossReplicaSyncInterval: 500ms
        """,
        header="apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n",
    )
    text = "\n".join(config.warnings)
    for expected in (
        ":1: apiVersion: deprecated: use llm-d.ai/v1",
        "plugin 'single-profile-handler' (single-profile-handler): ignored",
        ":8: plugin 'openai-parser' (openai-parser): ignored: Switchyard parses OpenAI bodies",
        ":9: requestHandler: decoded and ignored",
        ":10: dataLayer: decoded and ignored",
    ):
        assert expected in text
    assert "haPopulateNonLeaderDatastore" not in text  # true is its default: nothing to say
    assert len(config.warnings) == 5


def test_both_api_versions_of_the_router_load_the_same_file(tmp_path: Path) -> None:
    """llm-d.ai/v1alpha1 (v0.10) and llm-d.ai/v1 (the router's HEAD) decode alike, unwarned."""
    body = "plugins:\n- type: fake-scorer\n- type: decode-filter\n"
    for version in ("llm-d.ai/v1alpha1", "llm-d.ai/v1"):
        config = load(tmp_path, body, header=f"apiVersion: {version}\nkind: EndpointPickerConfig\n")
        assert config.api_version == version
        assert [f.name for f in config.pipeline().filters] == ["decode-filter"]
        assert config.warnings == ()


ERRORS = [
    ("bogus: 1\n", "picker.yaml:3: unknown field 'bogus' (known: apiVersion, dataLayer,"),
    (
        "plugins:\n- type: fake-scorer\n  nmae: q\n",
        "picker.yaml:5: plugins[0]: unknown field 'nmae'",
    ),
    ("plugins:\n- type: no-such\n", "picker.yaml:4: plugin 'no-such' (no-such): type: unknown"),
    (
        "plugins:\n- type: fake-scorer\n- type: context-length-aware\n"
        "- type: burst-prefix-cache-producer\n"
        "- type: precise-prefix-cache-producer\nschedulingProfiles:\n- name: p\n  plugins:\n"
        "  - pluginRef: context-length-aware\n",
        "picker.yaml: needs what Switchyard does not implement: running-request and "
        "context-length scoring (context-length-aware (line 5)); burst co-location of "
        "prompt-sharing requests (burst-prefix-cache-producer (line 6))",
    ),
    (
        "plugins:\n- type: max-score-picker\n  parameters:\n    maxNumOfEndpoints: x\n",
        "picker.yaml:6: plugin 'max-score-picker' (max-score-picker): "
        "parameters.maxNumOfEndpoints: expected int",
    ),
    (
        "plugins:\n- type: fake-scorer\n  parameters: {tabel: {}}\n",
        "picker.yaml:5: plugin 'fake-scorer' (fake-scorer): parameters: unknown field 'tabel'",
    ),
    (
        "plugins:\n- {type: fake-scorer, name: q}\n- {type: fake-filter, name: q}\n",
        "picker.yaml:5: plugin 'q' (fake-filter): name: duplicate (also plugins[0])",
    ),
    (
        "plugins:\n- type: fake-scorer\nschedulingProfiles:\n- name: p\n  plugins:\n"
        "  - pluginRef: fake-scoer\n",
        "picker.yaml:8: profile 'p', plugin 'fake-scoer': pluginRef: names no plugin "
        "(plugins: fake-scorer)",
    ),
    (
        "plugins:\n- type: fake-scorer\nschedulingProfiles:\n- name: p\n  plugins:\n"
        "  - {pluginRef: fake-scorer, weight: -1}\n",
        "picker.yaml:8: schedulingProfiles[0].plugins[0].weight: must be >= 0, got -1",
    ),
    (
        "plugins:\n- type: fake-scorer\nschedulingProfiles:\n- name: p\n  plugins:\n"
        "  - {pluginRef: fake-scorer, weight: high}\n",
        "picker.yaml:8: schedulingProfiles[0].plugins[0].weight: expected float, got str 'high'",
    ),
    (
        "schedulingProfiles:\n- name: a\n- name: b\n",
        "picker.yaml:5: schedulingProfiles: Switchyard runs exactly one scheduling profile; "
        "found 2 ('a', 'b')",
    ),
    (
        "plugins:\n- type: fake-source\nschedulingProfiles:\n- name: p\n  plugins:\n"
        "  - pluginRef: fake-source\n",
        "plugin 'fake-source': pluginRef: a data source runs on its own",
    ),
    (
        "plugins:\n- type: random-picker\n- type: max-score-picker\n",
        "profile 'default': more than one picker: random-picker, max-score-picker",
    ),
    (
        "plugins:\n- type: fake-scorer\n  parameters: {reads: [queue_depth]}\n"
        "dataLayer: {injectDefaults: false}\n",
        "picker.yaml:4: plugin 'fake-scorer' (fake-scorer): reads 'queue_depth', which no "
        "configured data source produces (add one: metrics-data-source produces it)",
    ),
    (
        "plugins:\n- type: fake-scorer\n  parameters: {reads: [warp_factor]}\n",
        "picker.yaml:4: plugin 'fake-scorer' (fake-scorer): reads 'warp_factor', which no "
        "configured data source produces",
    ),
    ("featureGates: [warpDrive]\n", "picker.yaml:3: featureGates: unknown gate 'warpDrive'"),
    ("featureGates: [flowControl=maybe]\n", "'flowControl=maybe': expected flowControl=true or"),
    ("featureGates: [enableLegacyMetrics]\n", "'enableLegacyMetrics': removed from the router"),
    ("parser: {pluginRef: openai-parser}\n", "parser.pluginRef: 'openai-parser' names no plugin"),
    (
        "flowControl: {defaultPriorityBand: {fairnessPolicyRef: fair}}\n",
        "flowControl.defaultPriorityBand.fairnessPolicyRef: 'fair' names no plugin",
    ),
    ("requestHandler: {parserz: []}\n", "requestHandler: unknown field 'parserz' (known: parsers"),
    (
        "plugins:\n- type: prefix-cache-scorer\n  parameters:\n"
        "    prefixMatchInfoProducerName: mine\n",
        "picker.yaml:6: plugin 'prefix-cache-scorer' (prefix-cache-scorer): "
        "prefixMatchInfoProducerName: 'mine' names no approx-prefix-cache-producer",
    ),
    (
        "plugins:\n- type: approx-prefix-cache-producer\n- type: prefix-cache-scorer\n"
        "  parameters: {blockSizeTokens: 8}\n",
        "blockSizeTokens belong to its producer 'approx-prefix-cache-producer': set them there",
    ),
    (
        "plugins:\n- type: approx-prefix-cache-producer\n  parameters: {lruCapacityPerServer: 0}\n",
        "picker.yaml:5: plugin 'approx-prefix-cache-producer' (approx-prefix-cache-producer): "
        "parameters.lruCapacityPerServer: must be >= 1, got 0",
    ),
    (
        "apiVersion: llm-d.ai/v2\nkind: EndpointPickerConfig\n",  # in place of the header
        "apiVersion: expected llm-d.ai/v1alpha1 or llm-d.ai/v1",
    ),
    (
        "plugins:\n- type: tests.plugin_fakes.Nothing\n",
        "type: cannot load 'tests.plugin_fakes.Nothing'",
    ),
    (
        "plugins:\n- type: tests.plugin_fakes.NotAPlugin\n",
        "plugin 'tests.plugin_fakes.NotAPlugin' (tests.plugin_fakes.NotAPlugin): "
        "NotAPlugin is no plugin",
    ),
    ("plugins: [\n", "picker.yaml:4: not YAML"),
    (
        "plugins:\n- type: approx-prefix-cache-producer\n  parameters: {autoTune: false}\n"
        "  parameters: {lruCapacityPerServer: 9}\n",
        "picker.yaml:6: key 'parameters' repeated (first at line 5); YAML allows a key once",
    ),
]


@pytest.mark.parametrize(
    ("body", "message"),
    ERRORS,
    ids=[
        "unknown-top-field",
        "unknown-plugin-field",
        "unknown-type",
        "router-features-not-implemented",
        "bad-parameter",
        "unknown-parameter",
        "duplicate-name",
        "dangling-ref",
        "negative-weight",
        "weight-not-a-number",
        "two-profiles",
        "source-in-profile",
        "two-pickers",
        "attribute-no-source-and-no-defaults",
        "attribute-nobody-produces",
        "unknown-feature-gate",
        "gate-value",
        "removed-gate",
        "dangling-ref-in-ignored-section",
        "dangling-policy-ref",
        "unknown-section-field",
        "producer-not-configured",
        "index-settings-twice",
        "bad-producer-parameter",
        "api-version",
        "dotted-path-missing",
        "not-a-plugin",
        "not-yaml",
        "repeated-key",
    ],
)
def test_each_error_names_the_file_line_plugin_and_field(
    tmp_path: Path, body: str, message: str
) -> None:
    """A bad file is refused with a message that says where (file:line), who and what."""
    header = "" if body.startswith("apiVersion:") else HEADER
    with pytest.raises(ConfigErrors) as raised:
        load_config(write(tmp_path, body, header), TYPES)
    assert message in str(raised.value)


def test_every_error_is_reported_not_just_the_first(tmp_path: Path) -> None:
    """Independent mistakes are listed together, one per line."""
    with pytest.raises(ConfigErrors) as raised:
        load(tmp_path, "plugins:\n- type: nope\n- type: fake-scorer\n  parameters: {x: 1}\n")
    assert len(raised.value.errors) == 2


def test_check_config_prints_the_pipeline_or_the_errors(tmp_path: Path) -> None:
    """``--check-config``: the resolved stages and exit 0, or every error and exit 1."""
    good = tmp_path / "good.yaml"
    good.write_text(
        HEADER
        + "plugins:\n- type: metrics-data-source\n- type: queue-scorer\n"
        + "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: queue-scorer, weight: 2}]\n"
    )
    ok = subprocess.run(
        [sys.executable, "-m", "lwepp", "--check-config", str(good)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"{good}: OK" in ok.stdout
    assert "  score              queue-scorer ×2" in ok.stdout
    assert (
        "  pick               max-score-picker  (default: the profile names no picker)" in ok.stdout
    )
    assert "  background         metrics-data-source" in ok.stdout
    assert "  queue-scorer         scorer; reads queue_depth" in ok.stdout
    bad = write(tmp_path, "plugins:\n- type: queue-scorer\ndataLayer: {injectDefaults: false}\n")
    refused = subprocess.run(
        [sys.executable, "-m", "lwepp", "--check-config", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 1
    assert (
        "picker.yaml:4: plugin 'queue-scorer' (queue-scorer): reads 'queue_depth'" in refused.stderr
    )


def test_the_demo_configuration_checks_out() -> None:
    """``demo/configs/prefix-aware.yaml``: prefix, queue and KV scorers over the metrics source."""
    config = load_config(Path(__file__).parent.parent / "demo/configs/prefix-aware.yaml")
    pipeline = config.pipeline()
    assert [(s.name, w) for s, w in pipeline.scorers] == [
        ("prefix-cache-scorer", 3.0),
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
    ]
    assert pipeline.needs_body
    assert [s.name for s in pipeline.sources] == ["metrics-data-source"]


def test_lwepp_runs_with_a_configuration_and_explains_on_request(tmp_path: Path) -> None:
    """``python -m lwepp --config --explain=header``: the pipeline picks, and the explain
    header says why."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "pods:\n- {name: a, address: 127.0.0.1, ports: [18001]}\n"
        "- {name: b, address: 127.0.0.1, ports: [18002]}\n"
    )
    config = write(
        tmp_path,
        "plugins:\n- type: label-selector-filter\n  parameters: {matchLabels: {}}\n"
        "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\n",
    )

    async def ask(port: int) -> list[ProcessingResponse]:
        async with ExtProcClient(f"127.0.0.1:{port}") as client:
            return await client.exchange(
                [
                    request_headers({EXPLAIN_HEADER: "1"}, end_of_stream=True),
                    response_headers({":status": "200"}),
                ]
            )

    flags = ["--pods", str(pods), "--config", str(config), "--explain=header"]
    with service("lwepp", *flags) as (_, listening):
        replies = asyncio.run(ask(listening["grpc_port"]))
    picked = dict(set_headers(replies[0]))["x-gateway-destination-endpoint"]
    assert picked == "127.0.0.1:18002,127.0.0.1:18001"
    decision = json.loads(dict(set_headers(replies[1]))[DECISION_HEADER])
    assert decision["picked"] == picked.split(",")


def test_lwepp_refuses_a_bad_configuration_at_start(tmp_path: Path) -> None:
    """A broken ``--config`` stops the start with the file's errors."""
    bad = write(tmp_path, "plugins:\n- type: nope\n")
    result = subprocess.run(
        [sys.executable, "-m", "lwepp", "--pods", "p.yaml", "--config", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "picker.yaml:4: plugin 'nope' (nope): type: unknown" in result.stderr


def test_the_router_s_deprecated_filter_names_load_with_a_warning(tmp_path: Path) -> None:
    """``by-label-selector`` is label-selector-filter (the router's alias, deprecated in v0.9);
    both it and ``by-label`` load, each with a warning naming what replaces it."""
    config = load(
        tmp_path,
        """
        plugins:
        - type: by-label-selector
          parameters: {matchLabels: {tier: gold}}
        - type: by-label
          parameters: {label: llm-d.ai/role, validValues: [decode]}
        """,
    )
    filters = config.pipeline().filters
    assert [type(f).__name__ for f in filters] == ["LabelSelectorFilter", "ByLabelFilter"]
    assert [w.split(": ", 1)[1] for w in config.warnings] == [
        "plugin 'by-label-selector' (by-label-selector): type: deprecated: use label-selector-filter",
        "plugin 'by-label' (by-label): type: deprecated: use label-selector-filter, or "
        "decode-filter/prefill-filter/encode-filter",
    ]


def test_a_config_file_that_is_not_utf8_is_refused_at_its_line(tmp_path: Path) -> None:
    """A byte that is not UTF-8 (a Latin-1 comment) is a ConfigErrors naming file:line:column
    and the byte, never a UnicodeDecodeError."""
    path = tmp_path / "picker.yaml"
    path.write_bytes(b"apiVersion: llm-d.ai/v1alpha1\n# caf\xe9\nkind: EndpointPickerConfig\n")
    with pytest.raises(ConfigErrors) as error:
        load_config(path)
    assert str(error.value) == f"{path}:2:6: not UTF-8 text (byte 0xe9)"
