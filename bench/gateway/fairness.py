"""Goal 1: do backlogged tenants get their weights' shares of service through real Envoy?

Three tenants weighted 1:2:3 stay backlogged against two simulated servers (1024-token KV budget
each, 5 ms steps). Each tenant's share of service (prompt + 2 × completion tokens, from the
engine-reported ``usage`` of every response) over the steady-state window (after a warm-up, before
sending stops; output tokens are placed evenly between a request's first and last token) must be
within 5 % (relative) of its weight's share. The picker's own ``fairway_weighted_service_total``
counters are reported beside it, and the same traffic runs with ``fcfs`` (pass-through) for
contrast. The runs also feed goal 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gateway.common import (
    GatewayRun,
    Plan,
    make_traffic,
    pool_numbers,
    run_gateway,
    tenant_numbers,
)

FAIR_WEIGHTS = {"w1": 1.0, "w2": 2.0, "w3": 3.0}


def shares_of(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: (v / total if total else 0.0) for k, v in values.items()}


def fairness_run(run: GatewayRun, weights: dict[str, float]) -> dict[str, Any]:
    tenants = {t: tenant_numbers(run, t) for t in weights}
    client = shares_of({t: n["service_in_window"] for t, n in tenants.items()})
    picker = shares_of({t: n["picker_service_in_window"] for t, n in tenants.items()})
    total_weight = sum(weights.values())
    for t, numbers in tenants.items():
        target = weights[t] / total_weight
        numbers.update(weight=weights[t], target_share=target, share=client[t],
                       rel_error=(client[t] - target) / target, picker_share=picker[t],
                       picker_rel_error=(picker[t] - target) / target)
    return {"policy": run.policy, "label": run.label, "duration_s": run.duration_s,
            "window_s": list(run.window), "tenants": tenants, "pool": pool_numbers(run),
            "resources": run.resources, "sample_failures": run.sample_failures,
            "load_summary": run.result.summary}


def exp_fairness(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, GatewayRun]]:
    # Not scaled down for quick runs: the heaviest tenant needs its full backlog to stay queued.
    traffic = make_traffic("weighted", plan.fair_duration)
    window = (plan.fair_warmup, plan.fair_duration)
    runs = {policy: run_gateway(f"fair-{policy}", policy, traffic, FAIR_WEIGHTS, window,
                                workdir, plan) for policy in ("vtc", "fcfs")}
    return {"traffic": "bench/traffic/gateway_weighted.yaml", "weights": FAIR_WEIGHTS,
            "backlog": traffic.tenants[0].backlog,
            "runs": {p: fairness_run(r, FAIR_WEIGHTS) for p, r in runs.items()}}, runs
