"""Latency isolation at realistic sizes through real Envoy, beside the pool simulator (issue 12).

It answers: *does the gateway give a light tenant under a flood what the simulator says, at the
pool sizes users run?* Each size of ``bench.isolation`` from 8k up runs through a fresh stack
(real Envoy, the picker, two simulated vLLM servers in priority mode with the size's KV, token
budget per step and prefill cost; ``--endpoints N`` for N of them, the flood N/2 times as
heavy, as ``bench.isolation_together --endpoints``) in its modes: the light tenant alone and
FCFS pass-through (the baselines), the picker with ``scheduling.enginePolicy: priority``,
and the same with ``bench.isolation_together``'s *ready* profile (the idle-tenant reserve kept
ready, growth room, prefill pacing), and ``capacity.profile: isolation`` (the switch that sets
them); then the same traffic goes through the pool simulator, which runs the picker's own gate
over a model of the same engines.

Two cores carry Envoy, the picker, both servers and the load client, so time runs ``SCALE``
times slower than in the simulator's own table (``bench/results/isolation.md``): each engine
step and each prefill token take ``SCALE`` times as long, and the tenants send ``SCALE`` times
fewer requests a second. The ratios the goals are about (p95 ÷ alone, tokens ÷ FCFS) keep their
meaning; milliseconds are ``SCALE`` times larger. The warm-up (``WARMUP_S``) and the light
tenant's start scale too; the light p95 the goals judge is over its requests after the
warm-up (the steady state), its first seconds reported apart (start-up).

Run: ``python -m bench.isolation_envoy --out bench/results`` (each mode runs the traffic's
duration and then its clients' timeout: about 4 minutes at 8k, 10 from 64k up; ``--only 64k``
for one size, ``--mode M`` for one picker mode besides the baselines, ``--report NAME`` for the
file it writes, ``--response-path access-log`` for Envoy's access-log response path, which the
simulator runs with ``PoolSpec.output_seen_at_end``). ``--light-rate R``, ``--duration S`` and
``--timeout S`` change the size's traffic before it is scaled, ``--step-ms`` its engines' step
(issue 27's 64k shape: ``--only 64k --light-rate 3``, whose steps are already 10 ms; a
shorter run: ``--duration 60 --timeout 20``). The goals table judges the isolation modes'
tokens against the default's (``vtc, priority engines``) too, when it ran: issue 27's ≥ 0.80 of
them on 2 endpoints, ≥ 0.90 on 4 or more.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.gateway.common import GatewayRun, Plan, picker_overrides, pool_numbers, run_gateway
from bench.isolation import (
    RATIO_GOAL,
    SIZES,
    TOKENS_GOAL,
    WARMUP_S,
    Size,
    _cell,
    _light_n,
    _ms,
    _numbers,
    light_split,
    size_heading,
)
from bench.isolation_together import PROFILES, RESPONSE_PATHS, widened
from picker.config.schema import CAPACITY_PROFILES, PickerConfig
from picker.config.strict import load, parse_duration
from picker.sim.load import percentile
from picker.sim.pool import PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic
from picker.stack.launcher import merge_sections

SCALE = 2.0
"""How many times slower than the simulator's table the stack runs (see the module docstring)."""

MODES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (scheduling policy, picker config over the run's)
    "light alone": ("vtc", {"scheduling": {"enginePolicy": "priority"}}),
    "fcfs pass-through": ("fcfs", {}),
    "vtc, priority engines": ("vtc", {"scheduling": {"enginePolicy": "priority"}}),
    "vtc + ready reserve, priority engines": ("vtc", {"scheduling": {"enginePolicy": "priority"},
                                                      "capacity": PROFILES["ready"]}),
    "isolation profile, priority engines": ("vtc", {"scheduling": {"enginePolicy": "priority"},
                                                    "capacity": {"profile": "isolation"}}),
    "isolation profile, one-request reserve": (
        "vtc", {"scheduling": {"enginePolicy": "priority"},
                "capacity": {"profile": "isolation", "reserveQuantile": 0}}),
}
BASELINES = ("light alone", "fcfs pass-through")
"""Every run has these: the ratios are against them."""
DEFAULT_MODE = "vtc, priority engines"
"""The default (``capacity.profile: throughput``) the isolation modes' tokens are judged by."""


