"""The pool simulator (``picker.sim.pool``): the server's gate in front of simulated vLLM engines.

Does a run repeat exactly, does every request end and the gate's ledger return to zero, do the
gate's decisions (weights, VTC against pass-through, engine priorities, queue timeouts) reach the
engines as the server's would, and does an fcfs engine refuse a priority as vLLM does?
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import picker.sim.pool as pool_module
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.load import PlannedRequest, percentile
from picker.sim.pool import PoolRecord, PoolRun, PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic

SMALL_POOL = PoolSpec(endpoints=2, kv_budget_tokens=1024, step_s=0.005)
LIGHT_START = 1.0
DRAIN_S = 30.0


def _config(tenants: dict[str, float], **sections: Any) -> PickerConfig:
    return load(PickerConfig, {"tenants": [{"id": t, "weight": w} for t, w in tenants.items()],
                               **sections})


def _flood(duration: float = 4.0, backlog: int = 8, rate: float = 6.0) -> Traffic:
    """A light tenant's short streams (from ``LIGHT_START``) under a flood of long ones that
    fills ``SMALL_POOL``: the gateway benchmark's goal-2 traffic, shortened."""
    shape = {"api": "completions", "stream_fraction": 1.0, "include_usage": True}
    return load_traffic({"duration_s": duration, "seed": 5, "timeout_s": 30, "tenants": [
        {"name": "light", "rate": rate, "start_s": LIGHT_START, "prompt_tokens": [20, 40],
         "output_tokens": [5, 10], **shape},
        {"name": "flood", "backlog": backlog, "prompt_tokens": [200, 400],
         "output_tokens": [100, 200], **shape}]})


def _run(config: PickerConfig, traffic: Traffic, spec: PoolSpec = SMALL_POOL,
         **kwargs: Any) -> PoolRun:
    return simulate(config, traffic, spec, drain_s=DRAIN_S, **kwargs)


def _mine(run: PoolRun, tenant: str) -> list[PoolRecord]:
    return [r for r in run.records if r.tenant == tenant]


def _service(record: PoolRecord) -> int:
    """What a served request costs with the default weights (w_p = 1, w_q = 2)."""
    return record.prompt_tokens + 2 * record.completion_tokens


def _charged(run: PoolRun, tenant: str) -> float:
    return run.gate.scheduler.service.get(tenant, 0.0)


def test_the_same_inputs_give_the_same_records() -> None:
    config = _config({"light": 1, "flood": 1})
    first, second = _run(config, _flood()), _run(config, _flood())
    assert first.records == second.records
    assert first.steps == second.steps
    assert first.output_tokens_in_window == second.output_tokens_in_window
    assert len({r.endpoint for r in first.records}) == SMALL_POOL.endpoints


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_drained_run_ends_every_request_and_empties_the_ledger(policy: str) -> None:
    run = _run(_config({"light": 1, "flood": 1}, scheduling={"policy": policy}), _flood())
    assert run.records and all(r.outcome == "ok" for r in run.records)
    for record in run.records:
        assert record.end_s is not None and record.first_token_s is not None
        assert record.completion_tokens == record.max_tokens
    assert run.gate.passages == {} and run.gate.queued_total() == 0
    for endpoint in run.gate.endpoints.values():
        assert (endpoint.inflight_requests, endpoint.inflight_tokens,
                endpoint.projected_tokens) == (0, 0, 0)
    # Settled to what the engines reported: each tenant is charged its requests' cost.
    for tenant in ("light", "flood"):
        assert _charged(run, tenant) == sum(_service(r) for r in _mine(run, tenant))


def _output_between(records: list[PoolRecord], t1: float, t2: float) -> float:
    """Output tokens produced in [t1, t2], each response's spread evenly from its first token to
    its end (an engine emits one a step)."""
    total = 0.0
    for r in records:
        if r.first_token_s is None or r.end_s is None:
            continue
        span = r.end_s - r.first_token_s
        if span <= 0:
            total += r.completion_tokens * (t1 <= r.first_token_s <= t2)
            continue
        overlap = min(t2, r.end_s) - max(t1, r.first_token_s)
        total += r.completion_tokens * max(0.0, overlap) / span
    return total


