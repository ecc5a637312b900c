"""Seed 000's fairness experiments, rerun on fairway's simulator and scheduling core.

It answers: does VTC keep the service gap of two overloaded tenants bounded while FCFS lets it grow
(table 1)? Does the counter lift stop a returning tenant from taking the engine (table 2)? How does
the gap scale with the KV budget (table 3)? What does an RPM limit cost (table 4)? Do weights and
lanes divide service as configured (table 5)? Do the single-seed answers hold across seeds
(table 6)? It checks the project's fairness goals against those numbers.

``python -m bench.experiments --out bench/results [--quick]`` prints the tables as markdown and
writes ``experiments.md``, ``experiments.json`` and PNG plots into ``--out``. ``--quick`` runs
fewer steps and seeds (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

from picker.config.strict import safe_load
from picker.sim.analysis import backlogged_drift, max_drift, service_between, shares, vtc_bound
from picker.sim.engine import SimResult, simulate
from picker.sim.scenario import Scenario, load_scenario

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
POLICIES = ("fcfs", "lcf", "vtc")
KV_BUDGETS = (2048, 4096, 8192, 16384, 32768)
RPM_LIMITS: tuple[float | None, ...] = (5, 20, 40, 80, None)
RETURN_STEP = 5000
RETURN_WINDOW = 600

# Seed 000's published numbers (the article's tables), for the columns beside ours.
SEED000: dict[str, Any] = {
    "two_overloaded": {
        "fcfs": {"max_drift": 248796, "drift_over_2u": 7.59, "throughput": 66.4},
        "lcf": {"max_drift": 5606, "drift_over_2u": 0.17, "throughput": 66.3},
        "vtc": {"max_drift": 6782, "drift_over_2u": 0.21, "throughput": 66.6},
    },
    "returning_tenant": {
        "fcfs": {"returning_share": 0.019, "steady_service": 38390},
        "lcf": {"returning_share": 0.835, "steady_service": 6662},
        "vtc": {"returning_share": 0.502, "steady_service": 20400},
    },
    "kv_sweep": {
        2048: {"max_drift": 2299, "drift_over_total": 0.023},
        4096: {"max_drift": 3268, "drift_over_total": 0.017},
        8192: {"max_drift": 6782, "drift_over_total": 0.017},
        16384: {"max_drift": 17753, "drift_over_total": 0.022},
        32768: {"max_drift": 36014, "drift_over_total": 0.023},
    },
    "rpm_sweep": {
        5: {"max_drift": 3144, "throughput": 3.8},
        20: {"max_drift": 6782, "throughput": 14.8},
        40: {"max_drift": 23375, "throughput": 28.8},
        80: {"max_drift": 44588, "throughput": 57.4},
        None: {"max_drift": 248796, "throughput": 66.4},
    },
}


# -- configuration --------------------------------------------------------------------------------


class Plan:
    """How long each experiment runs: the full measurement or the ``--quick`` smoke run."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.two_overloaded_steps = 5000 if quick else None  # None: the scenario file's steps
        self.returning_steps = RETURN_STEP + RETURN_WINDOW + 400 if quick else None
        self.kv_sweep_steps = 3000 if quick else None
        self.rpm_steps = 4000 if quick else None
        self.weighted_steps = 12000 if quick else None
        self.lanes_steps = 4000 if quick else None
        self.seeds: Sequence[int] = range(2) if quick else range(10)


def scenario_data(name: str) -> dict[str, Any]:
    """The parsed YAML of ``bench/scenarios/<name>.yaml``."""
    return safe_load((SCENARIOS / f"{name}.yaml").read_text(encoding="utf-8"))


def build(data: dict[str, Any], steps: int | None = None, **overrides: Any) -> Scenario:
    """A strictly loaded scenario from ``data`` with ``steps`` and top-level keys overridden."""
    data = copy.deepcopy(data)
    if steps is not None:
        data["steps"] = steps
    data.update(overrides)
    return load_scenario(data)


def scale_to_budget(data: dict[str, Any], kv_budget: int) -> dict[str, Any]:
    """``data`` with KV budget ``kv_budget`` and arrival rates and bursts scaled with it.

    The engine's request rate is proportional to M, so scaling the offered load by the same
    factor keeps both tenants as overloaded as at the original budget.
    """
    factor = kv_budget / data["kv_budget_tokens"]
    scaled = copy.deepcopy(data)
    scaled["kv_budget_tokens"] = kv_budget
    for tenant in scaled["tenants"]:
        for phase in tenant["arrivals"]:
            if phase.get("rate") is not None:
                phase["rate"] = phase["rate"] * factor
            if phase.get("backlog") is not None:
                phase["backlog"] = max(phase["backlog"], round(phase["backlog"] * factor))
    return scaled


