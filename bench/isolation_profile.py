"""What does each ``capacity.profile`` cost, and what does it buy a light tenant (issue 27 point 3)?

``python -m bench.isolation_profile`` runs, in the pool simulator of ``bench.isolation`` (its 8k
and 64k pools, shapes and step times, engines in vLLM's priority mode, the traffic's own seed),
on 2 endpoints and on 4 (the flood twice as heavy, as ``bench.isolation_together --endpoints 4``):
the light tenant alone, FCFS pass-through, and the picker under ``capacity.profile: throughput``
(the default) and ``isolation``. It writes ``isolation_profile.md`` and ``.json``: the light
tenant's p95 TTFT under the flood ÷ its p95 alone (goal ≤ 1.5) and the pool's tokens ÷ the
default's (issue 27's goals: ≥ 0.80 on 2 endpoints, ≥ 0.90 on 4) and ÷ FCFS pass-through's.
The 64k runs send 240 s of the size's 480 s of traffic (about 58 light requests), to keep the
run within a few minutes of CPU on a shared machine. ``--light-rate R`` sends the light tenant
R requests a second instead (how light a tenant must be for the profile to isolate it; at 8k
too with ``--sizes 8k,64k``). ``--sweep 1,1.5,2,3`` runs those light rates in one report,
``--isolation JSON`` adds capacity keys to the isolation profile's (e.g. the reserve's
``{"reserveQuantile": 0}``: the first reserve rule), ``--duration S`` shortens every size's
traffic, ``--skip-fcfs`` leaves out FCFS pass-through. The light tenant's p95 is judged over
the requests that arrived after the warm-up (``--warmup S``, 10 s: the steady state, once the
picker knows its rate) and reported over those before it (its start-up) and over all;
``--note TEXT`` ends the report with a paragraph.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.isolation import MODES, RATIO_GOAL, SIZES, WARMUP_S, light_alone, run_mode
from bench.isolation_together import widened

TOKENS_GOALS = {2: 0.80, 4: 0.90}
"""Issue 27: the isolation profile's tokens ÷ the default's, by endpoints."""
PROFILES = ("throughput", "isolation")
SHORT_64K_S = 240.0


def measure(name: str, endpoints: int, light_rate: float | None = None, *,
            duration: float | None = None, fcfs_baseline: bool = True,
            isolation: dict[str, Any] | None = None,
            compare: dict[str, Any] | None = None,
            warmup_s: float = WARMUP_S) -> dict[str, Any]:
    """One size on ``endpoints``: the baselines and both profiles (``isolation``: capacity keys
    written out over the isolation profile's; ``compare``: another set of them, run as a third
    variant, ``compared``). Tokens and the steady-state TTFT are counted from ``warmup_s``."""
    size = widened(next(s for s in SIZES if s.name == name), endpoints)
    assert isinstance(size.traffic, dict)
    traffic: dict[str, Any] = dict(size.traffic)
    if duration is not None:
        traffic["duration_s"] = duration
    elif name == "64k":
        traffic["duration_s"] = SHORT_64K_S
    if light_rate is not None:
        traffic["tenants"] = [{**t, "rate": light_rate} if t["name"] == "light" else t
                              for t in traffic["tenants"]]
    size = replace(size, traffic=traffic)
    alone = light_alone(size, warmup_s=warmup_s)
    mode, engines = MODES["vtc, priority engines"]
    row: dict[str, Any] = {"alone_p95_ms": alone["light_ttft_p95_ms"],
                           "alone_p95_steady_ms": alone["light_ttft_p95_steady_ms"],
                           "light_samples": alone["light_samples"],
                           "light_samples_steady": alone["light_samples_steady"],
                           "alone_kv_share": alone["light_kv_share"],
                           "warmup_s": warmup_s}
    fcfs = None
    if fcfs_baseline:
        fcfs = run_mode(size, MODES["fcfs pass-through, priority engines"][0], "priority",
                        warmup_s=warmup_s)
        row["fcfs_tokens_per_s"] = fcfs["tokens_per_s"]

    def variant(n: dict[str, Any]) -> dict[str, Any]:
        steady = alone["light_ttft_p95_steady_ms"]
        return {"p95_ms": n["light_ttft_p95_ms"], "tokens_per_s": n["tokens_per_s"],
                "p95_steady_ms": n["light_ttft_p95_steady_ms"],
                "p95_startup_ms": n["light_ttft_p95_startup_ms"],
                "ratio": n["light_ttft_p95_ms"] / alone["light_ttft_p95_ms"],
                "ratio_steady": n["light_ttft_p95_steady_ms"] / steady,
                "ratio_startup": None if n["light_ttft_p95_startup_ms"] is None
                else n["light_ttft_p95_startup_ms"] / steady,
                "preemptions_per_1000": n["preemptions_per_1000"],
                "kv_share": n["light_kv_share"]}

    for profile in PROFILES:
        extra = (isolation or {}) if profile == "isolation" else {}
        capacity = {"profile": profile, **extra}
        row[profile] = variant(run_mode(size, mode, engines, capacity=capacity,
                                        warmup_s=warmup_s))
        row[profile]["vs_fcfs"] = None if fcfs is None \
            else row[profile]["tokens_per_s"] / fcfs["tokens_per_s"]
    if compare is not None:
        row["compared"] = variant(run_mode(size, mode, engines, warmup_s=warmup_s,
                                           capacity={"profile": "isolation", **compare}))
    for judged in ("isolation", "compared"):
        if judged in row:
            row[judged]["vs_default"] = (row[judged]["tokens_per_s"]
                                         / row["throughput"]["tokens_per_s"])
    return row


def _fcfs(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _r(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def write_report(data: dict[str, Any], out: Path) -> None:
    runs = data["runs"]
    warmups = sorted({row.get("warmup_s", WARMUP_S) for row in runs.values()})
    warmup = " / ".join(f"{w:g}" for w in warmups)
    lines = ["# What each capacity profile costs (pool simulator)", "",
             "Generated by `python -m bench.isolation_profile"
             + (f" {data['args']}" if data.get("args") else "") + "`: `bench.isolation`'s 8k "
             "and 64k pools (priority engines, the traffic's own seed, one run each; 64k: 240 s "
             "of its 480 s unless `--duration`), on 2 endpoints and on 4 with the flood twice as "
             "heavy. Goals (issue 27): "
             f"light p95 ÷ alone ≤ {RATIO_GOAL}; the isolation profile's tokens ≥ 0.80 of the "
             "default's on 2 endpoints, ≥ 0.90 on 4."
             + (f" Isolation's keys written out: `{json.dumps(data['isolation'])}`."
                if data.get("isolation") else "")
             + (f" Compared: the isolation profile with `{json.dumps(data['compare'])}`."
                if data.get("compare") else ""), "",
             f"The light tenant starts at 5 s. Tokens, and the steady-state p95 (*steady*, what "
             f"the goals are judged on), count from a {warmup} s warm-up: the reserve learns a "
             "tenant's rate from its arrivals, so its first seconds are the start-up, reported "
             "apart: *all* is the p95 over every light request ÷ the same alone, *start-up* over "
             "those that "
             "arrived before the warm-up's end (few: its p95 is near their worst) ÷ the steady "
             "p95 alone. *KV share*: the share of the pool's KV the light tenant's "
             "requests held (prompt and half the output, dispatch to end) after the warm-up, "
             "alone / under the isolation profile; its fair share beside one flood is 0.50.",
             ""]
    compared = data.get("compare") is not None
    also = " / compared" if compared else ""
    lines += ["| pool | light req/s | light p95 alone ms (steady) | p95 ÷ alone, steady: "
              f"throughput / isolation{also} | all: throughput / isolation | start-up: "
              "throughput / isolation | light KV share: alone / isolation | tokens ÷ FCFS: "
              f"throughput / isolation | tokens ÷ throughput's: isolation{also} | goals "
              f"(isolation{also}) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in runs.items():
        t, i = row["throughput"], row["isolation"]
        endpoints = int(key.split("×")[1].split()[0])
        variants = [row[v] for v in ("isolation", "compared") if v in row]
        steady = [v.get("ratio_steady", v["ratio"]) for v in variants]
        verdicts = ["met" if r <= RATIO_GOAL and v["vs_default"] >= TOKENS_GOALS[endpoints]
                    else "NOT met" for r, v in zip(steady, variants, strict=True)]
        rate = row.get("light_rate")
        lines.append(f"| {key.split(' @')[0]} | {'default' if rate is None else f'{rate:g}'} | "
                     f"{row.get('alone_p95_steady_ms', row['alone_p95_ms']):.0f} | "
                     f"{_r(t.get('ratio_steady', t['ratio']))} / "
                     + " / ".join(_r(r) for r in steady)
                     + f" | {_r(t['ratio'])} / {_r(i['ratio'])}"
                     f" | {_r(t.get('ratio_startup'))} / {_r(i.get('ratio_startup'))}"
                     f" | {_r(row.get('alone_kv_share'))} / {_r(i.get('kv_share'))}"
                     f" | {_fcfs(t['vs_fcfs'])} / {_fcfs(i['vs_fcfs'])} | "
                     + " / ".join(f"{v['vs_default']:.3f}" for v in variants)
                     + f" | {' / '.join(verdicts)} |")
    if data.get("note"):
        lines += ["", data["note"]]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--light-rate", type=float, default=None)
    parser.add_argument("--sweep", default=None, metavar="RATES",
                        help="light rates, comma separated (instead of --light-rate)")
    parser.add_argument("--sizes", default=None, help="8k, 64k or 8k,64k (default: both; "
                        "64k only with --light-rate)")
    parser.add_argument("--endpoints", default="2,4")
    parser.add_argument("--duration", type=float, default=None, help="seconds of traffic")
    parser.add_argument("--skip-fcfs", action="store_true")
    parser.add_argument("--isolation", type=json.loads, default=None, metavar="JSON",
                        help="capacity keys written out over the isolation profile's")
    parser.add_argument("--compare", type=json.loads, default=None, metavar="JSON",
                        help="capacity keys over the isolation profile's for a third variant")
    parser.add_argument("--stem", default=None, help="the report's file name, no suffix")
    parser.add_argument("--warmup", type=float, default=WARMUP_S,
                        help="seconds before tokens and the steady-state TTFT count")
    parser.add_argument("--note", default=None, help="a paragraph for the report's end")
    args = parser.parse_args(argv)
    rates: list[float | None] = [float(r) for r in args.sweep.split(",")] if args.sweep \
        else [args.light_rate]
    sizes = args.sizes.split(",") if args.sizes else \
        (["8k", "64k"] if args.sweep is None and args.light_rate is None else ["64k"])
    runs: dict[str, Any] = {}
    for endpoints in (int(e) for e in args.endpoints.split(",")):
        for name in sizes:
            for rate in rates:
                key = f"{name} ×{endpoints}" + ("" if rate is None else f" @{rate:g}")
                runs[key] = {"light_rate": rate, **measure(
                    name, endpoints, rate, duration=args.duration,
                    fcfs_baseline=not args.skip_fcfs, isolation=args.isolation,
                    compare=args.compare, warmup_s=args.warmup)}
                print(f"{key}: {json.dumps(runs[key])}", flush=True)
    stem = args.stem or ("isolation_profile" if args.light_rate is None else
                         f"isolation_profile_light_{args.light_rate:g}")
    data = {"runs": runs, "isolation": args.isolation, "compare": args.compare,
            "note": args.note,
            "args": " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    write_report(data, args.out / f"{stem}.md")
    print(f"wrote {args.out / stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
