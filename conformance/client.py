"""The conformance client: requests, what came back, and the suite's ways of judging it.

This is Gateway API's conformance ``roundtripper`` and ``http`` helpers (which
GIE's tests call; GIE 84436a96 pins them at ``HELPERS``) rewritten for
Python, with the same rules:

- ``compare`` is ``CompareRoundTrip``: the status must be one of the expected
  ones, a timeout (408 or 504) counting as any expected timeout; on a 200 (or
  204) the echo server's JSON must show the same method, path and host, the
  same request headers (so the test header reached the backend) and the
  expected namespace; the pod name must *start with* the expected backend;
  expected response headers are compared after joining repeated values with
  ``,``.
- ``eventually`` is ``MakeRequestAndExpectEventuallyConsistentResponse``
  (``AwaitConvergence``): the request is repeated until it passes
  ``compare`` three times in a row. A failed attempt (a wrong answer, no
  answer, or one that cannot be read) is followed by a 1 s wait, a passing
  one by none; the deadline (``max_time_to_consistency``) is checked before
  every attempt and ends a wait early.
- ``send_many`` is the loop of GIE's traffic tests (``assertTrafficOnly...``):
  ``total`` requests, ``concurrency`` at a time; each one that gets no
  readable answer, a 404 or a 503 is retried every 500 ms for up to 2
  minutes; any other mismatch, or a pod outside the allowed set, fails the
  test at once.

A ``Transport`` carries a request either through the gateway (HTTP to an
Envoy listener, ``GatewayTransport``, on a connection of its own as the
helpers' round tripper opens one per request) or to an endpoint picker alone
(``conformance.picker``); the judging is the same. The clock and the sleep
are parameters, so the timing rules are tested without waiting.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp

NAMESPACE: Final = "inference-conformance-app-backend"
SELECTION_HEADER: Final = "test-epp-endpoint-selection"
"""The header GIE's tests use to tell the endpoint picker which pods it may pick."""
SERVED_HEADER: Final = "x-conformance-test-served-endpoint"
"""The response header in which the picker reports the endpoint the gateway says served."""


class Failed(Exception):
    """A conformance expectation that did not hold; the message says which and why."""


HELPERS_VERSION: Final = "v1.6.1"
HELPERS: Final = f"sigs.k8s.io/gateway-api/conformance {HELPERS_VERSION}"
"""The Gateway API conformance helpers whose rules and timing this client follows (the module
GIE's ``conformance/go.mod`` requires at 84436a96)."""


class Unreachable(Exception):
    """No usable answer: nothing answered (refused, reset, timed out), or the answer could not
    be read (an echo that is not JSON). The helpers' round trip returns an error for both, and
    both are retried."""


@dataclass(frozen=True, slots=True)
class Timing:
    """How long the suite waits; by default the values GIE runs its tests with.

    ``max_time_to_consistency`` is GIE's (``utils/config/timing.go``; Gateway
    API's own default is 30 s); the consecutive successes, the request
    timeout and the 1 s wait after a failed attempt are the ``HELPERS``'
    (``utils/config/timeout.go``, ``AwaitConvergence``); the traffic loop's
    500 ms and 2 minutes are GIE's (``assertTrafficOnlyReachesToExpectedPods``).
    These bound the waiting only: a conformant gateway passes every check in
    its first attempts.
    """

    max_time_to_consistency: float = 300.0
    required_consecutive_successes: int = 3
    delay_after_failure: float = 1.0
    request_timeout: float = 10.0
    retry_interval: float = 0.5
    retry_for: float = 120.0


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a test: to which gateway, with which host, path, headers and body."""

    path: str
    host: str | None = None
    method: str = "GET"
    headers: Mapping[str, str] = field(default_factory=dict)
    body: str = ""
    gateway: str = "conformance-primary"


@dataclass(frozen=True, slots=True)
class Echo:
    """What the echo server saw (its JSON): the request as it reached the backend."""

    path: str
    host: str
    method: str
    headers: Mapping[str, Sequence[str]]
    namespace: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Echo:
        """Read the echo's JSON as Go's ``json.Unmarshal`` into ``CapturedRequest`` does: a
        field of the wrong type is an error (``TypeError``); null or absent is empty."""
        headers = data.get("headers") or {}
        if not isinstance(headers, dict) or not all(
            isinstance(values, list) and all(isinstance(v, str) for v in values)
            for values in headers.values()
        ):
            raise TypeError("headers: expected an object of string lists")
        return cls(
            path=json_string(data, "path"),
            host=json_string(data, "host"),
            method=json_string(data, "method"),
            headers={name.lower(): values for name, values in headers.items()},
            namespace=json_string(data, "namespace"),
        )


def json_string(data: Mapping[str, Any], key: str) -> str:
    """A string field of the echo's JSON; null or absent is ""."""
    value = data.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{key}: expected a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class Observation:
    """What came back: status, response headers (lower-case names), the serving pod and port.

    ``echo`` is the backend's view of the request; None when the answer was
    not an echo (or came from a picker, which has no backend). ``note``: the
    start of an answer that was not an echo (the gateway's own error text),
    which a failure shows.
    """

    status: int
    headers: Mapping[str, Sequence[str]] = field(default_factory=dict)
    pod: str = ""
    http_port: str = ""
    echo: Echo | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Expected:
    """GIE's ``ExpectedResponse``: the request, and what a passing answer looks like."""

    request: Request
    statuses: tuple[int, ...] = (200,)
    headers: Mapping[str, str] = field(default_factory=dict)
    backend: str = ""
    """A prefix of the serving pod's name."""
    namespace: str = NAMESPACE


