"""A small asyncio Kubernetes API client: JSON requests, watch streams, and list-then-watch.

It answers: *what does the cluster say now, and what changed since?* HTTP is aiohttp (already the
picker's dependency), so every call is a coroutine and a watch stops the moment its task is
cancelled; the official ``kubernetes`` package is used only to find the credentials (in-cluster
service account, else kubeconfig), never to make calls. That keeps one event loop, no threads, and
``stop`` is honoured at once.

``Reflector`` lists a collection, then watches it from the list's ``resourceVersion``; on
``410 Gone`` it lists again at once, on any other error after a backoff (``retry_min`` doubling
up to ``retry_max``). The objects it holds are always a full, consistent view: a re-list replaces
them in one step. Against kmock's emulator (which sets no ``resourceVersion`` and replays every
object as ``ADDED`` on each watch) this still converges: the replay only re-states what is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

Headers = Callable[[], Mapping[str, str]]

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


UNREACHABLE: tuple[type[BaseException], ...] = (aiohttp.ClientError, OSError, TimeoutError)
"""Errors of a call that never got an answer (connection refused or reset, DNS, timeout): worth
retrying, unlike most answers."""


class ApiError(Exception):
    """The API answered with an error status (``code`` is the HTTP status)."""

    def __init__(self, code: int, reason: str = "", message: str = "") -> None:
        self.code = code
        self.reason = reason
        self.message = message
        super().__init__(f"{code} {reason}: {message}" if reason or message else str(code))

    @classmethod
    def from_status(cls, code: int, body: Any) -> ApiError:
        """From a ``Status`` object (or whatever text the server sent)."""
        if isinstance(body, dict):
            return cls(int(body.get("code") or code), str(body.get("reason") or ""),
                       str(body.get("message") or ""))
        return cls(code, "", str(body)[:200])


WATCH_FAILED: tuple[type[BaseException], ...] = (ApiError, *UNREACHABLE, ValueError)
"""A list or watch the API server refused, could not be reached for, or answered with what
was not JSON: logged, and tried again after a back-off."""


class Gone(ApiError):
    """410: the watched ``resourceVersion`` is too old; list again."""


def _error(code: int, body: Any) -> ApiError:
    error = ApiError.from_status(code, body)
    return Gone(error.code, error.reason, error.message) if error.code == 410 else error


class KubeClient:
    """The API server at ``server`` (``https://host:port``, or kmock's ``http://127.0.0.1:P``).

    ``headers`` is called before each request (a rotating service-account token is re-read this
    way). Use ``from_environment`` to find the server and credentials the usual way. The aiohttp
    session is opened on first use, in the running loop; ``close()`` it when done.
    """

    def __init__(self, server: str, *, headers: Headers | None = None,
                 ssl_context: ssl.SSLContext | None = None, timeout: float = 10.0) -> None:
        self.server = server.rstrip("/")
        self._headers = headers or (lambda: {})
        self._ssl = ssl_context
        self.timeout = timeout
        """Seconds a plain request may take (watches are bounded by their own timeout)."""
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, server: str | None = None, *, kubeconfig: str | None = None,
                         context: str | None = None, token: str | None = None) -> KubeClient:
        """``server`` given: that URL (with ``token`` as a bearer token if set). Else the pod's
        service account when running in a cluster, else kubeconfig (``$KUBECONFIG`` or
        ``~/.kube/config``; ``context`` picks one)."""
        if server is not None:
            return cls(server, headers=(lambda: {"authorization": f"Bearer {token}"})
                       if token else None)
        from kubernetes import client as kclient  # only to read credentials
        from kubernetes import config as kconfig

        configuration = kclient.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(SERVICE_ACCOUNT_TOKEN):
            kconfig.load_incluster_config(client_configuration=configuration)
        else:
            kconfig.load_kube_config(config_file=kubeconfig, context=context,
                                     client_configuration=configuration, persist_config=False)
        return cls(configuration.host, headers=_auth_headers(configuration),
                   ssl_context=_ssl_context(configuration))

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _request_headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"accept": "application/json", **self._headers()}
        if content_type:
            headers["content-type"] = content_type
        return headers

    async def request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json") -> Any:
        """One call; the decoded JSON answer, or ApiError for a status >= 400."""
        data = None if body is None else json.dumps(body)
        async with self._open().request(
                method, self.server + path, params=params, data=data,
                headers=self._request_headers(content_type if data is not None else None),
                timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
            text = await response.text()
            try:
                decoded = json.loads(text) if text else None
            except ValueError:
                decoded = text
            if response.status >= 400:
                raise _error(response.status, decoded)
            return decoded

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Any) -> Any:
        """POST to a collection."""
        return await self.request("POST", path, body=body)

    async def merge_patch(self, path: str, body: Any) -> Any:
        """PATCH with a JSON merge patch (``None`` removes a key)."""
        return await self.request("PATCH", path, body=body,
                                  content_type="application/merge-patch+json")

    async def delete(self, path: str) -> Any:
        return await self.request("DELETE", path)

    async def watch(self, path: str, params: Mapping[str, str],
                    timeout: float) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (``watch=true`` is added); ends when the server closes the
        stream or nothing arrives for ``timeout`` seconds. Lines are split by hand: one event may
        be larger than aiohttp's line limit (a ConfigMap holds up to 1 MiB)."""
        query = {**params, "watch": "true"}
        async with self._open().get(
                self.server + path, params=query, headers=self._request_headers(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                              sock_read=timeout)) as response:
            if response.status >= 400:
                text = await response.text()
                try:
                    decoded: Any = json.loads(text)
                except ValueError:
                    decoded = text
                raise _error(response.status, decoded)
            buffer = b""
            try:
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
            except TimeoutError:
                return  # quiet for `timeout` seconds: the caller watches again
            if buffer.strip():
                yield json.loads(buffer)


def _auth_headers(configuration: Any) -> Headers:
    def headers() -> dict[str, str]:
        result = {}
        for setting in configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                result[setting["key"]] = setting["value"]
        if not result and configuration.username and configuration.password:
            result["authorization"] = configuration.get_basic_auth_token()
        return result

    return headers


def _ssl_context(configuration: Any) -> ssl.SSLContext | None:
    if not configuration.host.startswith("https"):
        return None
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def name_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def resource_version(obj: Mapping[str, Any]) -> str | None:
    """The object's (or list's) ``metadata.resourceVersion``; None when absent (kmock)."""
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return str(value) if value else None


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True when ``stop`` was set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def until_stopped(stop: asyncio.Event, work: Awaitable[None]) -> None:
    """Run ``work`` until it ends or ``stop`` is set (then it is cancelled); an error it ended
    with by itself is re-raised."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished = task.done()
        task.cancel()
        stopper.cancel()
        await asyncio.gather(task, stopper, return_exceptions=True)
    if finished and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


OnChange = Callable[[dict[str, dict[str, Any]]], None]


class Reflector:
    """Keeps ``objects`` (name → object) of one namespaced collection in step with the API.

    ``path`` is the collection (``/api/v1/namespaces/NS/pods``); ``params`` narrow it
    (``fieldSelector``/``labelSelector``); ``keep`` filters client-side as well (kmock ignores
    selectors) and ``transform`` may slim each object down. ``on_change(objects)`` is called after
    every list and every event (it may see the same state again; callers compare).
    """

    def __init__(self, client: KubeClient, path: str, on_change: OnChange, *,
                 params: Mapping[str, str] | None = None,
                 keep: Callable[[dict[str, Any]], bool] = lambda obj: True,
                 transform: Callable[[dict[str, Any]], dict[str, Any]] = lambda obj: obj,
                 watch_timeout: float = 300.0, retry_min: float = 0.5,
                 retry_max: float = 10.0) -> None:
        self.client = client
        self.path = path
        self.on_change = on_change
        self.params = dict(params or {})
        self.keep = keep
        self.transform = transform
        self.watch_timeout = watch_timeout
        self.retry_min = retry_min
        self.retry_max = retry_max
        self.objects: dict[str, dict[str, Any]] = {}
        self.synced = False
        """True once the first list has arrived."""
        self.errors = 0
        """Failed lists and watches so far (each is followed by a backoff and a fresh list)."""

    async def run(self, stop: asyncio.Event) -> None:
        await until_stopped(stop, self._loop(stop))

    async def _loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        delay = self.retry_min
        while not stop.is_set():
            listed_at: float | None = None
            try:
                version = await self._list()
                listed_at = loop.time()
                while not stop.is_set():
                    started = loop.time()
                    version = await self._watch(version)
                    if loop.time() - started < 1.0 and await wait_or_stop(stop, self.retry_min):
                        return  # a server that ends watches at once is not hammered
            except Gone:
                log.info("watch of %s expired (410); listing again", self.path)
            except WATCH_FAILED as exc:
                self.errors += 1
                if listed_at is not None and loop.time() - listed_at > self.retry_max:
                    delay = self.retry_min  # it worked for a while: back off afresh
                log.warning("list/watch of %s failed (%s: %s); retrying in %.1fs", self.path,
                            type(exc).__name__, exc, delay)
                if await wait_or_stop(stop, delay):
                    return
                delay = min(self.retry_max, delay * 2)

    async def _list(self) -> str | None:
        answer = await self.client.get(self.path, self.params)
        if not isinstance(answer, dict) or not isinstance(answer.get("items"), list):
            raise ValueError(f"list of {self.path} returned no items")
        objects = {}
        for item in answer["items"]:
            if isinstance(item, dict) and self.keep(item):
                objects[name_of(item)] = self.transform(item)
        self.objects = objects
        self.synced = True
        self._changed()
        return resource_version(answer)

    async def _watch(self, version: str | None) -> str | None:
        params = {**self.params, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(max(1, int(self.watch_timeout)))}
        if version:
            params["resourceVersion"] = version
        # the server ends the watch at timeoutSeconds; give it a margin before deciding it is dead
        async for event in self.client.watch(self.path, params, self.watch_timeout + 30):
            kind = event.get("type")
            obj = event.get("object")
            if not isinstance(obj, dict):
                raise ValueError(f"watch event without an object: {event!r}"[:200])
            if kind == "ERROR":
                raise _error(int(obj.get("code") or 500), obj)
            version = resource_version(obj) or version
            if kind == "BOOKMARK":
                continue
            name = name_of(obj)
            if kind == "DELETED" or not self.keep(obj):
                if self.objects.pop(name, None) is None:
                    continue
            elif kind in ("ADDED", "MODIFIED"):
                self.objects[name] = self.transform(obj)
            else:
                continue
            self._changed()
        return version

    def _changed(self) -> None:
        try:
            self.on_change(self.objects)
        except Exception:
            log.exception("handling a change of %s failed", self.path)