def test_backlogged_tenants_get_output_in_their_weights_ratio() -> None:
    # Same shapes for both, so service (prompt + 2 × output) and output share the ratio.
    shape = {"api": "completions", "stream_fraction": 1.0, "prompt_tokens": [64, 64],
             "output_tokens": [64, 64]}
    # Backlogs larger than the pool takes: both tenants keep requests queued in the gate, so
    # the gate's order, not the engines' own queues, decides who is served.
    traffic = load_traffic({"duration_s": 30, "seed": 3, "tenants": [
        {"name": "a", "backlog": 48, **shape}, {"name": "b", "backlog": 48, **shape}]})
    run = simulate(_config({"a": 1, "b": 3}), traffic, SMALL_POOL)
    t1, t2 = 2.0, traffic.duration_s - 1.0
    for tenant in ("a", "b"):
        sent = [r for r in _mine(run, tenant)
                if r.dispatched_s is not None and t1 <= r.dispatched_s <= t2]
        assert sent and all(r.dispatched_s > r.arrival_s for r in sent), \
            f"{tenant} was not held in the gate"
    a = _output_between(_mine(run, "a"), t1, t2)
    b = _output_between(_mine(run, "b"), t1, t2)
    assert a > 0
    assert b / a == pytest.approx(3.0, rel=0.05)


def _light_p95(run: PoolRun) -> float:
    ttft = [r.ttft_s for r in _mine(run, "light") if r.outcome == "ok" and r.ttft_s is not None]
    got = percentile(ttft, 95)
    assert got is not None
    return got


def test_vtc_gives_a_light_tenant_a_shorter_wait_than_pass_through() -> None:
    traffic = _flood()
    fair = _run(_config({"light": 1, "flood": 1}), traffic)
    passthrough = _run(_config({"light": 1, "flood": 1}, scheduling={"policy": "fcfs"}), traffic)
    assert [r.arrival_s for r in _mine(fair, "light")] == \
        [r.arrival_s for r in _mine(passthrough, "light")]
    assert _light_p95(fair) < _light_p95(passthrough)


def test_an_fcfs_engine_refuses_a_request_with_a_priority() -> None:
    # The picker writes priorities (enginePolicy: priority) but the engines run fcfs.
    config = _config({"light": 1, "flood": 1}, scheduling={"enginePolicy": "priority"})
    run = _run(config, _flood(), SMALL_POOL)
    refused = [r for r in run.records if r.engine_priority]
    assert refused, "the backlogged flood should have been given priority 1"
    for record in refused:
        assert record.outcome == "engine_refused"
        assert record.first_token_s is None and record.completion_tokens == 0
    served = [r for r in run.records if r.dispatched_s is not None and not r.engine_priority]
    assert served and all(r.outcome == "ok" for r in served)
    # Refused requests are charged nothing: each tenant pays for what it was served only.
    for tenant in ("light", "flood"):
        ok = [r for r in _mine(run, tenant) if r.outcome == "ok"]
        assert _charged(run, tenant) == sum(_service(r) for r in ok)


def test_priority_engines_get_the_light_tenant_first_and_the_flood_last() -> None:
    config = _config({"light": 1, "flood": 1}, scheduling={"enginePolicy": "priority"})
    run = _run(config, _flood(), PoolSpec(endpoints=2, kv_budget_tokens=1024, step_s=0.005,
                                          engine_policy="priority"))
    assert all(r.outcome == "ok" for r in run.records)
    light = _mine(run, "light")
    assert light and all(r.engine_priority == 0 for r in light)
    # The flood's backlog is queued in the picker by the time the light tenant starts.
    later = [r for r in _mine(run, "flood") if r.dispatched_s is not None
             and r.dispatched_s >= LIGHT_START]
    assert later and all(r.engine_priority == 1 for r in later)


