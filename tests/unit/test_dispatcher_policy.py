"""Tenant policy in the dispatcher: budgets reserved and settled, caps, demotion, lanes, the
overload rule, metering records, and policy changes on reload that move no tenant ahead."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.core import Usage
from picker.dispatch.log_budget import INTERVAL, LINES_PER_INTERVAL
from picker.errors import (
    ConfigError,
    InputTooLong,
    LaneNotAllowed,
    MethodNotAllowed,
    NotFound,
    OutputTooLong,
    OverBudget,
    QueueFull,
    TenantQueueFull,
)
from tests.unit.test_dispatcher import (
    A,
    FakeClock,
    _admit,
    _config,
    _dispatcher,
    _hold,
    _request,
    _sample,
    _spin,
)

LANES = [{"name": "online"}, {"name": "batch"}]


def _policy_config(tenant: dict[str, Any], *, budget: int = 1000, **sections: Any) -> PickerConfig:
    return _config([A], budget=budget, lanes=LANES, tenants=[tenant], **sections)


async def test_budget_reserves_the_worst_case_and_refuses_with_the_wait_for_refill() -> None:
    clock = FakeClock()
    d = _dispatcher(_policy_config({"id": "a", "budgets": {"burst": {"tokens": 1000,
                                                                     "per": "100s"}}}), clock)
    # Each reserves what it may cost: its prompt and its max_tokens.
    first = await _admit(d, "a", _request(100, stream=False, max_tokens=300))  # reserves 400
    second = await _admit(d, "a", _request(100, stream=False, max_tokens=300))  # 800
    with pytest.raises(OverBudget) as refused:
        await d.admit("a", _request(100, stream=False, max_tokens=300))  # 400 > 200 left
    assert refused.value.http_status == 429
    assert refused.value.retry_after == pytest.approx(20.0)  # 200 short at 10 tokens/s
    # Settling to actual use refunds what the worst case over-reserved.
    d.complete(first, Usage(100, 50), "ok")
    d.complete(second, Usage(100, 50), "ok")
    assert d.admission.budget_state(clock())["a"]["burst"][0] == pytest.approx(700)
    await _admit(d, "a", _request(100, stream=False, max_tokens=300))


async def test_budget_reserve_expected_reserves_the_estimate_while_the_worst_case_fits() -> None:
    clock = FakeClock()
    d = _dispatcher(_policy_config({"id": "a", "budgets": {
        "burst": {"tokens": 1000, "per": "100s"}, "reserve": "expected"}}), clock)
    # Each reserves its prompt and the output estimate, min(max_tokens, 256 by default), and
    # may still use 44 more: admitted while that outstanding worst case is within the level.
    first = await _admit(d, "a", _request(100, stream=False, max_tokens=300))  # 356, 44 more
    second = await _admit(d, "a", _request(100, stream=False, max_tokens=300))  # 712, 88
    with pytest.raises(OverBudget) as refused:
        await d.admit("a", _request(100, stream=False, max_tokens=300))  # 356 > 288 left
    assert refused.value.retry_after == pytest.approx(6.8)  # 68 short at 10 tokens/s
    d.complete(first, Usage(100, 50), "ok")
    d.complete(second, Usage(100, 50), "ok")
    assert d.admission.budget_state(clock())["a"]["burst"][0] == pytest.approx(700)


async def test_cancelled_while_queued_gives_the_whole_reservation_back() -> None:
    d = _dispatcher(_policy_config({"id": "a", "budgets": {"burst": {"tokens": 1000,
                                                                     "per": "1h"}}}, budget=100))
    running = await _admit(d, "a", _request(100, max_tokens=256))
    held = await _hold(d, "a", 100, stream=False, max_tokens=100)
    assert not held.done()
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    remaining = d.admission.budget_state(d.clock())["a"]["burst"][0]
    d.complete(running, Usage(100, 10), "ok")
    assert remaining == pytest.approx(1000 - (100 + 256))  # only the running request's
    assert d.admission.budget_state(d.clock()).get("a", {}).get("burst", (890,))[0] == \
        pytest.approx(890)


async def test_over_budget_demotes_into_the_named_lane() -> None:
    d = _dispatcher(_policy_config({"id": "a", "lane": "online",
                                    "budgets": {"burst": {"tokens": 150, "per": "1h"}},
                                    "overBudget": {"action": "demote", "lane": "batch"}}))
    first = await _admit(d, "a", _request(100, stream=False, max_tokens=40))
    second = await _admit(d, "a", _request(100, stream=False, max_tokens=40))
    assert (first.lane, first.demoted) == ("online", False)
    assert (second.lane, second.demoted) == ("batch", True)
    assert _sample(d, "fairway_demotions_total", tenant="a", from_lane="online",
                   to_lane="batch") == 1


async def test_request_caps_refuse_or_clamp() -> None:
    d = _dispatcher(_config([A], tenants=[
        {"id": "strict", "limits": {"maxInputTokens": 50, "maxOutputTokens": 100}},
        {"id": "clamped", "limits": {"maxOutputTokens": 100, "outputLimit": "clamp"}}]))
    with pytest.raises(InputTooLong):
        await d.admit("strict", _request(51))
    with pytest.raises(OutputTooLong):
        await d.admit("strict", _request(10, max_tokens=101))
    ticket = await _admit(d, "clamped", _request(10, max_tokens=500))
    assert ticket.max_tokens == 100
    assert ticket.request.max_output_tokens == 100
    unset = await _admit(d, "clamped", _request(10))
    assert unset.max_tokens == 100  # no max_tokens: the engine is given the cap
    within = await _admit(d, "clamped", _request(10, max_tokens=20))
    assert within.max_tokens is None  # nothing to change in the body


async def test_tenant_queue_cap() -> None:
    d = _dispatcher(_policy_config({"id": "a", "limits": {"maxQueued": 2}}, budget=100))
    await _admit(d, "a", _request(100))
    held = [await _hold(d, "a") for _ in range(2)]
    with pytest.raises(TenantQueueFull):
        await d.admit("a", _request(100))
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)


async def test_concurrency_cap_parks_requests_outside_the_fair_queue() -> None:
    d = _dispatcher(_policy_config({"id": "a", "limits": {"maxConcurrent": 1}}, budget=10_000))
    first = await _admit(d, "a", _request(10))
    waiting = [await _hold(d, "a", 10) for _ in range(3)]
    other = await _admit(d, "b", _request(10))  # the pool has room: b is not held behind a
    assert not any(t.done() for t in waiting)
    assert d.scheduler.queued() == 0  # parked, not in the fair queue
    assert _sample(d, "fairway_running_requests", tenant="a", lane="online") == 1
    running = first
    for task in waiting:
        d.complete(running, Usage(10, 1), "ok")
        await _spin()
        assert task.done()
        running = task.result()
        assert d.admission.running("a") == 1
    d.complete(running, Usage(10, 1), "ok")
    d.complete(other, Usage(10, 1), "ok")
    assert d.busy == 0


async def test_lane_header_chooses_among_allowed_lanes_only() -> None:
    d = _dispatcher(_config([A], lanes=[{"name": "online", "enginePriority": 0},
                                        {"name": "batch", "enginePriority": 10}],
                            tenants=[{"id": "a", "lane": "online", "allowedLanes": ["batch"]},
                                     {"id": "b"}]))
    assert d.choose_lane("a", "batch") == "batch"
    assert d.choose_lane("a", None) == "online"
    with pytest.raises(LaneNotAllowed):
        d.choose_lane("b", "batch")
    assert (d.engine_priority("online"), d.engine_priority("batch")) == (0, 10)


async def test_full_queue_sheds_the_lowest_lane_first() -> None:
    d = _dispatcher(_config([A], budget=100, lanes=LANES, queue={"maxQueued": 2},
                            tenants=[{"id": "hi", "lane": "online"},
                                     {"id": "lo", "lane": "batch"}]))
    await _admit(d, "hi", _request(100))  # fills the endpoint
    lows = [await _hold(d, "lo") for _ in range(2)]
    high = await _hold(d, "hi")
    assert not high.done()
    done, _ = await asyncio.wait(lows, timeout=1)
    assert len(done) == 1  # the newest low-lane request made room
    with pytest.raises(QueueFull):
        done.pop().result()
    assert lows[0] not in done or lows[1] in done
    with pytest.raises(QueueFull):  # only high requests left to shed for a low one: refused
        await d.admit("lo", _request(100))
    for task in (*lows, high):
        task.cancel()
    await asyncio.gather(*lows, high, return_exceptions=True)


async def test_refuse_new_overload_rule_refuses_every_lane_alike() -> None:
    d = _dispatcher(_config([A], budget=100, lanes=LANES,
                            queue={"maxQueued": 1, "overload": "refuseNew"},
                            tenants=[{"id": "hi", "lane": "online"},
                                     {"id": "lo", "lane": "batch"}]))
    await _admit(d, "hi", _request(100))
    low = await _hold(d, "lo")
    with pytest.raises(QueueFull):
        await d.admit("hi", _request(100))
    assert not low.done()
    low.cancel()
    await asyncio.gather(low, return_exceptions=True)


async def test_metering_writes_one_record_per_finished_request(tmp_path: Path) -> None:
    out = tmp_path / "metering.jsonl"
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}],
                            metering={"output": str(out)}))
    ticket = await _admit(d, "a", _request(100))
    held = await _hold(d, "a")
    d.on_first_byte(ticket)
    d.complete(ticket, Usage(90, 30, 10), "ok")
    await _spin()
    second = held.result()
    d.complete(second, None, "cancelled")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["outcome"] for r in records] == ["ok", "cancelled"]
    first = records[0]
    assert (first["tenant_id"], first["model"], first["priority_lane"]) == ("a", "m", "default")
    assert (first["prompt_tokens"], first["completion_tokens"],
            first["cached_prompt_tokens"]) == (90, 30, 10)
    assert first["cost"] == 90 + 2 * 30
    assert first["endpoint"] == A
    assert first["ttft_ms"] is not None and first["e2e_ms"] >= first["queue_ms"] >= 0
    assert records[1]["estimated"] is True


async def test_refusals_are_counted_not_metered_and_their_log_is_bounded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26: every refusal wrote a metering row and an INFO line (a client refused ~650
    times a second wrote ~28 GB of metering a day)."""
    out = tmp_path / "metering.jsonl"
    clock = FakeClock()
    d = _dispatcher(_config([A], tenants=[{"id": "a"}], metering={"output": str(out)}), clock)
    caplog.set_level(logging.INFO, logger="picker.dispatch.dispatcher")
    for _ in range(1000):
        d.reject("a", NotFound("Invalid URL (POST /v2/nothing)"), request_id="r")
    d.reject("a", MethodNotAllowed("GET is not allowed"))
    assert _sample(d, "fairway_rejections_total", tenant="a", reason="not_found") == 1000
    assert _sample(d, "fairway_rejections_total", tenant="a", reason="method_not_allowed") == 1
    assert not out.exists() or out.read_text() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == LINES_PER_INTERVAL, lines[:3]
    clock.now += INTERVAL
    d.reject("a", NotFound("again"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-2] == f"991 refusals not logged in the last {INTERVAL:g}s", lines[-2:]
    assert "again" in lines[-1]


async def test_unwritable_metering_path_is_a_config_error_that_changes_nothing() -> None:
    d = _dispatcher(_config([A], tenants=[{"id": "a", "weight": 1}]))
    bad = _config([A], tenants=[{"id": "a", "weight": 5}],
                  metering={"output": "/nonexistent-fairway-dir/m.jsonl"})
    with pytest.raises(ConfigError) as caught:
        d.apply_config(bad)
    assert caught.value.path == "metering.output"
    assert d.scheduler.weights.get("a", 1.0) == 1.0


async def test_budget_change_on_reload_keeps_what_was_used() -> None:
    clock = FakeClock()
    tenant = {"id": "a", "budgets": {"burst": {"tokens": 1000, "per": "1h"}}}
    d = _dispatcher(_policy_config(tenant), clock)
    ticket = await _admit(d, "a", _request(100, stream=False, max_tokens=100))
    d.complete(ticket, Usage(100, 100), "ok")
    assert d.admission.budget_state(clock())["a"]["burst"][0] == pytest.approx(800)
    bigger = {"id": "a", "budgets": {"burst": {"tokens": 5000, "per": "1h"}}}
    d.apply_config(_policy_config(bigger))
    # The level is kept, not reset to the new capacity: the tenant does not jump ahead.
    assert d.admission.budget_state(clock())["a"]["burst"] == (pytest.approx(800), 5000)


async def test_weight_change_on_reload_moves_no_tenant_ahead_or_behind() -> None:
    """A backlog served one request at a time across a reload that triples a's weight: the
    counters are untouched by the change, and a's share moves from 1:1 to 3:1 at once, without a
    catch-up burst."""
    d = _dispatcher(_config([A], budget=150, tenants=[{"id": "a"}, {"id": "b"}]))
    running = await _admit(d, "a", _request(100))
    held = {t: [await _hold(d, t) for _ in range(3)] for t in ("a", "b")}

    async def serve(steps: int) -> list[str]:
        nonlocal running
        order = []
        for _ in range(steps):
            d.complete(running, Usage(100, 50), "ok")
            await _spin()
            done = [(t, task) for t, tasks in held.items() for task in tasks if task.done()]
            assert len(done) == 1
            tenant, task = done[0]
            held[tenant].remove(task)
            held[tenant].append(await _hold(d, tenant))  # stays backlogged
            running = task.result()
            order.append(tenant)
        return order

    before_order = await serve(40)
    before = {t: d.scheduler.counter(t) for t in ("a", "b")}
    d.apply_config(_config([A], budget=150, tenants=[{"id": "a", "weight": 3}, {"id": "b"}]))
    assert {t: d.scheduler.counter(t) for t in ("a", "b")} == before  # no jump at the change
    after = await serve(80)
    assert before_order[-20:].count("a") == 10  # 1:1 before
    assert after.count("a") == pytest.approx(60, abs=2)  # 3:1 from the change on
    longest = max(len(run) for run in "".join(after).replace("b", " ").split())
    assert longest <= 4  # no catch-up burst: a's runs are its 3 (+1 at the seam)
    for task in [*held["a"], *held["b"]]:
        task.cancel()
    await asyncio.gather(*held["a"], *held["b"], return_exceptions=True)


# -- light tenants: not stuck behind a head that waits, and (opt-in) room kept for them --


async def test_light_request_goes_ahead_of_a_head_that_does_not_fit() -> None:
    d = _dispatcher(_config([A], budget=1000, tenants=[{"id": "flood"}, {"id": "light"}]))
    running = await _admit(d, "flood", _request(800))
    heads = [await _hold(d, "flood", 400) for _ in range(2)]  # neither fits beside 800
    light = await _hold(d, "light", 50)
    assert light.done()  # it fits: holding it would leave the room unused
    assert not any(task.done() for task in heads)
    d.complete(running, Usage(800, 0), "ok")
    d.complete(light.result(), Usage(50, 0), "ok")
    await _spin()
    assert all(task.done() for task in heads)


async def test_a_backlogged_tenants_small_request_keeps_its_fair_place() -> None:
    d = _dispatcher(_config([A], budget=1000, tenants=[{"id": "flood"}]))
    await _admit(d, "flood", _request(800))
    big = await _hold(d, "flood", 400)
    small = await _hold(d, "flood", 50)  # fits, but its tenant is backlogged: no jumping
    assert not big.done() and not small.done()
    for task in (big, small):
        task.cancel()
    await asyncio.gather(big, small, return_exceptions=True)


async def test_light_request_of_a_lower_lane_does_not_pass_a_higher_lanes_head() -> None:
    d = _dispatcher(_config([A], budget=1000, lanes=LANES,
                            tenants=[{"id": "flood", "lane": "online"},
                                     {"id": "light", "lane": "batch"}]))
    await _admit(d, "flood", _request(800))
    head = await _hold(d, "flood", 400)
    light = await _hold(d, "light", 50)
    assert not light.done() and not head.done()
    for task in (head, light):
        task.cancel()
    await asyncio.gather(head, light, return_exceptions=True)


@pytest.mark.parametrize("reserve", ["2s", "0s"])
async def test_idle_tenant_reserve_keeps_room_for_a_light_tenants_next_request(
        reserve: str) -> None:
    clock = FakeClock()
    d = _dispatcher(_config([A], budget=1000, tenants=[{"id": "flood"}, {"id": "light"}],
                            capacity={"idleTenantReserve": reserve}), clock)
    served = await _admit(d, "light", _request(60, max_tokens=20))  # light is now "recent"
    d.complete(served, Usage(60, 20), "ok")
    filling = await _admit(d, "flood", _request(900))
    # Three queued: the flood is backlogged. Each will grow to 400 + 100 tokens.
    queued = [await _hold(d, "flood", 400, max_tokens=100) for _ in range(3)]
    d.complete(filling, Usage(900, 0), "ok")
    await _spin()
    assert queued[0].done()
    if reserve == "0s":
        assert queued[1].done()  # strictly work-conserving: its prompt fits, so it goes
    else:
        assert not queued[1].done()  # it would take the room kept for light's next request
        nxt = await _hold(d, "light", 60, max_tokens=20)
        assert nxt.done()  # light's request starts at once
        clock.now += 3  # the reserve lapses once light has been quiet for the window
        d.complete(nxt.result(), Usage(60, 20), "ok")
        await _spin()
        assert queued[1].done()
    queued[2].cancel()
    await asyncio.gather(*queued, return_exceptions=True)


async def test_lane_change_on_reload_moves_new_requests_and_keeps_queued_ones() -> None:
    tenants = [{"id": "a", "lane": "online"}, {"id": "b", "lane": "batch"}]
    d = _dispatcher(_config([A], budget=100, lanes=LANES, tenants=tenants))
    running = await _admit(d, "b", _request(100))
    queued = await _hold(d, "a")  # waits in online
    moved = [{"id": "a", "lane": "batch"}, {"id": "b", "lane": "batch"}]
    d.apply_config(_config([A], budget=100, lanes=LANES, tenants=moved))
    later = await _hold(d, "a")  # arrives after the reload: batch
    assert d.lane_of("a") == "batch"
    d.complete(running, Usage(100, 0), "ok")
    await _spin()
    first = queued.result()
    assert first.lane == "online"  # queued before the change: keeps its place and lane
    d.complete(first, Usage(100, 0), "ok")
    await _spin()
    assert later.result().lane == "batch"
    # Its service in online stays in online's counter. New to batch, it was lifted level with
    # b (the lane's last served), not left at 0 ahead of it, then charged its prompt.
    assert d.scheduler.counter("a", "online") == 100.0
    assert d.scheduler.counter("b", "batch") == 100.0
    assert d.scheduler.counter("a", "batch") == 100.0 + 100.0
