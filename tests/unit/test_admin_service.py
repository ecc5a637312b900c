"""The admin API's answers, called on the servicer directly (no network) over a dispatcher on a
fake clock: which tenants are listed, their figures against the dispatcher's own state, the
windowed share of service, the bounded history, and the endpoints; plus ``picker.ctl top``'s
cells."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.admin.service import ADMIN_SERVICE, AdminService
from picker.admin.v1 import admin_pb2
from picker.admin.window import ServiceWindow
from picker.config.schema import PickerConfig
from picker.core import Usage
from picker.ctl.top import budget_cell, render, tenant_rows, tokens
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics
from tests.unit.test_dispatcher import A, B, FakeClock, _admit, _config, _hold, _request, _spin

LANES = [{"name": "online"}, {"name": "batch"}]
WALL = 1_700_000_000.5


def _setup(config: PickerConfig, *, window: float = 60.0) -> tuple[Dispatcher, AdminService,
                                                                     FakeClock]:
    clock = FakeClock()
    d = Dispatcher(config, clock=clock, metrics=PickerMetrics(CollectorRegistry()),
                   wall_clock=lambda: WALL)
    return d, AdminService(d, window=window), clock


async def _serve(d: Dispatcher, tenant: str, prompt: int) -> None:
    """One streaming request served whole: the tenant is charged ``prompt`` (w_p = 1)."""
    ticket = await _admit(d, tenant, _request(prompt))
    d.complete(ticket, Usage(prompt, 0), "ok")


async def _list(admin: AdminService, *tenants: str) -> dict[str, admin_pb2.TenantState]:
    answer = await admin.ListTenants(admin_pb2.ListTenantsRequest(tenants=tenants), None)
    names = [t.tenant for t in answer.tenants]
    assert len(names) == len(set(names)), "one entry per tenant"
    return {t.tenant: t for t in answer.tenants}


def test_service_name_is_the_protos() -> None:
    assert ADMIN_SERVICE == "fairway.v1.Admin"


# -- which tenants, and their figures --


async def test_configured_tenants_are_listed_while_idle_with_weight_and_lane() -> None:
    _, admin, _ = _setup(_config([A], lanes=LANES, tenants=[
        {"id": "a", "weight": 2, "lane": "batch"}, {"id": "b"}]))
    answer = await admin.ListTenants(admin_pb2.ListTenantsRequest(), None)
    assert answer.window_seconds == 60
    assert answer.taken_at_unix == WALL
    tenants = {t.tenant: t for t in answer.tenants}
    assert set(tenants) == {"a", "b"}
    assert (tenants["a"].weight, tenants["a"].lane, tenants["a"].configured) == (2, "batch", True)
    assert (tenants["b"].weight, tenants["b"].lane, tenants["b"].configured) == (1, "online", True)
    for t in tenants.values():
        assert (t.queued_requests, t.running_requests, t.total_service, t.service_share) == \
            (0, 0, 0, 0)
        assert list(t.budgets) == []


async def test_queued_and_running_figures_match_the_dispatcher() -> None:
    d, admin, _ = _setup(_config([A], budget=100, tenants=[{"id": "a", "weight": 2}]))
    running = await _admit(d, "a", _request(100))  # fills the endpoint
    held = [await _hold(d, "a", 30), await _hold(d, "a", 20), await _hold(d, "x", 50)]
    assert not any(task.done() for task in held)
    tenants = await _list(admin)
    assert set(tenants) == {"a", "x"}  # x: unconfigured, but it has a request in the picker
    a, x = tenants["a"], tenants["x"]
    assert (a.configured, x.configured, x.weight, x.lane) == (True, False, 1, "default")
    assert (a.running_requests, a.running_tokens, a.queued_requests, a.queued_tokens) == \
        (1, 100, 2, 50)
    assert (x.running_requests, x.running_tokens, x.queued_requests, x.queued_tokens) == \
        (0, 0, 1, 50)
    state = d.snapshot()
    assert a.virtual_counter == state["counters"][("a", "default")] == pytest.approx(100 / 2)
    assert x.virtual_counter == state["counters"][("x", "default")]
    assert a.fairness_debt == state["debt"][("a", "default")]
    assert x.fairness_debt == state["debt"][("x", "default")]
    assert a.total_service == 100 and x.total_service == 0
    # Every queued tenant is at or above the floor, and the most owed one is at it.
    assert min(a.fairness_debt, x.fairness_debt) == 0

    d.complete(running, Usage(100, 0), "ok")
    await _spin()
    assert all(task.done() for task in held)  # 30 + 20 + 50 fit the 100 freed
    tenants = await _list(admin)
    assert (tenants["a"].running_requests, tenants["a"].running_tokens) == (2, 50)
    assert (tenants["x"].running_requests, tenants["x"].running_tokens) == (1, 50)
    assert tenants["a"].queued_requests == tenants["x"].queued_requests == 0
    assert tenants["a"].total_service == 150 and tenants["x"].total_service == 50
    for task in held:
        d.complete(task.result(), None, "ok")


async def test_budgets_show_what_is_left_and_full_buckets_for_tenants_not_yet_tracked() -> None:
    budgets: dict[str, Any] = {"burst": {"tokens": 1000, "per": "100s"},
                               "sustained": {"tokens": 50000, "per": "24h"}}
    d, admin, _ = _setup(_config([A], tenants=[
        {"id": "a", "budgets": budgets}, {"id": "c", "budgets": {"burst": {"tokens": 500,
                                                                          "per": "60s"}}},
        {"id": "free"}]))
    ticket = await _admit(d, "a", _request(100, stream=False, max_tokens=300))
    # Reserved at its worst case: 100 prompt + 300 max_tokens.
    tenants = await _list(admin)
    a = {b.window: (b.remaining_tokens, b.capacity_tokens) for b in tenants["a"].budgets}
    assert a == {"burst": (pytest.approx(600), 1000), "sustained": (pytest.approx(49600), 50000)}
    assert a == {w: levels for w, levels in
                 d.snapshot()["budgets"]["a"].items()}
    c = {b.window: (b.remaining_tokens, b.capacity_tokens) for b in tenants["c"].budgets}
    assert c == {"burst": (500, 500)}
    assert list(tenants["free"].budgets) == []
    d.complete(ticket, Usage(100, 50), "ok")


async def test_filter_returns_only_the_named_known_tenants() -> None:
    d, admin, _ = _setup(_config([A], tenants=[{"id": "a"}, {"id": "b"}]))
    await _serve(d, "x", 10)
    assert set(await _list(admin, "a", "x", "nobody")) == {"a", "x"}
    assert set(await _list(admin)) == {"a", "b", "x"}


# -- the window --


async def test_share_follows_service_within_the_window_and_drops_after_it() -> None:
    d, admin, clock = _setup(_config([A], tenants=[{"id": "a"}, {"id": "b"}]))
    clock.now = 5.0
    await _serve(d, "a", 300)
    await _serve(d, "b", 100)
    await _serve(d, "r", 40)  # an unconfigured tenant
    clock.now = 10.0
    tenants = await _list(admin)
    assert {t: s.window_service for t, s in tenants.items()} == {"a": 300, "b": 100, "r": 40}
    assert tenants["a"].service_share == pytest.approx(300 / 440)
    assert tenants["b"].service_share == pytest.approx(100 / 440)
    assert sum(t.service_share for t in tenants.values()) == pytest.approx(1)

    clock.now = 50.0
    await _serve(d, "b", 100)
    tenants = await _list(admin)  # window (-10, 50]: everything so far
    assert tenants["a"].service_share == pytest.approx(300 / 540)
    assert tenants["b"].window_service == 200

    clock.now = 80.0  # window (20, 80]: only b's second request
    await _serve(d, "b", 50)
    tenants = await _list(admin)
    assert set(tenants) == {"a", "b"}  # r was served only before the window: no longer listed
    assert (tenants["a"].service_share, tenants["a"].window_service) == (0, 0)
    assert tenants["a"].total_service == 300
    assert tenants["b"].service_share == 1
    assert tenants["b"].window_service == 150
    assert tenants["b"].total_service == 250

    clock.now = 500.0
    tenants = await _list(admin)
    assert all(t.service_share == 0 and t.window_service == 0 for t in tenants.values())


async def test_service_before_the_admin_service_started_is_in_no_window() -> None:
    clock = FakeClock()
    d = Dispatcher(_config([A]), clock=clock, metrics=PickerMetrics(CollectorRegistry()))
    await _serve(d, "early", 100)
    admin = AdminService(d)
    clock.now = 1.0
    await _serve(d, "late", 100)
    tenants = await _list(admin)
    assert tenants["late"].service_share == 1
    assert "early" not in tenants  # not configured, not busy, not served within the window


async def test_window_history_stays_bounded_under_random_tenant_ids() -> None:
    d, admin, clock = _setup(_config([A]), window=60.0)
    for second in range(1, 1001):
        clock.now = float(second)
        await _serve(d, f"random-{second}", 10)
        for _ in range(3):  # sampling more often than the interval keeps no extra samples
            admin.sample()
    assert admin.window.samples <= 61
    assert admin.window.tenants_held <= 61
    tenants = await _list(admin)
    assert 59 <= len(tenants) <= 61
    assert "random-1" not in tenants and "random-1000" in tenants
    assert sum(t.service_share for t in tenants.values()) == pytest.approx(1)


def test_window_attributes_gains_to_samples_and_ignores_net_negative_settlements() -> None:
    window = ServiceWindow(window=10.0, interval=1.0)
    window.observe(0.0, {"a": 50.0})  # the baseline
    assert window.service(0.5, {"a": 50.0}) == {}
    assert window.service(0.5, {"a": 60.0}) == {"a": 10.0}  # since the last sample
    window.observe(2.0, {"a": 60.0, "b": 5.0})
    window.observe(2.5, {"a": 99.0})  # too soon: not kept
    assert window.samples == 1
    assert window.service(3.0, {"a": 40.0, "b": 5.0}) == {"b": 5.0}  # a's net over it: -10
    assert window.service(12.5, {"a": 60.0, "b": 5.0}) == {}
    with pytest.raises(ValueError):
        ServiceWindow(window=0)
    with pytest.raises(ValueError):
        ServiceWindow(window=5, interval=10)


async def test_run_samples_until_stopped() -> None:
    d, admin, clock = _setup(_config([A]))
    admin.window.interval = 0.01
    stop = asyncio.Event()
    clock.now = 1.0
    await _serve(d, "a", 10)
    task = asyncio.create_task(admin.run(stop))
    await asyncio.sleep(0.05)
    assert admin.window.samples == 1
    clock.now = 2.0
    await _serve(d, "b", 10)
    await asyncio.sleep(0.05)
    assert admin.window.samples == 2  # nobody called ListTenants: the task took them
    stop.set()
    await asyncio.wait_for(task, 1.0)


# -- endpoints --


async def test_endpoints_are_listed_with_budget_load_scrape_and_draining() -> None:
    d, admin, _ = _setup(_config([A, B], budget="auto"))
    d.endpoints[A].learned_budget = 4096
    d.endpoints[A].waiting, d.endpoints[A].kv_usage = 3.0, 0.25
    ticket = await _admit(d, "a", _request(100))
    busy = ticket.endpoint
    assert busy is not None
    idle = B if busy.address == A else A
    d.apply_config(_config([idle], budget="auto"))  # the busy one drains
    answer = await admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), None)
    endpoints = {e.address: e for e in answer.endpoints}
    assert set(endpoints) == {A, B}
    assert (endpoints[busy.address].inflight_tokens, endpoints[busy.address].inflight_requests,
            endpoints[busy.address].draining) == (100, 1, True)
    assert (endpoints[idle].inflight_tokens, endpoints[idle].draining) == (0, False)
    assert endpoints[A].budget_tokens == 4096 and endpoints[B].budget_tokens == 8192
    assert (endpoints[A].waiting, endpoints[A].kv_usage) == (3.0, 0.25)
    assert (endpoints[B].waiting, endpoints[B].kv_usage) == (-1.0, -1.0)
    d.complete(ticket, Usage(100, 0), "ok")
    answer = await admin.ListEndpoints(admin_pb2.ListEndpointsRequest(), None)
    assert [e.address for e in answer.endpoints] == [idle]  # drained and forgotten


# -- picker.ctl top's cells --


def test_token_counts_and_budget_cells_read_at_a_glance() -> None:
    assert [tokens(v) for v in (0, 950, 9999, 12_345, -1_500_000)] == \
        ["0", "950", "9999", "12.3k", "-1.5M"]
    burst = admin_pb2.BudgetWindow(window="burst", remaining_tokens=12_345, capacity_tokens=20_000)
    sustained = admin_pb2.BudgetWindow(window="sustained", remaining_tokens=40_000,
                                       capacity_tokens=50_000)
    assert budget_cell([burst, sustained]) == "12.3k/80%"
    assert budget_cell([sustained]) == "-/80%"
    assert budget_cell([burst]) == "12.3k/-"
    assert budget_cell([]) == "-"


def test_top_sorts_by_share_and_cuts_to_the_screen() -> None:
    answer = admin_pb2.ListTenantsResponse(window_seconds=60, taken_at_unix=WALL, tenants=[
        admin_pb2.TenantState(tenant=f"t{i}", lane="default", weight=1, service_share=i / 10)
        for i in range(5)])
    assert [row[0] for row in tenant_rows(answer)] == ["t4", "t3", "t2", "t1", "t0"]
    assert tenant_rows(answer)[0][3] == "40.0%"
    endpoints = admin_pb2.ListEndpointsResponse(endpoints=[admin_pb2.EndpointState(
        address=A, budget_tokens=8192, inflight_tokens=2048, waiting=-1, kv_usage=0.5)])
    screen = render("127.0.0.1:9003", answer, endpoints, max_lines=8).splitlines()
    assert len(screen) == 8
    assert screen[1].split() == ["TENANT", "LANE", "WEIGHT", "SHARE", "QUEUED", "RUNNING", "TOK",
                                 "RUN", "DEBT", "BUDGET", "burst/sust"]
    assert screen[2].startswith("t4 ") and screen[3].startswith("t3 ")
    assert screen[4] == "... and 3 more"
    assert any(A in line and "2048/8192 (25%)" in line and "50%" in line for line in screen)
    narrow = render("127.0.0.1:9003", answer, endpoints, max_columns=30).splitlines()
    assert max(len(line) for line in narrow) == 30 and len(narrow) == 2 + 5 + 3  # all rows
