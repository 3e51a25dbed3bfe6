"""The OpenAI wire format as vLLM speaks it: request validation, responses, stream chunks, errors.

Only the fields a router or a test looks at are produced. Shapes follow
vLLM's OpenAI-compatible server: ``usage`` on every response, and when
streaming a final chunk with empty ``choices`` and the ``usage`` (vLLM sends
it when asked with ``stream_options.include_usage``; the simulator always
does, so the end of a stream is easy to check).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from simulator.tokenizer import tokenize

Api = Literal["completions", "chat"]

DEFAULT_MAX_TOKENS = 16
"""Output length when a request sets neither ``max_tokens`` nor ``max_completion_tokens``."""


class ApiError(Exception):
    """A request the server refuses; it becomes an OpenAI-style error body in one place."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message

    def body(self) -> dict[str, Any]:
        # vLLM's shape: the type names the error class, the code repeats the status.
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": None,
                "code": self.status,
            }
        }


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequestError", message)


@dataclass(frozen=True, slots=True)
class Request:
    """A validated generation request: only what the engine and the response need."""

    api: Api
    model: str
    tokens: tuple[int, ...]
    """The prompt's token ids (``simulator.tokenizer``), what the engine caches by."""
    max_tokens: int
    stream: bool
    prompts: tuple[tuple[int, ...], ...]
    """The prompt as the client split it: one entry per string of a list prompt, else
    one. Concatenated they are ``tokens``; the render endpoint answers one per entry."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


def named_model(raw: bytes) -> str | None:
    """The ``model`` a body names, if it is a JSON object naming one as a string."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def parse(api: Api, raw: bytes, served: Collection[str]) -> Request:
    """Validate a request body in the order vLLM does: JSON, then the model, then the fields.

    Raises ``ApiError``: 400 naming the problem, or 404 naming a model this
    replica does not serve (``served`` is the base model and its adapters).
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise bad_request(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("missing required field 'model' (a non-empty string)")
    if model not in served:
        raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.")
    prompts = _prompt_tokens(body) if api == "completions" else (_chat_tokens(body),)
    prompt = tuple(token for part in prompts for token in part)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("'max_tokens' (or 'max_completion_tokens') must be an integer >= 1")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false")
    if not prompt:
        raise bad_request("the prompt must have at least one token")
    return Request(api, model, prompt, max_tokens, stream, prompts)


def _prompt_tokens(body: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Completions: a string, a list of strings (one prompt, concatenated) or token ids.

    Returns the parts: one per string of a list, else one. The engine runs
    their concatenation as one sequence; ``/v1/completions/render`` answers
    each part separately, as vLLM renders each prompt of a list.
    """
    match body.get("prompt"):
        case str() as text:
            return (tuple(tokenize(text)),)
        case [*items] if items and all(isinstance(item, str) for item in items):
            return tuple(tuple(tokenize(item)) for item in items)
        case [*items] if items and all(type(item) is int for item in items):
            return (tuple(items),)
        case None:
            raise bad_request("missing required field 'prompt'")
        case _:
            raise bad_request("'prompt' must be a string, a list of strings or a list of token ids")


def _chat_tokens(body: dict[str, Any]) -> tuple[int, ...]:
    """Chat: the messages rendered by a trivial template, one ``role: content`` line each.

    Text parts of a multi-part ``content`` count; images and other parts do not.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = " ".join(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts")
        lines.append(f"{message['role']}: {content}")
    return tuple(tokenize("\n".join(lines)))


def usage(request: Request, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """Token counts; with ``cached`` (vLLM's ``--enable-prompt-tokens-details``) also
    ``prompt_tokens_details.cached_tokens``, the prompt tokens that hit the prefix cache."""
    counts: dict[str, Any] = {
        "prompt_tokens": request.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": request.prompt_tokens + completion_tokens,
    }
    if cached is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return counts


def _envelope(request: Request, rid: str, created: int, chunk: bool) -> dict[str, Any]:
    if request.api == "completions":
        kind = "text_completion"
    else:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": rid, "object": kind, "created": created, "model": request.model}


def response(
    request: Request, rid: str, created: int, text: str, tokens: int, cached: int | None = None
) -> dict[str, Any]:
    """The whole answer of a non-streamed request."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if request.api == "completions":
        choice["text"] = text
    else:
        choice["message"] = {"role": "assistant", "content": text}
    return {
        **_envelope(request, rid, created, False),
        "choices": [choice],
        "usage": usage(request, tokens, cached),
    }


def token_chunk(request: Request, rid: str, created: int, index: int, text: str) -> dict[str, Any]:
    """One streamed token. The last carries ``finish_reason``: the simulator never stops early."""
    finish = "length" if index == request.max_tokens - 1 else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if request.api == "completions":
        choice["text"] = text
    else:
        # The role rides on the first token's delta, so there is exactly one chunk per token.
        choice["delta"] = (
            {"role": "assistant", "content": text} if index == 0 else {"content": text}
        )
    return {**_envelope(request, rid, created, True), "choices": [choice]}


def usage_chunk(
    request: Request, rid: str, created: int, tokens: int, cached: int | None = None
) -> dict[str, Any]:
    """The chunk after the last token: no choices, only the token counts."""
    return {
        **_envelope(request, rid, created, True),
        "choices": [],
        "usage": usage(request, tokens, cached),
    }


def rendered(request: Request, rid: str, tokens: tuple[int, ...]) -> dict[str, Any]:
    """One prompt as vLLM's render endpoints answer it: a token-in generate request.

    vLLM's ``/v1/completions/render`` and ``/v1/chat/completions/render``
    return the request the engine would run, without running it:
    ``request_id``, ``token_ids`` (the prompt exactly as the engine tokenizes
    it), ``model``, ``sampling_params``, the ``stream`` flag, and
    ``token_offsets`` (null unless asked for; the simulator never fills it).
    A router that tokenizes through these endpoints (vllm-router's
    ``cache_aware``) thus keys its prefix tree by the ids the engine caches by.
    """
    return {
        "request_id": rid,
        "token_ids": list(tokens),
        "model": request.model,
        "sampling_params": {"max_tokens": request.max_tokens},
        "stream": request.stream,
        "token_offsets": None,
    }


def render(request: Request, rid: Callable[[], str]) -> list[dict[str, Any]] | dict[str, Any]:
    """The render endpoint's answer: completions, a list with one entry per prompt (each
    with its own ``rid()``); chat, a single object."""
    if request.api == "chat":
        return rendered(request, rid(), request.tokens)
    return [rendered(request, rid(), part) for part in request.prompts]


def prompt_token_ids(raw: bytes) -> list[int] | None:
    """A request body's prompt token ids exactly as ``parse`` gives them to the engine, or None.

    A local tokenizer for a router that indexes the engines' KV-cache events
    in front of these simulators (``precise-prefix-cache-producer``'s
    ``tokenizer``): chat ``messages`` through the chat template, a completions
    ``prompt`` as the engine reads it. None when the body is not JSON, has
    neither field, or ``parse`` would refuse it.
    """
    try:
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            return None
        if "messages" in body:
            return list(_chat_tokens(body))
        if "prompt" in body:
            return [token for part in _prompt_tokens(body) for token in part]
    except (ApiError, orjson.JSONDecodeError):
        return None
    return None