def tokens_goal_vs_default(endpoints: int) -> float:
    """Issue 27: the isolation profile's tokens ÷ the default's, at least this."""
    return 0.80 if endpoints <= 2 else 0.90


def scaled_spec(spec: PoolSpec, scale: float, response_path: str = "meter-stream") -> PoolSpec:
    return replace(spec, engine_policy="priority", step_s=spec.step_s * scale,
                   prefill_s_per_token=spec.prefill_s_per_token * scale,
                   output_seen_at_end=response_path == "access-log")


def scaled_traffic(size: Size, scale: float, light_only: bool = False) -> Traffic:
    data = copy.deepcopy(size.traffic)
    assert isinstance(data, dict), "only sizes with traffic written out scale"
    for tenant in data["tenants"]:
        tenant["rate"] = tenant["rate"] / scale
        if "start_s" in tenant:  # the light tenant starts as many steps in
            tenant["start_s"] = tenant["start_s"] * scale
    data["timeout_s"] = data.get("timeout_s", 120.0) * scale  # clients wait as many steps
    if light_only:
        data["tenants"] = [t for t in data["tenants"] if t["name"] == "light"]
    return load_traffic(data)


def server_args(spec: PoolSpec) -> list[str]:
    """``python -m picker.sim.server`` flags for an engine of ``spec``."""
    return ["--kv-budget-tokens", str(spec.kv_budget_tokens),
            "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
            "--step-ms", f"{spec.step_s * 1000:g}",
            "--prefill-ms-per-1k-tokens", f"{spec.prefill_s_per_token * 1e6:g}",
            "--scheduling-policy", spec.engine_policy]


def _mode_config(policy: str, extra: dict[str, Any], spec: PoolSpec, traffic: Traffic,
                 scale: float) -> dict[str, Any]:
    capacity = dict(extra.get("capacity", {}))
    if "profile" in capacity and "idleTenantReserve" not in capacity:
        # The profile's reserve, written out so that it scales as an explicit one does.
        reserve = CAPACITY_PROFILES[capacity["profile"]]["idle_tenant_reserve"]
        capacity["idleTenantReserve"] = f"{reserve:g}s"
    if "idleTenantReserve" in capacity:  # a window in time: as slow as the tenants' rates
        window = parse_duration(capacity["idleTenantReserve"], "idleTenantReserve")
        capacity["idleTenantReserve"] = f"{window * scale:g}s"
    # The picker holds a request as long as its client waits for it.
    return {**extra, "scheduling": {"policy": policy, **extra.get("scheduling", {})},
            "capacity": {**capacity, "kvBudgetTokens": spec.kv_budget_tokens},
            "queue": {"maxWait": f"{traffic.timeout_s:g}s"}}


def _gateway_numbers(run: GatewayRun) -> dict[str, Any]:
    t1, t2 = run.window
    light, never, steady, startup = light_split(
        ((r.start_s, r.ttft_s, None if r.end_s is None else r.end_s - r.start_s)
         for r in run.records if r.tenant == "light"), t1)
    served = sum(1 for r in run.records if r.ok and t1 <= r.start_s <= t2)
    preemptions = run.delta(run.server_series("vllm:num_preemptions_total"))
    pool = pool_numbers(run)
    unanswered: dict[str, int] = {}
    for record in run.records:
        if record.tenant == "light" and record.ttft_s is None:
            why = f"{record.status} {(record.error or '')[:60]}".strip()
            unanswered[why] = unanswered.get(why, 0) + 1
    return {"light_samples": len(light), "light_without_first_token": never,
            "light_unanswered": unanswered,
            "light_ttft_p50_ms": _ms(percentile(light, 50)),
            "light_ttft_p95_ms": _ms(percentile(light, 95)),
            "warmup_s": t1,
            "light_samples_steady": len(steady),
            "light_ttft_p95_steady_ms": _ms(percentile(steady, 95)),
            "light_samples_startup": len(startup),
            "light_ttft_p95_startup_ms": _ms(percentile(startup, 95)),
            "tokens_per_s": pool["server_output_tokens_per_s"],
            "preemptions_per_1000": 1000 * preemptions / served if served else 0.0,
            "errors": sum(1 for r in run.records if not r.ok),
            "cpu_busy_fraction": run.resources.get("cpu_busy_fraction")}


