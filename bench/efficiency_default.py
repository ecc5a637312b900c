"""Does the default gate keep the engines as full as FCFS pass-through, and what does a light
tenant pay for it? (issue 27, point 2)

Each row runs the issue's open-loop flood through fresh stacks (real Envoy, the picker, two
simulated vLLM servers, ``--step-ms 10``): a heavy tenant at 30 requests/s with ``ignore_eos``
and a light tenant at 3 requests/s, both streamed, 30 s, the shapes of ``bench.isolation``'s 8k and
64k sizes (their prefill cost: 0.05 ms a prompt token). A row is one engine policy (``fcfs`` or
``priority``) at one size, its variants one after another: the light tenant alone (its p95 TTFT
is the baseline), FCFS pass-through (``scheduling.policy: fcfs``, every request dispatched at
once: the tokens baseline), and the picker with ``capacity.engineQueue`` at each value asked (0:
a request leaves only when its prompt fits, the gate before the engine queue). Pool tokens are
the servers' own ``vllm:generation_tokens_total`` in the window (5 s to 30 s); the light tenant's
TTFTs are those of its requests sent in the window (a request without a first token counts at
its end).

Run: ``python -m bench.efficiency_default [--only 8k] [--engines fcfs] [--queue 0 --queue 2]``
(about a minute a variant; the whole table about 20 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.efficiency import engine_summary, read_trace
from bench.gateway.common import (
    GatewayRun,
    Sampler,
    drive,
    measured,
    picker_overrides,
    pool_numbers,
)
from bench.isolation import SIZES, light_ttfts
from bench.isolation_envoy import server_args
from picker.sim.load import LoadResult, percentile
from picker.sim.traffic import Traffic, load_traffic
from picker.stack.launcher import Stack, merge_sections

DURATION_S = 30.0
WARMUP_S = 5.0
TIMEOUT_S = DURATION_S + 5.0
"""Clients give up, and the picker drops a queued request, after this long (at any scale): no
request a pass-through engine takes inside the window has been given up by its client (an engine
would then compute requests nobody reads), and the run waits no longer for stragglers."""
HEAVY_RATE, LIGHT_RATE = 30.0, 3.0
QUEUES = (0, 2)
SCALE = 2.0
"""Time runs this many times slower than the issue's shape (steps and prefill that much longer,
rates divided by it), as in ``bench.isolation_envoy``: two shared cores carry Envoy, the picker,
both servers and the load client, and pass-through's engine queues of hundreds of streams would
otherwise slow every step of its servers. Ratios keep their meaning."""
GOAL = 0.98


def traffic(size_name: str, light_only: bool = False, seed: int = 27,
            scale: float = 1.0) -> Traffic:
    """The issue's flood at the size's shapes, ``scale`` times slower."""
    size = next(s for s in SIZES if s.name.split()[0] == size_name)
    assert isinstance(size.traffic, dict)
    shape = {k: v for k, v in size.traffic["tenants"][0].items()
             if k not in ("name", "rate", "start_s")}
    tenants = [{"name": "light", "rate": LIGHT_RATE / scale, **shape}]
    if not light_only:
        tenants.append({"name": "heavy", "rate": HEAVY_RATE / scale, **shape})
    return load_traffic({"duration_s": DURATION_S, "seed": seed, "timeout_s": TIMEOUT_S,
                         "tenants": tenants})


def variants(engines: str, queues: tuple[int, ...]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name: (scheduling policy, picker config over the run's)."""
    scheduling = {"enginePolicy": engines}
    out: dict[str, tuple[str, dict[str, Any]]] = {
        "light alone": ("vtc", {"scheduling": scheduling}),
        "fcfs pass-through": ("fcfs", {}),
    }
    for depth in queues:
        out[f"vtc, engineQueue {depth}"] = ("vtc", {"scheduling": scheduling,
                                                     "capacity": {"engineQueue": depth}})
    return out


