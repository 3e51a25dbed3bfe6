"""The model rewrite as the picker applies it: a request control (``lwepp.picking.RequestControl``).

Where the llm-d router applies an InferenceModelRewrite (``Director.HandleRequest``
at ebab68792), first thing for each request, before the objective lookup,
admission and the scheduler, so every one of them sees the *target* model:

1. The target starts as the request header ``x-llm-d-model-name-rewrite`` (or
   the older ``x-gateway-model-name-rewrite``), else the body's ``model``.
2. If a rule matches the body's model (``RewriteTable.lookup``: exact, else
   generic), a target drawn by weight overrides the header, and the decision
   is counted in ``llm_d_epp_model_rewrite_decisions_total``.
3. No target at all (no ``model``, no header, no generic rule): **400**, the
   router's "model not found in request body".
4. A target other than the body's model: the body goes upstream with
   ``model`` set to it (re-serialised only then; the core sends the new
   ``Content-Length``), and the strategy chooses for that body, with
   ``x-gateway-model-name`` naming the target, so the LoRA-aware plugins see
   the adapter the replica will load, not the alias.
5. The response is mapped back: each ``"model":"<target>"`` (or
   ``"model": "<target>"``) in the body, streamed or not, becomes the name the
   client sent, as the router's ``rewriteModelName`` does.

A request with no body (headers only) passes untouched: there is nothing to
rewrite. The picker holds the body only when Envoy streams it to it
(full-duplex, as the router's gateways do).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import orjson
from prometheus_client import CollectorRegistry, Counter

from lwepp.metrics import MODEL_HEADER
from lwepp.picking import Admitted, RequestInfo
from lwepp.rewrites import RewriteTable
from wire.exchange import Refusal

REWRITE_HEADERS: Final = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
"""The request headers that name a target (the router's, then its deprecated alias)."""

CAP: Final = 1000
"""Distinct ``model_name`` values counted before the rest count as ``other``, as the router."""


class RewriteSource(Protocol):
    """Where the rewrites come from (a file, the Kubernetes API): the current table, replaced
    whole when the set changes, and the background task that keeps it current."""

    @property
    def table(self) -> RewriteTable: ...

    async def run(self) -> None: ...


class RewriteMetrics:
    """``llm_d_epp_model_rewrite_decisions_total{model_rewrite_name, model_name, target_model}``:
    a rule's decisions (the router's name and labels, ``docs/metrics.md``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions: Final = Counter(
            "llm_d_epp_model_rewrite_decisions",
            "Model rewrite decisions: the rewrite that decided, the model the client sent, "
            "the model it was sent to.",
            ("model_rewrite_name", "model_name", "target_model"),
            registry=registry,
        )
        self._seen: set[str] = set()

    def count(self, rewrite: str, model: str, target: str, configured: frozenset[str]) -> None:
        """One decision. A model no rule names exactly (a generic rule's) counts as ``other``
        past ``CAP`` distinct ones; the configured names always count as themselves."""
        if model not in configured and model not in self._seen:
            if len(self._seen) >= CAP:
                model = "other"
            else:
                self._seen.add(model)
        self.decisions.labels(rewrite, model, target).inc()


class ModelRewriteControl:
    """The request control that rewrites the model (module docstring), over a source's table.

    ``rng``: the draw among weighted targets (a seeded one in tests).
    """

    hears_response: Final = False
    reads_response_body: Final = True

    def __init__(
        self, source: RewriteSource, metrics: RewriteMetrics, rng: random.Random | None = None
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.rng = rng or random.Random()

    async def admit(self, admitted: Admitted) -> Admitted:
        request = admitted.request
        if request.body is None:
            return admitted
        body = parse(request.body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise Refusal(400, "body field 'model': expected a string", reason="bad_model")
        incoming = model or ""
        target = header(request.headers) or incoming
        table = self.source.table
        if (decision := table.lookup(incoming)) is not None:
            target = decision.rule.choose(self.rng)
            self.metrics.count(decision.rewrite, incoming, target, table.clients)
        if not target:
            raise Refusal(
                400,
                "model not found in request body: it names no 'model', and no "
                "InferenceModelRewrite rule for every model supplies one",
                reason="no_model",
            )
        if target == incoming:
            return admitted
        rewritten = orjson.dumps({**body, "model": target})
        headers = with_model(request.headers, target)
        back = (ModelNameBack(target, incoming),) if incoming else ()
        return Admitted(RequestInfo(headers, rewritten), rewritten, (*admitted.followups, *back))


def parse(body: bytes) -> dict[str, object]:
    """The request body as a JSON object, or 400 (as the router's parser answers)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Refusal(400, "request body is not valid JSON", reason="bad_body") from None
    if not isinstance(parsed, dict):
        raise Refusal(400, "request body is not a JSON object", reason="bad_body")
    return parsed


def header(headers: Sequence[tuple[str, str]]) -> str:
    """The target a rewrite header names (the router's header first), or ``""``."""
    found: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in REWRITE_HEADERS and key not in found:
            found[key] = value.strip()
    return next((found[name] for name in REWRITE_HEADERS if found.get(name)), "")


def with_model(headers: Sequence[tuple[str, str]], model: str) -> list[tuple[str, str]]:
    """``headers`` as the choice sees them: the model header names ``model``."""
    return [*((n, v) for n, v in headers if n.lower() != MODEL_HEADER), (MODEL_HEADER, model)]


class ModelNameBack:
    """The response's ``model`` mapped back to the name the client sent (a ``Followup``).

    The router replaces ``"model":"<target>"`` and ``"model": "<target>"`` in
    each chunk on its own; a chunk boundary inside one would let the target
    through. Here the bytes at the end of a chunk that could begin one (at
    most the pattern's length) wait for the next chunk. A well-formed body
    never ends inside one (JSON ends with ``}``, an event stream with a blank
    line), so nothing is held when it ends.
    """

    __slots__ = ("_held", "_longest", "_pattern", "_prefixes", "_replacement")

    def __init__(self, target: str, incoming: str) -> None:
        quoted = orjson.dumps(target)
        self._pattern = re.compile(rb'("model": ?)' + re.escape(quoted))
        self._replacement = orjson.dumps(incoming)
        self._prefixes = (b'"model":' + quoted, b'"model": ' + quoted)
        self._longest = len(self._prefixes[1])
        self._held = b""

    def headers(self, served: str | None, headers: Mapping[str, str]) -> Sequence[tuple[str, str]]:
        return ()

    def chunk(self, chunk: bytes) -> bytes:
        data, self._held = self._held + chunk, b""
        if b'"model"' not in data and b'"' not in data[-self._longest :]:
            return data  # the common chunk: no model field, nothing to wait for
        out: list[bytes] = []
        start = 0
        for match in self._pattern.finditer(data):
            out += (data[start : match.start()], match.group(1), self._replacement)
            start = match.end()
        rest = data[start:]
        keep = self._partial(rest)
        self._held = rest[len(rest) - keep :] if keep else b""
        out.append(rest[: len(rest) - keep])
        return b"".join(out)

    def _partial(self, rest: bytes) -> int:
        """The length of the longest end of ``rest`` that begins a pattern but does not finish
        it (0 if none)."""
        tail = rest[-self._longest :]
        at = tail.find(b'"')
        while at != -1:
            piece = tail[at:]
            if any(p.startswith(piece) and p != piece for p in self._prefixes):
                return len(piece)
            at = tail.find(b'"', at + 1)
        return 0

    def end(self) -> None:
        self._held = b""
