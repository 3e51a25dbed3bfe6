"""BBR configured as the payload processor is now: a ``PayloadProcessorConfig`` from
``--config-file`` or ``--config-text`` (``bbr.config``), decoded strictly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bbr.config import load_config, load_text
from bbr.server import BodyBasedRouter
from plugin_api.document import ConfigErrors
from serving.testing import set_headers
from tests.test_bbr import FDS, post, talk

DEFAULT = Path(__file__).parent / "data" / "upstream" / "default-ipp-config.yaml"
HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: PayloadProcessorConfig\n"
EXTRACTOR = """\
- type: body-field-to-header
  name: extractor
  parameters: {fieldName: model, headerName: X-Gateway-Model-Name}
"""


class Stamp:
    """A response plugin of a user's own (``tests.test_bbr_config.Stamp``)."""

    def __init__(self, name: str, _params: object) -> None:
        self.name = name

    def process_response(self, _message: object) -> None:
        return None


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigErrors) as caught:
        load_text(HEAD + text, "ipp.yaml")
    return caught.value.errors


def test_the_payload_processor_s_default_configuration_routes_on_the_model() -> None:
    """The chart's default file: both plugins, in order, in the request chain; a request gets
    the model header and the (unknown, so empty) base model header."""
    config = load_config(DEFAULT)
    router = BodyBasedRouter(CollectorRegistry(), config.chains)
    assert [s.name for s in router.request_chain.steps] == [
        "body-field-to-header",
        "base-model-to-header",
    ]
    assert not router.response_chain
    replies = talk(router, *post(modes=FDS))
    assert ("X-Gateway-Model-Name", "llama-3") in set_headers(replies[0])
    assert ("X-Gateway-Base-Model-Name", "") in set_headers(replies[0])
    assert config.warnings == []


def test_pre_and_post_processing_wrap_the_profile_s_chains() -> None:
    """``preProcessing`` runs before the profile's request list, ``postProcessing`` after its
    response list; the one profile picker there is may be named."""
    config = load_text(
        HEAD
        + "plugins:\n"
        + EXTRACTOR
        + "- {type: base-model-to-header, name: base}\n"
        + "- {type: single-profile-picker}\n"
        + "- {type: tests.test_bbr_config.Stamp, name: echo}\n"
        + "- {type: tests.test_bbr_config.Stamp, name: last}\n"
        + "preProcessing: {plugins: [{pluginRef: base}]}\n"
        + "profilePicker: {pluginRef: single-profile-picker}\n"
        + "profiles:\n- name: one\n  plugins:\n    request: [{pluginRef: extractor}]\n"
        + "    response: [{pluginRef: echo}]\n"
        + "postProcessing: {plugins: [{pluginRef: last}]}\n",
        "ipp.yaml",
    )
    assert [r.name for r in config.request] == ["base", "extractor"]
    assert [r.name for r in config.response] == ["echo", "last"]


def test_what_bbr_cannot_do_is_refused_naming_the_file_line_and_field() -> None:
    """Model selection, weights, the data layer and several profiles are refused where they
    are written; every error at once."""
    found = errors(
        "plugins:\n"  # 3
        + EXTRACTOR  # 4-6
        + "- type: model-selector\n"  # 7
        + "profiles:\n"  # 8
        + "- name: a\n"  # 9
        + "  plugins:\n"  # 10
        + "    request:\n"  # 11
        + "    - pluginRef: extractor\n"  # 12
        + "      weight: 2\n"  # 13
        + "    - pluginRef: model-selector\n"  # 14
        + "- name: b\n"  # 15
        + "  plugins: {request: [{pluginRef: extractor}]}\n"  # 16
        + "datalayer:\n"  # 17
        + "  extractors: [{pluginRef: x}]\n"  # 18
    )
    assert found == [
        "ipp.yaml:7: plugins[1].type: 'model-selector' is the payload processor's model "
        "selection, which Switchyard's BBR does not implement",
        "ipp.yaml:18: datalayer.extractors: the data layer (collectors, extractors, "
        "datasources) is not implemented by Switchyard's BBR",
        "ipp.yaml:15: profiles[1].name: Switchyard's BBR runs one profile: choosing among "
        "several (a profile picker) is not implemented",
    ]


def test_mistakes_are_reported_at_their_line_with_the_field() -> None:
    """Unknown fields, a dangling reference, a bad parameter, a plugin in a chain it has no
    method for, a weight, a wrong kind: each reported, with its line."""
    found = errors(
        "plugins:\n"  # 3
        + "- type: body-field-to-header\n"  # 4
        + "  parameters: {fieldName: model}\n"  # 5
        + "- {type: base-model-to-header, name: base, extra: 1}\n"  # 6
        + "profiles:\n"  # 7
        + "- name: p\n"  # 8
        + "  plugins:\n"  # 9
        + "    request: [{pluginRef: nowhere}, {pluginRef: body-field-to-header, weight: 1}]\n"
        + "    response: [{pluginRef: body-field-to-header}]\n"  # 11
    )
    joined = "\n".join(found)
    assert "ipp.yaml:6: plugins[1]: unknown field 'extra'" in joined
    assert "ipp.yaml:10: profiles[0].plugins.request[0].pluginRef: no plugin is named" in joined
    assert "ipp.yaml:10: profiles[0].plugins.request[1].weight: only the model selector" in joined
    assert "ipp.yaml:5: plugin 'body-field-to-header' (body-field-to-header): " in joined
    assert "parameters.headerName: required" in joined
    with pytest.raises(ConfigErrors) as caught:
        load_text("apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n", "epp.yaml")
    assert caught.value.errors[:2] == [
        "epp.yaml:1: apiVersion: expected llm-d.ai/v1alpha1, got 'llm-d.ai/v1'",
        "epp.yaml:2: kind: expected PayloadProcessorConfig, got 'EndpointPickerConfig'",
    ]


def test_a_plugin_in_a_chain_it_has_no_method_for_is_an_error() -> None:
    """A request-only plugin referenced in the response list cannot run there."""
    found = errors(
        "plugins:\n"
        + EXTRACTOR
        + "profiles:\n- name: p\n  plugins:\n    response: [{pluginRef: extractor}]\n"
    )
    assert found == [
        "ipp.yaml:10: profiles[0].plugins.response[0].pluginRef: plugin 'extractor' "
        "(body-field-to-header) has no process_response: it cannot run in the response chain"
    ]


def test_the_command_takes_a_configuration_and_refuses_it_beside_plugin_flags(
    tmp_path: Path,
) -> None:
    """``python -m bbr --config-file``: a broken file exits 2 with every error; with
    ``--plugin`` too, it says to give one."""
    broken = tmp_path / "ipp.yaml"
    broken.write_text(HEAD + "plugins:\n- type: model-selector\nprofiles: []\n")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "bbr", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    failed = run("--config-file", str(broken))
    assert failed.returncode == 2
    assert f"{broken}:4: plugins[0].type: 'model-selector'" in failed.stderr
    assert f"{broken}:5: profiles: at least one profile is required" in failed.stderr
    both = run("--config-file", str(DEFAULT), "--plugin", "body-field-to-header:x:{}")
    assert both.returncode == 2
    assert "--plugin and a configuration" in both.stderr
