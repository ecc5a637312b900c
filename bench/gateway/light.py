"""Goal 2: does a light tenant's time to first token hold up under a flood?

Its p95 TTFT under a flood must stay within 1.5 × its p95 when alone (three judged runs: alone,
flood with vtc, flood with fcfs; a fourth shows the flood with the other ``idleTenantReserve``).
The picker's histograms split the mean TTFT into time held in the picker, dispatch → first byte,
and the rest. The flood runs also feed goal 3.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.gateway.common import (
    GatewayRun,
    Plan,
    make_traffic,
    msum,
    percentile_ms,
    pool_numbers,
    run_gateway,
    traffic_data,
)
from picker.sim.traffic import load_traffic

#: The ``idleTenantReserve`` of goal 2's comparison run when the judged runs use none.
COMPARE_RESERVE = "2s"


def light_run(run: GatewayRun, light: str = "light") -> dict[str, Any]:
    t1, t2 = run.window
    mine = [r for r in run.records if r.tenant == light]
    ok = [r for r in mine if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    first, last = (run.samples[0], run.samples[-1]) if run.samples else (None, None)

    def mean_of(name: str) -> float | None:
        if first is None or last is None:
            return None
        total = msum(last.picker, f"{name}_sum", tenant=light) - msum(
            first.picker, f"{name}_sum", tenant=light)
        count = msum(last.picker, f"{name}_count", tenant=light) - msum(
            first.picker, f"{name}_count", tenant=light)
        return total / count * 1000 if count else None

    flood = [r.ttft_s for r in run.records
             if r.tenant != light and r.ok and r.ttft_s is not None and t1 <= r.start_s <= t2]
    out: dict[str, Any] = {
        "policy": run.policy, "label": run.label, "window_s": [t1, t2],
        "sent": len(mine), "ok": len(ok), "errors": len(mine) - len(ok),
        "ttft_ms": {"p50": percentile_ms(ttft, 50), "p95": percentile_ms(ttft, 95),
                    "p99": percentile_ms(ttft, 99),
                    "mean": statistics.fmean(ttft) * 1000 if ttft else None,
                    "max": max(ttft) * 1000 if ttft else None},
        "picker_hold_ms_mean": mean_of("fairway_queue_wait_seconds"),
        "picker_ttft_ms_mean": mean_of("fairway_ttft_seconds"),
        "flood_ttft_ms_p50": percentile_ms(flood, 50),
        "pool": pool_numbers(run),
        "resources": run.resources,
    }
    hold, picker_ttft = out["picker_hold_ms_mean"], out["picker_ttft_ms_mean"]
    if hold is not None and picker_ttft is not None:
        out["after_dispatch_ms_mean"] = picker_ttft - hold
        if out["ttft_ms"]["mean"] is not None:
            out["outside_picker_ms_mean"] = out["ttft_ms"]["mean"] - picker_ttft
    return out


def exp_light(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, GatewayRun]]:
    flood = make_traffic("flood", plan.flood_duration, plan.backlog_scale,
                         light=plan.light_start)
    alone = load_traffic({**traffic_data("flood"), "duration_s": plan.flood_duration,
                          "tenants": [{**t, "start_s": plan.light_start}
                                      for t in traffic_data("flood")["tenants"]
                                      if t["name"] == "light"]})
    window = (plan.light_start, plan.flood_duration)
    runs = {
        "alone": run_gateway("light-alone", "vtc", alone, {}, window, workdir, plan),
        "flood_vtc": run_gateway("flood-vtc", "vtc", flood, {}, window, workdir, plan),
        "flood_fcfs": run_gateway("flood-fcfs", "fcfs", flood, {}, window, workdir, plan),
    }
    # The same flood with the other setting of the reserve, to show what it trades.
    other = COMPARE_RESERVE if plan.idle_tenant_reserve in ("0", "0s") else "0s"
    runs["flood_vtc_other"] = run_gateway("flood-vtc-other", "vtc", flood, {}, window, workdir,
                                          plan, idle_tenant_reserve=other)
    data = {"traffic": "bench/traffic/gateway_flood.yaml", "other_reserve": other,
            "flood_backlog": flood.tenant("flood").backlog,
            "light_rate": flood.tenant("light").rate,
            "runs": {name: light_run(run) for name, run in runs.items()}}
    alone_p95 = data["runs"]["alone"]["ttft_ms"]["p95"]
    for run in data["runs"].values():
        p95 = run["ttft_ms"]["p95"]
        run["p95_over_alone"] = (p95 / alone_p95) if p95 is not None and alone_p95 else None
    return data, runs