# -- measuring one run ----------------------------------------------------------------------------


def share_while_backlogged(result: SimResult, tenant: str) -> float:
    """``tenant``'s fraction of all service delivered in the steps where it was backlogged."""
    i = result.tenants.index(tenant)
    own = total = 0.0
    previous = [0.0] * len(result.tenants)
    for row, flags in zip(result.service, result.backlogged, strict=True):
        if flags[i]:
            own += row[i] - previous[i]
            total += sum(row) - sum(previous)
        previous = row
    return own / total if total else 0.0


def record(scenario: Scenario, result: SimResult) -> dict[str, Any]:
    """The numbers of one run: throughput, service, and drift for every pair of tenants."""
    summary = result.summary()
    bound = vtc_bound(scenario)
    pairs = []
    for a, b in combinations(result.tenants, 2):
        drift, held = max_drift(result, a, b), backlogged_drift(result, a, b)
        pairs.append({"tenants": [a, b], "max_drift": drift, "backlogged_drift": held,
                      "max_drift_over_bound": drift / bound,
                      "backlogged_drift_over_bound": held / bound})
    steps = max(result.steps, 1)
    return {
        "policy": result.policy,
        "steps": result.steps,
        "seed": scenario.seed,
        "kv_budget_tokens": scenario.kv_budget_tokens,
        "weighted_service_per_step": summary["weighted_service_per_step"],
        "output_tokens_per_step": summary["output_tokens_per_step"],
        "total_service": result.total_service(),
        "service": summary["service"],
        "weights": summary["weights"],
        "shares": shares(result),
        "vtc_bound": bound,
        "held_step_fraction": result.admission_stops.count("held") / steps,
        "max_drift": max(p["max_drift"] for p in pairs) if pairs else 0.0,
        "backlogged_drift": max(p["backlogged_drift"] for p in pairs) if pairs else 0.0,
        "pairs": pairs,
    }


# -- the experiments ------------------------------------------------------------------------------


Runs = dict[str, SimResult]


def exp_two_overloaded(plan: Plan) -> tuple[dict[str, Any], Runs]:
    """Table 1: two tenants overloaded at different rates; drift and throughput per policy."""
    scenario = build(scenario_data("two_overloaded"), plan.two_overloaded_steps)
    out: dict[str, Any] = {"scenario": "two_overloaded.yaml", "steps": scenario.steps,
                           "vtc_bound": vtc_bound(scenario), "runs": {}}
    results: Runs = {}
    for policy in POLICIES:
        results[policy] = simulate(scenario, policy)
        out["runs"][policy] = record(scenario, results[policy])
    return out, results


def _returning_numbers(result: SimResult) -> dict[str, float]:
    start, end = RETURN_STEP, RETURN_STEP + RETURN_WINDOW
    return {"returning_share": shares(result, start, end)["a"],
            "returning_service": service_between(result, "a", start, end),
            "steady_service": service_between(result, "b", start, end)}


def exp_returning(plan: Plan) -> tuple[dict[str, Any], Runs]:
    """Table 2: a tenant returns from idleness; its share in the 600 steps after it returns."""
    scenario = build(scenario_data("returning_tenant"), plan.returning_steps)
    out: dict[str, Any] = {"scenario": "returning_tenant.yaml", "steps": scenario.steps,
                           "window": [RETURN_STEP, RETURN_STEP + RETURN_WINDOW], "runs": {}}
    results: Runs = {}
    for policy in POLICIES:
        result = results[policy] = simulate(scenario, policy)
        out["runs"][policy] = record(scenario, result) | _returning_numbers(result)
    return out, results


def exp_kv_sweep(plan: Plan) -> dict[str, Any]:
    """Table 3: experiment 1 at KV budgets 2k-32k, offered load scaled with the budget."""
    base = scenario_data("two_overloaded")
    rows = []
    for budget in KV_BUDGETS:
        scenario = build(scale_to_budget(base, budget), plan.kv_sweep_steps)
        runs = {policy: record(scenario, simulate(scenario, policy)) for policy in POLICIES}
        rows.append({"kv_budget_tokens": budget, "vtc_bound": vtc_bound(scenario),
                     "steps": scenario.steps, "runs": runs})
    return {"scenario": "two_overloaded.yaml, M and arrival rates scaled", "rows": rows}


