"""Property tests: lifts never lower counters, the VTC drift bound, work conservation."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core import LaneSpec, Request, Scheduler, Usage
from picker.sim.analysis import backlogged_drift, vtc_bound
from picker.sim.engine import simulate
from picker.sim.scenario import Scenario, load_scenario

TENANTS = ("a", "b", "c")
LANES = ("high", "low")

# One scheduler operation: (kind, tenant index, lane or request index, amount). Enqueue and
# dispatch are drawn more often than the rest so that tenants leave and re-enter the queue a lot.
Op = tuple[str, int, int, int]
KINDS = ("enqueue", "enqueue", "enqueue", "dispatch", "dispatch", "output", "output", "finish",
         "settle", "cancel")

ops_strategy = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(0, 30), st.integers(1, 300)),
    min_size=10,
    max_size=120,
)


def apply_op(scheduler: Scheduler, op: Op, live: list[Request], now: float) -> None:
    """Apply one non-enqueue operation to ``scheduler``; ``live`` holds unfinished requests."""
    kind, _, index, amount = op
    queued = [r for r in live if r.state == "queued"]
    running = [r for r in live if r.state == "running"]
    if kind == "dispatch":
        chosen = scheduler.peek(now)
        if chosen is not None:
            scheduler.dispatch(chosen, now)
    elif kind == "output" and running:
        scheduler.charge_output(running[index % len(running)], amount)
    elif kind == "finish" and running:
        scheduler.finish(running[index % len(running)])
    elif kind == "settle" and running:
        request = running[index % len(running)]
        scheduler.settle(request, Usage(request.prompt_tokens, amount // 3))
    elif kind == "cancel" and queued:
        scheduler.cancel(queued[index % len(queued)])
    live[:] = [r for r in live if r.state in ("queued", "running")]


def counters(scheduler: Scheduler) -> dict[tuple[str, str], float]:
    """Every tenant's counter in every lane."""
    return {(t, lane): scheduler.counter(t, lane) for t in TENANTS for lane in LANES}


# -- (1) the lift never lowers a counter --


@pytest.mark.parametrize("policy", ["vtc", "lcf"])
@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, lane_count=st.integers(1, len(LANES)),
       weights=st.lists(st.integers(1, 4), min_size=3, max_size=3))
def test_enqueue_never_lowers_a_counter_and_touches_only_the_enqueuing_tenant(
    policy: str, ops: list[Op], lane_count: int, weights: list[int]
) -> None:
    scheduler = Scheduler(lanes=[LaneSpec(name) for name in LANES], policy=policy,
                          weights=dict(zip(TENANTS, map(float, weights), strict=True)))
    live: list[Request] = []
    for step, op in enumerate(ops):
        now = float(step)
        kind, tenant_index, lane_index, amount = op
        if kind != "enqueue":
            apply_op(scheduler, op, live, now)
            continue
        tenant, lane = TENANTS[tenant_index], LANES[lane_index % lane_count]
        backlogged = {r.tenant for r in live if r.state == "queued" and r.lane == lane}
        before = counters(scheduler)
        request = Request(tenant=tenant, prompt_tokens=amount, lane=lane)
        scheduler.enqueue(request, now)
        live.append(request)
        after = counters(scheduler)
        assert after[(tenant, lane)] >= before[(tenant, lane)]
        for key in before:
            if key != (tenant, lane):
                assert after[key] == before[key], key
        if policy == "lcf" or tenant in backlogged:
            assert after[(tenant, lane)] == before[(tenant, lane)]
        elif backlogged:  # VTC: a returning tenant starts no lower than the backlogged floor
            assert after[(tenant, lane)] >= min(before[(t, lane)] for t in backlogged)


# -- (2) VTC's bound on the service gap of two backlogged tenants --


@st.composite
def phases(draw: st.DrawFn, steps: int) -> list[dict[str, Any]]:
    """One to three traffic phases: Poisson arrivals or a standing backlog."""
    count = draw(st.integers(1, 3))
    ends = sorted(draw(st.lists(st.integers(1, steps), min_size=count - 1, max_size=count - 1,
                                unique=True)))
    out: list[dict[str, Any]] = []
    for i in range(count):
        if draw(st.integers(0, 2)):
            phase: dict[str, Any] = {"backlog": draw(st.integers(1, 16))}
        else:
            phase = {"rate": draw(st.floats(0.05, 1.5, allow_nan=False))}
        if i < count - 1:
            phase["until"] = ends[i]
        out.append(phase)
    return out


@st.composite
def scenarios(draw: st.DrawFn, weighted: bool, lanes: bool = False) -> Scenario:
    """A small random scenario.

    Outputs may be much longer than prompts: the engine checks the KV budget only when it admits
    a prompt, so such batches outgrow the budget while decoding, and the bound is then taken over
    the batch's actual peak (``vtc_bound(scenario, result)``).
    """
    budget = draw(st.integers(256, 2048))
    steps = draw(st.integers(300, 1500))
    lane_specs = [{"name": "default"}]
    if lanes:
        lane_specs = [{"name": "high"}, {"name": "low", "min_share": draw(st.sampled_from(
            [0.0, 0.2, 0.5]))}]
    tenants = []
    for i in range(draw(st.integers(2, 4))):
        p_low = draw(st.integers(8, 96))
        p_high = draw(st.integers(p_low, min(budget, 512)))
        o_high = draw(st.integers(1, 160))
        o_low = draw(st.integers(1, o_high))
        tenant: dict[str, Any] = {
            "name": f"t{i}",
            "arrivals": draw(phases(steps)),
            "prompt_tokens": [p_low, p_high],
            "output_tokens": [o_low, o_high],
            "weight": draw(st.integers(1, 4)) if weighted else 1,
        }
        if lanes:
            tenant["lane"] = draw(st.sampled_from(["high", "low"]))
        tenants.append(tenant)
    return load_scenario({
        "steps": steps,
        "kv_budget_tokens": budget,
        "seed": draw(st.integers(0, 2**16)),
        "cost": {"prefill_weight": draw(st.sampled_from([1, 2])),
                 "decode_weight": draw(st.sampled_from([1, 2, 3]))},
        "lanes": lane_specs,
        "tenants": tenants,
    })


