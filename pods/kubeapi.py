"""A small Kubernetes API client over aiohttp: connection config, list/watch, and a few verbs.

Written by hand rather than taken from a client library, because the part of
the API Switchyard needs is small and its details are exactly what a reader
should see: how a list returns a ``resourceVersion``, how a watch resumes from
it, what a bookmark is, and what to do when the server answers 410 Gone.

The list/watch protocol, in brief (Kubernetes "API Concepts", *Efficient
detection of changes*):

1. ``GET /api/v1/namespaces/NS/pods?labelSelector=…`` returns the objects and
   the collection's ``metadata.resourceVersion``, the point in history the
   list was taken at.
2. ``GET …&watch=1&resourceVersion=RV&allowWatchBookmarks=true`` streams
   every change after RV as one JSON object per line:
   ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": {...}}``. A
   ``BOOKMARK`` carries only a newer ``resourceVersion``: nothing changed, but
   a watch resumed from there need not replay history.
3. A watch ends when its ``timeoutSeconds`` run out or the connection drops;
   the client watches again from the last version it saw, missing nothing.
4. If that version is older than the history the server keeps, the server
   answers 410 Gone (as the response status, or as an ``ERROR`` event whose
   object is a ``Status`` with ``code: 410``, "too old resource version"); the
   client must list again, and replace what it held with the new list.

``reflect`` is that loop; a consumer gives it two callbacks, one taking a
whole list and one taking a single change.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import random
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import aiohttp
import orjson
import structlog
import yaml

log = structlog.get_logger()

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service-account token, CA bundle and namespace."""

Object = dict[str, Any]
"""A Kubernetes object as decoded JSON: ``apiVersion``, ``kind``, ``metadata``, ``spec``…"""


class KubeconfigError(ValueError):
    """No usable connection to a cluster: the message says which file or variable is wrong."""


class ApiError(Exception):
    """The API server answered with an error ``Status`` (or a watch sent an ``ERROR`` event)."""

    def __init__(self, code: int, reason: str = "", message: str = "") -> None:
        super().__init__(f"{code} {reason}: {message}".rstrip(": "))
        self.code, self.reason, self.message = code, reason, message

    @property
    def gone(self) -> bool:
        """The resource version asked for is older than the history the server keeps."""
        return self.code == 410 or self.reason in ("Expired", "Gone")

    @classmethod
    def from_status(cls, status: Mapping[str, Any], code: int = 0) -> ApiError:
        return cls(
            int(status.get("code") or code),
            str(status.get("reason") or ""),
            str(status.get("message") or ""),
        )


TokenSource = Callable[[], Coroutine[Any, Any, str | None]]


async def _no_token() -> None:
    return None


@dataclass(frozen=True)
class ClusterConfig:
    """How to reach one API server: its URL, TLS settings and bearer token."""

    server: str
    """``https://host:port`` (``http://`` only for tests)."""
    ssl: ssl.SSLContext | bool = True
    """An SSL context with the cluster CA (and client certificate), or False to skip checks."""
    token: TokenSource = _no_token
    """Called before every request: service-account tokens are rotated on disk."""
    namespace: str = "default"
    """The namespace of this pod (in-cluster) or of the kubeconfig context."""


def in_cluster_namespace(directory: Path = SERVICE_ACCOUNT_DIR) -> str | None:
    """The pod's own namespace from its service-account mount, or None outside a cluster."""
    try:
        return (directory / "namespace").read_text().strip() or None
    except OSError:
        return None


def in_cluster_config(
    environ: Mapping[str, str] = os.environ, directory: Path = SERVICE_ACCOUNT_DIR
) -> ClusterConfig:
    """The API server as seen from inside a pod (what client-go's ``InClusterConfig`` reads).

    ``KUBERNETES_SERVICE_HOST``/``PORT`` name the ``kubernetes`` Service; the
    token, CA and namespace come from the service-account mount. The token is
    re-read before each request: bound tokens are rotated by the kubelet.
    """
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise KubeconfigError(
            "not running in a cluster (KUBERNETES_SERVICE_HOST/PORT are not set); give --kubeconfig"
        )
    token_file, ca_file = directory / "token", directory / "ca.crt"
    for needed in (token_file, ca_file):
        if not needed.is_file():
            raise KubeconfigError(f"{needed}: missing (is a service account token mounted?)")
    host = f"[{host}]" if ":" in host else host

    async def token() -> str:
        return (await asyncio.to_thread(token_file.read_text)).strip()

    return ClusterConfig(
        server=f"https://{host}:{port}",
        ssl=ssl.create_default_context(cafile=str(ca_file)),
        token=token,
        namespace=in_cluster_namespace(directory) or "default",
    )