def exp_rpm_sweep(plan: Plan) -> dict[str, Any]:
    """Table 4: the ``rpm`` baseline at several per-tenant limits on experiment 1's scenario."""
    scenario = build(scenario_data("two_overloaded"), plan.rpm_steps)
    rows = []
    for limit in RPM_LIMITS:
        run = record(scenario, simulate(scenario, "rpm", limit))
        rows.append({"rpm_limit": limit, **run})
    fcfs = record(scenario, simulate(scenario, "fcfs"))
    return {"scenario": "two_overloaded.yaml", "steps": scenario.steps,
            "rpm_window_steps": scenario.rpm_window_steps, "rows": rows, "fcfs": fcfs}


def exp_weights_and_lanes(plan: Plan) -> tuple[dict[str, Any], Runs]:
    """Table 5: weighted shares 1:2:3:4 under VTC, and batch-lane protection by ``min_share``."""
    scenario = build(scenario_data("weighted_1234"), plan.weighted_steps)
    result = simulate(scenario, "vtc")
    run = record(scenario, result)
    total_weight = sum(t.weight for t in scenario.tenants)
    tenants = []
    for tenant in scenario.tenants:
        target = tenant.weight / total_weight
        got = run["shares"][tenant.name]
        tenants.append({"tenant": tenant.name, "weight": tenant.weight, "target_share": target,
                        "share": got, "abs_error": got - target,
                        "rel_error": (got - target) / target})
    weighted = {"scenario": "weighted_1234.yaml", "run": run, "tenants": tenants}
    results: Runs = {"weighted": result}
    lanes = []
    for name in ("lanes_strict", "lanes_min_share"):
        lane_scenario = build(scenario_data(name), plan.lanes_steps)
        lane_result = results[name] = simulate(lane_scenario, "vtc")
        batch = lane_scenario.lanes[1]
        batch_tenant = next(t.name for t in lane_scenario.tenants if t.lane == batch.name)
        index = lane_result.tenants.index(batch_tenant)
        flags = [row[index] for row in lane_result.backlogged]
        lanes.append({
            "scenario": f"{name}.yaml", "min_share": batch.min_share,
            "batch_tenant": batch_tenant,
            "shares": shares(lane_result),
            "batch_share_while_backlogged": share_while_backlogged(lane_result, batch_tenant),
            "batch_backlogged_fraction": sum(flags) / max(len(flags), 1),
            "weighted_service_per_step": lane_result.summary()["weighted_service_per_step"],
        })
    return {"weighted": weighted, "lanes": lanes}, results


def exp_seeds(plan: Plan) -> dict[str, Any]:
    """Table 6: experiments 1 and 2 over several seeds: are the single-seed answers typical?"""
    one, two = scenario_data("two_overloaded"), scenario_data("returning_tenant")
    rows = []
    for seed in plan.seeds:
        s1 = build(one, plan.two_overloaded_steps, seed=seed)
        s2 = build(two, plan.returning_steps, seed=seed)
        row: dict[str, Any] = {"seed": seed, "two_overloaded": {}, "returning_tenant": {}}
        for policy in POLICIES:
            row["two_overloaded"][policy] = record(s1, simulate(s1, policy))
            result = simulate(s2, policy)
            row["returning_tenant"][policy] = record(s2, result) | _returning_numbers(result)
        rows.append(row)
    return {"seeds": list(plan.seeds), "rows": rows}


# -- goals ----------------------------------------------------------------------------------------


