"""What do the isolation settings buy together, and what do they cost, against issue 12's goals?

``python -m bench.isolation_together`` runs, in the pool simulator of ``bench.isolation`` (same
pools, shapes and step times, engines in vLLM's priority mode), three picker configurations on
every size, each on its traffic's own seed and on two more: the default; *together*, the
idle-tenant reserve, growth room and prefill pacing (``capacity.idleTenantReserve: 10s``,
``growthRoom: true``, ``maxPrefillTokens: 4096``); and *ready*, the same with
``readyReserve: true`` (the reserve kept where no prefill is under way). It writes
``isolation_together.md`` and ``.json``: the light tenant's p95 TTFT under the flood ÷ its p95
alone (goal ≤ 1.5) and the pool's tokens ÷ FCFS pass-through's (goal ≥ 0.97), with what each
costs against the default. ``--endpoints 4`` runs the pools with four engines each and the flood
twice as heavy (the light tenant unchanged): how the cost of a ready reserve falls as the pool
widens, since only one endpoint of the pool has to be kept ready. ``--response-path
access-log`` runs the picker as behind manifests/gateway/envoy-access-log.yaml, seeing each
request's output only when it has ended (``PoolSpec.output_seen_at_end``): what prefill pacing
and the ready reserve are worth when no first token tells the picker a prefill is over.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.isolation import (
    MODES,
    RATIO_GOAL,
    SIZES,
    TOKENS_GOAL,
    Size,
    light_alone,
    run_mode,
    traffic_seed,
)

DEFAULT = "vtc, priority engines"
"""``bench.isolation``'s mode every profile adds its capacity settings to."""
TOGETHER = {"idleTenantReserve": "10s", "growthRoom": True, "maxPrefillTokens": 4096}
PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "together": TOGETHER,
    "ready": {**TOGETHER, "readyReserve": True},
}
"""Capacity settings over the default, by name."""
SEEDS = (None, 13, 14)
"""None: the traffic's own seed (5 for the 1k hard case, 12 from 8k up)."""


def _met(numbers: dict[str, Any]) -> bool:
    return numbers["ttft_ratio"] <= RATIO_GOAL and numbers["tokens_vs_fcfs"] >= TOKENS_GOAL


def widened(size: Size, endpoints: int) -> Size:
    """The size with ``endpoints`` engines and the flood's rate scaled with them."""
    if endpoints == size.spec.endpoints:
        return size
    assert isinstance(size.traffic, dict), "only sizes with traffic written out widen"
    factor = endpoints / size.spec.endpoints
    traffic = {**size.traffic, "tenants": [
        {**t, "rate": t["rate"] * factor} if t["name"] == "flood" else t
        for t in size.traffic["tenants"]]}
    return replace(size, spec=replace(size.spec, endpoints=endpoints), traffic=traffic)


def measure_run(size: Size, seed: int | None) -> dict[str, Any]:
    """Every profile on one size and seed, against the light tenant alone and FCFS."""
    alone = light_alone(size, seed)
    fcfs_mode, _ = MODES["fcfs pass-through, priority engines"]
    fcfs = run_mode(size, fcfs_mode, "priority", seed=seed)
    run: dict[str, Any] = {"seed": seed if seed is not None else traffic_seed(size),
                           "alone_p95_ms": alone["light_ttft_p95_ms"],
                           "fcfs_tokens_per_s": fcfs["tokens_per_s"]}
    mode, engines = MODES[DEFAULT]
    for name, capacity in PROFILES.items():
        numbers = run_mode(size, mode, engines, seed=seed, capacity=capacity)
        numbers["ttft_ratio"] = numbers["light_ttft_p95_ms"] / alone["light_ttft_p95_ms"]
        numbers["tokens_vs_fcfs"] = numbers["tokens_per_s"] / fcfs["tokens_per_s"]
        run[name] = numbers
    return run