def test_a_client_that_gives_up_is_cancelled_in_the_engine_and_charged_what_it_got() -> None:
    """The load client stops waiting ``timeout_s`` after it sent a request; Envoy resets the
    stream and the engine aborts it. The simulator does the same: the engine frees its blocks,
    the gate settles it to the tokens it delivered, and nothing it generated later counts."""
    traffic = load_traffic({"duration_s": 0.5, "seed": 1, "timeout_s": 1.0, "tenants": [
        {"name": "long", "backlog": 1, "stop_s": 0.1, "api": "completions",
         "stream_fraction": 1.0, "prompt_tokens": [100, 100], "output_tokens": [5000, 5000]}]})
    run = _run(_config({"long": 1}), traffic, SMALL_POOL)
    (record,) = _mine(run, "long")
    assert record.outcome == "cancelled"
    assert record.end_s == pytest.approx(1.0, abs=SMALL_POOL.step_s)
    # One token a 5 ms step from its first: about 200 before its client left, far from 5,000.
    assert 150 <= record.completion_tokens <= 200
    assert _charged(run, "long") == _service(record)
    assert run.gate.passages == {}
    assert all(e.inflight_tokens == 0 and e.inflight_requests == 0
               for e in run.gate.endpoints.values())


@pytest.mark.parametrize("newest_first_after", ["0s", "5s"])
def test_a_sustained_overload_serves_requests_whose_clients_still_wait(
        newest_first_after: str) -> None:
    """An open-loop flood far above the pool's capacity, whose clients give up after 20 s, as
    long as the picker would hold them. Oldest first, every request sent has waited nearly its
    client's patience and is abandoned mid-answer; newest first (the default), those sent are
    answered and the stale ones time out in the queue without costing an engine anything."""
    traffic = load_traffic({"duration_s": 60, "seed": 4, "timeout_s": 20, "tenants": [
        {"name": "flood", "rate": 40, "api": "completions", "stream_fraction": 1.0,
         "prompt_tokens": [200, 300], "output_tokens": [150, 200]}]})
    config = _config({"flood": 1}, queue={"maxWait": "20s",
                                          "newestFirstAfter": newest_first_after})
    run = _run(config, traffic, SMALL_POOL)
    outcomes = {o: sum(r.outcome == o for r in run.records) for o in ("ok", "cancelled")}
    if newest_first_after == "0s":
        assert outcomes["cancelled"] > outcomes["ok"]
    else:
        assert outcomes["ok"] > 10 * max(1, outcomes["cancelled"])


def test_requests_past_the_queue_timeout_are_dropped_uncharged() -> None:
    config = _config({"light": 1, "flood": 1}, queue={"maxWait": "200ms"})
    run = _run(config, _flood(backlog=16))
    timed_out = [r for r in run.records if r.outcome == "queue_timeout"]
    assert timed_out
    for record in timed_out:
        assert record.dispatched_s is None and record.completion_tokens == 0
        assert record.end_s is not None
        # Checked once a step: dropped in the first step at or past its 200 ms.
        assert 0.2 - 1e-9 <= record.end_s - record.arrival_s <= 0.2 + SMALL_POOL.step_s + 1e-9
    assert {r.outcome for r in run.records} <= {"ok", "queue_timeout"}
    for tenant in ("light", "flood"):
        ok = [r for r in _mine(run, tenant) if r.outcome == "ok"]
        assert _charged(run, tenant) == sum(_service(r) for r in ok)
    assert run.gate.passages == {}


@pytest.mark.parametrize("caching", [True, False])
def test_the_pool_runs_the_prefix_caching_engine(monkeypatch: pytest.MonkeyPatch,
                                                 caching: bool) -> None:
    """Requests that carry token ids share a 64-token prefix: the second and later are hits
    on the endpoint that served the first (prefix caching on, as the engines default to)."""
    prefix = tuple(range(1000, 1064))
    planned = [PlannedRequest("t", i, "poisson", i * 0.5, 80, 4, True,
                              token_ids=prefix + tuple(range(i * 16, i * 16 + 16)))
               for i in range(4)]
    monkeypatch.setattr(pool_module, "plan_open_loop", lambda traffic, duration: planned)
    traffic = load_traffic({"duration_s": 3, "seed": 1, "timeout_s": 30, "tenants": [
        {"name": "t", "rate": 0.001, "prompt_tokens": [80, 80], "output_tokens": [4, 4]}]})
    spec = replace(PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01),
                   enable_prefix_caching=caching)
    run = _run(_config({"t": 1}), traffic, spec)
    assert [r.outcome for r in run.records] == ["ok"] * 4
    assert run.prefix_cache_queries == (4 * 80 if caching else 0)
    assert run.prefix_cache_hits == (3 * 64 if caching else 0)