async def _drive(stack: Stack, traffic: Traffic) -> tuple[LoadResult, Sampler, float]:
    """``traffic`` through ``stack``, its metrics sampled every 0.25 s: the records, the
    samples and the start on the monotonic clock the servers' traces use."""
    result, sampler = await drive(stack, traffic, 0.25)
    return result, sampler, sampler.t0


def run_variant(label: str, policy: str, traffic: Traffic, config: dict[str, Any],
                spec: Any, workdir: Path) -> dict[str, Any]:
    """One variant on a fresh stack whose servers write their step traces: the client's
    records, the pool's sampled numbers, and each engine's steps in the window
    (``bench.efficiency.engine_summary``: decode tokens per second of *modelled* step time,
    what the engine would have delivered had no step run late on the shared cores)."""
    where = workdir / label
    where.mkdir(parents=True, exist_ok=True)
    merged = merge_sections(picker_overrides(traffic, {}, "0s"), config)
    stack = Stack(where / "stack", policy=policy, endpoints=spec.endpoints,
                  server_args=[*server_args(spec), "--trace", str(where / "engine-{port}.jsonl")],
                  picker_config=merged)
    print(f"  {label}: {policy}, {traffic.duration_s:g} s of traffic", flush=True)
    resources: dict[str, Any] = {}
    with stack, measured(resources, lambda: [stack]):
        result, sampler, t0 = asyncio.run(_drive(stack, traffic))
    window = (WARMUP_S, traffic.duration_s)
    run = GatewayRun(label, policy, traffic.duration_s, window, result, sampler.samples,
                     resources, sampler.failures)
    engines = [engine_summary(read_trace(path).lines, t0 + window[0], t0 + window[1], spec)
               for path in sorted(where.glob("engine-*.jsonl"))]
    return {"run": run, "engines": engines}