def _ratios(results: dict[str, dict[str, Any]]) -> None:
    alone = results["light alone"]["light_ttft_p95_ms"]
    alone_steady = results["light alone"].get("light_ttft_p95_steady_ms")
    fcfs = results["fcfs pass-through"]["tokens_per_s"] if "fcfs pass-through" in results \
        else None
    for numbers in results.values():
        p95 = numbers["light_ttft_p95_ms"]
        numbers["ttft_ratio"] = p95 / alone if p95 and alone else None
        for part in ("steady", "startup"):  # both against the steady state alone
            p95 = numbers.get(f"light_ttft_p95_{part}_ms")
            numbers[f"ttft_ratio_{part}"] = p95 / alone_steady if p95 and alone_steady else None
        numbers["tokens_vs_fcfs"] = numbers["tokens_per_s"] / fcfs if fcfs else None
    default = results.get(DEFAULT_MODE)
    for mode, numbers in results.items():
        numbers["tokens_vs_default"] = numbers["tokens_per_s"] / default["tokens_per_s"] \
            if default and default["tokens_per_s"] and mode not in BASELINES else None


def run_size(size: Size, scale: float, workdir: Path, plan: Plan,
             modes: tuple[str, ...]) -> dict[str, Any]:
    """The modes through Envoy, and the same in the simulator."""
    spec = scaled_spec(size.spec, scale, plan.response_path)
    warmup = WARMUP_S * scale  # as many steps as the simulator's own table warms up
    gateway: dict[str, dict[str, Any]] = {}
    simulator: dict[str, dict[str, Any]] = {}
    for name in modes:
        policy, extra = MODES[name]
        traffic = scaled_traffic(size, scale, light_only=name == "light alone")
        window = (warmup, traffic.duration_s)
        config = _mode_config(policy, extra, spec, traffic, scale)
        run = run_gateway(f"{size.name.split()[0]}-{_slug(name)}",
                          policy, traffic, {}, window, workdir, plan,
                          server_args=server_args(spec), picker_config=config,
                          endpoints=spec.endpoints)
        gateway[name] = _gateway_numbers(run)
        started = time.process_time()
        sim = simulate(_sim_config(traffic, config, spec), traffic, spec, warmup_s=warmup,
                       drain_s=traffic.timeout_s)
        simulator[name] = _numbers(sim, time.process_time() - started, warmup)
        print(f"    {name}: gateway p95 {gateway[name]['light_ttft_p95_ms']} ms, "
              f"simulator p95 {simulator[name]['light_ttft_p95_ms']} ms", flush=True)
    _ratios(gateway)
    _ratios(simulator)
    return {"spec": spec.__dict__, "source": size.source, "gateway": gateway,
            "simulator": simulator}


def _slug(mode: str) -> str:
    return mode.split(",")[0].replace(" + ", "-").replace(" ", "-")


def _sim_config(traffic: Traffic, config: dict[str, Any], spec: PoolSpec) -> PickerConfig:
    """The picker config ``run_gateway`` gives the stack, for the simulator's endpoints."""
    merged = merge_sections(picker_overrides(traffic, {}, "0s"), config)
    merged["endpoints"] = [{"address": a} for a in spec.addresses()]
    merged["capacity"] = {**merged["capacity"],
                          "scrapeInterval": f"{spec.scrape_interval_s * 1000:g}ms"}
    return load(PickerConfig, merged)


