"""Leader election among picker replicas on a ``coordination.k8s.io/v1`` Lease.

It answers: *is this replica the one that should do the once-per-pool work?* The algorithm is
client-go's: every ``retry_period`` the elector reads the Lease; it takes it when it is absent,
released (empty ``holderIdentity``) or expired, renews it while it holds it, and leaves it alone
otherwise. A Lease is expired when its record has not changed for ``leaseDurationSeconds``
measured on *this* replica's clock from when it first saw that record (so clocks need not agree).
Taking the Lease from another holder (or after a release) increments ``leaseTransitions``;
``acquireTime`` and ``renewTime`` are RFC 3339 micro-times.

A leader that cannot renew steps down after ``renew_deadline`` (default two thirds of the lease
duration), before any other replica may take the expired Lease, so two replicas never both believe
they lead. On ``stop`` a leader releases the Lease (``release_on_stop``) so another takes over at
its next retry instead of after a full lease duration.

Writes are JSON merge patches carrying the read ``metadata.resourceVersion``: a real API server
refuses a write over a changed Lease (409), which is how two candidates racing for a free Lease
are told apart. kmock's emulator sets no ``resourceVersion`` and ignores it in patches, so there
the last writer wins; a loser notices at its next read (the holder is not itself) and steps down
after at most one ``retry_period``. HTTP is ``picker.k8s.client`` (aiohttp).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from picker.k8s.client import (
    UNREACHABLE,
    ApiError,
    KubeClient,
    resource_version,
    until_stopped,
    wait_or_stop,
)

log = logging.getLogger(__name__)

WRITE_FAILED: tuple[type[BaseException], ...] = (*UNREACHABLE, ValueError, AttributeError)
"""A Lease write the API server could not be reached for, or answered with what was not a
Lease: this round fails, the next one tries again."""
RELEASE_FAILED: tuple[type[BaseException], ...] = (ApiError, *UNREACHABLE)
"""A release on the way out that did not reach the API server: the Lease then expires."""

LEASE_API = "/apis/coordination.k8s.io/v1"


def default_identity() -> str:
    """``$POD_NAME`` (set it from the downward API), else ``hostname_pid``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}"