class Transport(Protocol):
    """Carries one request and reports what came back."""

    @property
    def checks_backend(self) -> bool:
        """Whether observations carry the backend's echo (through a gateway) or not (a picker)."""
        ...

    async def send(self, request: Request) -> Observation:
        """Send ``request``; raise ``Unreachable`` when nothing answered."""
        ...


def _header_mismatch(
    kind: str,
    expected: Mapping[str, str],
    got: Mapping[str, Sequence[str]],
    *,
    backend: bool = False,
) -> str | None:
    """Why ``got`` (lower-case names) lacks one of the ``expected`` headers or holds another
    value (a repeated header's values joined by ``,``), or None; ``backend``: the headers the
    echo says reached the backend, not the response's."""
    where, seen = (" at the backend", "the backend got") if backend else ("", "got")
    for name, value in expected.items():
        values = got.get(name.lower())
        if values is None:
            return f"expected {kind} header {name}{where}, it was not there"
        if ",".join(values) != value:
            return f"expected {kind} header {name}: {value}, {seen} {','.join(values)}"
    return None


TIMEOUTS: Final = frozenset({408, 504})
"""The helpers' ``IsTimeoutError``: a request timeout from either side of the gateway."""


def compare(expected: Expected, seen: Observation, *, check_echo: bool = True) -> str | None:
    """Why ``seen`` does not meet ``expected`` (Gateway API's ``CompareRoundTrip``), or None.

    A timeout passes where any timeout is expected (a test that allows 504 also takes a 408:
    InvalidEPPService's 500-504). On 200 or 204 the echo is checked, as the helpers do.
    """
    if seen.status in TIMEOUTS and TIMEOUTS & set(expected.statuses):
        return None
    if seen.status not in expected.statuses:
        said = f" ({seen.note})" if seen.note else ""
        return f"expected status {list(expected.statuses)}, got {seen.status}{said}"
    if seen.status not in (200, 204):
        return None
    request = expected.request
    if check_echo:
        echo = seen.echo
        if echo is None:
            return f"a {seen.status} that is not the echo server's JSON"
        if request.host is not None and echo.host != request.host:
            return f"expected host {request.host}, got {echo.host}"
        if echo.path != request.path:
            return f"expected path {request.path}, got {echo.path}"
        if echo.method != request.method:
            return f"expected method {request.method}, got {echo.method}"
        if echo.namespace != expected.namespace:
            return f"expected namespace {expected.namespace!r}, got {echo.namespace!r}"
        if problem := _header_mismatch("request", request.headers, echo.headers, backend=True):
            return problem
    if problem := _header_mismatch("response", expected.headers, seen.headers):
        return problem
    if not seen.pod.startswith(expected.backend):
        return f"expected a pod named {expected.backend}..., got {seen.pod!r}"
    return None


async def _attempt(
    transport: Transport, expected: Expected
) -> tuple[Observation | None, str | None]:
    try:
        seen = await transport.send(expected.request)
    except Unreachable as error:
        return None, f"no answer: {error}"
    return seen, compare(expected, seen, check_echo=transport.checks_backend)


