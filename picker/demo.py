"""``make demo``: one noisy neighbour, three well-behaved tenants, with and without fairway.

Starts the local stack twice (real Envoy, the picker, two simulated vLLM servers on 127.0.0.1):
first with ``fcfs`` (pass-through: what a gateway without fairness does, so the engines' own FCFS
queues decide), then with ``vtc``. The same open-loop traffic runs against each; the demo prints a
side-by-side per-tenant table (share of service, TTFT p50/p95, requests served) and writes a PNG of
each tenant's service over time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from picker.sim.load import LoadResult, run_traffic
from picker.sim.traffic import load_traffic
from picker.stack.launcher import Stack

TRAFFIC = Path(__file__).resolve().parent.parent / "bench" / "traffic" / "demo.yaml"
SERVER_ARGS = ["--kv-budget-tokens", "4096", "--step-ms", "10"]
POLICIES = ("fcfs", "vtc")


def run_policy(policy: str, traffic_path: Path, duration: float, workdir: Path) -> LoadResult:
    traffic = load_traffic(traffic_path)
    tenants = [{"id": t.name} for t in traffic.tenants]
    with Stack(workdir / policy, policy=policy, endpoints=2, server_args=SERVER_ARGS,
               picker_config={"tenants": tenants, "queue": {"maxWait": "120s"}}) as stack:
        print(f"  {policy}: gateway {stack.gateway_url}, picker metrics {stack.metrics_url}",
              flush=True)
        return asyncio.run(run_traffic(traffic, stack.gateway_url, workdir / policy / "load",
                                       duration_s=duration))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def side_by_side(results: dict[str, LoadResult]) -> str:
    """The per-tenant table, one column group per policy."""
    tenants = list(next(iter(results.values())).summary["tenants"])
    head = f"{'tenant':<8}"
    rule = "-" * 8
    for policy in results:
        head += f" | {policy + ' share':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'served':>9}"
        rule += "-+-" + "-" * 40
    lines = [head + "   (TTFT in ms)", rule]
    for tenant in tenants:
        row = f"{tenant:<8}"
        for result in results.values():
            s = result.summary["tenants"][tenant]
            row += (f" | {s['service_share']:>10.1%} {_ms(s['ttft_s']['p50']):>9} "
                    f"{_ms(s['ttft_s']['p95']):>9} {s['ok']:>4}/{s['sent']:<4}")
        lines.append(row)
    return "\n".join(lines)


def plot(results: dict[str, LoadResult], path: Path) -> None:
    """Per policy: cumulative service per tenant (top) and each request's TTFT (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), sharey="row",
                             squeeze=False)
    for column, (policy, result) in enumerate(results.items()):
        served = sorted((r for r in result.records if r.ok), key=lambda r: r.end_s or 0.0)
        tenants = sorted({r.tenant for r in result.records})
        top, bottom = axes[0][column], axes[1][column]
        for tenant in tenants:
            mine = [r for r in served if r.tenant == tenant]
            times, totals, total = [0.0], [0.0], 0.0
            for record in mine:
                total += record.prompt_tokens + 2 * record.completion_tokens
                times.append(record.end_s or 0.0)
                totals.append(total)
            top.step(times, totals, where="post", label=tenant)
            bottom.scatter([r.start_s for r in mine], [r.ttft_s for r in mine], s=10,
                           label=tenant)
        top.set_title(f"{policy}: cumulative service per tenant")
        bottom.set_title(f"{policy}: time to first token of each request")
        bottom.set_xlabel("seconds since start")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("service (prompt + 2 × completion tokens)")
    axes[1][0].set_ylabel("TTFT (s, log scale)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.demo", description=__doc__)
    parser.add_argument("--traffic", type=Path, default=TRAFFIC)
    parser.add_argument("--duration", type=float, default=20.0,
                        help="seconds of traffic per policy (stragglers get the traffic's "
                             "timeout_s more, then count as not served)")
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"fairway demo: {args.traffic.name}, {args.duration:g} s per policy, "
          f"real Envoy + picker + 2 simulated vLLM servers on 127.0.0.1", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fairway-demo-") as tmp:
        for policy in POLICIES:
            results[policy] = run_policy(policy, args.traffic, args.duration, Path(tmp))
    print()
    print(side_by_side(results))
    png = args.out / "demo_service.png"
    plot(results, png)
    print(f"\nwrote {png}")
    print("fcfs passes every request straight to the engines, whose FCFS queues fill with the "
          "noisy neighbour's\nlong requests; vtc holds them in the picker and serves each tenant "
          "in turn.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
