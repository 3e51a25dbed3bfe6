"""A fake Kubernetes API server, in process, speaking the real list/watch wire format.

Enough of the API server for the pod source and leader election: namespaced
collections of any resource (pods, inferencepools, leases), list with label
and field selectors, get/create/update with ``resourceVersion`` conflicts,
and watch streams of newline-delimited JSON events with the server's rules:

- one global, increasing ``resourceVersion``; a watch from version N replays
  every change after N, then streams live changes;
- with a label selector, an object modified *out of* the selector is sent as
  DELETED and one modified *into* it as ADDED (the watch cache does this);
- ``BOOKMARK`` events when asked for (``bookmark()``), if the watch allowed them;
- history can be compacted (``compact()``): a watch from an older version
  then gets an ``ERROR`` event carrying a 410 ``Status`` ("too old resource
  version"), or a 410 response status (``gone_as_status``);
- watches can be ended cleanly (``end_watches()``, like ``timeoutSeconds``)
  or dropped mid-event (``drop_watches()``: half a line, then the socket closes).

Every request is recorded (``requests``) so tests can derive which verbs on
which resources the code really uses (``verbs()``), and compare with RBAC.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from pods.selector import LabelSelector

Object = dict[str, Any]
T = TypeVar("T")

_PATH = re.compile(
    r"^(?P<api>/api/v1|/apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[^/]+)"
    r"(?:/(?P<name>[^/]+))?$"
)

_DISCOVERY = re.compile(r"^/apis/(?P<gv>[^/]+/[^/]+)$")

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"

_END = "end"
_DROP = "drop"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    authorization: str = ""

    @property
    def verb(self) -> str:
        named = _PATH.match(self.path)
        has_name = bool(named and named["name"])
        if self.method == "GET":
            if self.query.get("watch") in ("1", "true"):
                return "watch"
            return "get" if has_name else "list"
        return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[
            self.method
        ]

    @property
    def group_resource(self) -> tuple[str, str]:
        match = _PATH.match(self.path)
        assert match, self.path
        api = match["api"]
        group = "" if api == "/api/v1" else api.split("/")[2]
        return group, match["res"]


def status(code: int, reason: str, message: str) -> Object:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def matches(obj: Object | None, labels: LabelSelector, fields: dict[str, str]) -> bool:
    """The API server's selection: a label selector in any syntax, field equality."""
    if obj is None:
        return False
    if not labels.matches(obj["metadata"].get("labels") or {}):
        return False
    return all(obj["metadata"].get(k.removeprefix("metadata.")) == v for k, v in fields.items())


def _selector(text: str | None) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item) if text else {}


@dataclass
class _Change:
    version: int
    collection: str
    kind: str
    obj: Object
    old: Object | None


@dataclass
class _Watch:
    collection: str
    labels: LabelSelector
    fields: dict[str, str]
    bookmarks: bool
    kind: str
    queue: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    def offer(self, change: _Change) -> None:
        """Queue the event this change means for this watch, if any (selector transitions)."""
        was = matches(change.old, self.labels, self.fields)
        now = change.kind != "DELETED" and matches(change.obj, self.labels, self.fields)
        if change.collection != self.collection or not (was or now):
            return
        if was and now:
            kind, obj = "MODIFIED", change.obj
        elif now:
            kind, obj = "ADDED", change.obj
        else:
            # Left the selector (or was deleted): the last state it matched in,
            # at the version of the change.
            kind, obj = "DELETED", copy.deepcopy(change.old or change.obj)
            obj["metadata"]["resourceVersion"] = str(change.version)
        self.queue.put_nowait(json.dumps({"type": kind, "object": obj}))