async def eventually(
    transport: Transport,
    expected: Expected,
    timing: Timing,
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> Observation:
    """Repeat the request until it passes ``compare`` several times in a row (``AwaitConvergence``).

    The deadline is checked before every attempt, passing or not, and cuts
    short the wait after a failure; an attempt under way is not interrupted
    (the request has its own timeout), as in the Go helper.
    """
    deadline = clock() + timing.max_time_to_consistency
    streak = attempts = 0
    problem: str | None = None  # the latest failed attempt's, kept through later passes

    def timed_out() -> Failed:
        # The latest failure says why the streak broke, even when the attempts after it
        # passed (a picker that is right by chance now and then ends on a pass).
        return Failed(
            f"{expected.request.method} {expected.request.path}: not "
            f"{timing.required_consecutive_successes} passes in a row within "
            f"{timing.max_time_to_consistency:g} s ({attempts} attempts); "
            f"last failure: {problem or 'none (every attempt passed)'}"
        )

    while True:
        if clock() >= deadline:
            raise timed_out()
        seen, failure = await _attempt(transport, expected)
        attempts += 1
        if failure is None and seen is not None:
            streak += 1
            if streak >= timing.required_consecutive_successes:
                return seen
            continue  # no wait after a pass
        streak, problem = 0, failure
        left = deadline - clock()
        if left <= timing.delay_after_failure:
            await sleep(max(left, 0.0))
            raise timed_out()
        await sleep(timing.delay_after_failure)


async def send_many(
    transport: Transport,
    expected: Expected,
    timing: Timing,
    *,
    total: int,
    concurrency: int,
    accept: Callable[[Observation], str | None],
    clock: Clock = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> list[Observation]:
    """``total`` requests, ``concurrency`` at a time, each judged by ``compare`` and ``accept``.

    ``accept`` says why an answer that passed ``compare`` is still wrong (a
    pod outside the allowed set, a port the picker was not allowed), or None.
    Each request's 2 minutes start when it is first sent; a retry that would
    start after them is not made.
    """
    limit = asyncio.Semaphore(concurrency)

    async def one() -> Observation:
        async with limit:
            give_up = clock() + timing.retry_for
            while True:
                seen, problem = await _attempt(transport, expected)
                if seen is not None and problem is None:
                    if (wrong := accept(seen)) is not None:
                        raise Failed(wrong)
                    return seen
                if seen is not None and seen.status not in (404, 503):
                    raise Failed(f"expectation failed: {problem}")
                # No usable answer, or 404/503: GIE retries these (an unconverged gateway).
                left = give_up - clock()
                if left <= timing.retry_interval:
                    await sleep(max(left, 0.0))
                    raise Failed(f"failed after retries: {problem}")
                await sleep(timing.retry_interval)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one()) for _ in range(total)]
    except* Failed as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


def gateway_session() -> aiohttp.ClientSession:
    """An HTTP client that opens a connection for every request and closes it after (sending
    ``Connection: close``), as the helpers' round tripper does: a new Go ``http.Transport``
    with ``DisableKeepAlives`` for each request (``roundtripper.go``). No request rides on a
    connection an earlier one opened, so none inherits what Envoy chose for it."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


class GatewayTransport:
    """Requests through the gateway: HTTP/1.1 to the Envoy listener of ``request.gateway``.

    Like the suite's Go client: the ``Host`` header set when the test names a
    host, every test header set once, ``X-Echo-Set-Header`` always sent (empty
    unless a test wants the backend to set response headers), and the body
    parsed as the echo's JSON only when it says ``application/json``. The
    session should be ``gateway_session()``'s, one connection per request.
    """

    checks_backend: Final = True

    def __init__(
        self, session: aiohttp.ClientSession, gateways: Mapping[str, str], timing: Timing
    ) -> None:
        self._session = session
        self._gateways = gateways
        self._timeout = aiohttp.ClientTimeout(total=timing.request_timeout)

    async def send(self, request: Request) -> Observation:
        address = self._gateways[request.gateway]
        headers = {**request.headers, "X-Echo-Set-Header": ""}
        if request.host is not None:
            headers["Host"] = request.host
        try:
            async with self._session.request(
                request.method,
                f"http://{address}{request.path}",
                headers=headers,
                data=request.body.encode() if request.body else None,
                timeout=self._timeout,
                skip_auto_headers=("Content-Type",),
            ) as response:
                seen = {
                    name.lower(): response.headers.getall(name)
                    for name in dict.fromkeys(response.headers.keys())
                }
                body = await response.read()
                echo, pod, port, note = None, "", "", ""
                # As the Go client: the body is the echo's JSON only when it says so, and a
                # body that says so but does not decode is an error of the round trip.
                if response.headers.get("Content-Type") == "application/json":
                    echo, pod, port = _read_echo(body)
                else:
                    note = body[:300].decode(errors="replace").strip()
                return Observation(response.status, seen, pod, port, echo, note)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise Unreachable(f"{type(error).__name__}: {error}") from None


def _read_echo(body: bytes) -> tuple[Echo, str, str]:
    """The echo's JSON: what reached the backend, the pod, its ``httpPort``."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return Echo.from_json(data), json_string(data, "pod"), json_string(data, "httpPort")
    except (ValueError, TypeError) as error:
        raise Unreachable(f"unexpected error reading response: {error}") from None
