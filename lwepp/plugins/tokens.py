"""``token-producer``: a prompt's token ids as the engine's own tokenizer cuts them, once a request.

The precise prefix cache (``lwepp.plugins.precise_prefix``) matches a prompt's
blocks against the blocks the engines report holding, and blocks are keyed by
token ids: the prompt must be tokenized exactly as the engine tokenizes it.
The llm-d router does that in a ``token-producer`` (legacy name
``tokenizer``), a data producer that runs before scheduling; here too. Its
backend, by parameters:

- ``vllm: {url, timeout, mmTimeout}`` (or ``modelName`` alone): vLLM's render
  endpoints, ``POST /v1/completions/render`` and ``/v1/chat/completions/render``
  at ``url`` (default ``http://localhost:8000``), with ``modelName`` stamped in
  as the model: the ids the engine would run, chat template applied. ``vllm
  launch render`` serves them without a GPU; so does the simulator.
- ``llamacpp: {url, timeout}`` (Switchyard's): llama.cpp's server, ``POST
  /apply-template`` for a chat's messages, then ``POST /tokenize`` of the
  prompt (its special tokens parsed, as its completions do).
- ``local: {modelTokenizerMap, autoDiscoveryDir,
  autoDiscoveryTokenizerFileName}`` (Switchyard's, in the shape of the router's
  ``tokenizersPoolConfig.local``): a Hugging Face ``tokenizer.json`` read by the
  ``tokenizers`` package (``pip install tokenizers``), for an engine with no
  tokenizing endpoint: ``modelTokenizerMap`` maps ``modelName`` to its file,
  else ``<autoDiscoveryDir>/<modelName>/<autoDiscoveryTokenizerFileName>``.
  Completions prompts are exact; a chat's messages are tokenized as
  ``role: content`` lines (no chat template is applied).
- ``estimate`` (the default, and what the router adds when a plugin needs
  tokens and none is configured): 4 bytes of the prompt a pseudo-token, no
  model. Its ids never equal an engine's, so the precise cache then finds no
  block; the configuration loader says so when it adds one.

``udsTokenizerConfig`` (the router's deprecated sidecar) is refused, naming
``vllm.url`` as its replacement.

**When.** A pick does no I/O (``lwepp.contracts``), so a backend that asks a
server does it before the pick, as the router's director does: the producer
is also a request control (``lwepp.picking.RequestControl``; the assembly
runs it after the others, just before the choice) whose ``admit`` tokenizes
the body and keeps the ids, by body, for the pick that follows; the pick
reads them (``token_ids``). A server that fails or is slower than ``timeout``
(5 s) leaves the request without ids, logged and counted, and the plugins
reading them fall back as the router's do: the precise cache scores nothing
for that request. The HTTP session lives in the producer's background task
(``run``). The ``estimate`` and ``local`` backends tokenize on the pick
itself: they take no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from pathlib import Path
from typing import Any, ClassVar, Final

import aiohttp
import orjson
import structlog

from lwepp.contracts import TOKENS, AttributeWriter, Clock, EndpointsNow, LLMRequest
from lwepp.picking import Admitted
from plugin_api import NO_PARAMS, ConfigError, Params
from plugin_api.frozen import dumps
from serving.cli import duration

log = structlog.get_logger()

PRODUCER: Final = "token-producer"
BYTES_PER_TOKEN: Final = 4
"""The router's ``estimate`` backend: one pseudo-token per 4 bytes."""
KEPT: Final = 1024
"""Bodies whose ids wait for their pick, at most (a request refused after admission never
picks: the oldest entry goes first)."""


def estimate(text: bytes) -> list[int]:
    """4 bytes a pseudo-token (little-endian, the tail zero-padded), as the router packs them."""
    padded = text + b"\0" * (-len(text) % BYTES_PER_TOKEN)
    return list(struct.unpack(f"<{len(padded) // BYTES_PER_TOKEN}I", padded))


def _text(body: dict[str, Any]) -> bytes | None:
    """What the estimate and local backends tokenize: a completion's prompt, a chat's messages
    as ``role: content`` lines, other bodies' input as JSON."""
    if isinstance(messages := body.get("messages"), list):
        lines = [
            f"{m.get('role', '')}: {m.get('content', '')}" for m in messages if isinstance(m, dict)
        ]
        return "\n".join(lines).encode()
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt).encode()
    for field in ("input", "items"):
        if field in body:
            return dumps(body[field])
    return None


