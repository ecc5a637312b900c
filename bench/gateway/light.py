"""Goal 2: does a light tenant's time to first token hold up under a flood?

Its p95 TTFT under a flood must stay within 1.5 × its p95 when alone (three judged runs: alone,
flood with vtc, flood with fcfs; a fourth shows the flood with the other ``idleTenantReserve``).
The picker's histograms split the mean TTFT into time held in the picker, dispatch → first byte,
and the rest. The flood runs also feed goal 3.

Each run's traffic also goes through the pool simulator (``picker.sim.pool``: the server's own
gate, the same picker config, engines like the stack's servers), and the light tenant's TTFT,
each tenant's output and the pool's tokens/s are set side by side (issue 12): the gateway's
figures against the simulator's, on the same requests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gateway.common import (
    POOL_ENDPOINTS,
    POOL_ENGINE_POLICY,
    POOL_KV_BUDGET,
    POOL_STEP_MS,
    GatewayRun,
    Plan,
    make_traffic,
    msum,
    percentile_ms,
    picker_overrides,
    pool_numbers,
    run_gateway,
    trace,
    traffic_data,
)
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.load import RequestRecord
from picker.sim.pool import PoolRecord, PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic
from picker.stack.launcher import merge_sections

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
    reserves = {"flood_vtc_other": other}
    data["vs_simulator"] = {
        name: {"gateway": compared(run.records, window, pool_numbers(run)[
                   "server_output_tokens_per_s"]),
               "simulator": simulated(run.policy, alone if name == "alone" else flood, window,
                                      reserves.get(name, plan.idle_tenant_reserve))}
        for name, run in runs.items()}
    alone_p95 = data["runs"]["alone"]["ttft_ms"]["p95"]
    for run in data["runs"].values():
        p95 = run["ttft_ms"]["p95"]
        run["p95_over_alone"] = (p95 / alone_p95) if p95 is not None and alone_p95 else None
    return data, runs


# -- the same traffic in the pool simulator --------------------------------------------------------


def sim_spec() -> PoolSpec:
    """The stack's contended pool as the simulator models it."""
    return PoolSpec(endpoints=POOL_ENDPOINTS, kv_budget_tokens=POOL_KV_BUDGET,
                    step_s=POOL_STEP_MS / 1000, engine_policy=POOL_ENGINE_POLICY)


def sim_config(policy: str, traffic: Traffic, idle_tenant_reserve: str,
               spec: PoolSpec) -> PickerConfig:
    """The picker config ``run_gateway`` gives the stack: the stack's own part
    (``Stack.write_picker_config``) with the run's overrides merged over it."""
    base: dict[str, Any] = {"scheduling": {"policy": policy},
                            "endpoints": [{"address": a} for a in spec.addresses()],
                            "capacity": {"scrapeInterval": f"{spec.scrape_interval_s * 1000:g}ms"}}
    return load(PickerConfig, merge_sections(base, picker_overrides(traffic, {},
                                                                   idle_tenant_reserve)))


def _as_client_record(record: PoolRecord, seq: int) -> RequestRecord:
    """A simulated request as the load client would have recorded it (so both sides are
    measured by the same functions)."""
    ok = record.outcome == "ok"
    return RequestRecord(
        tenant=record.tenant, seq=seq, kind=record.kind, api="completions", stream=record.stream,
        scheduled_s=record.arrival_s, start_s=record.arrival_s,
        drawn_prompt_tokens=record.prompt_tokens, max_tokens=record.max_tokens,
        status=200 if ok else 503, ttft_s=record.ttft_s, end_s=record.end_s,
        prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
        usage_source="usage" if ok else "none", error=None if ok else record.outcome)


def compared(records: Sequence[RequestRecord], window: tuple[float, float],
             pool_tokens_per_s: float | None, light: str = "light") -> dict[str, Any]:
    """What the side-by-side table shows of one run (gateway or simulator alike)."""
    t1, t2 = window
    span = t2 - t1
    ttft = [r.ttft_s for r in records if r.tenant == light and r.ok and r.ttft_s is not None]
    tenants = sorted({r.tenant for r in records})
    return {
        "light_ttft_ms": {"p50": percentile_ms(ttft, 50), "p95": percentile_ms(ttft, 95)},
        "output_tokens_per_s": {t: trace(records, t, 0.0, 1.0).between(t1, t2) / span
                                for t in tenants},
        "pool_tokens_per_s": pool_tokens_per_s,
        "ok": {t: sum(r.ok for r in records if r.tenant == t) for t in tenants},
        "sent": {t: sum(r.tenant == t for r in records) for t in tenants},
    }


def simulated(policy: str, traffic: Traffic, window: tuple[float, float],
              idle_tenant_reserve: str) -> dict[str, Any]:
    """``traffic`` through the pool simulator, with the picker config of the gateway run and
    stragglers followed as long as the load client waits for them."""
    spec = sim_spec()
    started = time.process_time()
    run = simulate(sim_config(policy, traffic, idle_tenant_reserve, spec), traffic, spec,
                   warmup_s=window[0], drain_s=traffic.timeout_s)
    records = [_as_client_record(r, i) for i, r in enumerate(run.records)]
    out = compared(records, window, run.tokens_per_s())
    out["sim_cpu_s"] = time.process_time() - started
    return out
