"""How fast does a what-if replay run, and in how much memory? (issue 29's day-at-50-rps goal)

``python -m bench.whatif_speed [--rate 50] [--minutes 10] [--modes exact coarse:8 fast]
[--log PATH] [--out DIR]``: writes a synthetic metering log (three tenants, Poisson at ``--rate``
requests/s together for ``--minutes``, prompts 100-800 tokens, outputs 20-200, streamed, served
by 2 endpoints; to ``--log`` if given and kept there, else a temporary file; an existing
``--log`` is reused), then for each mode replays it in a child process: ``picker.whatif``'s scan
of the log (pool figures) and one replay under the log's own config, as ``python -m
picker.whatif`` does per config. A mode is ``exact``, ``coarse:K`` (``--coarse K``) or ``fast``
(``--fast``). Each child reports its CPU seconds for the scan and the replay (its start and
imports left out; the scan is the one pass that decodes the log, scans it and spools its
arrivals), records per CPU second, its peak RSS (``ru_maxrss``) and the replay's shares
and TTFT p95, which are compared with the exact mode's when it ran. The log is streamed
(``read_log``), so the peak RSS must not grow with ``--minutes``: run two lengths to see
it. ``--out`` writes the figures to ``whatif_speed.json`` there.
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any

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


def child(log: Path, mode: str) -> None:
    """One config's replay, as the CLI does it; prints its figures as JSON."""
    from picker.config.schema import PickerConfig
    from picker.config.strict import load
    from picker.whatif.__main__ import pool_spec, read_log
    from picker.whatif.coarse import step_scale
    from picker.whatif.fast import replay_fast
    from picker.whatif.log import Skips, quiet_gc
    from picker.whatif.replay import replay

    config = load(PickerConfig, CONFIG)
    cpu = time.process_time()  # the interpreter's start and the imports are left out
    with quiet_gc() if mode == "fast" else contextlib.nullcontext():  # as the CLI does
        # As the CLI: one pass decodes the log, scans it for the pool's figures and spools its
        # arrivals; the config gives the KV budget, so the scan does not estimate it.
        skips = Skips()
        figures, spool = read_log(log, skips, estimate_kv=not isinstance(
            config.capacity.kv_budget_tokens, int))
        options = SimpleNamespace(endpoints=None, kv_budget_tokens=None, step_ms=None,
                                  engine_policy="fcfs", prefill_ms_per_1k_tokens=0.0)
        spec, notes = pool_spec(options, figures, config)  # type: ignore[arg-type]
        scan_s = time.process_time() - cpu
        with spool:
            if mode == "fast":
                result = replay_fast(config, spec, spool, start=START)
            else:
                k = int(mode.split(":")[1]) if mode.startswith("coarse:") else 1
                result = replay(config, spec, iter(spool), start=START, coarse=k,
                                coarse_scale=step_scale(figures.outputs, k))
    cpu_s = time.process_time() - cpu
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "mode": mode, "records": skips.used, "scan_cpu_s": scan_s,
        "cpu_s": cpu_s, "start_cpu_s": usage.ru_utime + usage.ru_stime - cpu_s,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "pool": notes, "shares": {f"{t}/{lane}": round(result.share((t, lane)), 4)
                                  for t, lane in sorted(result.lanes)},
        "ttft_p95_s": {f"{t}/{lane}": s.ttft.quantile(0.95)
                       for (t, lane), s in sorted(result.lanes.items())},
        "ok": {f"{t}/{lane}": s.ok for (t, lane), s in sorted(result.lanes.items())},
        "unfinished": result.unfinished}))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.whatif_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--modes", nargs="+", default=["exact", "coarse:8", "fast"])
    parser.add_argument("--log", type=Path, help="the synthetic log's path (kept; reused)")
    parser.add_argument("--out", type=Path, help="write whatif_speed.json here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for mode in args.modes:
        if mode not in ("exact", "fast") and not (
                mode.startswith("coarse:") and mode[7:].isdigit() and int(mode[7:]) >= 1):
            parser.error(f"a mode is exact, coarse:K or fast, not {mode!r}")
    if args.child is not None:
        child(args.child, args.modes[0])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "metering.jsonl"
        if args.log is not None and log.is_file():
            with log.open("rb") as lines:
                records = sum(1 for _ in lines)
        else:
            records = write_log(log, args.rate, args.minutes)
        head = {"records": records, "log_mb": log.stat().st_size / 1e6, "rate": args.rate,
                "minutes": args.minutes, "load_average_start": _load(), "runs": []}
        print(f"log: {records:,} records over {args.minutes:g} min at {args.rate:g}/s "
              f"({head['log_mb']:.1f} MB); load average {head['load_average_start']}",
              flush=True)
        day = 86400 * args.rate
        exact: dict[str, Any] | None = None
        for mode in args.modes:
            done = subprocess.run([sys.executable, "-m", "bench.whatif_speed", "--child",
                                   str(log), "--modes", mode], check=True,
                                  capture_output=True, text=True)
            figures = json.loads(done.stdout)
            figures["load_average_end"] = _load()
            rate = figures["records"] / figures["cpu_s"]
            replay_cpu = figures["cpu_s"] - figures["scan_cpu_s"]
            figures["records_per_s"] = rate
            figures["replay_records_per_s"] = figures["records"] / replay_cpu
            figures["day_minutes"] = day / rate / 60
            print(f"{mode:>9}: {figures['cpu_s']:7.1f} s CPU ({figures['scan_cpu_s']:.1f} s "
                  f"scan), {rate:,.0f} records/s ({figures['replay_records_per_s']:,.0f} the "
                  f"replay alone), a day at {args.rate:g}/s ≈ {figures['day_minutes']:,.1f} "
                  f"min; peak RSS {figures['peak_rss_mb']:.0f} MB; load "
                  f"{figures['load_average_end']}", flush=True)
            if mode == "exact":
                exact = figures
            print("   ", json.dumps({k: figures[k] for k in (
                "shares", "ttft_p95_s", "ok", "unfinished") if k in figures}), flush=True)
            head["runs"].append(figures)
        for figures in head["runs"]:
            if exact is not None and figures is not exact:  # whichever order the modes ran
                figures["against_exact"] = {
                    key: {"share_points": 100 * (figures["shares"][key] - exact["shares"][key]),
                          "ttft_p95": figures["ttft_p95_s"][key] / exact["ttft_p95_s"][key] - 1}
                    for key in exact["shares"] if key in figures["shares"]}
                print(f"{figures['mode']} against exact:", json.dumps(figures["against_exact"]),
                      flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "whatif_speed.json").write_text(json.dumps(head, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
