"""Goal 5: does gateway-level VTC stay within the engine-level bound on its drift?

Two equally weighted backlogged tenants run through the gateway and, in the same shape, through
the engine-level simulator (one engine holding the pool's whole KV budget): drift ÷ bound,
bound = 2·max(w_p·L_input, w_q·M) with M the pool's total KV budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gateway.common import (
    DECODE_WEIGHT,
    POOL_ENDPOINTS,
    POOL_KV_BUDGET,
    POOL_STEP_MS,
    PREFILL_WEIGHT,
    GatewayRun,
    Plan,
    Series,
    make_traffic,
    msum,
    pool_numbers,
    run_gateway,
    series,
    tenant_numbers,
    trace,
)
from picker.sim.analysis import backlogged_drift, max_drift, vtc_bound, widest_swing
from picker.sim.engine import simulate
from picker.sim.scenario import load_scenario
from picker.sim.traffic import Traffic


def both_backlogged(run: GatewayRun, a: str, b: str) -> tuple[float, float] | None:
    """First and last sample at which the picker held requests of both ``a`` and ``b``."""
    times = [s.t for s in run.samples
             if msum(s.picker, "fairway_queued_requests", tenant=a) > 0
             and msum(s.picker, "fairway_queued_requests", tenant=b) > 0]
    return (times[0], times[-1]) if times else None


def gap_series(run: GatewayRun, a: str, b: str, weights: dict[str, float], end: float,
               step: float = 0.01) -> Series:
    ta, tb = trace(run.records, a), trace(run.records, b)
    points, t = [], 0.0
    while t <= end:
        points.append((t, ta.at(t) / weights.get(a, 1.0) - tb.at(t) / weights.get(b, 1.0)))
        t += step
    return points


def _drift_from(service: list[list[float]], backlogged: list[list[bool]], start: int) -> float:
    """``backlogged_drift`` of the first two (equally weighted) tenants from step ``start`` on."""
    return widest_swing(row[0] - row[1] if flags[0] and flags[1] else None
                        for row, flags in zip(service[start:], backlogged[start:], strict=True))


def drift_scenario(traffic: Traffic, steps: int, seed: int) -> dict[str, Any]:
    """The engine-level scenario of the same shape: one engine holding the pool's whole budget."""
    return {
        "steps": steps, "kv_budget_tokens": POOL_ENDPOINTS * POOL_KV_BUDGET, "seed": seed,
        "cost": {"prefill_weight": PREFILL_WEIGHT, "decode_weight": DECODE_WEIGHT},
        "tenants": [{"name": t.name, "prompt_tokens": list(t.prompt_tokens),
                     "output_tokens": list(t.output_tokens), "arrivals": [{"backlog": 8}]}
                    for t in traffic.tenants],
    }


def exp_drift(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    traffic = make_traffic("drift", plan.drift_duration, plan.backlog_scale)
    a, b = (t.name for t in traffic.tenants)
    weights = {a: 1.0, b: 1.0}
    run = run_gateway("drift-vtc", "vtc", traffic, weights, (0.0, plan.drift_duration),
                      workdir, plan)
    budget = POOL_ENDPOINTS * POOL_KV_BUDGET
    longest = max(t.prompt_tokens[1] for t in traffic.tenants)
    bound = 2 * max(PREFILL_WEIGHT * longest, DECODE_WEIGHT * budget)
    window = both_backlogged(run, a, b)
    gaps = gap_series(run, a, b, weights, max(plan.drift_duration, window[1] if window else 0.0))
    gateway: dict[str, Any] = {"window_s": list(window) if window else None, "bound": bound}
    warm = plan.fair_warmup
    gateway["warmup_s"] = warm
    if window is not None:
        inside = [g for t, g in gaps if window[0] <= t <= window[1]]
        gateway["backlogged_drift"] = max(inside) - min(inside) if inside else 0.0
        later = [g for t, g in gaps if max(window[0], warm) <= t <= window[1]]
        gateway["backlogged_drift_after_warmup"] = max(later) - min(later) if later else 0.0
        counter = series(run.samples, lambda s: msum(s.picker, "fairway_virtual_service",
                                                     tenant=a)
                         - msum(s.picker, "fairway_virtual_service", tenant=b))
        held = [v for t, v in counter if window[0] <= t <= window[1]]
        gateway["picker_counter_gap_range"] = max(held) - min(held) if held else None
        gateway["picker_counter_gap_max_abs"] = max(abs(v) for v in held) if held else None
    gateway["max_drift_from_start"] = max(abs(g) for _, g in gaps) if gaps else 0.0
    gateway["drift_over_bound"] = gateway.get("backlogged_drift", 0.0) / bound
    gateway["max_drift_over_bound"] = gateway["max_drift_from_start"] / bound
    gateway["observed_longest_prompt"] = max((r.prompt_tokens for r in run.records if r.ok),
                                             default=0)
    pool = pool_numbers(run)
    pool["window_s"] = list(window) if window else None
    gateway["pool"] = pool
    gateway["resources"] = run.resources
    gateway["tenants"] = {t: {k: v for k, v in tenant_numbers(run, t).items()
                              if k in ("sent", "ok", "errors", "ttft_ms")} for t in (a, b)}
    gateway["services"] = {t: trace(run.records, t).at(plan.drift_duration) for t in (a, b)}

    steps = round(plan.drift_duration * 1000 / POOL_STEP_MS)
    scenario = load_scenario(drift_scenario(traffic, steps, traffic.seed))
    engine: dict[str, Any] = {"steps": steps, "kv_budget_tokens": scenario.kv_budget_tokens}
    kept_gap: Series = []
    for policy in ("vtc", "fcfs"):
        result = simulate(scenario, policy)
        held = backlogged_drift(result, a, b)
        engine[policy] = {
            "backlogged_drift": held, "max_drift": max_drift(result, a, b),
            "backlogged_drift_after_warmup": _drift_from(
                result.service, result.backlogged, round(warm * 1000 / POOL_STEP_MS)),
            "bound": vtc_bound(scenario), "bound_with_peak_batch": vtc_bound(scenario, result),
            "drift_over_bound": held / vtc_bound(scenario),
            "max_drift_over_bound": max_drift(result, a, b) / vtc_bound(scenario),
            "output_tokens_per_step": result.output_tokens / max(result.steps, 1),
            "peak_batch_tokens": result.peak_batch_tokens,
            "service": dict(zip(result.tenants, result.service[-1], strict=True)),
        }
        if policy == "vtc":
            stride = max(1, steps // 1000)
            kept_gap = [(i * POOL_STEP_MS / 1000, row[0] - row[1])
                        for i, row in enumerate(result.service) if i % stride == 0]
    data = {"traffic": "bench/traffic/gateway_drift.yaml", "tenants": [a, b],
            "duration_s": plan.drift_duration, "backlog": traffic.tenants[0].backlog,
            "gateway": gateway, "engine": engine,
            "scenario": drift_scenario(traffic, steps, traffic.seed)}
    kept = {"gateway_gap": gaps[:: max(1, len(gaps) // 1000)], "engine_gap": kept_gap,
            "bound": bound, "window": window}
    return data, kept