class TokenProducer:
    needs_body = True
    provides: Final = frozenset({TOKENS})
    """The plugins that need the engine's ids read them (``token_ids``; ``Want``)."""
    produces: ClassVar[frozenset[str]] = frozenset()
    """A background task of its own (the HTTP session), writing no endpoint attribute."""
    hears_response: Final = False
    reads_response_body: Final = False

    def __init__(self, name: str, params: Params = NO_PARAMS) -> None:
        self.name = name
        if "udsTokenizerConfig" in params:
            raise params.error(
                "udsTokenizerConfig",
                "the router's deprecated tokenizer sidecar (gRPC over a Unix socket) is not "
                "supported: use vllm.url (vLLM's render endpoint, or `vllm launch render`)",
            )
        self.model = params.get("modelName", str, "")
        vllm = params.get("vllm", dict, None)
        llamacpp = params.get("llamacpp", dict, None)
        local = params.get("local", dict, None)
        params.get("estimate", dict, {})  # multimodal placeholder estimation: no images here
        chosen = [
            k
            for k, v in (("vllm", vllm), ("llamacpp", llamacpp), ("local", local))
            if v is not None
        ]
        if len(chosen) > 1:
            raise params.error(chosen[1], f"one backend only: {' and '.join(chosen)} are both set")
        self.backend = chosen[0] if chosen else ("vllm" if self.model else "estimate")
        self.url, self.timeout = "", 5.0
        if self.backend in ("vllm", "llamacpp"):
            entry = params.entry(self.backend, vllm if self.backend == "vllm" else llamacpp)
            default = "http://localhost:8000" if self.backend == "vllm" else "http://localhost:8080"
            self.url = entry.get("url", str, default).rstrip("/")
            self.timeout = _seconds(entry, "timeout", "5s")
            if self.backend == "vllm":
                _seconds(entry, "mmTimeout", "30s")  # images: none are sent here
                if not self.model:
                    raise params.error("modelName", "required with vllm: the model to render for")
            entry.done()
        self._tokenizer: Any = None
        if self.backend == "local":
            self._tokenizer = _local(params.entry("local", local), self.model)
        self._ready: collections.OrderedDict[bytes, list[int] | None] = collections.OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self.failures = 0
        """Requests a server left without ids (refused, failed or too slow)."""
        self._key = f"{name}.ids"

    # --- the pick: what the readers call -----------------------------------------------

    def token_ids(self, request: LLMRequest) -> list[int] | None:
        """The request's prompt ids (None: not a prompt, or the backend had none), once."""
        if self._key in request.state:
            found: list[int] | None = request.state[self._key]
            return found
        ids = self._tokenize(request)
        request.state[self._key] = ids
        return ids

    def _tokenize(self, request: LLMRequest) -> list[int] | None:
        if request.body is None:
            return None
        if self.backend in ("vllm", "llamacpp"):
            return self._ready.pop(request.body, None)
        body = request.parsed
        text = _text(dict(body)) if body is not None else None
        if text is None:
            return None
        if self.backend == "estimate":
            return estimate(text)
        ids: list[int] = self._tokenizer.encode(text.decode(errors="replace")).ids
        return ids

    # --- before the pick: the request control ------------------------------------------

    async def admit(self, admitted: Admitted) -> Admitted:
        """Ask the engine's tokenizer for the body's ids, kept for its pick (``token_ids``)."""
        body = admitted.request.body
        if self.backend not in ("vllm", "llamacpp") or body is None or body in self._ready:
            return admitted
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return admitted
        if not isinstance(parsed, dict) or self._session is None:
            return admitted
        try:
            async with asyncio.timeout(self.timeout):
                ids = await (self._vllm if self.backend == "vllm" else self._llamacpp)(parsed)
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as error:
            self.failures += 1
            log.warning("tokenizing failed", producer=self.name, url=self.url, error=repr(error))
            return admitted
        self._ready[body] = ids
        while len(self._ready) > KEPT:
            self._ready.popitem(last=False)
        return admitted

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        assert self._session is not None
        headers = {"content-type": "application/json"}
        data = orjson.dumps(payload)
        async with self._session.post(self.url + path, data=data, headers=headers) as response:
            response.raise_for_status()
            return orjson.loads(await response.read())

    async def _vllm(self, body: dict[str, Any]) -> list[int] | None:
        """vLLM's render endpoints (the router's ``vllm`` backend): the first prompt's ids."""
        if "messages" not in body and "prompt" not in body:
            return None
        chat = "messages" in body
        answer = await self._post(
            "/v1/chat/completions/render" if chat else "/v1/completions/render",
            {**body, "model": self.model},
        )
        first = answer if chat else answer[0]
        return [int(token) for token in first["token_ids"]]

    async def _llamacpp(self, body: dict[str, Any]) -> list[int] | None:
        """llama.cpp's server: a chat's messages through its template, then its tokenizer."""
        if isinstance(body.get("messages"), list):
            prompt = (await self._post("/apply-template", {"messages": body["messages"]}))["prompt"]
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
        else:
            return None
        answer = await self._post(
            "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
        )
        return [int(token) for token in answer["tokens"]]

    async def run(self, endpoints: EndpointsNow, store: AttributeWriter, clock: Clock) -> None:
        """Hold the HTTP session the backend's requests use, until cancelled."""
        if self.backend not in ("vllm", "llamacpp"):
            await asyncio.Event().wait()
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            try:
                await asyncio.Event().wait()
            finally:
                self._session = None


def _seconds(entry: Params, field: str, default: str) -> float:
    text = entry.get(field, str, default)
    try:
        seconds = duration(text)
    except Exception as error:  # argparse.ArgumentTypeError: the message names the value
        raise entry.error(field, str(error)) from None
    if seconds <= 0:
        raise entry.error(field, f"must be > 0, got {text!r}")
    return seconds


def _local(entry: Params, model: str) -> Any:
    """The ``tokenizers`` tokenizer the ``local`` backend names for ``model``."""
    mapping = entry.get("modelTokenizerMap", dict, {})
    directory = entry.get("autoDiscoveryDir", str, "/mnt/models")
    filename = entry.get("autoDiscoveryTokenizerFileName", str, "tokenizer.json")
    entry.done()
    found = mapping.get(model) if model else None
    if found is None and len(mapping) == 1 and not model:
        found = next(iter(mapping.values()))
    path = Path(str(found)) if found is not None else Path(directory, model, filename)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"{entry.path}: needs the tokenizers package (pip install tokenizers)",
            entry.path,
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the package raises its own Exception for a bad file
        raise entry.error("modelTokenizerMap", f"cannot load {str(path)!r}: {error}") from None
