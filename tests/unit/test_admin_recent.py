"""The admin API's recent-requests window (``RecentRequests``, what a what-if replays): the
dispatcher's finished requests kept in a bounded ring whether or not a metering log is written,
filtered by arrival, cut to the latest, and sent with the metering log's field names."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from picker.admin.service import AdminService
from picker.admin.v1 import admin_pb2
from picker.core import Usage
from picker.dispatch import Dispatcher
from picker.metering import MeteringRecord, RecentRecords
from picker.metrics import PickerMetrics
from tests.unit.test_dispatcher import A, B, FakeClock, _admit, _config, _request


def _record(timestamp: float, e2e_ms: float, tenant: str = A) -> MeteringRecord:
    return MeteringRecord(
        request_id=f"r{timestamp}", timestamp=timestamp, tenant_id=tenant, model="m",
        priority_lane="default", outcome="ok", finish_reason="stop", endpoint="e:1",
        prompt_tokens=10, completion_tokens=5, cached_prompt_tokens=0, estimated=False,
        cost=15.0, demoted=False, queue_ms=1.0, ttft_ms=2.0, e2e_ms=e2e_ms,
        arrived_at=timestamp - e2e_ms / 1000, max_tokens=None, stream=True, lane_asked=None)


def test_the_ring_forgets_the_oldest_and_filters_by_arrival_not_finish() -> None:
    ring = RecentRecords(3)
    for at in (100.0, 101.0, 102.0, 103.0):
        ring.add(_record(at, 500.0))
    assert [r.timestamp for r in ring.records] == [101.0, 102.0, 103.0]
    assert ring.oldest_arrival() == 100.5
    # Finished at 102 but arrived at 101.5: outside a window from 101.6.
    found, truncated = ring.since(101.6, 10)
    assert [r.timestamp for r in found] == [103.0] and not truncated
    found, truncated = ring.since(0.0, 2)
    assert [r.timestamp for r in found] == [102.0, 103.0] and truncated


async def test_finished_requests_are_answered_without_a_metering_log() -> None:
    clock = FakeClock()
    d = Dispatcher(_config(), clock=clock, metrics=PickerMetrics(CollectorRegistry()),
                   wall_clock=lambda: 1_700_000_000.0 + clock.now)
    assert not d.metering.enabled  # no metering log configured
    admin = AdminService(d, recent_requests=50)
    for tenant in (A, B):
        ticket = await _admit(d, tenant, _request(40))
        clock.now += 0.25
        d.complete(ticket, Usage(40, 7), "ok")
    answer = await admin.RecentRequests(admin_pb2.RecentRequestsRequest(), None)
    assert [r.tenant_id for r in answer.records] == [A, B]
    first = answer.records[0]
    assert (first.prompt_tokens, first.completion_tokens, first.outcome) == (40, 7, "ok")
    assert first.timestamp - first.arrived_at == 0.25 and first.e2e_ms == 250.0
    assert not first.HasField("max_tokens")
    assert (answer.held, answer.capacity, answer.truncated) == (2, 50, False)
    assert answer.oldest_arrived_at == first.arrived_at
    # A window that began after the first arrival holds only the second request.
    assert answer.taken_at_unix - first.arrived_at == 0.5
    later = admin.recent_requests(since_seconds=0.4)
    assert [r.tenant_id for r in later.records] == [B]
    assert [r.tenant_id for r in admin.recent_requests(limit=1).records] == [B]


def test_an_admin_service_without_a_ring_answers_empty() -> None:
    d = Dispatcher(_config(), clock=FakeClock(), metrics=PickerMetrics(CollectorRegistry()))
    admin = AdminService(d, recent_requests=0)
    assert d.recent is None
    answer = asyncio.run(admin.RecentRequests(admin_pb2.RecentRequestsRequest(), None))
    assert not answer.records and answer.capacity == 0