def micro_time(moment: datetime.datetime) -> str:
    """RFC 3339 with microseconds in UTC, as Kubernetes writes ``MicroTime``."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


LEADING, HELD, FAILED = "leading", "held", "failed"


class LeaderElector:
    """Competes for Lease ``namespace/name`` as ``identity``; ``on_leading(True)`` when this
    replica becomes the leader, ``on_leading(False)`` when it stops being one (lost, stepped down,
    or stopped). ``leading`` is the current state, ``holder`` the holder last seen."""

    def __init__(self, client: KubeClient, namespace: str, name: str,
                 on_leading: Callable[[bool], None] = lambda leading: None, *,
                 identity: str | None = None, lease_duration: float = 15.0,
                 renew_deadline: float | None = None, retry_period: float = 5.0,
                 release_on_stop: bool = True, owner_config_map: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], datetime.datetime] =
                 lambda: datetime.datetime.now(datetime.UTC)) -> None:
        if lease_duration < 1:
            raise ValueError("lease_duration must be at least 1 second (the Lease counts whole "
                             "seconds)")
        self.client = client
        self.namespace = namespace
        self.name = name
        self.on_leading = on_leading
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = lease_duration * 2 / 3 if renew_deadline is None else renew_deadline
        if not 0 < self.renew_deadline < lease_duration:
            raise ValueError("renew_deadline must be between 0 and lease_duration")
        self.retry_period = retry_period
        self.release_on_stop = release_on_stop
        self.owner_config_map = owner_config_map
        """A ConfigMap of the Lease's namespace that owns the Lease it creates (the picker's
        config): deleting the release deletes the ConfigMap, and the garbage collector the
        Lease with it. None: the Lease has no owner."""
        self.clock = clock
        self.wall_clock = wall_clock
        self.leading = False
        self.holder: str | None = None
        self.transitions: int | None = None
        """``leaseTransitions`` as last read or written."""
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        self._renewed_at = 0.0

    @property
    def path(self) -> str:
        return f"{LEASE_API}/namespaces/{self.namespace}/leases"

    # -- one round --

    def _observe(self, spec: dict[str, Any]) -> None:
        if spec != self._observed:
            self._observed = spec
            self._observed_at = self.clock()
        self.holder = spec.get("holderIdentity") or None
        transitions = spec.get("leaseTransitions")
        self.transitions = transitions if isinstance(transitions, int) else 0

    def _spec(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = micro_time(self.wall_clock())
        spec: dict[str, Any] = {"holderIdentity": self.identity,
                                "leaseDurationSeconds": max(1, round(self.lease_duration)),
                                "renewTime": now}
        if previous is None:
            spec.update(acquireTime=now, leaseTransitions=0)
        elif previous.get("holderIdentity") == self.identity:
            spec["acquireTime"] = previous.get("acquireTime") or now
            spec["leaseTransitions"] = previous.get("leaseTransitions") or 0
        else:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = (previous.get("leaseTransitions") or 0) + 1
        return spec

    async def try_acquire_or_renew(self) -> str:
        """One round: ``leading`` (acquired or renewed), ``held`` (another replica holds it), or
        ``failed`` (the API could not be asked or refused for another reason)."""
        try:
            try:
                lease = await self.client.get(f"{self.path}/{self.name}")
            except ApiError as exc:
                if exc.code != 404:
                    raise
                return await self._create()
            spec = dict(lease.get("spec") or {})
            self._observe(spec)
            holder = spec.get("holderIdentity") or ""
            duration = spec.get("leaseDurationSeconds")
            if not isinstance(duration, int | float) or duration <= 0:
                duration = self.lease_duration
            if holder and holder != self.identity and \
                    self.clock() < self._observed_at + duration:
                return HELD
            new = self._spec(spec)
            patch: dict[str, Any] = {"spec": new}
            version = resource_version(lease)
            if version:
                patch["metadata"] = {"resourceVersion": version}
            written = await self.client.merge_patch(f"{self.path}/{self.name}", patch)
        except ApiError as exc:
            if exc.code == 409:  # someone else wrote the Lease since we read it
                return HELD
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            return FAILED
        except WRITE_FAILED as exc:
            log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(exc).__name__, exc)
            return FAILED
        stored = written.get("spec") if isinstance(written, dict) else None
        self._observe(dict(stored or new))
        return LEADING if self.holder == self.identity else HELD

    async def _create(self) -> str:
        spec = self._spec(None)
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        owner = await self._owner()
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": metadata, "spec": spec}
        try:
            await self.client.create(self.path, body)
        except ApiError as exc:
            if exc.code == 409:  # created by another replica meanwhile
                return HELD
            raise
        self._observe(spec)
        return LEADING

    async def _owner(self) -> dict[str, Any] | None:
        if not self.owner_config_map:
            return None
        try:
            owner = await self.client.get(
                f"/api/v1/namespaces/{self.namespace}/configmaps/{self.owner_config_map}")
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise
        uid = (owner.get("metadata") or {}).get("uid")
        return None if not uid else {"apiVersion": "v1", "kind": "ConfigMap",
                                     "name": self.owner_config_map, "uid": uid}

    async def release(self) -> None:
        """Give the Lease up if this replica holds it (empty holder, 1 s duration)."""
        lease = await self.client.get(f"{self.path}/{self.name}")
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return
        now = micro_time(self.wall_clock())
        patch: dict[str, Any] = {"spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                                          "acquireTime": now, "renewTime": now}}
        version = resource_version(lease)
        if version:
            patch["metadata"] = {"resourceVersion": version}
        await self.client.merge_patch(f"{self.path}/{self.name}", patch)
        log.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)

    # -- the loop --

    def _set_leading(self, leading: bool) -> None:
        if leading == self.leading:
            return
        self.leading = leading
        log.info("lease %s/%s: %s %s", self.namespace, self.name, self.identity,
                 "is the leader" if leading else "is not the leader any more")
        try:
            self.on_leading(leading)
        except Exception:
            log.exception("on_leading(%s) failed", leading)

    async def run(self, stop: asyncio.Event) -> None:
        """Compete until ``stop`` is set; then release the Lease if held and report
        ``on_leading(False)``."""
        try:
            await until_stopped(stop, self._loop(stop))
        finally:
            if self.leading and self.release_on_stop:
                try:
                    await asyncio.wait_for(self.release(), self.client.timeout)
                except RELEASE_FAILED as exc:
                    log.warning("lease %s/%s not released: %s", self.namespace, self.name, exc)
            self._set_leading(False)

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            wait = self.retry_period
            if self.leading:  # a renewal must not outlast the deadline
                budget = self._renewed_at + self.renew_deadline - self.clock()
                try:
                    result = await asyncio.wait_for(self.try_acquire_or_renew(),
                                                    max(0.05, budget))
                except TimeoutError:
                    result = FAILED
            else:
                result = await self.try_acquire_or_renew()
            if result == LEADING:
                self._renewed_at = self.clock()
                self._set_leading(True)
            elif result == HELD:
                self._set_leading(False)
            elif self.leading:
                left = self._renewed_at + self.renew_deadline - self.clock()
                if left <= 0:
                    log.warning("lease %s/%s not renewed for %.1fs: stepping down", self.namespace,
                                self.name, self.renew_deadline)
                    self._set_leading(False)
                else:
                    wait = min(wait, left)
            if await wait_or_stop(stop, wait):
                return
