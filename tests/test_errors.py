"""Refusals as the client reads them: OpenAI-style JSON errors, whoever refused."""

from __future__ import annotations

import json

import pytest

from wire.exchange import Refusal, error_body


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "invalid_request_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
    ids=["400", "404", "413", "429", "500", "503"],
)
def test_error_type_follows_openai_split_between_client_and_server(status: int, kind: str) -> None:
    """A 4xx is the client's `invalid_request_error`, a 5xx the service's `server_error`."""
    assert error_body(status, "why", "label") == {
        "error": {"message": "why", "type": kind, "code": "label"}
    }


def test_refusal_answers_json_with_its_reason_as_code_and_its_own_headers() -> None:
    """A refusal becomes an ImmediateResponse: its status, `content-type: application/json`
    before the refusal's own headers, and the body {"error": {message, type, code=reason}}."""
    refusal = Refusal(503, "no ready endpoint", reason="no_endpoints", headers=[("x-why", "a")])

    answer = refusal.answer().immediate_response

    assert answer.status.code == 503
    headers = [(h.header.key, h.header.raw_value) for h in answer.headers.set_headers]
    assert headers == [("content-type", b"application/json"), ("x-why", b"a")]
    assert json.loads(answer.body) == {
        "error": {"message": "no ready endpoint", "type": "server_error", "code": "no_endpoints"}
    }


def test_refusal_without_reason_is_coded_with_gie_name_for_the_status() -> None:
    """No reason given: the code is GIE's name for the status (BadRequest, ...)."""
    answer = Refusal(400, "failed to parse request body").answer().immediate_response
    assert json.loads(answer.body)["error"]["code"] == "BadRequest"
