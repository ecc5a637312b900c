"""Lease election against an in-memory API that, unlike kmock, bumps ``resourceVersion`` and
refuses a stale write with 409 (the optimistic concurrency a real API server gives)."""

from __future__ import annotations

import asyncio
import copy
import datetime
import re
from collections.abc import Callable
from typing import Any

import pytest

from picker.k8s.client import ApiError
from picker.k8s.leader import FAILED, HELD, LEADING, LeaderElector, micro_time

MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


class LeaseApi:
    """One Lease, with resourceVersion preconditions; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.timeout = 1.0
        self.conflicts = 0
        self.calls = 0

    async def _call(self) -> None:
        self.calls += 1
        await asyncio.sleep(0)  # let racing electors interleave
        if self.down:
            raise ApiError(503, "ServiceUnavailable")

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        await self._call()
        if self.lease is None:
            raise ApiError(404, "NotFound")
        return copy.deepcopy(self.lease)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        await self._call()
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists")
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        await self._call()
        assert self.lease is not None
        wanted = body.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != self.lease["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "Conflict")
        self.version += 1
        self.lease["spec"].update(body["spec"])
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


def _elector(api: LeaseApi, identity: str, **options: Any) -> LeaderElector:
    options = {"lease_duration": 1.0, "renew_deadline": 0.5, "retry_period": 0.05, **options}
    return LeaderElector(api, "ns", "picker", identity=identity, **options)  # type: ignore[arg-type]


def test_micro_time_is_rfc3339_with_microseconds_in_utc() -> None:
    moment = datetime.datetime(2025, 3, 4, 5, 6, 7, 89,
                               tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert micro_time(moment) == "2025-03-04T03:06:07.000089Z"


def test_durations_are_checked() -> None:
    with pytest.raises(ValueError):
        _elector(LeaseApi(), "a", lease_duration=0.5)
    with pytest.raises(ValueError):
        _elector(LeaseApi(), "a", renew_deadline=1.0)


async def test_first_candidate_creates_the_lease_and_renews_it() -> None:
    api = LeaseApi()
    a = _elector(api, "a")
    assert await a.try_acquire_or_renew() == LEADING
    spec = api.lease["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 0
    assert spec["leaseDurationSeconds"] == 1
    assert MICRO_TIME.match(spec["acquireTime"]) and MICRO_TIME.match(spec["renewTime"])
    acquired = spec["acquireTime"]
    await asyncio.sleep(0.01)
    assert await a.try_acquire_or_renew() == LEADING
    assert api.lease["spec"]["acquireTime"] == acquired
    assert api.lease["spec"]["renewTime"] > acquired
    assert api.lease["spec"]["leaseTransitions"] == 0


async def test_a_held_lease_is_left_alone_until_unchanged_for_its_duration() -> None:
    api = LeaseApi()
    now = [0.0]
    a = _elector(api, "a")
    b = _elector(api, "b", clock=lambda: now[0])
    assert await a.try_acquire_or_renew() == LEADING
    assert await b.try_acquire_or_renew() == HELD
    now[0] = 0.9
    assert await b.try_acquire_or_renew() == HELD
    assert await a.try_acquire_or_renew() == LEADING  # a renews: b starts counting again
    now[0] = 1.5
    assert await b.try_acquire_or_renew() == HELD
    now[0] = 2.6  # unchanged since b saw it at 1.5, for more than 1 s
    assert await b.try_acquire_or_renew() == LEADING
    assert api.lease["spec"]["holderIdentity"] == "b"
    assert api.lease["spec"]["leaseTransitions"] == 1
    assert await a.try_acquire_or_renew() == HELD


async def test_racing_candidates_one_wins_the_other_gets_a_conflict() -> None:
    api = LeaseApi()
    api.lease = {"metadata": {"name": "picker", "resourceVersion": "7"},
                 "spec": {"holderIdentity": "", "leaseTransitions": 3}}
    api.version = 7
    a, b = _elector(api, "a"), _elector(api, "b")
    results = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
    assert sorted(results) == [HELD, LEADING]
    assert api.conflicts == 1
    assert api.lease["spec"]["leaseTransitions"] == 4


async def test_an_unreachable_api_fails_the_round() -> None:
    api = LeaseApi()
    api.down = True
    assert await _elector(api, "a").try_acquire_or_renew() == FAILED


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# The electors below run their loops in real time (retry_period), but judge leases and deadlines
# by a clock the test moves: what they decide does not depend on how fast the machine runs them.


async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires() -> None:
    api = LeaseApi()
    now = [0.0]
    states: list[tuple[bool, float]] = []
    a = _elector(api, "a", clock=lambda: now[0],
                 on_leading=lambda leading: states.append((leading, now[0])))
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    await _until(lambda: a.leading)
    api.down = True
    calls = api.calls
    await _until(lambda: api.calls >= calls + 2)  # a round failed: none renews any more
    now[0] = 0.4  # within the renew deadline (0.5 s) of its last renewal (at 0)
    calls = api.calls
    await _until(lambda: api.calls >= calls + 3)
    assert a.leading
    now[0] = 0.6  # past it, before the lease (1 s) lets another replica take over
    await _until(lambda: not a.leading)
    assert states == [(True, 0.0), (False, 0.6)]
    api.down = False
    await _until(lambda: a.leading)  # candidates again, and the lease is still its own
    stop.set()
    await asyncio.wait_for(task, 10.0)
    assert [s for s, _ in states] == [True, False, True, False]
    assert api.lease["spec"]["holderIdentity"] == ""  # released on stop


async def test_two_electors_running_exactly_one_leads_and_a_release_hands_over() -> None:
    api = LeaseApi()
    now = [0.0]  # never moves: the lease never expires, only a release hands it over
    a, b = _elector(api, "a", clock=lambda: now[0]), _elector(api, "b", clock=lambda: now[0])
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(a.run(stop_a)), asyncio.create_task(b.run(stop_b))]
    await _until(lambda: a.leading or b.leading)
    calls = api.calls
    while api.calls < calls + 20:  # rounds of both: renewals, and reads of a held lease
        assert a.leading + b.leading == 1
        await asyncio.sleep(0.01)
    assert a.leading + b.leading == 1
    leader, other = (a, b) if a.leading else (b, a)
    (stop_a if leader is a else stop_b).set()
    await _until(lambda: other.leading)
    assert api.lease["spec"]["holderIdentity"] == other.identity
    assert api.lease["spec"]["leaseTransitions"] == 1
    stop_a.set()
    stop_b.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
