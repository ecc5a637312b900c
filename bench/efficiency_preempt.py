"""What ``scheduling.preempt`` costs the default, and how far the goal's ratio moves by itself,
in the pool simulator (issue 27; deterministic token counts, no stack, no lock needed).

Two tables, on the goal matrix's traffic (``bench.efficiency``: its shapes, seeds, loops and
window, 20 s of sending, tokens counted from 5 s):

* *preempt*: the default ÷ FCFS pass-through on priority engines with ``scheduling.preempt``
  on and off (every other setting the default's), the engines' recomputed prompt tokens in
  each, and the light tenant's p95 TTFT (from 5 s). The latencies are the ones the traced
  runs through Envoy measured for the default (about 8 ms from dispatch to the engine, up to
  about 60 ms before a completion is seen; ``--dispatch-latency-ms``, ``--completion-lag-ms``).
* *noise*: pass-through ÷ pass-through with the dispatch latency moved by 10 and 20 ms (the
  same policy, the same traffic: what a run's timing alone does to the ratio), and the default ÷
  pass-through at each latency; with ``--long`` also over 80 s counted from 20 s.

Run: ``python -m bench.efficiency_preempt --out bench/results`` (about 2 minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.efficiency import SHAPES, WARMUP_S, Cell, cell_spec, mode_config, shape_traffic
from bench.isolation import _numbers
from bench.isolation_envoy import _sim_config
from picker.sim.pool import PoolRun, simulate
from picker.stack.launcher import merge_sections

SEEDS = (27, 28, 29)
DURATION_S = 20.0
PREEMPT_OFF: dict[str, Any] = {"scheduling": {"preempt": False}}
PREEMPT_ON: dict[str, Any] = {"scheduling": {"preempt": True}}
LATENCIES_S = (0.0, 0.010, 0.020)
"""Dispatch latencies of the noise table (the simulator rounds them to whole 10 ms steps)."""


def run_pair(size: str, endpoints: int, seed: int, loop: str, extra: dict[str, Any] | None,
             dispatch_s: float, completion_s: float, duration_s: float = DURATION_S,
             warmup_s: float = WARMUP_S, modes: tuple[str, ...] = ("pass-through", "default"),
             ) -> dict[str, PoolRun]:
    """Each of ``modes`` on one cell of priority engines (``extra`` merged into the default's
    config)."""
    shape = next(s for s in SHAPES if s.name == size)
    cell = Cell(shape, loop, "priority", endpoints, seed)
    spec = replace(cell_spec(cell, 1.0), dispatch_latency_s=dispatch_s,
                   completion_lag_s=completion_s)
    traffic = shape_traffic(shape, 1.0, seed, loop, endpoints, duration_s)
    out = {}
    for mode in modes:
        config = mode_config(mode, spec, traffic, 1.0)
        if mode == "default" and extra:
            config = merge_sections(config, extra)
        out[mode] = simulate(_sim_config(traffic, config, spec), traffic, spec,
                             warmup_s=warmup_s, duration_s=duration_s, drain_s=0.0)
    return out


def preempt_table(dispatch_s: float, completion_s: float) -> list[dict[str, Any]]:
    rows = []
    for size in ("8k", "64k"):
        for loop in ("open", "closed"):
            for endpoints in (2, 4):
                for seed in SEEDS:
                    row: dict[str, Any] = {"size": size, "loop": loop, "endpoints": endpoints,
                                           "seed": seed}
                    for name, extra in (("on", PREEMPT_ON), ("off", PREEMPT_OFF)):
                        got = run_pair(size, endpoints, seed, loop, extra, dispatch_s,
                                       completion_s)
                        base, default = got["pass-through"], got["default"]
                        row[name] = {
                            "ratio": default.output_tokens_in_window
                            / base.output_tokens_in_window,
                            "recomputed": default.recomputed_tokens,
                            "recomputed_pass_through": base.recomputed_tokens,
                            "light_p95_ms": _numbers(default, 0.0)["light_ttft_p95_steady_ms"]}
                    rows.append(row)
                    print(f"{size} {loop} x{endpoints} s{seed}: on {row['on']['ratio']:.3f} "
                          f"off {row['off']['ratio']:.3f}", flush=True)
    return rows


def noise_table(duration_s: float, warmup_s: float) -> list[dict[str, Any]]:
    rows = []
    for endpoints in (2, 4):
        for seed in SEEDS:
            tokens: dict[str, dict[float, int]] = {"pass-through": {}, "default": {}}
            for latency in LATENCIES_S:
                got = run_pair("64k", endpoints, seed, "open", None, latency, 0.0,
                               duration_s, warmup_s)
                for mode, run in got.items():
                    tokens[mode][latency] = run.output_tokens_in_window
            base = tokens["pass-through"][0.0]
            rows.append({"endpoints": endpoints, "seed": seed, "duration_s": duration_s,
                         "pass_through_vs_itself": {
                             f"{1000 * k:g}": v / base for k, v in
                             tokens["pass-through"].items() if k},
                         "default_vs_pass_through": {
                             f"{1000 * k:g}": tokens["default"][k] / v for k, v in
                             tokens["pass-through"].items()}})
            print(f"noise {duration_s:g} s x{endpoints} s{seed}: {rows[-1]}", flush=True)
    return rows


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}"


def report(data: dict[str, Any]) -> list[str]:
    lines = ["# scheduling.preempt and the goal ratio's own noise, in the pool simulator "
             "(issue 27)", "", f"Generated by `python -m bench.efficiency_preempt "
             f"{data['command']}`. " + " ".join((__doc__ or "").split("\n\n")[1].split()), "",
             *(f"- {' '.join(item.split())}" for item in
               (__doc__ or "").split("\n\n")[2][2:].split("\n* ")), "",
             "## The default with preempt on (before) and off (now), priority engines", "",
             f"Latencies: {data['dispatch_ms']:g} ms dispatch to engine, "
             f"{data['completion_ms']:g} ms completion lag.", "",
             "| cell | seed | ÷ pass-through, on | off | recomputed k (whole run), on | off | "
             "pass-through | light p95 ms, on | off |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["preempt"]:
        on, off = r["on"], r["off"]
        lines.append(
            f"| {r['size']}, {r['loop']} loop, {r['endpoints']} endpoints | {r['seed']} | "
            f"{on['ratio']:.3f} | {off['ratio']:.3f} | {on['recomputed'] / 1000:.1f} | "
            f"{off['recomputed'] / 1000:.1f} | {on['recomputed_pass_through'] / 1000:.1f} | "
            f"{on['light_p95_ms'] or 0:.0f} | {off['light_p95_ms'] or 0:.0f} |")
    for size in ("8k", "64k"):
        for loop in ("open", "closed"):
            rows = [r for r in data["preempt"] if r["size"] == size and r["loop"] == loop]
            p95 = [r["off"]["light_p95_ms"] / r["on"]["light_p95_ms"] for r in rows
                   if r["on"]["light_p95_ms"] and r["off"]["light_p95_ms"]]
            lines.append(
                f"\n- {size}, {loop} loop: ratio on {_span([r['on']['ratio'] for r in rows])}, "
                f"off {_span([r['off']['ratio'] for r in rows])}; runs ≥ 0.98 on "
                f"{sum(r['on']['ratio'] >= 0.98 for r in rows)} of {len(rows)}, off "
                f"{sum(r['off']['ratio'] >= 0.98 for r in rows)}; light p95 off ÷ on "
                f"{_span(p95) if p95 else '–'} (median "
                f"{statistics.median(p95) if p95 else float('nan'):.2f})")
    for key, title in (("noise", "20 s of sending, counted from 5 s (the goal matrix's)"),
                       ("noise_long", "80 s of sending, counted from 20 s")):
        if not data.get(key):
            continue
        lines += ["", f"## The ratio's own noise: 64k, open loop, priority engines, {title}",
                  "", "| endpoints | seed | pass-through ÷ itself, dispatch +10 / +20 ms | "
                  "default ÷ pass-through at 0 / 10 / 20 ms |", "|---|---|---|---|"]
        for r in data[key]:
            lines.append(
                f"| {r['endpoints']} | {r['seed']} | "
                + " / ".join(f"{v:.3f}" for v in r["pass_through_vs_itself"].values()) + " | "
                + " / ".join(f"{v:.3f}" for v in r["default_vs_pass_through"].values()) + " |")
        aa = [v for r in data[key] for v in r["pass_through_vs_itself"].values()]
        ab = [v for r in data[key] for v in r["default_vs_pass_through"].values()]
        lines.append(f"\nPass-through against itself: {_span(aa)}; the default against "
                     f"pass-through: {_span(ab)} (mean {statistics.fmean(ab):.3f}).")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--dispatch-latency-ms", type=float, default=8.0)
    parser.add_argument("--completion-lag-ms", type=float, default=20.0)
    parser.add_argument("--long", action="store_true", help="the noise table over 80 s too")
    parser.add_argument("--report", metavar="JSON",
                        help="no runs: write the report again from this efficiency_preempt.json")
    args = parser.parse_args()
    if args.report:
        stored = json.loads(Path(args.report).read_text(encoding="utf-8"))
        Path(args.report).with_suffix(".md").write_text("\n".join(report(stored)) + "\n",
                                                         encoding="utf-8")
        return
    data: dict[str, Any] = {"command": " ".join(sys.argv[1:]),
                            "dispatch_ms": args.dispatch_latency_ms,
                            "completion_ms": args.completion_lag_ms}
    data["preempt"] = preempt_table(args.dispatch_latency_ms / 1000,
                                    args.completion_lag_ms / 1000)
    data["noise"] = noise_table(DURATION_S, WARMUP_S)
    if args.long:
        data["noise_long"] = noise_table(80.0, 20.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "efficiency_preempt.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    (out / "efficiency_preempt.md").write_text("\n".join(report(data)) + "\n", encoding="utf-8")
    print(f"wrote {out / 'efficiency_preempt.md'}")


if __name__ == "__main__":
    main()