def write_report(data: dict[str, Any], out: Path) -> None:
    scale = data["scale"]
    lines = ["# Latency isolation through real Envoy, beside the pool simulator", "",
             "Generated by `python -m bench.isolation_envoy`. Each size runs through a fresh "
             f"stack (real Envoy, the picker over TLS, {data.get('endpoints', 2)} simulated "
             "vLLM servers in priority mode) and through the pool simulator on the same "
             "traffic: a flood above capacity and a light tenant, as in `isolation.md`, with "
             f"time {scale:g}× slower (steps and prefill {scale:g}× longer, rates ÷ {scale:g}) "
             "so that "
             "two cores carry Envoy, the picker, the servers and the load client. Ratios keep "
             "their meaning; milliseconds are that much larger. Goals: light p95 ÷ alone ≤ "
             f"{RATIO_GOAL}, tokens ÷ FCFS ≥ {TOKENS_GOAL}.", "",
             f"Warm-up {WARMUP_S * scale:g} s ({WARMUP_S:g} s × {scale:g}, the light tenant "
             f"starting at {5 * scale:g} s): tokens count after it, and *steady* is the light "
             "p95 over the requests that arrived after it ÷ the same alone (what the goals "
             "are judged on: the picker learns a tenant's rate from its arrivals); *start-up* "
             "is the p95 of those that arrived before it ÷ the steady p95 alone, and the "
             "p95 ÷ alone column counts every request.", ""]
    changed = [f"{label} {data[key]:g}" for key, label in (
        ("light_rate", "light tenant's requests/s"), ("duration", "seconds of traffic"),
        ("timeout", "s clients' timeout"), ("step_ms", "ms engine step"))
        if data.get(key) is not None]
    if changed:
        lines += ["Traffic changed before scaling: " + ", ".join(changed) + ".", ""]
    if data.get("response_path", "meter-stream") != "meter-stream":
        lines += [f"Response path: `{data['response_path']}` (Envoy's access log; the "
                  "simulator sees each request's output only once it has ended).", ""]
    for name, size in data["sizes"].items():
        lines += [f"## {name}", "", size_heading(size["spec"], size["source"]), "",
                  "| mode | where | light p50 ms | light p95 ms | p95 ÷ alone | steady | "
                  "start-up | tokens/s | ÷ FCFS | ÷ default | preemptions /1k req | "
                  "light n (no first token) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        modes = list(size["gateway"])
        for mode in modes:
            for where in ("gateway", "simulator"):
                n = size[where][mode]
                lines.append(
                    f"| {mode} | {'through Envoy' if where == 'gateway' else 'simulator'} | "
                    f"{_cell(n['light_ttft_p50_ms'], '.0f')} | "
                    f"{_cell(n['light_ttft_p95_ms'], '.0f')} | {_cell(n['ttft_ratio'])} | "
                    f"{_cell(n.get('ttft_ratio_steady'))} | "
                    f"{_cell(n.get('ttft_ratio_startup'))} | "
                    f"{_cell(n['tokens_per_s'], '.0f')} | {_cell(n['tokens_vs_fcfs'], '.3f')} | "
                    f"{_cell(n.get('tokens_vs_default'), '.3f')} | "
                    f"{_cell(n['preemptions_per_1000'], '.1f')} | {_light_n(n)} |")
        for mode in modes:
            numbers = size["gateway"][mode]
            never = numbers.get("light_without_first_token", 0)
            if never:
                reasons = numbers.get("light_unanswered") or {}
                why = "; ".join(f"{n} × {r}" for r, n in reasons.items()) or "reasons not recorded"
                lines += ["", f"{mode}, through Envoy: {never} light requests got no first "
                          f"token ({why}); each counts at the time it ended, so a refusal "
                          "that came at once pulls the percentiles down."]
        busy = [size["gateway"][m].get("cpu_busy_fraction") for m in modes]
        busy_known = [b for b in busy if b is not None]
        if busy_known:
            lines += ["", f"The stack's processes kept {statistics.fmean(busy_known):.0%} of "
                      f"both cores busy on average over the {len(busy_known)} runs."]
        lines.append("")
    goal = tokens_goal_vs_default(data.get("endpoints", 2))
    lines += ["## Goals", "", "| size | mode, where | steady p95 ÷ alone ≤ 1.5 | "
              f"tokens ÷ FCFS ≥ 0.97 | tokens ÷ the default's ≥ {goal:.2f} (isolation) |",
              "|---|---|---|---|---|"]
    for name, size in data["sizes"].items():
        judged = [m for m in size["gateway"] if m not in BASELINES]
        for mode, where in ((m, w) for m in judged for w in ("gateway", "simulator")):
            n = size[where][mode]
            ratio, tokens = n.get("ttft_ratio_steady", n["ttft_ratio"]), n["tokens_vs_fcfs"]
            vs_default = n.get("tokens_vs_default") if mode != DEFAULT_MODE else None
            place = "through Envoy" if where == "gateway" else "simulator"
            lines.append(
                f"| {name} | {mode}, {place} | "
                f"{_cell(ratio)} {_verdict(ratio is not None and ratio <= RATIO_GOAL)} | "
                f"{_cell(tokens, '.3f')} "
                f"{'' if tokens is None else _verdict(tokens >= TOKENS_GOAL)} | "
                f"{_cell(vs_default, '.3f')} "
                f"{'' if vs_default is None else _verdict(vs_default >= goal)} |")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _changed(size: Size, light_rate: float | None, duration: float | None,
             timeout: float | None, step_ms: float | None = None) -> Size:
    """The size with its light tenant's rate, its traffic's duration or timeout, or its
    engines' step changed."""
    assert isinstance(size.traffic, dict)
    traffic = copy.deepcopy(size.traffic)
    if light_rate is not None:
        for tenant in traffic["tenants"]:
            if tenant["name"] == "light":
                tenant["rate"] = light_rate
    if duration is not None:
        traffic["duration_s"] = duration
    if timeout is not None:
        traffic["timeout_s"] = timeout
    spec = size.spec if step_ms is None else replace(size.spec, step_s=step_ms / 1000)
    return replace(size, traffic=traffic, spec=spec)


def chosen_sizes(only: list[str] | None, endpoints: int = 2, *, light_rate: float | None = None,
                 duration: float | None = None, timeout: float | None = None,
                 step_ms: float | None = None) -> list[Size]:
    """The sizes to run (``only``: these names; default every size with its traffic written
    out), changed as asked (``_changed``) and on ``endpoints`` engines, the flood scaled with
    them (``bench.isolation_together.widened``)."""
    return [widened(_changed(s, light_rate, duration, timeout, step_ms), endpoints)
            for s in SIZES if isinstance(s.traffic, dict)
            and (not only or s.name.split()[0] in only)]


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--only", action="append", help="run only this size (repeatable)")
    parser.add_argument("--scale", type=float, default=SCALE)
    parser.add_argument("--mode", action="append", choices=[m for m in MODES
                                                            if m not in BASELINES],
                        help="run only this picker mode besides the baselines (repeatable)")
    parser.add_argument("--skip-fcfs", action="store_true",
                        help="leave FCFS pass-through out (ten minutes from 64k up; its tokens "
                             "only give the ÷ FCFS column)")
    parser.add_argument("--report", default="isolation_envoy",
                        help="the report's file name, without .md or .json")
    parser.add_argument("--response-path", choices=RESPONSE_PATHS,
                        default="meter-stream", help="how Envoy hands responses to the picker")
    parser.add_argument("--light-rate", type=float, default=None,
                        help="the light tenant's requests a second (before scaling)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of traffic (before scaling)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="the clients' timeout and the picker's maxWait (before scaling)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the engines' step, before scaling (default the size's)")
    parser.add_argument("--endpoints", type=int, default=2,
                        help="simulated vLLM servers (default 2); the flood scales with them")
    args = parser.parse_args(argv)
    if args.endpoints < 1:
        parser.error("--endpoints must be at least 1")
    baselines = ("light alone",) if args.skip_fcfs else BASELINES
    modes = baselines + tuple(args.mode or (m for m in MODES if m not in BASELINES))
    sizes = chosen_sizes(args.only, args.endpoints, light_rate=args.light_rate,
                         duration=args.duration, timeout=args.timeout, step_ms=args.step_ms)
    plan = Plan(quick=False, goals=frozenset(), response_path=args.response_path)
    data: dict[str, Any] = {"scale": args.scale, "response_path": args.response_path,
                            "light_rate": args.light_rate, "duration": args.duration,
                            "timeout": args.timeout, "step_ms": args.step_ms,
                            "endpoints": args.endpoints, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="fairway-isolation-") as tmp:
        for size in sizes:
            print(f"{size.name}:", flush=True)
            data["sizes"][size.name] = run_size(size, args.scale, Path(tmp), plan, modes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.report}.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    write_report(data, out / f"{args.report}.md")
    print(f"wrote {out / args.report}.md")


if __name__ == "__main__":
    main()
