"""List-then-watch against a scripted API: resourceVersions, 410 Gone, errors and backoff, and
stopping (no network: the client is a fake with the ``KubeClient`` methods the Reflector uses)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from picker.k8s.client import ApiError, Reflector


def _obj(name: str, version: str, **data: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}, **data}


class ScriptedApi:
    """Each list answers the next of ``lists`` (an exception is raised); each watch yields the
    next of ``watches`` then hangs (as a live watch with nothing to say does)."""

    def __init__(self, lists: list[Any], watches: list[list[dict[str, Any]]]) -> None:
        self.lists = lists
        self.watches = watches
        self.list_calls: list[float] = []
        self.watch_params: list[dict[str, str]] = []
        self.timeout = 1.0

    async def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        self.list_calls.append(asyncio.get_running_loop().time())
        answer = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        if isinstance(answer, Exception):
            raise answer
        return copy.deepcopy(answer)

    async def watch(self, path: str, params: dict[str, str],
                    timeout: float) -> AsyncIterator[dict[str, Any]]:
        self.watch_params.append(dict(params))
        events = self.watches.pop(0) if self.watches else []
        for event in events:
            yield event
        await asyncio.Event().wait()


async def _until(predicate: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _running(reflector: Reflector) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(reflector.run(stop))


async def test_list_then_watch_from_the_lists_version_following_events() -> None:
    api = ScriptedApi(
        [{"metadata": {"resourceVersion": "10"}, "items": [_obj("a", "5"), _obj("b", "6")]}],
        [[{"type": "MODIFIED", "object": _obj("a", "11", spec=2)},
          {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
          {"type": "DELETED", "object": _obj("b", "13")},
          {"type": "ADDED", "object": _obj("c", "14")}]])
    seen: list[dict[str, Any]] = []
    reflector = Reflector(api, "/api/v1/namespaces/ns/things",  # type: ignore[arg-type]
                          lambda objects: seen.append(copy.deepcopy(objects)),
                          params={"labelSelector": "x=y"})
    stop, task = await _running(reflector)
    await _until(lambda: set(reflector.objects) == {"a", "c"})
    assert reflector.objects["a"]["spec"] == 2
    assert set(seen[0]) == {"a", "b"}  # the list first, as a whole
    assert api.watch_params[0]["resourceVersion"] == "10"
    assert api.watch_params[0]["labelSelector"] == "x=y"
    assert api.watch_params[0]["allowWatchBookmarks"] == "true"
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_gone_relists_at_once_and_the_list_replaces_what_was_held() -> None:
    api = ScriptedApi(
        [{"metadata": {"resourceVersion": "10"}, "items": [_obj("a", "5"), _obj("b", "6")]},
         {"metadata": {"resourceVersion": "50"}, "items": [_obj("a", "40")]}],
        [[{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}]])
    reflector = Reflector(api, "/p", lambda objects: None,  # type: ignore[arg-type]
                          retry_min=5.0)  # a backoff would outlast the test
    stop, task = await _running(reflector)
    await _until(lambda: len(api.list_calls) == 2 and len(api.watch_params) == 2)
    assert set(reflector.objects) == {"a"}  # b vanished while we were not watching
    assert api.watch_params[1]["resourceVersion"] == "50"
    assert reflector.errors == 0
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_errors_back_off_doubling_then_recover() -> None:
    api = ScriptedApi([ApiError(500, "InternalError"), ApiError(503, "Unavailable"),
                       OSError("connection refused"),
                       {"metadata": {"resourceVersion": "1"}, "items": [_obj("a", "1")]}], [])
    reflector = Reflector(api, "/p", lambda objects: None,  # type: ignore[arg-type]
                          retry_min=0.05, retry_max=0.1)
    stop, task = await _running(reflector)
    await _until(lambda: reflector.synced)
    assert reflector.errors == 3
    gaps = [b - a for a, b in zip(api.list_calls, api.list_calls[1:], strict=False)]
    assert gaps[0] >= 0.04 and gaps[1] >= 0.09 and gaps[2] >= 0.09  # 0.05, 0.1, capped 0.1
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_a_watch_error_event_other_than_gone_backs_off_and_relists() -> None:
    api = ScriptedApi([{"metadata": {"resourceVersion": "1"}, "items": []}],
                      [[{"type": "ERROR", "object": {"code": 500, "message": "boom"}}]])
    reflector = Reflector(api, "/p", lambda objects: None,  # type: ignore[arg-type]
                          retry_min=0.05)
    stop, task = await _running(reflector)
    await _until(lambda: len(api.list_calls) == 2)
    assert reflector.errors == 1
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_keep_filters_client_side_and_an_object_leaving_the_filter_is_dropped() -> None:
    api = ScriptedApi(
        [{"metadata": {}, "items": [_obj("mine", "1"), _obj("other", "1")]}],
        [[{"type": "ADDED", "object": _obj("other2", "2")},
          {"type": "MODIFIED", "object": _obj("mine", "3", gone=True)}]])
    calls = []
    reflector = Reflector(api, "/p", lambda objects: calls.append(dict(objects)),  # type: ignore[arg-type]
                          keep=lambda obj: obj["metadata"]["name"].startswith("mine")
                          and not obj.get("gone"))
    stop, task = await _running(reflector)
    await _until(lambda: len(calls) == 2)
    assert calls == [{"mine": _obj("mine", "1")}, {}]
    assert "resourceVersion" not in api.watch_params[0]  # kmock-like list without a version
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_a_failing_callback_does_not_stop_the_watch() -> None:
    api = ScriptedApi([{"metadata": {}, "items": []}],
                      [[{"type": "ADDED", "object": _obj("a", "1")}]])
    calls = []

    def callback(objects: dict[str, Any]) -> None:
        calls.append(set(objects))
        raise RuntimeError("bug in the consumer")

    reflector = Reflector(api, "/p", callback)  # type: ignore[arg-type]
    stop, task = await _running(reflector)
    await _until(lambda: len(calls) == 2)
    assert calls == [set(), {"a"}]
    stop.set()
    await asyncio.wait_for(task, 1.0)
