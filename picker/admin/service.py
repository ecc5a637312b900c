"""What is the picker doing right now: which tenants does it know, what is each owed, queued,
running and left of its budget, and how loaded is each endpoint?

``AdminService`` serves ``fairway.v1.Admin`` (``proto/fairway/v1/admin.proto``) from the
dispatcher's live state. It only reads: nothing here changes a queue, a counter or a budget, and
it does no I/O but answering gRPC. Its methods run on the event loop that runs the dispatcher, so
they see consistent state without locks.

Which tenants are listed: the configured ones, every tenant with a request in the picker now, and
every tenant served within the window. The last set is what keeps unconfigured tenants visible
without listing every id ever seen: random tenant ids drop out once their window has passed.
Answers are paged (``limit``, ``page_token``), busiest first by window service, so one reply
stays bounded (``MAX_PAGE`` tenants) even during a flood of random ids; only the page is built
into messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Collection, Mapping

import grpc

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.admin.window import DEFAULT_INTERVAL, DEFAULT_WINDOW, ServiceWindow
from picker.dispatch import Dispatcher
from picker.metering import MeteringRecord, RecentRecords

DEFAULT_PAGE = 100
"""Tenants per answer when the request sets no ``limit``."""
MAX_PAGE = 1000
"""The most tenants one answer holds (a few hundred bytes each: far below gRPC's 4 MB)."""

RECENT_REQUESTS = 20_000
"""Finished requests the picker keeps for ``RecentRequests`` (a what-if's traffic): about 11 MB,
and 6 minutes of traffic at 50 requests/s."""
MAX_RECENT_PAGE = 20_000
"""The most records one ``RecentRequests`` answer holds (about 100 bytes each: 2 MB)."""

ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
"""``fairway.v1.Admin``: the service name, for gRPC health."""


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _request_record(record: MeteringRecord) -> admin_pb2.RequestRecord:
    """A metering record as the admin API sends it (the same field names)."""
    arrived = record.arrived_at if record.arrived_at is not None else \
        record.timestamp - record.e2e_ms / 1000
    return admin_pb2.RequestRecord(
        tenant_id=record.tenant_id, model=record.model or "",
        priority_lane=record.priority_lane, lane_asked=record.lane_asked or "",
        arrived_at=arrived, timestamp=record.timestamp, prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        cached_prompt_tokens=record.cached_prompt_tokens, max_tokens=record.max_tokens,
        stream=record.stream is not False, outcome=record.outcome,
        endpoint=record.endpoint or "", queue_ms=_finite(record.queue_ms) or 0.0,
        ttft_ms=_finite(record.ttft_ms), e2e_ms=_finite(record.e2e_ms) or 0.0,
        demoted=record.demoted)


def _per_tenant(values: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """Sum a ``{(tenant, lane): n}`` map over lanes."""
    out: dict[str, int] = {}
    for (tenant, _), value in values.items():
        out[tenant] = out.get(tenant, 0) + value
    return out


class AdminService(admin_pb2_grpc.AdminServicer):
    """The admin API over one dispatcher (read-only)."""

    def __init__(self, dispatcher: Dispatcher, *, window: float = DEFAULT_WINDOW,
                 interval: float = DEFAULT_INTERVAL,
                 recent_requests: int = RECENT_REQUESTS) -> None:
        self.dispatcher = dispatcher
        self.window = ServiceWindow(window, interval)
        if recent_requests > 0 and dispatcher.recent is None:
            dispatcher.recent = RecentRecords(recent_requests)
        # The baseline: service charged before now is not counted in any window.
        self.sample()

    def sample(self) -> None:
        """Record the tenants' service totals now (at most one kept sample per interval)."""
        d = self.dispatcher
        # Read the scheduler anew each time: a config reload may have replaced it.
        self.window.observe(d.clock(), d.scheduler.service)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every interval until ``stop`` is set, so the window's edges are sharp even when
        nobody asks for a while."""
        while not stop.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.window.interval)

    # -- the RPCs --

    async def ListTenants(self, request: admin_pb2.ListTenantsRequest,
                          context: grpc.aio.ServicerContext | None
                          ) -> admin_pb2.ListTenantsResponse:
        """The tenants the picker knows now (or those of ``request.tenants`` among them), one
        page, busiest first. A malformed ``page_token`` is an INVALID_ARGUMENT."""
        try:
            return self.list_tenants(request.tenants, limit=request.limit,
                                     page_token=request.page_token)
        except ValueError as error:
            if context is None:
                raise
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            raise  # abort raises; this keeps type checkers sure the function ends here

    async def ListEndpoints(self, request: admin_pb2.ListEndpointsRequest,
                            context: grpc.aio.ServicerContext | None
                            ) -> admin_pb2.ListEndpointsResponse:
        """The pool's endpoints as the picker sees them, in config order."""
        return self.list_endpoints()

    async def RecentRequests(self, request: admin_pb2.RecentRequestsRequest,
                             context: grpc.aio.ServicerContext | None
                             ) -> admin_pb2.RecentRequestsResponse:
        """The requests that finished most recently (what a what-if replays)."""
        return self.recent_requests(request.since_seconds, request.limit)

    # -- the answers --

    def recent_requests(self, since_seconds: float = 0.0, limit: int = 0
                        ) -> admin_pb2.RecentRequestsResponse:
        """The ``RecentRequests`` answer: records that arrived within ``since_seconds`` (0: all
        held), at most ``limit`` (0: ``MAX_RECENT_PAGE``), the latest to finish."""
        d = self.dispatcher
        now = d.wall_clock()
        recent = d.recent
        if recent is None:
            return admin_pb2.RecentRequestsResponse(taken_at_unix=now)
        size = MAX_RECENT_PAGE if limit <= 0 else min(limit, MAX_RECENT_PAGE)
        start = now - since_seconds if since_seconds > 0 else -math.inf
        found, truncated = recent.since(start, size)
        return admin_pb2.RecentRequestsResponse(
            records=[_request_record(r) for r in found], taken_at_unix=now,
            held=len(recent.records), capacity=recent.capacity,
            oldest_arrived_at=recent.oldest_arrival() or 0.0, truncated=truncated)


    def list_tenants(self, only: Collection[str] = (), *, limit: int = 0,
                     page_token: str = "") -> admin_pb2.ListTenantsResponse:
        """The ``ListTenants`` answer; ``only`` restricts it to those tenants (empty: all).

        Ordered by window service, highest first (then by name), and cut to ``limit`` tenants
        (0: ``DEFAULT_PAGE``; at most ``MAX_PAGE``) from ``page_token`` (an offset, as a previous
        answer's ``next_page_token`` gives it). Raises ValueError for a malformed token.
        """
        size = DEFAULT_PAGE if limit <= 0 else min(limit, MAX_PAGE)
        try:
            start = int(page_token) if page_token else 0
        except ValueError:
            start = -1
        if start < 0:
            raise ValueError(f"page_token {page_token[:40]!r} is not one this API gave")
        d = self.dispatcher
        now = d.clock()
        state = d.snapshot()
        windowed = self.window.service(now, d.scheduler.service)
        window_total = sum(windowed.values())
        configured = {tenant.id for tenant in d.config.tenants}
        queued, running = _per_tenant(state["queued"]), _per_tenant(state["running"])
        queued_tokens = _per_tenant(state["queued_tokens"])
        running_tokens = _per_tenant(state["running_tokens"])
        names = configured | set(queued) | set(running) | set(windowed)
        if only:
            names &= set(only)
        ordered = sorted(names, key=lambda t: (-windowed.get(t, 0.0), t))
        page = ordered[start:start + size]
        following = str(start + size) if start + size < len(ordered) else ""
        tenants = []
        for tenant in page:
            lane = d.lane_of(tenant)
            key = (tenant, lane)
            counter = state["counters"].get(key)
            served = windowed.get(tenant, 0.0)
            tenants.append(admin_pb2.TenantState(
                tenant=tenant, lane=lane, weight=d.scheduler.weights.get(tenant, 1.0),
                configured=tenant in configured,
                virtual_counter=d.scheduler.counter(tenant, lane) if counter is None else counter,
                fairness_debt=state["debt"].get(key, 0.0),
                service_share=served / window_total if window_total > 0 else 0.0,
                window_service=served,
                total_service=d.scheduler.service.get(tenant, 0.0),
                queued_requests=queued.get(tenant, 0), queued_tokens=queued_tokens.get(tenant, 0),
                running_requests=running.get(tenant, 0),
                running_tokens=running_tokens.get(tenant, 0),
                budgets=self._budgets(tenant, state["budgets"])))
        return admin_pb2.ListTenantsResponse(tenants=tenants, window_seconds=self.window.window,
                                             taken_at_unix=d.wall_clock(),
                                             next_page_token=following,
                                             total_tenants=len(ordered))

    def _budgets(self, tenant: str, tracked: Mapping[str, Mapping[str, tuple[float, int]]]
                 ) -> list[admin_pb2.BudgetWindow]:
        levels = tracked.get(tenant)
        if levels is None:
            # Admission forgets a tenant whose buckets are full: report them full, not missing.
            rules = self.dispatcher.admission.rules_for(tenant)
            levels = {window: (float(rule.capacity_tokens), rule.capacity_tokens)
                      for window, rule in rules.budgets}
        return [admin_pb2.BudgetWindow(window=window, remaining_tokens=remaining,
                                       capacity_tokens=capacity)
                for window, (remaining, capacity) in levels.items()]

    def list_endpoints(self) -> admin_pb2.ListEndpointsResponse:
        """The ``ListEndpoints`` answer."""
        d = self.dispatcher
        fallback = d.rules.fallback_budget
        return admin_pb2.ListEndpointsResponse(endpoints=[
            admin_pb2.EndpointState(
                address=e.address, budget_tokens=e.budget(fallback),
                inflight_tokens=e.inflight_tokens, inflight_requests=e.inflight_requests,
                waiting=-1.0 if e.waiting is None else e.waiting,
                kv_usage=-1.0 if e.kv_usage is None else e.kv_usage, draining=e.draining)
            for e in d.endpoints.values()])