def _extra_seeds(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Table 6's rows except the one repeating experiments 1 and 2's own seed."""
    own = data["two_overloaded"]["runs"]["vtc"]["seed"]
    return [row for row in data["seeds"]["rows"] if row["seed"] != own]


def _vtc_runs(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """Every VTC run: (label, record, whether both/all tenants are overloaded from step 0)."""
    runs = [("exp 1", data["two_overloaded"]["runs"]["vtc"], True),
            ("exp 2", data["returning_tenant"]["runs"]["vtc"], False)]
    runs += [(f"exp 3 M={row['kv_budget_tokens']}", row["runs"]["vtc"], True)
             for row in data["kv_sweep"]["rows"]]
    runs.append(("exp 5 weights", data["weights_and_lanes"]["weighted"]["run"], True))
    for row in _extra_seeds(data):
        runs.append((f"exp 1 seed {row['seed']}", row["two_overloaded"]["vtc"], True))
        runs.append((f"exp 2 seed {row['seed']}", row["returning_tenant"]["vtc"], False))
    return runs


def _throughput_pairs(data: dict[str, Any]) -> list[tuple[str, float]]:
    def ratio(runs: dict[str, Any]) -> float:
        return runs["vtc"]["weighted_service_per_step"] / runs["fcfs"]["weighted_service_per_step"]

    pairs = [("exp 1", ratio(data["two_overloaded"]["runs"])),
             ("exp 2", ratio(data["returning_tenant"]["runs"]))]
    pairs += [(f"exp 3 M={row['kv_budget_tokens']}", ratio(row["runs"]))
              for row in data["kv_sweep"]["rows"]]
    for row in _extra_seeds(data):
        pairs.append((f"exp 1 seed {row['seed']}", ratio(row["two_overloaded"])))
        pairs.append((f"exp 2 seed {row['seed']}", ratio(row["returning_tenant"])))
    return pairs


def goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Pass/fail for the project's fairness goals, each with the worst case that decides it."""
    out = []
    runs = _vtc_runs(data)
    label, run, _ = max(runs, key=lambda r: r[1]["backlogged_drift"] / r[1]["vtc_bound"])
    worst = run["backlogged_drift"] / run["vtc_bound"]
    out.append({"goal": "VTC backlogged drift <= bound 2·max(w_p·L, w_q·M), every VTC run",
                "measured": f"worst {worst:.3f} × bound ({label}, "
                            f"{run['backlogged_drift']:,.0f} of {run['vtc_bound']:,.0f}; "
                            f"{len(runs)} runs)",
                "threshold": "<= 1.0 × bound", "value": worst, "passed": worst <= 1.0})
    from_start = [r for r in runs if r[2]]
    label, run, _ = max(from_start, key=lambda r: r[1]["max_drift"] / r[1]["vtc_bound"])
    worst = run["max_drift"] / run["vtc_bound"]
    out.append({"goal": "VTC max drift from step 0 <= bound, runs overloaded from step 0",
                "measured": f"worst {worst:.3f} × bound ({label}, "
                            f"{run['max_drift']:,.0f} of {run['vtc_bound']:,.0f}; "
                            f"{len(from_start)} runs)",
                "threshold": "<= 1.0 × bound", "value": worst, "passed": worst <= 1.0})

    returning = [("exp 2", data["returning_tenant"]["runs"]["vtc"]["returning_share"])]
    returning += [(f"seed {row['seed']}", row["returning_tenant"]["vtc"]["returning_share"])
                  for row in _extra_seeds(data)]
    low = min(returning, key=lambda r: r[1])
    high = max(returning, key=lambda r: r[1])
    ok = all(0.45 <= share <= 0.55 for _, share in returning)
    out.append({"goal": "returning tenant's share of the 600 steps after its return (VTC)",
                "measured": f"exp 2: {returning[0][1]:.1%}; over {len(returning)} runs "
                            f"{low[1]:.1%} ({low[0]}) to {high[1]:.1%} ({high[0]})",
                "threshold": "45 % to 55 %", "value": returning[0][1], "passed": ok})

    tenants = data["weights_and_lanes"]["weighted"]["tenants"]
    rel = max(abs(t["rel_error"]) for t in tenants)
    absolute = max(abs(t["abs_error"]) for t in tenants)
    out.append({"goal": "weighted shares (1:2:3:4) within 2 % of the weights (relative)",
                "measured": f"worst relative error {rel:.2%} "
                            f"(absolute {absolute * 100:.3f} percentage points)",
                "threshold": "<= 2 % relative", "value": rel, "passed": rel <= 0.02})

    pairs = _throughput_pairs(data)
    label, ratio = min(pairs, key=lambda p: p[1])
    out.append({"goal": "VTC throughput >= 99 % of FCFS (weighted service per step)",
                "measured": f"worst {ratio:.2%} ({label}; {len(pairs)} scenario runs)",
                "threshold": ">= 99 %", "value": ratio, "passed": ratio >= 0.99})

    lanes = {row["min_share"]: row for row in data["weights_and_lanes"]["lanes"]}
    strict, protected = lanes.get(0.0), lanes.get(0.2)
    if strict is not None:
        share = strict["shares"][strict["batch_tenant"]]
        out.append({"goal": "(extra) batch lane starves under strict priority (min_share 0)",
                    "measured": f"batch share {share:.2%}", "threshold": "< 5 %",
                    "value": share, "passed": share < 0.05})
    if protected is not None:
        share = protected["batch_share_while_backlogged"]
        out.append({"goal": "(extra) batch lane with min_share 0.2 gets ~20 % while backlogged",
                    "measured": f"batch share while backlogged {share:.2%}",
                    "threshold": ">= 19.5 %", "value": share, "passed": share >= 0.195})
    return out


# -- markdown -------------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = True) -> str:
    """A markdown table; with ``numeric``, every column but the first is right-aligned."""
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if i and numeric else "---" for i in range(len(headers)))
             + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _pct(value: float, digits: int = 1) -> str:
    return f"{value * 100:.{digits}f} %"