def kubeconfig_config(path: str | os.PathLike[str], context: str | None = None) -> ClusterConfig:
    """The cluster, user and namespace of a kubeconfig context (the current one by default).

    Supports what most clusters hand out: a CA file or inline data, bearer
    tokens (inline or from a file), client certificates, and ``exec``
    credential plugins (``client.authentication.k8s.io``, as cloud providers
    use). Relative file names are relative to the kubeconfig's directory.
    """
    where = Path(path)
    try:
        document = yaml.safe_load(where.read_text())
    except OSError as error:
        raise KubeconfigError(f"{where}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise KubeconfigError(f"{where}: not valid YAML: {error}") from None
    if not isinstance(document, Mapping):
        raise KubeconfigError(f"{where}: not a kubeconfig")

    def entry(section: str, name: str) -> Mapping[str, Any]:
        for item in document.get(section) or []:
            if isinstance(item, Mapping) and item.get("name") == name:
                found = item.get(section[:-1]) or {}
                if isinstance(found, Mapping):
                    return found
        raise KubeconfigError(f"{where}: {section}: no entry named {name!r}")

    name = context or document.get("current-context")
    if not name:
        raise KubeconfigError(f"{where}: no current-context (and none given)")
    ctx = entry("contexts", str(name))
    cluster = entry("clusters", str(ctx.get("cluster")))
    user = entry("users", str(ctx.get("user"))) if ctx.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"{where}: cluster {ctx.get('cluster')!r}: no server")

    def local(file: str) -> str:
        return str(where.parent / file)

    tls: ssl.SSLContext | bool = True
    if cluster.get("insecure-skip-tls-verify"):
        tls = False
    else:
        # With a cluster CA, trust only it (as client-go does); else the system's.
        if cluster.get("certificate-authority-data"):
            ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
            tls = ssl.create_default_context(cadata=ca)
        elif cluster.get("certificate-authority"):
            tls = ssl.create_default_context(cafile=local(cluster["certificate-authority"]))
        else:
            tls = ssl.create_default_context()
        _load_client_certificate(tls, user, local)

    return ClusterConfig(
        server=server.rstrip("/"),
        ssl=tls,
        token=_user_token(user, local, where),
        namespace=str(ctx.get("namespace") or "default"),
    )


def _load_client_certificate(
    tls: ssl.SSLContext, user: Mapping[str, Any], local: Callable[[str], str]
) -> None:
    if user.get("client-certificate-data") and user.get("client-key-data"):
        # ssl loads certificates from files only: write the inline data to
        # private temporary files, load them, and remove them at once.
        with tempfile.TemporaryDirectory() as directory:
            cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
            cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
            key.write_bytes(base64.b64decode(user["client-key-data"]))
            tls.load_cert_chain(str(cert), str(key))
    elif user.get("client-certificate") and user.get("client-key"):
        tls.load_cert_chain(local(user["client-certificate"]), local(user["client-key"]))


def _user_token(user: Mapping[str, Any], local: Callable[[str], str], where: Path) -> TokenSource:
    if isinstance(user.get("token"), str):
        fixed = user["token"]

        async def static() -> str:
            return str(fixed)

        return static
    if isinstance(user.get("tokenFile"), str):
        token_file = Path(local(user["tokenFile"]))

        async def from_file() -> str:
            return (await asyncio.to_thread(token_file.read_text)).strip()

        return from_file
    if isinstance(user.get("exec"), Mapping):
        return _ExecCredential(user["exec"], where).token
    return _no_token


