"""Live figures from the picker's admin API (``fairway.v1.Admin/ListTenants``) for policy status.

One snapshot of all tenants is shared by every policy's timer for a short while, so a pool with
many policies costs one call per refresh interval, and an unreachable picker one failed call.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpc
import grpc.aio

from picker.admin.v1 import admin_pb2, admin_pb2_grpc

WINDOWS = ("burst", "sustained")
MAX_PAGE = 1000
"""Tenants per admin API page (the picker's most)."""
MAX_PAGES = 20
"""Pages read per snapshot at most: the picker holds few tenants beyond the busiest."""
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The largest admin API answer read (a RecentRequests window)."""
RECENT_TIMEOUT = 10.0
"""Seconds a RecentRequests call may take at least (it carries thousands of records)."""


class PickerUnreachable(Exception):
    """The admin API did not answer (down, refusing, too slow, or an error status)."""


class AdminClient:
    """A client of one picker's admin API. The channel is made on first use, in the running
    event loop; ``close`` it in the same loop."""

    def __init__(self, address: str, timeout: float = 2.0, max_age: float = 1.0,
                 reconnect_backoff: float = 10.0, token_file: Path | None = None) -> None:
        self.address = address
        self.token_file = token_file
        """The admin API's bearer token (a mounted Secret), read at each call: a rotation is
        followed without a restart."""
        self._timeout = timeout
        self._max_age = max_age
        self._reconnect_backoff = reconnect_backoff
        self._channel: grpc.aio.Channel | None = None
        self._stub: admin_pb2_grpc.AdminStub | None = None
        self._latest: asyncio.Future[admin_pb2.ListTenantsResponse] | None = None
        self._latest_at = -math.inf

    async def snapshot(self) -> admin_pb2.ListTenantsResponse:
        """All tenants the picker knows now: one call shared by callers within ``max_age``
        seconds (a failure is shared too). Raises PickerUnreachable."""
        loop = asyncio.get_running_loop()
        if self._latest is None or loop.time() - self._latest_at > self._max_age:
            self._latest_at = loop.time()
            self._latest = asyncio.ensure_future(self._list_tenants())
        return await asyncio.shield(self._latest)

    async def recent_requests(self, since_seconds: float, limit: int
                              ) -> admin_pb2.RecentRequestsResponse:
        """The picker's requests that arrived within ``since_seconds`` (at most ``limit``, the
        latest), for a dry run's replay. Raises PickerUnreachable."""
        stub = self._stub_now()
        try:
            answer: admin_pb2.RecentRequestsResponse = await stub.RecentRequests(
                admin_pb2.RecentRequestsRequest(since_seconds=since_seconds, limit=limit),
                timeout=max(self._timeout, RECENT_TIMEOUT), metadata=self._metadata())
        except grpc.aio.AioRpcError as exc:
            raise PickerUnreachable(f"{self.address}: {exc.code().name}: {exc.details()}") from None
        return answer

    def _stub_now(self) -> admin_pb2_grpc.AdminStub:
        if self._stub is None:
            backoff_ms = int(self._reconnect_backoff * 1000)
            self._channel = grpc.aio.insecure_channel(self.address, options=[
                ("grpc.initial_reconnect_backoff_ms", min(1000, backoff_ms)),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
                # RecentRequests answers up to 20,000 records (about 2 MB; 4 MB by default).
                ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
            ])
            self._stub = admin_pb2_grpc.AdminStub(self._channel)
        return self._stub

    async def _list_tenants(self) -> admin_pb2.ListTenantsResponse:
        self._stub = self._stub_now()
        try:
            # The answer is paged (busiest first); a configured tenant may be on a later page.
            metadata = self._metadata()
            answer = await self._stub.ListTenants(admin_pb2.ListTenantsRequest(limit=MAX_PAGE),
                                                  timeout=self._timeout, metadata=metadata)
            token, pages = answer.next_page_token, 1
            while token and pages < MAX_PAGES:
                page = await self._stub.ListTenants(
                    admin_pb2.ListTenantsRequest(limit=MAX_PAGE, page_token=token),
                    timeout=self._timeout, metadata=metadata)
                answer.tenants.extend(page.tenants)
                token, pages = page.next_page_token, pages + 1
            return answer
        except grpc.aio.AioRpcError as exc:
            raise PickerUnreachable(f"{self.address}: {exc.code().name}: {exc.details()}") from None

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self.token_file is None:
            return None
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise PickerUnreachable(f"admin token {self.token_file}: {exc}") from None
        return (("authorization", f"Bearer {token}"),)

    async def close(self) -> None:
        if self._latest is not None and not self._latest.done():
            self._latest.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None


def figures(snapshot: admin_pb2.ListTenantsResponse, tenants: Sequence[str]) -> dict:
    """The status fields of a policy over ``tenants``: ``share`` (sum of their service shares),
    ``queuedRequests`` and ``runningRequests`` (sums), ``budgetRemaining`` (of the first tenant;
    removed when the picker reports no budget for it) and ``lastUpdated``."""
    states = {state.tenant: state for state in snapshot.tenants}
    mine = [states[t] for t in dict.fromkeys(tenants) if t in states]
    share = sum(s.service_share for s in mine if math.isfinite(s.service_share))
    first = states.get(tenants[0]) if tenants else None
    budgets = _budgets(first.budgets) if first is not None else {}
    taken = snapshot.taken_at_unix if snapshot.taken_at_unix > 0 else time.time()
    return {
        "share": round(min(max(share, 0.0), 1.0), 6),
        "queuedRequests": max(0, sum(s.queued_requests for s in mine)),
        "runningRequests": max(0, sum(s.running_requests for s in mine)),
        "budgetRemaining": budgets or None,
        "lastUpdated": rfc3339(taken),
    }


def _budgets(windows: Iterable[admin_pb2.BudgetWindow]) -> dict[str, float]:
    out: dict[str, float] = {}
    for window in windows:
        if window.window in WINDOWS and math.isfinite(window.remaining_tokens):
            value = window.remaining_tokens
            out[window.window] = int(value) if value == int(value) else round(value, 3)
    return out


def rfc3339(unix: float) -> str:
    """``2025-01-02T03:04:05Z`` (UTC, whole seconds), as Kubernetes writes times."""
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
