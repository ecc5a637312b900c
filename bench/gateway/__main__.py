"""The command line: ``python -m bench.gateway --out DIR [--quick] [--only 1,4] ...`` runs the
chosen goals on fresh stacks in a temporary directory, writes ``gateway.md``, ``gateway.json`` and
``gateway.png`` into ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import gateway
from bench.gateway.common import Plan, envoy_version, loadavg
from bench.gateway.drift import exp_drift
from bench.gateway.fairness import exp_fairness
from bench.gateway.light import exp_light
from bench.gateway.overhead import exp_overhead
from bench.gateway.report import goals, plot, render
from bench.gateway.throughput import throughput
from picker.stack.envoy import RESPONSE_PATHS


def _strip(value: Any) -> Any:
    """JSON-able copy: drop the load summaries' bulky parts, keep numbers."""
    if isinstance(value, dict):
        return {str(k): _strip(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value


def run_all(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    started = time.perf_counter()
    data: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    phases: dict[str, float] = {}
    load_start = loadavg()

    def phase(name: str) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def timer() -> Iterator[None]:
            t0 = time.perf_counter()
            print(f"[{name}] load average {loadavg()}", flush=True)
            try:
                yield
            finally:
                phases[name] = round(time.perf_counter() - t0, 1)
        return timer()

    if 4 in plan.goals:
        with phase("overhead"):
            data["overhead"] = exp_overhead(plan, workdir)
    if plan.goals & {1, 3}:
        with phase("fairness"):
            data["fairness"], kept["fairness"] = exp_fairness(plan, workdir)
    if plan.goals & {2, 3}:
        with phase("light"):
            data["light"], kept["light"] = exp_light(plan, workdir)
    if 3 in plan.goals:
        data["throughput"] = throughput(data.get("fairness"), data.get("light"))
    if 5 in plan.goals:
        with phase("drift"):
            data["drift"], kept["drift"] = exp_drift(plan, workdir)
    data["goals"] = [g for g in goals(data) if int(g["goal"][0]) in plan.goals]
    data["meta"] = {
        "quick": plan.quick, "goals": sorted(plan.goals), "python": sys.version.split()[0],
        "envoy_version": envoy_version(), "cpu_count": os.cpu_count(),
        "response_path": plan.response_path,
        "secure_serving": plan.secure_serving,
        "idle_tenant_reserve": plan.idle_tenant_reserve,
        "loadavg_start": load_start, "loadavg_end": loadavg(),
        "runtime_seconds": time.perf_counter() - started, "phase_seconds": phases,
        "note": "all processes share the machine's cores; see each run's cpu_s",
    }
    return _strip(data), kept


def write_outputs(data: dict[str, Any], kept: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "gateway.md", out / "gateway.json"]
    paths[0].write_text(render(data), encoding="utf-8")
    paths[1].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    png = out / "gateway.png"
    if plot(data, kept, png):
        paths.append(png)
    return paths


def _goal_set(text: str) -> frozenset[int]:
    try:
        got = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of 1..5, got {text!r}") from None
    if not got or not got <= {1, 2, 3, 4, 5}:
        raise argparse.ArgumentTypeError(f"a comma-separated list of 1..5, got {text!r}")
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway",
                                     description=(gateway.__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="output directory (default: bench/results)")
    parser.add_argument("--quick", action="store_true",
                        help="short runs: a smoke run, not a measurement")
    parser.add_argument("--only", type=_goal_set, default=frozenset({1, 2, 3, 4, 5}),
                        help="comma-separated goals to run (1..5; 3 needs the runs of 1 and 2)")
    parser.add_argument("--response-path", choices=RESPONSE_PATHS,
                        default="meter-stream",
                        help="how Envoy hands responses to the picker (default: meter-stream)")
    parser.add_argument("--idle-tenant-reserve", default="0s", metavar="DURATION",
                        help="the picker's capacity.idleTenantReserve in the pool runs "
                             "(default 0s: strictly work-conserving)")
    parser.add_argument("--plaintext", action="store_true",
                        help="the picker's ext_proc without TLS (default: TLS, as gateways dial "
                             "it), to measure what TLS costs")
    args = parser.parse_args(argv)
    plan = Plan(args.quick, args.only, args.response_path, args.idle_tenant_reserve,
                secure_serving=not args.plaintext)
    print(f"bench.gateway: {'quick' if plan.quick else 'full'} run of goals "
          f"{sorted(plan.goals)} on {os.cpu_count()} shared cores, load average {loadavg()}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="fairway-gateway-") as tmp:
        data, kept = run_all(plan, Path(tmp))
    paths = write_outputs(data, kept, args.out)
    print(render(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = [g["goal"] for g in data["goals"] if g["passed"] is False]
    if failed:
        print(f"{len(failed)} goal(s) not met: " + "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