def run_row(size_name: str, engines: str, queues: tuple[int, ...], workdir: Path,
            scale: float) -> dict[str, Any]:
    size = next(s for s in SIZES if s.name.split()[0] == size_name)
    spec = replace(size.spec, engine_policy=engines, step_s=size.spec.step_s * scale,
                   prefill_s_per_token=size.spec.prefill_s_per_token * scale)
    window = (WARMUP_S, DURATION_S)
    row: dict[str, Any] = {"size": size_name, "engines": engines, "scale": scale,
                           "spec": spec.__dict__,
                           "variants": {}}
    for name, (policy, extra) in variants(engines, queues).items():
        load_before = os.getloadavg()[0]
        config = {**extra, "capacity": {**extra.get("capacity", {}),
                                        "kvBudgetTokens": spec.kv_budget_tokens},
                  "queue": {"maxWait": f"{TIMEOUT_S:g}s"}}
        got = run_variant(f"{size_name}-{engines}-{name.replace(' ', '-').replace(',', '')}",
                          policy, traffic(size_name, light_only=name == "light alone",
                                          scale=scale), config, spec, workdir)
        run, steps = got["run"], got["engines"]
        t1, t2 = window
        light, bounds = light_ttfts(
            (r.ttft_s, None if r.end_s is None else r.end_s - r.start_s)
            for r in run.records if r.tenant == "light" and t1 <= r.start_s <= t2)
        pool = pool_numbers(run)
        unanswered: dict[str, int] = {}
        for record in run.records:
            if record.tenant == "light" and t1 <= record.start_s <= t2 and record.ttft_s is None:
                why = f"{record.status} {(record.error or '')[:60]}".strip()
                unanswered[why] = unanswered.get(why, 0) + 1
        numbers = {
            "tokens_per_s": pool["server_output_tokens_per_s"],
            "prompt_tokens_per_s": pool["server_prompt_tokens_per_s"],
            "mean_running": pool["mean_running"],
            "mean_engine_waiting": pool["mean_engine_waiting"],
            "mean_kv_usage": pool["mean_kv_usage"],
            "light_n": len(light), "light_bounds": bounds, "light_unanswered": unanswered,
            "light_p50_ms": _ms(percentile(light, 50)),
            "light_p95_ms": _ms(percentile(light, 95)),
            "preemptions": run.delta(run.server_series("vllm:num_preemptions_total")),
            "decode_per_model_s": sum(e.get("decode_per_model_s", 0.0) for e in steps),
            "trace_running": sum(e.get("running", 0.0) for e in steps),
            "trace_waiting": sum(e.get("waiting", 0.0) for e in steps),
            "trace_kv_use": statistics.fmean(e.get("kv_use", 0.0) for e in steps)
            if steps else None,
            "step_overrun_ms": statistics.fmean(e.get("step_overrun_ms", 0.0) for e in steps)
            if steps else None,
            "load_before": load_before, "load_after": os.getloadavg()[0],
            "cpu_busy_fraction": run.resources.get("cpu_busy_fraction"),
        }
        row["variants"][name] = numbers
        print(f"    {name}: {numbers['tokens_per_s']:.0f} tokens/s "
              f"({numbers['decode_per_model_s']:.0f} per modelled step time), light p95 "
              f"{numbers['light_p95_ms'] or 0:.0f} ms, running {numbers['mean_running'] or 0:.1f}"
              f", engine waiting {numbers['mean_engine_waiting'] or 0:.1f}, load "
              f"{load_before:.2f}", flush=True)
    fcfs = row["variants"]["fcfs pass-through"]["tokens_per_s"]
    fcfs_model = row["variants"]["fcfs pass-through"]["decode_per_model_s"]
    alone = row["variants"]["light alone"]["light_p95_ms"]
    for numbers in row["variants"].values():
        numbers["tokens_vs_fcfs"] = numbers["tokens_per_s"] / fcfs if fcfs else None
        numbers["model_vs_fcfs"] = numbers["decode_per_model_s"] / fcfs_model \
            if fcfs_model else None
        p95 = numbers["light_p95_ms"]
        numbers["p95_vs_alone"] = p95 / alone if p95 and alone else None
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _cell(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["# The default gate beside FCFS pass-through (issue 27, point 2)", "",
             "Generated by `python -m bench.efficiency_default`: " + __doc__.split("\n\n")[1]
             .replace("\n", " "), "",
             "| size, engines | variant | tokens/s | ÷ pass-through | per modelled step s | "
             "÷ pass-through | light p95 ms | p95 ÷ alone | running | engine waiting | KV use "
             "| step overrun ms | preemptions | light n | load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, n in row["variants"].items():
            lines.append(
                f"| {row['size']}, {row['engines']} | {name} | {n['tokens_per_s']:.0f} | "
                f"{_cell(n['tokens_vs_fcfs'], '.3f')} | {n['decode_per_model_s']:.0f} | "
                f"{_cell(n['model_vs_fcfs'], '.3f')} | {_cell(n['light_p95_ms'], '.0f')} | "
                f"{_cell(n['p95_vs_alone'])} | {_cell(n['trace_running'], '.1f')} | "
                f"{_cell(n['trace_waiting'], '.1f')} | {_cell(n['trace_kv_use'])} | "
                f"{_cell(n['step_overrun_ms'], '.1f')} | "
                f"{n['preemptions']:.0f} | {n['light_n']} | {n['load_before']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--report", default="efficiency_default")
    parser.add_argument("--only", action="append", choices=["8k", "64k"])
    parser.add_argument("--engines", action="append", choices=["fcfs", "priority"])
    parser.add_argument("--scale", type=float, default=SCALE)
    parser.add_argument("--queue", action="append", type=int,
                        help="capacity.engineQueue values to run (repeatable)")
    args = parser.parse_args()
    queues = tuple(args.queue) if args.queue else QUEUES
    rows = []
    with tempfile.TemporaryDirectory(prefix="fairway-efficiency-") as tmp:
        for size in args.only or ["8k", "64k"]:
            for engines in args.engines or ["fcfs", "priority"]:
                print(f"{size}, {engines} engines:", flush=True)
                rows.append(run_row(size, engines, queues, Path(tmp), args.scale))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.report}.json").write_text(json.dumps(rows, indent=1, default=str))
    (args.out / f"{args.report}.md").write_text(render(rows))
    print(f"wrote {args.out / args.report}.md")


if __name__ == "__main__":
    main()