async def eventually(check: Callable[[], bool], what: str = "condition") -> None:
    """Wait until ``check()`` holds (events cross a real socket); fail after 15 s.

    A poll with a deadline: the state checked is the client's or the fake's, which
    have no event of their own. The deadline only bounds a bug; it is generous
    because a loaded machine can take seconds over a few round trips.
    """
    deadline = asyncio.get_running_loop().time() + 15
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def in_background(job: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """``job()`` running as a task for the block (a source's ``run``), cancelled after it."""
    task = asyncio.create_task(job())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class FakeKube:
    """Start with ``await fake.start()`` (or ``async with FakeKube() as fake``); ``url`` to connect."""

    def __init__(self) -> None:
        self.version = 1000
        self.collections: dict[str, dict[str, Object]] = {}
        self.history: list[_Change] = []
        self.oldest = 0
        self.watches: list[_Watch] = []
        self.requests: list[Recorded] = []
        self.failing: int | None = None
        """When set, every request is answered with this status (a broken API server)."""
        self.gone_as_status = False
        """Answer a too-old watch with HTTP 410 instead of an ERROR event."""
        self.tokens: dict[str, Object] = {}
        """Bearer token → the ``user`` a TokenReview answers for it (others: unauthenticated)."""
        self.allowed: set[tuple[str, str, str]] = set()
        """(user name, non-resource path, verb) a SubjectAccessReview allows; others denied."""
        self.reviews: list[Object] = []
        """The body of every TokenReview and SubjectAccessReview received, in order."""
        self.served: dict[str, list[str]] = {}
        """API discovery: group/version (``llm-d.ai/v1alpha2``) → the resources it serves, as
        ``GET /apis/<group>/<version>`` lists them (a custom resource's CRD installed); any
        other group/version is a 404. Not in ``requests``: discovery is open to every user."""
        self.discoveries: list[str] = []
        """The group/versions asked about, in order."""
        self.uninstalled: set[str] = set()
        """API groups (``llm-d.ai/v1alpha2``) whose CRDs are not installed: answered 404."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a watch handler stops when its client hangs up,
        # as the API server's does, so ``watching()`` counts live watches only.
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    # --- what tests do to the cluster -------------------------------------------------

    def put(self, collection: str, obj: Object) -> Object:
        """Create or replace an object (as a controller or kubectl would); returns the stored copy."""
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        store = self.collections.setdefault(collection, {})
        old = store.get(name)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        store[name] = obj
        self._record(_Change(self.version, collection, "MODIFIED" if old else "ADDED", obj, old))
        return copy.deepcopy(obj)

    def delete(self, collection: str, name: str) -> None:
        old = self.collections.get(collection, {}).pop(name)
        self.version += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._record(_Change(self.version, collection, "DELETED", gone, old))

    def bump(self) -> None:
        """Advance the global version with a change no watch here sees (another collection)."""
        self.put("/api/v1/namespaces/elsewhere/configmaps", {"metadata": {"name": "noise"}})

    def bookmark(self) -> None:
        """Send every bookmark-enabled watch a BOOKMARK at the current version."""
        for watch in self.watches:
            if watch.bookmarks:
                event = {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": watch.kind,
                        "metadata": {"resourceVersion": str(self.version)},
                    },
                }
                watch.queue.put_nowait(json.dumps(event))

    def compact(self) -> None:
        """Forget all history: a watch from any version seen so far is now too old."""
        self.bump()
        self.history.clear()
        self.oldest = self.version

    def end_watches(self) -> None:
        """End every open watch cleanly, as ``timeoutSeconds`` running out does."""
        for watch in self.watches:
            watch.queue.put_nowait(_END)

    def drop_watches(self) -> None:
        """Cut every open watch mid-event: half a JSON line, then the connection is closed."""
        for watch in self.watches:
            watch.queue.put_nowait(_DROP)

    def watching(self, collection: str) -> int:
        return sum(1 for watch in self.watches if watch.collection == collection)

    def verbs(self) -> set[tuple[str, str, str]]:
        """(api group, resource, verb) of every request made so far."""
        return {(*r.group_resource, r.verb) for r in self.requests}

    def count(self, verb: str, resource: str) -> int:
        return sum(1 for r in self.requests if r.verb == verb and r.group_resource[1] == resource)

    # --- the HTTP side ----------------------------------------------------------------

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        for watch in self.watches:
            watch.offer(change)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        if request.method == "GET" and (discovery := _DISCOVERY.match(request.path)):
            return self._discovery(discovery["gv"])
        self.requests.append(
            Recorded(request.method, request.path, query, request.headers.get("Authorization", ""))
        )
        match = _PATH.match(request.path)
        if self.failing is not None:
            return web.json_response(
                status(self.failing, "InternalError", "failing"), status=self.failing
            )
        if match and match["api"].removeprefix("/apis/") in self.uninstalled:
            return web.json_response(status(404, "NotFound", "no such resource"), status=404)
        if request.method == "POST" and request.path in (TOKEN_REVIEWS, ACCESS_REVIEWS):
            return web.json_response(self._review(request.path, await request.json()), status=201)
        if not match or not match["ns"]:
            return web.json_response(status(404, "NotFound", request.path), status=404)
        collection = request.path if not match["name"] else request.path.rsplit("/", 1)[0]
        store = self.collections.setdefault(collection, {})
        name = match["name"]
        if request.method == "GET" and name is None:
            if query.get("watch") in ("1", "true"):
                return await self._watch(request, collection, match["res"], query)
            labels, fields = (
                LabelSelector.parse(query.get("labelSelector", "")),
                _selector(query.get("fieldSelector")),
            )
            items = [o for o in store.values() if matches(o, labels, fields)]
            return web.json_response(
                {
                    "kind": "List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": sorted(items, key=lambda o: o["metadata"]["name"]),
                }
            )
        if request.method == "GET":
            if name not in store:
                return web.json_response(status(404, "NotFound", f"{name} not found"), status=404)
            return web.json_response(store[name])
        body = await request.json()
        if request.method == "POST":
            if body["metadata"]["name"] in store:
                return web.json_response(status(409, "AlreadyExists", "exists"), status=409)
            return web.json_response(self.put(collection, body), status=201)
        if request.method == "PUT":
            if name not in store:
                return web.json_response(status(404, "NotFound", f"{name} not found"), status=404)
            if (
                body["metadata"].get("resourceVersion")
                != store[name]["metadata"]["resourceVersion"]
            ):
                return web.json_response(
                    status(409, "Conflict", "the object has been modified"), status=409
                )
            return web.json_response(self.put(collection, body))
        return web.json_response(status(405, "MethodNotAllowed", request.method), status=405)

    def _discovery(self, group_version: str) -> web.Response:
        self.discoveries.append(group_version)
        if group_version not in self.served:
            return web.json_response(
                status(404, "NotFound", "the server could not find it"), status=404
            )
        resources = [{"name": name, "namespaced": True} for name in self.served[group_version]]
        return web.json_response(
            {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}
        )

    def _review(self, path: str, review: Object) -> Object:
        """The API server's answer to a TokenReview or a SubjectAccessReview: the review
        with its ``status`` filled in from ``tokens`` and ``allowed``."""
        self.reviews.append(copy.deepcopy(review))
        spec = review.get("spec") or {}
        if path == TOKEN_REVIEWS:
            user = self.tokens.get(spec.get("token", ""))
            answer = {"authenticated": True, "user": user} if user else {"authenticated": False}
        else:
            url = spec.get("nonResourceAttributes") or {}
            asked = (spec.get("user", ""), url.get("path", ""), url.get("verb", ""))
            answer = {"allowed": asked in self.allowed}
        return {**review, "status": answer}

    async def _watch(
        self, request: web.Request, collection: str, resource: str, query: dict[str, str]
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or self.version)
        if since < self.oldest:
            gone = status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
            if self.gone_as_status:
                return web.json_response(gone, status=410)
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await response.write_eof()
            return response
        watch = _Watch(
            collection,
            LabelSelector.parse(query.get("labelSelector", "")),
            _selector(query.get("fieldSelector")),
            query.get("allowWatchBookmarks") == "true",
            resource.rstrip("s").capitalize(),
        )
        for change in self.history:
            if change.version > since:
                watch.offer(change)
        self.watches.append(watch)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            while True:
                line = await watch.queue.get()
                if request.transport is None or request.transport.is_closing():
                    return response
                if line == _END:
                    await response.write_eof()
                    return response
                if line == _DROP:
                    await response.write(b'{"type": "MODIFIED", "object": {"metad')
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await response.write(line.encode() + b"\n")
        except ConnectionResetError:
            return response  # the client went away mid-write
        finally:
            self.watches.remove(watch)


class ThreadedFakeKube:
    """A ``FakeKube`` on its own event loop in a thread, for tests that drive child processes.

    ``do(fn)`` runs ``fn(fake)`` on that loop (the fake is not thread-safe) and
    returns its result.
    """

    def __init__(self) -> None:
        self.fake = FakeKube()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedFakeKube:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fake.start(), self._loop).result(10)
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def url(self) -> str:
        return self.fake.url

    def do(self, fn: Callable[[FakeKube], T]) -> T:
        async def call() -> T:
            return fn(self.fake)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig file pointing at this fake, with a token and a default namespace."""
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"contexts: [{{name: fake, context: {{cluster: fake, user: fake, "
            f"namespace: {namespace}}}}}]\n"
            f"clusters: [{{name: fake, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: fake, user: {token: fake-token}}]\n"
        )
        return path
