"""The demo gateway driven by the official OpenAI Python SDK, as an OpenAI user's code drives it.

Every answer, and every refusal, must be what the SDK expects: the model list
and the three kinds of completion parse into its types, and each refusal
(BBR's, the gateway's, LWEPP's) surfaces as the SDK's exception for its
status, carrying the error's message, type and code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from demo.topology import Topology
from wire.exchange import MAX_BODY_BYTES

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(gateway: Topology) -> openai.OpenAI:
    # No retries: the SDK would resend a 503 twice before raising it.
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    """models.list() gives every pool's model; models.retrieve() one of them."""
    models = client.models.list()
    assert [(m.id, m.owned_by, m.object) for m in models] == [
        ("model-a", "a", "model"),
        ("model-b", "b", "model"),
    ]
    assert client.models.retrieve("model-b").owned_by == "b"


def test_completion_chat_and_streamed_chat(client: openai.OpenAI) -> None:
    """A completion, a chat completion and a streamed chat parse into the SDK's types."""
    completion = client.completions.create(model="model-a", prompt="Say hello", max_tokens=4)
    assert completion.model == "model-a"
    assert completion.choices[0].text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4

    messages: list[Any] = [{"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(model="model-b", messages=messages, max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content

    stream = client.chat.completions.create(
        model="model-a", messages=messages, max_tokens=4, stream=True
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices]
    assert len([piece for piece in pieces if piece]) == 4


def refused(call: Callable[[], object]) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(
    ("ask", "exception", "status", "code"),
    [
        pytest.param(
            lambda c: c.post("/completions", body=["not", "an", "object"], cast_to=object),
            openai.BadRequestError,
            400,
            "BadRequest",
            id="bbr-400-not-an-object",
        ),
        pytest.param(
            lambda c: c.completions.create(model="gpt-9", prompt="hi"),
            openai.NotFoundError,
            404,
            "model_not_found",
            id="gateway-404-unknown-model",
        ),
        pytest.param(
            lambda c: c.models.retrieve("gpt-9"),
            openai.NotFoundError,
            404,
            "model_not_found",
            id="gateway-404-unknown-model-card",
        ),
        pytest.param(
            lambda c: c.completions.create(
                model="model-a",
                prompt="hi",
                extra_headers={"test-epp-endpoint-selection": "192.0.2.1:8000"},
            ),
            openai.InternalServerError,
            503,
            "no_candidates",
            id="lwepp-503-no-candidate",
        ),
        pytest.param(
            lambda c: c.completions.create(model="model-a", prompt="x" * (MAX_BODY_BYTES + 1)),
            openai.APIStatusError,
            413,
            "body_too_large",
            id="bbr-413-body-over-cap",
        ),
        pytest.param(
            lambda c: c.audio.transcriptions.create(
                model="model-a", file=("hello.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")
            ),
            openai.APIStatusError,
            415,
            "UnsupportedMediaType",
            id="bbr-415-multipart-upload",
        ),
    ],
)
def test_each_refusal_is_the_sdk_exception_for_its_status(
    client: openai.OpenAI,
    ask: Callable[[openai.OpenAI], object],
    exception: type[openai.APIStatusError],
    status: int,
    code: str,
) -> None:
    """Each refusal is raised as the SDK's exception for its status (BadRequestError,
    NotFoundError, InternalServerError for 503, APIStatusError for 413 and 415), with the JSON
    error's type and code read into it."""
    error = refused(lambda: ask(client))
    assert type(error) is exception
    assert error.status_code == status
    assert error.code == code
    assert error.type == ("server_error" if status >= 500 else "invalid_request_error")
    assert error.response.headers["content-type"] == "application/json"