def _limit(limit: float | None) -> str:
    return "unlimited" if limit is None else f"{limit:g}"


def section_two_overloaded(data: dict[str, Any]) -> str:
    exp, seed = data["two_overloaded"], SEED000["two_overloaded"]
    rows = []
    for policy in POLICIES:
        run = exp["runs"][policy]
        rows.append([policy, _n(run["max_drift"]), _n(seed[policy]["max_drift"]),
                     f"{run['max_drift'] / run['vtc_bound']:.2f}",
                     f"{seed[policy]['drift_over_2u']:.2f}", _n(run["backlogged_drift"]),
                     f"{run['weighted_service_per_step']:.1f}", f"{seed[policy]['throughput']:.1f}",
                     f"{run['output_tokens_per_step']:.2f}"])
    text = [
        "## 1. Two overloaded tenants",
        f"Max drift max_t |W_a(0,t) − W_b(0,t)| of two tenants overloaded from step 0 (a burst of "
        f"20 requests each, then Poisson 0.09 and 0.06 requests/step; the engine serves ~0.097) "
        f"at M = 8192, {exp['steps']:,} steps; bound 2U = {_n(exp['vtc_bound'])}.",
        "",
        md_table(["policy", "max drift", "seed 000", "drift ÷ 2U", "seed 000",
                "backlogged drift", "weighted service/step", "seed 000 tok/step",
                "output tok/step"], rows),
    ]
    runs = exp["runs"]
    if runs["lcf"]["max_drift"] == runs["vtc"]["max_drift"]:
        text += ["", "LCF and VTC coincide: both tenants stay backlogged from step 0, so the lift "
                     "never fires (it matters only when a tenant re-enters; see table 2)."]
    return "\n".join(text)


def section_returning(data: dict[str, Any]) -> str:
    exp, seed = data["returning_tenant"], SEED000["returning_tenant"]
    start, end = exp["window"]
    rows = []
    for policy in POLICIES:
        run = exp["runs"][policy]
        rows.append([policy, _pct(run["returning_share"]),
                     _pct(seed[policy]["returning_share"]), _n(run["steady_service"]),
                     _n(seed[policy]["steady_service"]), _n(run["returning_service"]),
                     _n(run["backlogged_drift"]), f"{run['weighted_service_per_step']:.1f}"])
    return "\n".join([
        "## 2. Returning tenant",
        f"Tenant a sends under its share, goes silent at step 3000, returns overloaded at step "
        f"{start}; b is overloaded throughout. Service in steps [{start}, {end}).",
        "",
        md_table(["policy", "returning share", "seed 000", "steady tenant's service", "seed 000",
                "returning tenant's service", "backlogged drift (run)",
                "weighted service/step (run)"], rows),
    ])


def section_kv_sweep(data: dict[str, Any]) -> str:
    rows = []
    for row in data["kv_sweep"]["rows"]:
        budget, runs = row["kv_budget_tokens"], row["runs"]
        vtc, seed = runs["vtc"], SEED000["kv_sweep"].get(row["kv_budget_tokens"], {})
        rows.append([
            _n(budget), _n(row["vtc_bound"]), _n(vtc["max_drift"]),
            _n(seed.get("max_drift", float("nan"))), _n(vtc["backlogged_drift"]),
            f"{vtc['max_drift'] / row['vtc_bound']:.3f}",
            f"{vtc['max_drift'] / vtc['total_service']:.4f}",
            f"{seed.get('drift_over_total', float('nan')):.3f}",
            _n(runs["lcf"]["max_drift"]), _n(runs["fcfs"]["max_drift"]),
            f"{vtc['weighted_service_per_step']:.1f}",
            _pct(vtc["weighted_service_per_step"] / runs["fcfs"]["weighted_service_per_step"], 2),
        ])
    steps = data["kv_sweep"]["rows"][0]["steps"]
    return "\n".join([
        "## 3. KV budget sweep",
        f"Experiment 1 at KV budgets M = 2k…32k ({steps:,} steps each; arrival rates scaled "
        f"with M so both tenants stay overloaded). Bound = 2·max(w_p·L_input, w_q·M) = 4M here.",
        "",
        md_table(["M", "bound", "VTC max drift", "seed 000", "VTC backlogged drift",
                "drift ÷ bound", "drift ÷ total service", "seed 000", "LCF max drift",
                "FCFS max drift", "VTC weighted service/step", "VTC ÷ FCFS throughput"], rows),
        "",
        "Seed 000's drift ÷ total service implies a denominator of about 49·M (≈ 6,000 steps of "
        "service, not 20,000), so compare how the ratio moves with M, not its level.",
    ])