def assert_within_vtc_bound(scenario: Scenario) -> None:
    result = simulate(scenario, "vtc")
    bound = vtc_bound(scenario, result)
    for a, b in itertools.combinations(result.tenants, 2):
        drift = backlogged_drift(result, a, b)
        assert drift <= bound, (a, b, drift, bound)


@settings(max_examples=60, deadline=None)
@given(scenario=scenarios(weighted=False))
def test_vtc_keeps_two_backlogged_tenants_within_the_bound(scenario: Scenario) -> None:
    assert_within_vtc_bound(scenario)


@settings(max_examples=60, deadline=None)
@given(scenario=scenarios(weighted=True))
def test_vtc_keeps_two_backlogged_weighted_tenants_within_the_bound(scenario: Scenario) -> None:
    assert_within_vtc_bound(scenario)


def test_bound_is_over_the_batch_the_engine_really_held() -> None:
    # Tiny prompts, long outputs: 256 one-token prompts fill M = 256 at admission, then decode
    # grows the batch a hundredfold; b's 64-token prompt waits at the head meanwhile.
    scenario = load_scenario({
        "steps": 400, "kv_budget_tokens": 256,
        "cost": {"prefill_weight": 1, "decode_weight": 1},
        "tenants": [
            {"name": "a", "arrivals": [{"backlog": 300}], "prompt_tokens": [1, 1],
             "output_tokens": [100, 100]},
            {"name": "b", "arrivals": [{"until": 5, "rate": 0}, {"backlog": 1}],
             "prompt_tokens": [64, 64], "output_tokens": [1, 1]},
        ],
    })
    result = simulate(scenario, "vtc")
    drift = backlogged_drift(result, "a", "b")
    assert result.peak_batch_tokens > 50 * scenario.kv_budget_tokens
    assert drift > vtc_bound(scenario)  # the nominal-M bound does not apply to such a batch
    assert drift <= vtc_bound(scenario, result)


def test_vtc_bound_holds_on_a_standing_backlog_where_fcfs_breaks_it() -> None:
    scenario = load_scenario({
        "steps": 2000,
        "kv_budget_tokens": 512,
        "tenants": [
            {"name": "a", "arrivals": [{"backlog": 20}], "prompt_tokens": [64, 128],
             "output_tokens": [16, 64]},
            {"name": "b", "arrivals": [{"backlog": 20}], "prompt_tokens": [8, 16],
             "output_tokens": [4, 8]},
        ],
    })
    bound = vtc_bound(scenario)
    assert backlogged_drift(simulate(scenario, "vtc"), "a", "b") <= bound
    assert backlogged_drift(simulate(scenario, "fcfs"), "a", "b") > bound


# -- (3) work conservation --


@settings(max_examples=30, deadline=None)
@given(scenario=scenarios(weighted=True, lanes=True),
       policy=st.sampled_from(["vtc", "lcf", "fcfs", "rpm"]))
def test_work_conserving_policies_never_hold_a_queued_request_in_the_simulator(
    scenario: Scenario, policy: str
) -> None:
    result = simulate(scenario, policy)  # rpm without a limit
    assert "held" not in result.admission_stops
    assert len(result.admission_stops) >= scenario.steps


def test_rpm_with_a_finite_limit_does_hold_requests_in_the_simulator() -> None:
    scenario = load_scenario({
        "steps": 300,
        "kv_budget_tokens": 4096,
        "rpm_window_steps": 100,
        "tenants": [{"name": "a", "arrivals": [{"backlog": 5}], "prompt_tokens": [8, 8],
                     "output_tokens": [4, 4]}],
    })
    assert "held" in simulate(scenario, "rpm", rpm_limit=3).admission_stops
    assert "held" not in simulate(scenario, "rpm", rpm_limit=math.inf).admission_stops


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, policy=st.sampled_from(["vtc", "lcf", "fcfs", "rpm"]),
       min_share=st.sampled_from([0.0, 0.1, 0.5]))
def test_peek_is_none_only_when_nothing_is_queued(
    ops: list[Op], policy: str, min_share: float
) -> None:
    options = {"limit": math.inf} if policy == "rpm" else {}
    scheduler = Scheduler(lanes=[LaneSpec("high"), LaneSpec("low", min_share)], policy=policy,
                          **options)
    live: list[Request] = []
    for step, op in enumerate(ops):
        now = float(step)
        kind, tenant_index, lane_index, amount = op
        if kind == "enqueue":
            request = Request(tenant=TENANTS[tenant_index], prompt_tokens=amount,
                              lane=LANES[lane_index % len(LANES)])
            scheduler.enqueue(request, now)
            live.append(request)
        else:
            apply_op(scheduler, op, live, now)
        chosen = scheduler.peek(now)
        assert (chosen is None) == (scheduler.queued() == 0)
        assert scheduler.queued() == sum(r.state == "queued" for r in live)
