"""How many scheduling decisions per second the core makes with many backlogged tenants.

It answers: is ``picker.core.Scheduler`` under VTC fast enough to sit in a request path, i.e. does
it make >= 100,000 decisions/s with 1,000 backlogged tenants in one lane? A decision is
``scheduler.peek(now)`` followed by ``scheduler.dispatch(request, now)``, which charges the prompt.

Two loops are timed with ``time.perf_counter``:

* ``loop`` (the goal's measure): every decision also re-enqueues a new request for the dispatched
  tenant, so every tenant stays backlogged; and, as in production, the loop charges output tokens
  to two running requests per decision and finishes the oldest of 64 running requests, so
  counters keep moving and the heap keeps being re-keyed.
* ``bare``: peek + dispatch only, over queues filled beforehand deep enough that no tenant runs
  dry: the decision alone, without the work around it.

A third timing, ``admission``, is the per-request cost of the tenant policy the picker runs
before the fair queue (``picker.core.admission``): admit (caps, two token buckets, reservation),
start, the rate-limit headers and finish (settlement), for tenants that all have budgets and caps.

``python -m bench.core_throughput --out bench/results`` prints a table and writes
``core_throughput.md`` and ``core_throughput.json``; ``--profile`` adds a cProfile breakdown.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from picker.core import Request, Scheduler
from picker.core.admission import Admission, Admitted, BucketRule, TenantRules

GOAL_TENANTS = 1000
GOAL_DECISIONS_PER_SECOND = 100_000
RUNNING = 64
"""Requests kept running in the ``loop`` benchmark; the oldest finishes when a new one starts."""
OUTPUT_CHARGES = 2
"""Running requests charged a few output tokens per decision in the ``loop`` benchmark."""
OUTPUT_TOKENS = 4


def _sizes(count: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.randint(64, 512) for _ in range(count)],
            [rng.randint(32, 384) for _ in range(count)])


def _tenants(n: int) -> list[str]:
    return [f"tenant-{i:05d}" for i in range(n)]


def time_loop(tenants: int, decisions: int, seed: int = 0) -> float:
    """Seconds for ``decisions`` decisions of the production-like loop (see the module doc)."""
    scheduler = Scheduler(policy="vtc")
    prompts, outputs = _sizes(4096, seed)
    mask = len(prompts) - 1
    for i, name in enumerate(_tenants(tenants)):
        for j in range(2):
            k = (2 * i + j) & mask
            scheduler.enqueue(Request(tenant=name, prompt_tokens=prompts[k],
                                      max_output_tokens=outputs[k]), 0)
    running: list[Request | None] = [None] * RUNNING
    peek, dispatch, enqueue = scheduler.peek, scheduler.dispatch, scheduler.enqueue
    charge, finish = scheduler.charge_output, scheduler.finish
    now = 0.0
    start = time.perf_counter()
    for k in range(decisions):
        request = peek(now)
        dispatch(request, now)
        j = k & mask
        enqueue(Request(tenant=request.tenant, prompt_tokens=prompts[j],
                        max_output_tokens=outputs[j]), now)
        slot = k % RUNNING
        oldest = running[slot]
        if oldest is not None:
            finish(oldest)
        running[slot] = request
        for c in range(1, OUTPUT_CHARGES + 1):
            other = running[(slot + 17 * c) % RUNNING]
            if other is not None:
                charge(other, OUTPUT_TOKENS)
        now += 0.001
    elapsed = time.perf_counter() - start
    if scheduler.policy("default").backlogged() != tenants:  # type: ignore[attr-defined]
        raise AssertionError("a tenant ran dry: the benchmark no longer measures backlog")
    return elapsed


def time_bare(tenants: int, decisions: int, seed: int = 0) -> float:
    """Seconds for ``decisions`` bare peek + dispatch decisions over pre-filled queues."""
    scheduler = Scheduler(policy="vtc")
    prompts, outputs = _sizes(4096, seed)
    mask = len(prompts) - 1
    depth = decisions * 3 // (2 * tenants) + 16  # VTC spreads dispatches evenly; 1.5× is ample
    k = 0
    for _ in range(depth):
        for name in _tenants(tenants):
            scheduler.enqueue(Request(tenant=name, prompt_tokens=prompts[k & mask],
                                      max_output_tokens=outputs[k & mask]), 0)
            k += 1
    peek, dispatch = scheduler.peek, scheduler.dispatch
    start = time.perf_counter()
    for _ in range(decisions):
        dispatch(peek(0.0), 0.0)
    elapsed = time.perf_counter() - start
    if scheduler.policy("default").backlogged() != tenants:  # type: ignore[attr-defined]
        raise AssertionError("a tenant ran dry: pre-fill deeper")
    return elapsed


def time_admission(tenants: int, requests: int, seed: int = 0) -> float:
    """Seconds for ``requests`` requests through admission: admit, start, headers, finish."""
    rules = TenantRules(burst=BucketRule(10**9, 60), sustained=BucketRule(10**10, 86_400),
                        max_queued=10_000, max_concurrent=10_000, max_input_tokens=100_000,
                        max_output_tokens=100_000)
    names = _tenants(tenants)
    admission = Admission({name: rules for name in names}, rules)
    prompts, outputs = _sizes(4096, seed)
    started = time.perf_counter()
    for i in range(requests):
        now = i * 1e-4
        tenant = names[i % tenants]
        decision = admission.admit(tenant, "default", prompts[i % 4096], outputs[i % 4096],
                                   outputs[i % 4096], now)
        assert isinstance(decision, Admitted)
        admission.start(decision.reservation)
        admission.headers(tenant, now)
        admission.finish(decision.reservation, prompts[i % 4096] + outputs[i % 4096], now)
    return time.perf_counter() - started


BENCHMARKS: dict[str, Callable[[int, int, int], float]] = {
    "loop": time_loop, "bare": time_bare, "admission": time_admission}


def measure(kind: str, tenants: int, decisions: int, repeats: int) -> dict[str, Any]:
    """Decisions/s of benchmark ``kind`` over ``repeats`` runs: best, median and all."""
    rates = [decisions / BENCHMARKS[kind](tenants, decisions, seed) for seed in range(repeats)]
    return {"benchmark": kind, "tenants": tenants, "decisions": decisions, "repeats": repeats,
            "best": max(rates), "median": statistics.median(rates), "all": rates,
            "best_us_per_decision": 1e6 / max(rates)}


def profile(tenants: int, decisions: int, top: int = 15) -> list[dict[str, Any]]:
    """cProfile of one ``loop`` run: the functions with the most own time, and their share."""
    profiler = cProfile.Profile()
    profiler.enable()
    time_loop(tenants, decisions)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), entry in stats.stats.items():  # type: ignore[attr-defined]
        calls, own, cumulative = entry[1], entry[2], entry[3]
        where = filename
        if "picker" in filename:
            where = filename[filename.index("picker"):]
        elif "bench" in filename:
            where = filename[filename.index("bench"):]
        rows.append({"function": f"{where}:{line}({name})", "calls": calls, "own_seconds": own,
                     "own_share": own / total if total else 0.0,
                     "cumulative_seconds": cumulative})
    rows.sort(key=lambda r: r["own_seconds"], reverse=True)
    return rows[:top]


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _fmt_load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def render(data: dict[str, Any]) -> str:
    """The results as a markdown document."""
    rows = [[r["benchmark"], f"{r['tenants']:,}", f"{r['decisions']:,} × {r['repeats']}",
             f"{r['best']:,.0f}", f"{r['median']:,.0f}", f"{r['best_us_per_decision']:.2f}"]
            for r in data["results"]]
    goal = data["goal"]
    meta = data["machine"]
    load = meta["load_average_1min"]

    def verdict(passed: bool) -> str:
        return "PASS" if passed else "**FAIL**"
    parts = [
        "# Core throughput: VTC decisions per second",
        "",
        f"A decision is `Scheduler.peek` + `Scheduler.dispatch` with every tenant backlogged in "
        f"one lane under vtc. `loop` also re-enqueues a request per decision, charges "
        f"{OUTPUT_TOKENS} output tokens to {OUTPUT_CHARGES} running requests and finishes one of "
        f"{RUNNING} running (the goal's measure); `bare` is peek + dispatch alone over pre-filled "
        f"queues; `admission` counts requests through the tenant policy instead (admit with caps "
        f"and two token buckets, start, rate-limit headers, settle). "
        f"Python {meta['python']} ({meta['implementation']}), {meta['cpu_count']} CPUs, "
        f"{meta['platform']}.",
        "",
        _table(["benchmark", "tenants", "decisions × repeats", "best decisions/s",
                "median decisions/s", "µs/decision (best)"], rows),
        "",
        f"Goal: >= {goal['threshold']:,} decisions/s at {goal['tenants']:,} tenants (`loop`): "
        + (f"best {goal['best']:,.0f} — {verdict(goal['passed_best'])}; median "
           f"{goal['median']:,.0f} — {verdict(goal['passed_median'])}."
           if goal["measured"] else "not measured in this run."),
        "",
        f"Timings are wall-clock on a shared machine: the 1-minute load average was "
        f"{_fmt_load(load['before'])} before and {_fmt_load(load['after'])} after the run; "
        f"other processes slow the median more than the best.",
    ]
    if data.get("profile"):
        prof_rows = [[f"`{r['function']}`", f"{r['calls']:,}", f"{r['own_share']:.1%}"]
                     for r in data["profile"]]
        parts += ["", f"## Where the time goes ({GOAL_TENANTS:,} tenants, `loop`, cProfile)", "",
                  "Own time per function (cProfile inflates call overhead, so read shares, not "
                  "absolute times).", "", _table(["function", "calls", "own time"], prof_rows)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core_throughput",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--decisions", type=int, default=200_000,
                        help="decisions per timed run (default 200,000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--tenants", type=int, nargs="+", default=[10, 1_000, 10_000])
    parser.add_argument("--profile", action="store_true",
                        help="add a cProfile breakdown of the 1,000-tenant loop")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_before = _load()
    results = [measure(kind, tenants, args.decisions, args.repeats)
               for tenants in args.tenants for kind in ("loop", "bare", "admission")]
    load_after = _load()
    goal_row = next((r for r in results
                     if r["benchmark"] == "loop" and r["tenants"] == GOAL_TENANTS), None)
    best = goal_row["best"] if goal_row else 0.0
    median = goal_row["median"] if goal_row else 0.0
    data: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "implementation": platform.python_implementation(),
                    "platform": platform.platform(),
                    "load_average_1min": {"before": load_before, "after": load_after}},
        "definition": {"decision": "Scheduler.peek(now) + Scheduler.dispatch(request, now)",
                       "loop": f"+ enqueue of a replacement request, {OUTPUT_CHARGES} "
                               f"charge_output({OUTPUT_TOKENS}) calls, finish of the oldest of "
                               f"{RUNNING} running requests, per decision",
                       "bare": "peek + dispatch only, over queues pre-filled deep enough"},
        "results": results,
        "goal": {"tenants": GOAL_TENANTS, "threshold": GOAL_DECISIONS_PER_SECOND,
                 "benchmark": "loop", "measured": goal_row is not None,
                 "best": best, "median": median,
                 "passed_best": goal_row is not None and best >= GOAL_DECISIONS_PER_SECOND,
                 "passed_median": goal_row is not None and median >= GOAL_DECISIONS_PER_SECOND},
    }
    if args.profile or (goal_row is not None and not data["goal"]["passed_median"]):
        data["profile"] = profile(GOAL_TENANTS, min(args.decisions, 100_000))
    data["runtime_seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core_throughput.json").write_text(json.dumps(data, indent=2) + "\n",
                                                   encoding="utf-8")
    text = render(data)
    (args.out / "core_throughput.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"ran in {data['runtime_seconds']:.1f} s; wrote {args.out / 'core_throughput.md'}, "
          f"{args.out / 'core_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
