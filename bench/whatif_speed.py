"""How fast does a what-if replay run, and in how much memory? (issue 29's day-at-50-rps goal)

``python -m bench.whatif_speed [--rate 50] [--minutes 10] [--coarse 1 8 16]``: writes a synthetic
metering log (three tenants, Poisson at ``--rate`` requests/s together for ``--minutes``,
prompts 100-800 tokens, outputs 20-200, streamed, served by 2 endpoints) to a temporary file,
then for each ``--coarse`` K replays it in a child process: ``picker.whatif``'s scan of the log
(pool figures) and one replay under the log's own config, as ``python -m picker.whatif`` does
per config. Each child reports its CPU seconds (user + system), records replayed per CPU second
and its peak RSS (``ru_maxrss``). The log is streamed (``read_arrivals``), so the peak RSS must
not grow with ``--minutes``: run two lengths to see it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

CONFIG = {"capacity": {"kvBudgetTokens": 16384}, "queue": {"maxWait": "30s"},
          "tenants": [{"id": "a"}, {"id": "b", "weight": 2}, {"id": "c"}]}
START = 1_800_000_000.0


def write_log(path: Path, rate: float, minutes: float, seed: int = 1) -> int:
    """A log of served requests at ``rate``/s over ``minutes``, written as the picker would
    (finish order is approximated by arrival order: the replay reorders within its window)."""
    rng = random.Random(seed)
    at, end, count = START, START + minutes * 60, 0
    with path.open("w") as out:
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                return count
            prompt, completion = rng.randint(100, 800), rng.randint(20, 200)
            ttft = rng.uniform(20, 200)
            e2e = ttft + (completion - 1) * 10.0
            out.write(json.dumps({
                "request_id": str(count), "timestamp": at + e2e / 1000,
                "tenant_id": rng.choice("aabc"), "model": "m", "priority_lane": "default",
                "outcome": "ok", "finish_reason": "length",
                "endpoint": f"10.0.0.{rng.randint(1, 2)}:8000", "prompt_tokens": prompt,
                "completion_tokens": completion, "cached_prompt_tokens": 0, "estimated": False,
                "cost": 0.0, "demoted": False, "queue_ms": 1.0, "ttft_ms": ttft, "e2e_ms": e2e,
                "arrived_at": at, "max_tokens": completion, "stream": True,
                "lane_asked": None}) + "\n")
            count += 1


def child(log: Path, coarse: int) -> None:
    """One config's replay, as the CLI does it; prints its figures as JSON."""
    from picker.config.schema import PickerConfig
    from picker.config.strict import load
    from picker.whatif.__main__ import pool_spec, scan_figures
    from picker.whatif.log import Skips, read_arrivals
    from picker.whatif.replay import replay

    config = load(PickerConfig, CONFIG)
    cpu = time.process_time()
    figures = scan_figures(log)
    options = SimpleNamespace(endpoints=None, kv_budget_tokens=None, step_ms=None,
                              engine_policy="fcfs", prefill_ms_per_1k_tokens=0.0)
    spec, notes = pool_spec(options, figures, config)  # type: ignore[arg-type]
    scan_s = time.process_time() - cpu
    skips = Skips()
    result = replay(config, spec, read_arrivals(log, skips), start=START, coarse=coarse)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "coarse": coarse, "records": skips.used, "scan_cpu_s": scan_s,
        "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
        "pool": notes, "shares": {f"{t}/{lane}": round(result.share((t, lane)), 4)
                                  for t, lane in sorted(result.lanes)},
        "ttft_p95_s": {f"{t}/{lane}": s.ttft.quantile(0.95)
                       for (t, lane), s in sorted(result.lanes.items())},
        "unfinished": result.unfinished}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.whatif_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--coarse", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.coarse[0])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "metering.jsonl"
        records = write_log(log, args.rate, args.minutes)
        print(f"log: {records:,} records over {args.minutes:g} min at {args.rate:g}/s "
              f"({log.stat().st_size / 1e6:.1f} MB); load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for k in args.coarse:
            done = subprocess.run([sys.executable, "-m", "bench.whatif_speed", "--child",
                                   str(log), "--coarse", str(k)], check=True,
                                  capture_output=True, text=True)
            figures = json.loads(done.stdout)
            rate = figures["records"] / figures["cpu_s"]
            day = 86400 * args.rate / rate
            print(f"coarse {k:>2}: {figures['cpu_s']:6.1f} s CPU ({figures['scan_cpu_s']:.1f} s "
                  f"scan), {rate:,.0f} records/s, a day at {args.rate:g}/s ≈ {day / 60:,.0f} "
                  f"min; peak RSS {figures['peak_rss_mb']:.0f} MB; load "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
            print("   ", json.dumps({k: figures[k] for k in ("shares", "ttft_p95_s",
                                                           "unfinished")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