RESPONSE_PATHS = ("meter-stream", "access-log")
"""How the picker sees output: every token (the meter stream), or each request's once it ended."""


def measure(endpoints: int, only: list[str] | None, response_path: str = "meter-stream"
            ) -> dict[str, list[dict[str, Any]]]:
    data: dict[str, list[dict[str, Any]]] = {}
    for seed in SEEDS:
        for size in SIZES:
            if only and size.name.split()[0] not in only:
                continue
            if endpoints != size.spec.endpoints and not isinstance(size.traffic, dict):
                continue  # the 1k hard case's traffic is a file: its flood is a backlog
            size = widened(size, endpoints)
            if response_path == "access-log":
                size = replace(size, spec=replace(size.spec, output_seen_at_end=True))
            run = measure_run(size, seed)
            data.setdefault(size.name, []).append(run)
            print(f"{size.name}, seed {run['seed']}: " + "; ".join(
                f"{name} ×{run[name]['ttft_ratio']:.2f} tokens ×{run[name]['tokens_vs_fcfs']:.3f}"
                for name in PROFILES), flush=True)
    return data


def render(data: dict[str, list[dict[str, Any]]], endpoints: int,
           response_path: str = "meter-stream") -> str:
    seen = "" if response_path == "meter-stream" else ", output seen at each request's end"
    lines = [f"# Latency isolation: the isolation settings together (pool simulator, "
             f"{endpoints} endpoints{seen})", "",
             (__doc__ or "").split("\n\n")[1].replace("\n", " "),
             "", "| size | seed | p95 ÷ alone: default / together / ready | tokens ÷ FCFS: "
             "default / together / ready | tokens ÷ default: together / ready | preemptions "
             "/1k: default / together / ready | both goals: together / ready |",
             "|---|---:|---|---|---|---|---|"]
    for size, runs in data.items():
        for run in runs:
            d, t, r = (run[name] for name in PROFILES)
            lines.append(
                f"| {size} | {run['seed']} | {d['ttft_ratio']:.2f} / {t['ttft_ratio']:.2f} / "
                f"{r['ttft_ratio']:.2f} | {d['tokens_vs_fcfs']:.3f} / {t['tokens_vs_fcfs']:.3f} "
                f"/ {r['tokens_vs_fcfs']:.3f} | {t['tokens_per_s'] / d['tokens_per_s']:.3f} / "
                f"{r['tokens_per_s'] / d['tokens_per_s']:.3f} | "
                f"{d['preemptions_per_1000']:.0f} / {t['preemptions_per_1000']:.0f} / "
                f"{r['preemptions_per_1000']:.0f} | {_verdict(t)} / {_verdict(r)} |")
    runs = [run for size_runs in data.values() for run in size_runs]
    lines += [""] + [f"*{name}* meets both goals in {sum(_met(run[name]) for run in runs)} of "
                     f"{len(runs)} runs." for name in PROFILES]
    lines += ["", "All three but the default hold a flood's request whose prompt would fit now: "
              "they are opt-in, and the default stays strictly work-conserving."]
    return "\n".join(lines) + "\n"


def _verdict(numbers: dict[str, Any]) -> str:
    return "met" if _met(numbers) else "NOT met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--endpoints", type=int, default=2,
                        help="engines per pool (the flood's rate scales with them)")
    parser.add_argument("--only", action="append", help="run only this size (repeatable)")
    parser.add_argument("--response-path", choices=RESPONSE_PATHS, default="meter-stream",
                        help="how the picker sees output (access-log: once a request ended)")
    args = parser.parse_args(argv)
    data = measure(args.endpoints, args.only, args.response_path)
    name = "isolation_together" + ("" if args.endpoints == 2 else
                                   f"_{args.endpoints}_endpoints")
    if args.response_path != "meter-stream":
        name += "_" + args.response_path.replace("-", "_")
    report = render(data, args.endpoints, args.response_path)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    (args.out / f"{name}.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