def section_rpm(data: dict[str, Any]) -> str:
    exp = data["rpm_sweep"]
    unlimited = next(r for r in exp["rows"] if r["rpm_limit"] is None)
    rows = []
    for run in exp["rows"]:
        seed = SEED000["rpm_sweep"].get(run["rpm_limit"], {})
        rows.append([_limit(run["rpm_limit"]), _n(run["max_drift"]),
                     _n(seed.get("max_drift", float("nan"))), _n(run["backlogged_drift"]),
                     f"{run['max_drift'] / run['vtc_bound']:.2f}",
                     f"{run['weighted_service_per_step']:.1f}",
                     f"{seed.get('throughput', float('nan')):.1f}",
                     f"{run['output_tokens_per_step']:.2f}",
                     _pct(run["weighted_service_per_step"]
                          / unlimited["weighted_service_per_step"]),
                     _pct(run["held_step_fraction"])])
    same = unlimited["max_drift"] == exp["fcfs"]["max_drift"]
    return "\n".join([
        "## 4. RPM limits",
        f"The rpm baseline (per-tenant requests per {exp['rpm_window_steps']:,}-step \"minute\", "
        f"FCFS among tenants under their limit) on experiment 1's scenario, {exp['steps']:,} "
        "steps.",
        "",
        md_table(["RPM limit", "max drift", "seed 000", "backlogged drift", "drift ÷ bound",
                "weighted service/step", "seed 000 tok/step", "output tok/step",
                "% of unlimited", "steps held by the limit"], rows),
        "",
        f"Unlimited rpm {'equals' if same else 'differs from'} FCFS "
        f"(FCFS max drift {_n(exp['fcfs']['max_drift'])}, "
        f"{exp['fcfs']['weighted_service_per_step']:.1f} service/step).",
    ])


def section_weights_and_lanes(data: dict[str, Any]) -> str:
    exp = data["weights_and_lanes"]
    weighted = exp["weighted"]
    rows = [[t["tenant"], f"{t['weight']:g}", _pct(t["target_share"], 1), _pct(t["share"], 3),
             f"{t['abs_error'] * 100:+.3f} pp", f"{t['rel_error'] * 100:+.2f} %"]
            for t in weighted["tenants"]]
    run = weighted["run"]
    lane_rows = []
    for lane in exp["lanes"]:
        batch = lane["batch_tenant"]
        others = [t for t in lane["shares"] if t != batch]
        lane_rows.append([f"{lane['min_share']:g}", _pct(sum(lane["shares"][t] for t in others)),
                          _pct(lane["shares"][batch]), _pct(lane["batch_share_while_backlogged"]),
                          _pct(lane["batch_backlogged_fraction"]),
                          f"{lane['weighted_service_per_step']:.1f}"])
    return "\n".join([
        "## 5. Weights and lanes",
        f"5a. Four backlogged tenants weighted 1:2:3:4 under VTC ({run['steps']:,} steps): each "
        f"one's share of weighted service. Worst normalized backlogged drift "
        f"{_n(run['backlogged_drift'])} (bound {_n(run['vtc_bound'])}).",
        "",
        md_table(["tenant", "weight", "target share", "measured share", "absolute error",
                "relative error"], rows),
        "",
        "5b. Two lanes, interactive above batch, one overloaded tenant each: batch's share with "
        "and without min_share.",
        "",
        md_table(["batch min_share", "interactive share", "batch share",
                "batch share while backlogged", "steps batch backlogged",
                "weighted service/step"], lane_rows),
    ])


def section_seeds(data: dict[str, Any]) -> str:
    rows_data = data["seeds"]["rows"]

    def spread(values: list[float], fmt: Callable[[float], str]) -> str:
        return (f"{fmt(min(values))} / {fmt(statistics.median(values))} / "
                f"{fmt(max(values))}")

    rows = []
    for policy in POLICIES:
        one = [row["two_overloaded"][policy] for row in rows_data]
        two = [row["returning_tenant"][policy] for row in rows_data]
        rows.append([policy, spread([r["max_drift"] for r in one], _n),
                     spread([r["backlogged_drift"] for r in one], _n),
                     spread([r["weighted_service_per_step"] for r in one], lambda v: f"{v:.1f}"),
                     spread([r["returning_share"] for r in two], _pct),
                     spread([r["steady_service"] for r in two], _n)])
    return "\n".join([
        "## 6. Across seeds",
        f"Experiments 1 and 2 rerun with seeds {rows_data[0]['seed']}…{rows_data[-1]['seed']} "
        "(min / median / max over seeds).",
        "",
        md_table(["policy", "exp 1 max drift", "exp 1 backlogged drift",
                "exp 1 weighted service/step", "exp 2 returning share",
                "exp 2 steady tenant's service"], rows),
    ])


