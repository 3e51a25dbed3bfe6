"""Hand-written plugins for the pipeline's tests: scorers, filters and hooks that record and fail on cue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lwepp.contracts import AttributeWriter, Candidate, LLMRequest, Measurement, Usage
from lwepp.pipeline import ROLES
from lwepp.plugins import REGISTRY
from plugin_api import Params, build
from pods.model import Endpoint


class Boom(RuntimeError):
    """What a fake raises when told to fail."""


class FakeScorer:
    """Scores each candidate by its ``ip:port`` from a table (``default`` for the rest)."""

    def __init__(
        self,
        name: str,
        table: Mapping[str, float] | None = None,
        default: float = 0.0,
        *,
        reads: frozenset[str] = frozenset(),
        fail: bool = False,
    ) -> None:
        self.name = name
        self.table = dict(table or {})
        self.default = default
        self.reads = reads
        self.fail = fail
        self.seen: list[list[str]] = []

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        self.seen.append([c.endpoint.hostport for c in candidates])
        if self.fail:
            raise Boom(f"{self.name} is broken")
        return [self.table.get(c.endpoint.hostport, self.default) for c in candidates]


class FakeFilter:
    """Removes the candidates whose ``ip:port`` is in ``drop``."""

    def __init__(self, name: str, drop: Sequence[str] = (), *, fail: bool = False) -> None:
        self.name = name
        self.drop = set(drop)
        self.fail = fail

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        if self.fail:
            raise Boom(f"{self.name} is broken")
        return [c for c in candidates if c.endpoint.hostport not in self.drop]


class RecordingHook:
    """Every hook at once; appends ``(name, stage, detail)`` to ``log`` and fails where told."""

    def __init__(
        self,
        name: str,
        log: list[tuple[str, str, Any]],
        *,
        needs_body: bool = False,
        fail_at: str | None = None,
        add_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.needs_body = needs_body
        self.fail_at = fail_at
        self.add_headers = dict(add_headers or {})

    def _record(self, stage: str, detail: Any) -> None:
        self.log.append((self.name, stage, detail))
        if stage == self.fail_at:
            raise Boom(f"{self.name} fails at {stage}")

    def prepare(self, request: LLMRequest) -> None:
        request.state[f"{self.name}.prepared"] = True
        self._record("prepare", request.parsed)

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        self._record("picked", [e.hostport for e in endpoints])

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        self._record("response_headers", (served, headers.get(":status")))
        return self.add_headers

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        self._record("response_chunk", chunk)

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        self._record("response_complete", (served, usage))


class FixedPicker:
    """Returns the endpoints named in ``order`` (by ``ip:port``), whatever the scores."""

    def __init__(self, name: str, order: Sequence[str], endpoints: Mapping[str, Endpoint]) -> None:
        self.name = name
        self.order = list(order)
        self.endpoints = endpoints

    def pick(self, request: LLMRequest, scored: Sequence[Any]) -> list[Endpoint]:
        return [self.endpoints[hostport] for hostport in self.order]


class FakeSource:
    """A data source that writes ``values`` for every endpoint once per round, then waits.

    It raises on its first ``failures`` rounds; ``rounds`` counts the rounds it ran.
    """

    def __init__(
        self,
        name: str,
        values: Mapping[str, float],
        *,
        failures: int = 0,
    ) -> None:
        self.name = name
        self.produces = frozenset(values)
        self.values = dict(values)
        self.failures = failures
        self.rounds = 0
        self.wrote = asyncio.Event()

    async def run(
        self,
        endpoints: Callable[[], Sequence[Endpoint]],
        store: AttributeWriter,
        clock: Callable[[], float],
    ) -> None:
        self.rounds += 1
        if self.rounds <= self.failures:
            raise Boom(f"{self.name} failed round {self.rounds}")
        for endpoint in endpoints():
            store.write(
                endpoint.hostport, {k: Measurement(v, clock()) for k, v in self.values.items()}
            )
        self.wrote.set()
        await asyncio.Event().wait()  # until cancelled


def fake_scorer(name: str, params: Params) -> FakeScorer:
    """A registry factory: ``table`` ({ip:port: score}) and ``default`` parameters."""
    table = params.get("table", dict, {})
    default = params.get("default", float, 0.0)
    reads = frozenset(params.get("reads", list, []))
    return FakeScorer(name, table, default, reads=reads)


def fake_filter(name: str, params: Params) -> FakeFilter:
    return FakeFilter(name, params.get("drop", list, []))


def fake_source(name: str, params: Params) -> FakeSource:
    return FakeSource(name, params.get("values", dict, {}))


class HookOnly(RecordingHook):
    """A plugin that is only hooks (configured by dotted path, built as Class(name, params))."""

    def __init__(self, name: str, params: Params) -> None:
        super().__init__(name, [])


class HookingScorer(RecordingHook):
    """A scorer that also has hooks; built by a classmethod named in the path, too."""

    def __init__(self, name: str, params: Params) -> None:
        super().__init__(name, [])

    @classmethod
    def from_params(cls, name: str, params: Params) -> HookingScorer:
        return cls(name, params)

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        return [0.0] * len(candidates)


class NotAPlugin:
    """Constructs fine, but has none of the plugin methods."""

    def __init__(self, name: str, params: Params) -> None:
        self.name = name


def configured(kind: str, parameters: Mapping[str, Any] | None = None, name: str = "p") -> Any:
    """A built-in plugin built as a configuration file builds it: every parameter checked."""
    return build(kind, name, parameters, REGISTRY, ROLES).plugin


class FailsOnCue:
    """Every hook of a pick but the picker's: raises at the stage a request names in ``x-fail-at``.

    For running as a real plugin (by dotted path, in a picker started from a
    configuration file): one picker then fails wherever each request asks.
    """

    CUE = "x-fail-at"

    def __init__(self, name: str, params: Params) -> None:
        self.name = name

    def _cue(self, request: LLMRequest, stage: str) -> None:
        if request.headers.get(self.CUE) == stage:
            raise Boom(f"{self.name} fails at {stage}, as the request asked")

    def prepare(self, request: LLMRequest) -> None:
        self._cue(request, "prepare")

    def filter(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        self._cue(request, "filter")
        return list(candidates)

    def score(
        self, request: LLMRequest, candidates: Sequence[Candidate], now: float
    ) -> list[float]:
        self._cue(request, "score")
        return [0.5] * len(candidates)

    def picked(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        self._cue(request, "picked")

    def response_headers(
        self, request: LLMRequest, served: str | None, headers: Mapping[str, str]
    ) -> Mapping[str, str]:
        self._cue(request, "response_headers")
        return {}

    def response_chunk(self, request: LLMRequest, chunk: bytes) -> None:
        self._cue(request, "response_chunk")

    def response_complete(
        self, request: LLMRequest, served: str | None, usage: Usage | None
    ) -> None:
        self._cue(request, "response_complete")


class FailsOnCuePicker(FailsOnCue):
    """The picker of the same: the best-scored candidate, unless the request cues ``pick``."""

    def pick(self, request: LLMRequest, scored: Sequence[Any]) -> list[Endpoint]:
        self._cue(request, "pick")
        return [max(scored, key=lambda s: s.total).candidate.endpoint]


class BBRFailsOnCue:
    """A BBR request plugin that raises when the request carries ``x-fail-at: bbr``."""

    needs_body = False

    def __init__(self, name: str, params: Params) -> None:
        self.name = name

    def process_request(self, message: Any) -> None:
        if message.headers.get(FailsOnCue.CUE) == "bbr":
            raise Boom(f"{self.name} fails, as the request asked")


class BBRStampsResponse:
    """A BBR response plugin: every response it sees gets ``x-bbr-response: <its name>``."""

    needs_body = False

    def __init__(self, name: str, params: Params) -> None:
        self.name = name

    def process_response(self, message: Any) -> None:
        message.set_header("x-bbr-response", self.name)
