"""Per-tenant state stays bounded (issue 11, point 3): idle tenants are forgotten once forgetting
cannot change a decision, and the admin API answers in bounded pages."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from picker.admin.service import MAX_PAGE, AdminService
from picker.config.schema import load_config
from picker.core import LaneSpec, Request, Usage
from picker.core.lanes import Scheduler
from picker.core.vtc import VirtualTokenCounter
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _req(tenant: str, prompt: int = 10, lane: str = "default") -> Request:
    return Request(tenant=tenant, prompt_tokens=prompt, lane=lane)


# -- the VTC's own rule --

def test_vtc_forgets_only_what_the_lift_would_recreate() -> None:
    v = VirtualTokenCounter()
    for tenant, counter in (("low", 1.0), ("high", 50.0), ("floor", 10.0), ("queued", 0.0)):
        v.counters[tenant] = counter
    v.enqueue(_req("floor"), 0.0)   # backlogged at 10: the floor
    v.enqueue(_req("queued"), 0.0)  # lifted to 10, still queued
    assert v.lift_floor() == 10.0
    gone = v.forget_idle()
    assert gone == ["low"]  # at or below the floor and idle
    assert set(v.counters) == {"high", "floor", "queued"}
    # Re-created, it is lifted to exactly what it would have been lifted to.
    v.enqueue(_req("low"), 0.0)
    assert v.counter("low") == 10.0


def test_vtc_keeps_the_last_tenant_to_leave_and_running_tenants() -> None:
    v = VirtualTokenCounter()
    a, b = _req("a"), _req("b")
    v.enqueue(a, 0.0)
    v.enqueue(b, 0.0)
    v.charge("a", 5.0)
    v.pop(b, 0.0)
    v.pop(a, 0.0)  # a left last: its counter (5) is the floor; b (0) is below it
    assert v.forget_idle(keep={"b"}) == []
    assert v.forget_idle() == ["b"]
    assert "a" in v.counters
    v.enqueue(_req("b"), 0.0)
    assert v.counter("b") == 5.0
    assert v.peek(0.0) is not None


def _workload(seed: int) -> list[tuple[str, int, int]]:
    """(tenant, prompt, output) arrivals: a few steady tenants, many one-off ids, and some ids
    that come back after a while (where forgetting too much would show)."""
    rng = random.Random(seed)
    out = []
    for i in range(800):
        draw = rng.random()
        tenant = rng.choice(["s1", "s2", "s3"]) if draw < 0.4 else \
            f"back-{rng.randrange(6)}" if draw < 0.6 else f"once-{i}"
        out.append((tenant, rng.randint(1, 200), rng.randint(0, 300)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forgetting_changes_no_decision(seed: int) -> None:
    """Two schedulers take the same arrivals and completions; one forgets idle tenants after
    every step, the other never does. They must pick the same requests in the same order."""
    lanes = [LaneSpec("a"), LaneSpec("b", min_share=0.2)]
    runs = []
    for forget in (False, True):
        rng = random.Random(seed)
        s = Scheduler(lanes, weights={"s1": 2.0})
        running: list[tuple[Request, int]] = []
        order: list[tuple[str, int]] = []
        held_max = 0
        for tenant, prompt, output in _workload(seed):
            s.enqueue(Request(tenant=tenant, prompt_tokens=prompt,
                              lane="b" if tenant == "s3" else "a"), 0.0)
            # Dispatch up to 4 at once, finish the oldest; output charged as it streams.
            while len(running) < 4 and (chosen := s.peek(0.0)) is not None:
                s.dispatch(chosen, 0.0)
                order.append((chosen.tenant, chosen.seq))
                running.append((chosen, output))
            # A little slower than arrivals: a backlog forms, so tenants leave with counters
            # above the floor and come back while it is still below them.
            for _ in range(int(rng.random() < 0.97)):
                if running:
                    request, produced = running.pop(0)
                    s.charge_output(request, produced)
                    s.finish(request, Usage(request.prompt_tokens, produced))
            if forget:
                s.forget_idle(keep={r.tenant for r, _ in running}, keep_service={"s1"})
                held_max = max(held_max, s.tenants_held())
        runs.append((order, s, held_max))
    (reference, never, _), (order, _, held_max) = runs
    assert order == reference
    assert len(order) > 300
    # And it did forget: the reference holds every id it ever saw.
    assert never.tenants_held() > 250
    assert held_max < never.tenants_held() / 2


# -- the dispatcher as a whole --

CONFIG = {
    "endpoints": [{"address": "10.0.0.1:8000"}],
    "capacity": {"kvBudgetTokens": 100_000},
    "tenants": [{"id": "steady", "weight": 2}],
}


def _inference(prompt: int = 50) -> InferenceRequest:
    return InferenceRequest(model="m", prompt_tokens=prompt, max_tokens=None, stream=True,
                            include_usage=True, body={})


async def _serve(d: Dispatcher, tenant: str, prompt: int, output: int) -> None:
    ticket = await asyncio.wait_for(d.admit(tenant, _inference(prompt)), 1.0)
    d.on_output_tokens(ticket, output)
    d.complete(ticket, Usage(prompt, output), "ok")


async def test_a_flood_of_one_off_tenants_leaves_no_state_behind() -> None:
    clock = FakeClock()
    d = Dispatcher(load_config(CONFIG), clock=clock, metrics=PickerMetrics(CollectorRegistry()))
    for i in range(2000):
        await _serve(d, f"flood-{i}", 20 + i % 50, i % 300)
        if i % 100 == 0:
            await _serve(d, "steady", 50, 10)
    flooded = d.tenants_held()
    assert flooded["scheduler"] > 1000 and flooded["estimates"] > 1000
    # Time passes (past the estimates' ttl) and the steady tenant keeps being served.
    clock.now += d.estimates.ttl + 1
    for _ in range(40):
        clock.now += 31
        await _serve(d, "steady", 50, 200)
    held = d.tenants_held()
    assert held == {"admission": 0, "estimates": 1, "scheduler": 1, "queues": 0, "recent": 0,
                    "occupancy": 0}
    assert set(d.scheduler.policy("default").counters) == {"steady"}
    assert set(d.scheduler.service) == {"steady"}
    assert d.estimates.tenants() == {"steady"}


async def test_a_forgotten_tenant_comes_back_where_a_remembered_one_would() -> None:
    """Side by side: the same traffic through a dispatcher that forgets and one that never does
    (its sweep disabled); a flood tenant returning after the sweep gets the same counter."""
    pair = []
    for forget in (True, False):
        clock = FakeClock()
        d = Dispatcher(load_config(CONFIG), clock=clock,
                       metrics=PickerMetrics(CollectorRegistry()))
        if not forget:
            d.gate.forget_idle = lambda now: None  # type: ignore[method-assign]
        for i in range(200):
            await _serve(d, f"flood-{i}", 30, 40)
        clock.now += d.estimates.ttl + 1
        for _ in range(20):
            clock.now += 31
            await _serve(d, "steady", 50, 200)
        pair.append(d)
    forgetful, reference = pair
    assert "flood-7" not in forgetful.scheduler.policy("default").counters
    assert "flood-7" in reference.scheduler.policy("default").counters
    tickets = []
    for d in pair:
        ticket = await asyncio.wait_for(d.admit("flood-7", _inference(30)), 1.0)
        tickets.append((ticket.request.prompt_tokens, ticket.request.estimated_output,
                        d.scheduler.counter("flood-7"),
                        d.endpoints["10.0.0.1:8000"].projected_tokens))
    assert tickets[0] == tickets[1]


# -- the admin API --

async def test_admin_answers_are_paged_busiest_first() -> None:
    clock = FakeClock()
    d = Dispatcher(load_config(CONFIG), clock=clock, metrics=PickerMetrics(CollectorRegistry()))
    admin = AdminService(d)
    for i in range(250):
        await _serve(d, f"t-{i:03d}", 10, i)
    first = admin.list_tenants(limit=100)
    assert len(first.tenants) == 100 and first.total_tenants == 251
    shares = [t.window_service for t in first.tenants]
    assert shares == sorted(shares, reverse=True)
    assert first.tenants[0].tenant == "t-249"
    seen = [t.tenant for t in first.tenants]
    token = first.next_page_token
    while token:
        page = admin.list_tenants(limit=100, page_token=token)
        seen += [t.tenant for t in page.tenants]
        token = page.next_page_token
    assert len(seen) == len(set(seen)) == 251
    assert len(admin.list_tenants().tenants) == 100  # the default page
    assert len(admin.list_tenants(limit=10**6).tenants) == min(251, MAX_PAGE)
    with pytest.raises(ValueError):
        admin.list_tenants(page_token="not-a-token")


async def test_top_counts_the_tenants_beyond_its_page() -> None:
    from picker.admin.v1 import admin_pb2
    from picker.ctl.top import TOP_LIMIT, render

    clock = FakeClock()
    d = Dispatcher(load_config(CONFIG), clock=clock, metrics=PickerMetrics(CollectorRegistry()))
    admin = AdminService(d)
    for i in range(TOP_LIMIT + 50):
        await _serve(d, f"t-{i:03d}", 10, i)
    answer = admin.list_tenants(limit=TOP_LIMIT)
    screen = render("127.0.0.1:9004", answer, admin_pb2.ListEndpointsResponse())
    assert f"({TOP_LIMIT + 51} tenants)" in screen
    assert "... and 51 more" in screen
    assert "t-249" in screen.split("\n")[2]  # the busiest first


async def test_the_operator_reads_every_page() -> None:
    """The operator's policy status needs configured tenants that may sit past the first page."""
    from fairway_operator.figures import AdminClient
    from picker.admin.v1 import admin_pb2

    clock = FakeClock()
    d = Dispatcher(load_config(CONFIG), clock=clock, metrics=PickerMetrics(CollectorRegistry()))
    admin = AdminService(d)
    for i in range(2500):
        await _serve(d, f"t-{i:04d}", 10, 1 + i)

    class Stub:
        async def ListTenants(self, request: admin_pb2.ListTenantsRequest, timeout: float,
                              metadata: object = ()) -> admin_pb2.ListTenantsResponse:
            return admin.list_tenants(limit=request.limit, page_token=request.page_token)

    reader = AdminClient("127.0.0.1:1")
    reader._stub = Stub()  # type: ignore[assignment]
    answer = await reader.snapshot()
    names = {t.tenant for t in answer.tenants}
    assert "steady" in names and len(names) == 2501