def section_goals(data: dict[str, Any]) -> str:
    rows = [[g["goal"], g["measured"], g["threshold"], "PASS" if g["passed"] else "**FAIL**"]
            for g in data["goals"]]
    failed = sum(not g["passed"] for g in data["goals"])
    return "\n".join([
        "## Goals",
        f"The project's fairness goals, checked on the runs above: "
        f"{len(rows) - failed} of {len(rows)} pass.",
        "",
        md_table(["goal", "measured", "threshold", "result"], rows, numeric=False),
    ])


def render(data: dict[str, Any]) -> str:
    """All tables, as one markdown document."""
    meta = data["meta"]
    mode = ("quick (smoke run: fewer steps and seeds, not a measurement)" if meta["quick"]
            else "full")
    head = "\n".join([
        "# Fairness experiments: seed 000's tables on fairway's simulator",
        "",
        f"Mode {mode}; "
        f"python {meta['python']}; {meta['runtime_seconds']:.1f} s. Service is weighted "
        "(w_p = 1 per prompt token, w_q = 2 per output token); throughput is weighted service per "
        "decode step (seed 000's \"tok/step\"); drift is max_t |W_a(0,t)/w_a − W_b(0,t)/w_b| and "
        "backlogged drift the worst gap over intervals where both are backlogged. Seed 000's "
        "numbers are from the article.",
    ])
    sections = [head, section_two_overloaded(data), section_returning(data),
                section_kv_sweep(data), section_rpm(data), section_weights_and_lanes(data),
                section_seeds(data), section_goals(data)]
    return "\n\n".join(sections) + "\n"


# -- plots ----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    return plt, FuncFormatter(lambda v, _: f"{v / 1000:,.0f}k")