class _ExecCredential:
    """A kubeconfig ``exec`` plugin: run it, take ``status.token``, reuse it until it expires."""

    def __init__(self, spec: Mapping[str, Any], where: Path) -> None:
        if not isinstance(spec.get("command"), str):
            raise KubeconfigError(f"{where}: users[].user.exec.command: required")
        self.command = [spec["command"], *map(str, spec.get("args") or [])]
        self.env = {str(e["name"]): str(e["value"]) for e in spec.get("env") or []}
        self.api_version = str(spec.get("apiVersion", "client.authentication.k8s.io/v1"))
        self._token: str | None = None
        self._expires: datetime.datetime | None = None

    async def token(self) -> str | None:
        now = datetime.datetime.now(datetime.UTC)
        if self._token is not None and (self._expires is None or now < self._expires):
            return self._token
        request = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {}}
        process = await asyncio.create_subprocess_exec(
            *self.command,
            env={**os.environ, **self.env, "KUBERNETES_EXEC_INFO": orjson.dumps(request).decode()},
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise ApiError(401, "Unauthorized", f"exec plugin {self.command[0]} failed")
        status = orjson.loads(out).get("status") or {}
        self._token = status.get("token")
        expiry = status.get("expirationTimestamp")
        self._expires = datetime.datetime.fromisoformat(expiry) if expiry else None
        return self._token


def load_kubeconfig(
    kubeconfig: str | None = None, environ: Mapping[str, str] = os.environ
) -> ClusterConfig:
    """A kubeconfig file when given, else ``$KUBECONFIG``'s, else the in-cluster service account.

    controller-runtime's order (``ctrl.GetConfig``, which GIE's lwepp and the
    llm-d router use), short of its last resort, ``~/.kube/config``: a picker
    should not quietly reach whatever cluster a home directory points at. Of
    several files in ``$KUBECONFIG`` the first is read (client-go merges them).
    """
    if kubeconfig:
        return kubeconfig_config(kubeconfig)
    if first := environ.get("KUBECONFIG", "").split(os.pathsep)[0]:
        return kubeconfig_config(first)
    return in_cluster_config(environ)


@dataclass(frozen=True, slots=True)
class ObjectList:
    """A list response: the objects and the version of the collection they were read at."""

    items: list[Object]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One line of a watch stream."""

    type: str
    """ADDED, MODIFIED, DELETED or BOOKMARK (ERROR is raised as ``ApiError``)."""
    object: Object
    resource_version: str


def resource_version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class KubeApi:
    """Requests to one API server; use as ``async with KubeApi(config) as api``."""

    def __init__(self, config: ClusterConfig, request_timeout: float = 30.0) -> None:
        self.config = config
        self.request_timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.config.ssl),
            headers={"Accept": "application/json", "User-Agent": "switchyard"},
        )
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("KubeApi used outside 'async with'")
        return self._session

    async def _headers(self) -> dict[str, str]:
        token = await self.config.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        body: Object | None = None,
    ) -> Object:
        """One request, answered with one object; an error status raises ``ApiError``."""
        async with self.session.request(
            method,
            self.config.server + path,
            params=dict(params or {}),
            data=orjson.dumps(body) if body is not None else None,
            headers={
                **await self._headers(),
                **({"Content-Type": "application/json"} if body is not None else {}),
            },
            timeout=aiohttp.ClientTimeout(total=self.request_timeout),
        ) as response:
            payload = await response.read()
            decoded = _decode(payload)
            if response.status >= 400:
                raise ApiError.from_status(decoded, response.status)
            return decoded

    async def list(self, path: str, params: Mapping[str, str] | None = None) -> ObjectList:
        found = await self.request("GET", path, params)
        return ObjectList(list(found.get("items") or []), resource_version(found))

    async def watch(
        self,
        path: str,
        params: Mapping[str, str] | None,
        since: str,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[WatchEvent]:
        """Every change to the collection after version ``since``, until the server ends the watch.

        Bookmarks are asked for and passed on. An ``ERROR`` event, or an
        error status, raises ``ApiError`` (``.gone`` for 410). A dropped
        connection raises ``aiohttp.ClientError``; a half-received line is
        never decoded.
        """
        query = {
            **(params or {}),
            "watch": "1",
            "resourceVersion": since,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_seconds + 30)
        async with self.session.get(
            self.config.server + path,
            params=query,
            headers=await self._headers(),
            timeout=timeout,
        ) as response:
            if response.status >= 400:
                raise ApiError.from_status(_decode(await response.read()), response.status)
            # One JSON object per line. Read raw chunks rather than lines:
            # aiohttp's readline refuses lines over 128 KiB, and one pod with
            # its managed fields can be larger.
            pending = b""
            async for chunk in response.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(orjson.loads(line))


def _decode(payload: bytes) -> Object:
    try:
        decoded = orjson.loads(payload) if payload else {}
    except orjson.JSONDecodeError:
        return {"message": payload[:200].decode(errors="replace")}
    return decoded if isinstance(decoded, dict) else {}


def _event(line: Any) -> WatchEvent:
    kind, obj = line.get("type"), line.get("object") or {}
    if kind == "ERROR":
        raise ApiError.from_status(obj)
    return WatchEvent(str(kind), obj, resource_version(obj))


@dataclass
class Backoff:
    """Exponential backoff with jitter for reconnecting: 0.5 s, 1 s, 2 s … up to ``cap``.

    ``sleep`` is injectable so tests run without waiting.
    """

    initial: float = 0.5
    cap: float = 30.0
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    delay: float = field(init=False, default=0.0)

    def reset(self) -> None:
        self.delay = 0.0

    async def wait(self) -> None:
        self.delay = min(self.cap, self.delay * 2 if self.delay else self.initial)
        await self.sleep(self.delay * random.uniform(0.8, 1.0))


class Reflector(Protocol):
    """What ``reflect`` keeps current: a local copy of one collection."""

    def replace(self, items: list[Object]) -> None:
        """The whole collection, as a (re)list returned it: drop anything not in ``items``."""
        ...

    def apply(self, kind: str, obj: Object) -> None:
        """One change: ``kind`` is ADDED, MODIFIED or DELETED."""
        ...


class Held:
    """A collection as ``reflect`` keeps it (a ``Reflector``): every object by name, and
    ``changed`` called after each list and each change."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.objects: dict[str, Object] = {}
        self.listed = False
        """True once a list filled it (a watch alone does not)."""
        self._changed = changed

    def replace(self, items: list[Object]) -> None:
        self.objects = {item["metadata"]["name"]: item for item in items}
        self.listed = True
        self._changed()

    def apply(self, kind: str, obj: Object) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects.pop(name, None)
        else:
            self.objects[name] = obj
        self._changed()


async def reflect(
    api: KubeApi,
    path: str,
    params: Mapping[str, str],
    into: Reflector,
    backoff: Backoff | None = None,
    timeout_seconds: int = 300,
) -> None:
    """List the collection into ``into``, then follow its watch, forever (until cancelled).

    - A watch that ends (its timeout, a dropped connection) resumes from the
      last version seen: an event's, or a bookmark's.
    - 410 Gone means that version is too old: list again at once.
    - Any other failure (connection refused, 5xx, 403) waits with backoff,
      then retries the same step. Progress (a list, an event) resets the backoff.
    """
    backoff = backoff or Backoff()
    since: str | None = None
    while True:
        progressed = False
        try:
            if since is None:
                listing = await api.list(path, params)
                into.replace(listing.items)
                since, progressed = listing.resource_version, True
                backoff.reset()
            async for event in api.watch(path, params, since, timeout_seconds):
                if event.type != "BOOKMARK":
                    into.apply(event.type, event.object)
                since, progressed = event.resource_version or since, True
                backoff.reset()
        except ApiError as error:
            if error.gone:
                log.info("watch too old; listing again", path=path, since=since)
                since = None
                continue
            log.warning("kubernetes api error", path=path, error=str(error))
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            log.warning("kubernetes api unreachable", path=path, error=repr(error))
        else:
            if progressed:
                continue  # the watch timed out normally: resume from ``since`` at once
        await backoff.wait()