def _step_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v else "0"))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _sampled(result: SimResult, start: int, end: int | None, points: int) -> list[int]:
    end = result.steps if end is None else min(end, result.steps)
    return list(range(start, end, max(1, (end - start) // points)))


def _cumulative(ax: Any, result: SimResult, start: int = 0, end: int | None = None,
                points: int = 2000) -> None:
    xs = _sampled(result, start, end, points)
    for i, tenant in enumerate(result.tenants):
        ax.plot(xs, [result.service[s][i] for s in xs], label=f"tenant {tenant}")
    _step_axis(ax)


def _gap(ax: Any, result: SimResult, bound: float, points: int = 2000) -> None:
    xs = _sampled(result, 0, None, points)
    (w_a, w_b), (a, b) = result.weights[:2], result.tenants[:2]
    ax.plot(xs, [result.service[s][0] / w_a - result.service[s][1] / w_b for s in xs],
            color="black", label=f"W_{a} − W_{b}")
    for sign in (1, -1):
        ax.axhline(sign * bound, color="red", linestyle="--", linewidth=1,
                   label="± VTC bound" if sign > 0 else None)
    _step_axis(ax)


def plot_policies(results: Runs, title: str, path: Path, window: tuple[int, int] | None = None,
                  gap_bound: float | None = None) -> None:
    """One panel per policy of cumulative service per tenant, plus a second row: a zoom on
    ``window`` if given, else the service gap of the first two tenants against ``gap_bound``."""
    plt, thousands = _pyplot()
    rows = 2 if window or gap_bound else 1
    fig, axes = plt.subplots(rows, len(results), figsize=(5 * len(results), 3.8 * rows),
                             squeeze=False)
    for col, (policy, result) in enumerate(results.items()):
        ax = axes[0][col]
        _cumulative(ax, result)
        ax.set_title(policy.upper())
        if gap_bound and not window:
            gap = axes[1][col]
            _gap(gap, result, gap_bound)
            gap.set_title(f"{policy.upper()}: service gap")
            gap.yaxis.set_major_formatter(thousands)
        if window:
            ax.axvspan(*window, color="grey", alpha=0.25)
            zoom = axes[1][col]
            start, end = max(0, window[0] - 1000), window[1] + 1400
            _cumulative(zoom, result, start, end)
            zoom.axvspan(*window, color="grey", alpha=0.25, label="measured window")
            zoom.set_title(f"{policy.upper()}: steps {start:,}–{min(end, result.steps):,}")
            zoom.yaxis.set_major_formatter(thousands)
        ax.yaxis.set_major_formatter(thousands)
    for row in range(rows):
        axes[row][0].set_ylabel("service gap" if gap_bound and row else
                                "cumulative weighted service")
        axes[row][0].legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_weights_and_lanes(data: dict[str, Any], results: Runs, path: Path) -> None:
    """Weighted shares against their targets, and the two lane runs' cumulative service."""
    plt, thousands = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    tenants = data["weights_and_lanes"]["weighted"]["tenants"]
    xs = range(len(tenants))
    axes[0].bar([x - 0.2 for x in xs], [t["target_share"] for t in tenants], 0.4, label="target")
    axes[0].bar([x + 0.2 for x in xs], [t["share"] for t in tenants], 0.4, label="measured (VTC)")
    axes[0].set_xticks(list(xs), [f"{t['tenant']} (w={t['weight']:g})" for t in tenants])
    axes[0].set_ylabel("share of weighted service")
    axes[0].set_title("5a. weights 1:2:3:4")
    axes[0].legend(loc="upper left")
    axes[0].grid(alpha=0.3, axis="y")
    for ax, name in zip(axes[1:], ("lanes_strict", "lanes_min_share"), strict=True):
        lane = next(row for row in data["weights_and_lanes"]["lanes"]
                    if row["scenario"] == f"{name}.yaml")
        _cumulative(ax, results[name])
        ax.set_title(f"5b. batch min_share {lane['min_share']:g}: chat = interactive, "
                     "etl = batch", fontsize=10)
        ax.yaxis.set_major_formatter(thousands)
        ax.legend(loc="upper left")
    axes[1].set_ylabel("cumulative weighted service")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver ---------------------------------------------------------------------------------------


def run_all(quick: bool = False) -> tuple[dict[str, Any], dict[str, Runs]]:
    """Run every experiment; return the JSON-able numbers and the results the plots need."""
    plan = Plan(quick)
    started = time.perf_counter()
    data: dict[str, Any] = {}
    timings: dict[str, float] = {}
    kept: dict[str, Runs] = {}

    def timed(name: str, fn: Callable[[Plan], Any]) -> Any:
        t0 = time.perf_counter()
        value = fn(plan)
        timings[name] = time.perf_counter() - t0
        return value

    data["two_overloaded"], kept["two_overloaded"] = timed("two_overloaded", exp_two_overloaded)
    data["returning_tenant"], kept["returning_tenant"] = timed("returning_tenant", exp_returning)
    data["kv_sweep"] = timed("kv_sweep", exp_kv_sweep)
    data["rpm_sweep"] = timed("rpm_sweep", exp_rpm_sweep)
    data["weights_and_lanes"], kept["weights_and_lanes"] = timed("weights_and_lanes",
                                                                  exp_weights_and_lanes)
    data["seeds"] = timed("seeds", exp_seeds)
    data["goals"] = goals(data)
    data["meta"] = {"quick": quick, "python": sys.version.split()[0],
                    "runtime_seconds": time.perf_counter() - started,
                    "experiment_seconds": timings, "seed000": _jsonable_seed000()}
    return data, kept


def _jsonable_seed000() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, table in SEED000.items():
        out[name] = {("unlimited" if key is None else str(key)): value
                     for key, value in table.items()}
    return out


def write_outputs(data: dict[str, Any], kept: dict[str, Runs], out: Path) -> list[Path]:
    """Write experiments.md, experiments.json and the PNG plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "experiments.md", out / "experiments.json"]
    paths[0].write_text(render(data), encoding="utf-8")
    paths[1].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    plots = [
        (out / "exp1_two_overloaded.png",
         lambda p: plot_policies(kept["two_overloaded"],
                                 "Experiment 1: two overloaded tenants (a: 0.09/step, "
                                 "b: 0.06/step): cumulative service and its gap", p,
                                 gap_bound=data["two_overloaded"]["vtc_bound"])),
        (out / "exp2_returning_tenant.png",
         lambda p: plot_policies(kept["returning_tenant"],
                                 "Experiment 2: tenant a returns at step 5000 (grey: the 600 "
                                 "measured steps)", p,
                                 window=(RETURN_STEP, RETURN_STEP + RETURN_WINDOW))),
        (out / "exp5_weights_and_lanes.png",
         lambda p: plot_weights_and_lanes(data, kept["weights_and_lanes"], p)),
    ]
    for path, draw in plots:
        draw(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="output directory (default: bench/results)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and seeds: a smoke run, not a measurement")
    args = parser.parse_args(argv)
    data, kept = run_all(args.quick)
    paths = write_outputs(data, kept, args.out)
    print(render(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = [g["goal"] for g in data["goals"] if not g["passed"]]
    if failed:
        print(f"{len(failed)} goal(s) not met: " + "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
