"""Programs and sessions (issue 28 point 5), in the pool simulator: does a tenant whose agents
make 30 calls per task get more than its share for making more calls, and what do sessions
(``routing.sessions``) do to each tenant's task completion time?

It runs ``bench/traffic/prefix_agent_sessions.yaml`` (agent programs of 1, 10 and 30 calls per
task, equal weights, tasks arriving open loop for 60 s so that every tenant is backlogged) on
``bench.prefix``'s pool under vtc with prefix affinity, the prompt charged as computed
(``cost.chargeCachedPrompt: false``), three ways: sessions off; ``routing.sessions`` on with
only stickiness (``resumeFirst: false``); and sessions on (sticky, programs in progress first).
Per tenant: its share of the computed-token cost ``(prompt - cached) + 2 × output`` of the
requests dispatched in the backlogged window (10 s to 60 s, the fair queue's charge), beside
the sent-token share; the fraction of that window it had a request waiting in the picker
(backlogged: the fair queue, not its own pace, limits it); its tasks completed of those started
and their completion time p50/p95 (first call sent to last reply); TTFT p50/p95.

Run: ``python -m bench.prefix_sessions --out bench/results`` (writes the "programs and
sessions" section of ``prefix.md`` between its markers, replacing it, and
``prefix_sessions.json``; about 30 s of CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.prefix import DRAIN_S, ROOT, SPEC, WARMUP_S, _config, _f, numbers
from picker.sim.pool import PoolRecord, simulate
from picker.sim.traffic import load_traffic

TRAFFIC = "bench/traffic/prefix_agent_sessions.yaml"
WINDOW = (WARMUP_S, 60.0)
"""Seconds in which every tenant sends new tasks: the backlogged window."""
BASE: dict[str, Any] = {"routing": {"prefixAffinity": {}}, "cost": {"chargeCachedPrompt": False}}
MODES: dict[str, dict[str, Any]] = {
    "sessions off": BASE,
    "sticky only": {**BASE, "routing": {"prefixAffinity": {},
                                        "sessions": {"resumeFirst": False}}},
    "sessions on": {**BASE, "routing": {"prefixAffinity": {}, "sessions": {}}},
}


def backlogged_fraction(records: list[PoolRecord], window: tuple[float, float]) -> float:
    """The fraction of ``window`` in which one of ``records`` had arrived and not yet left the
    picker's queue (dispatched, or ended undispatched)."""
    low, high = window
    spans = sorted((max(low, r.arrival_s), min(high, left))
                   for r in records
                   if (left := r.dispatched_s if r.dispatched_s is not None else
                       (r.end_s if r.end_s is not None else high)) > r.arrival_s)
    covered, reach = 0.0, low
    for start, end in spans:
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / (high - low)


def window_shares(records: list[PoolRecord]) -> tuple[dict[str, float], dict[str, float]]:
    """Per tenant, its share of the computed- and of the sent-token cost of the requests
    answered that were dispatched in ``WINDOW``."""
    computed: dict[str, float] = {}
    sent: dict[str, float] = {}
    for r in records:
        if r.outcome != "ok" or r.dispatched_s is None or not WINDOW[0] <= r.dispatched_s \
                < WINDOW[1]:
            continue
        computed[r.tenant] = computed.get(r.tenant, 0.0) + (r.prompt_tokens - r.cached_tokens) \
            + 2 * r.completion_tokens
        sent[r.tenant] = sent.get(r.tenant, 0.0) + r.prompt_tokens + 2 * r.completion_tokens
    total_c, total_s = sum(computed.values()) or 1.0, sum(sent.values()) or 1.0
    return ({t: v / total_c for t, v in computed.items()},
            {t: v / total_s for t, v in sent.items()})


def measure() -> dict[str, Any]:
    traffic = load_traffic(ROOT / TRAFFIC)
    out: dict[str, Any] = {"traffic": TRAFFIC, "window_s": list(WINDOW), "modes": {}}
    for name, mode in MODES.items():
        started = time.process_time()
        run = simulate(_config(mode), traffic, SPEC, warmup_s=WARMUP_S, drain_s=DRAIN_S)
        result = numbers(run, traffic, time.process_time() - started)
        computed, sent = window_shares(run.records)
        for tenant, data in result["tenants"].items():
            mine = [r for r in run.records if r.tenant == tenant]
            data["window_computed_share"] = computed.get(tenant, 0.0)
            data["window_sent_share"] = sent.get(tenant, 0.0)
            data["backlogged"] = backlogged_fraction(mine, WINDOW)
        out["modes"][name] = result
        print(f"{name}: {result['sim_cpu_s']} s of CPU", file=sys.stderr)
    return out


def render(results: dict[str, Any], load: str) -> str:
    low, high = results["window_s"]
    lines = [
        "## programs and sessions",
        "",
        f"`python -m bench.prefix_sessions --out bench/results` (`bench/prefix_sessions.py`), "
        f"one run of the three modes, load average {load} on the shared 2-core machine (the "
        "simulator's numbers do not depend on it). Traffic: "
        f"`{results['traffic']}` (agent programs of 1, 10 and 30 calls per task, equal "
        "weights, tasks arriving open loop until 60 s, each tenant asking more than a third of "
        "the pool); the pool above; vtc with prefix affinity, the prompt charged as computed "
        "(`cost.chargeCachedPrompt: false`). Shares: of the computed-token cost "
        f"`(prompt − cached) + 2 × output` (what the fair queue charges) of the requests "
        f"dispatched between {low:g} and {high:g} s, beside the sent-token cost; backlogged: "
        "the fraction of that window the tenant had a request waiting in the picker. "
        "Completion: a task's first call sent to its last reply, over the tasks completed "
        "before the end (150 s + up to 30 s for calls in flight).",
        "",
        "| mode | pool tokens/s | prefix hit rate | TTFT p50 ms | TTFT p95 ms | requests ok |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, n in results["modes"].items():
        lines.append(f"| {name} | {_f(n['tokens_per_s'])} | {n['prefix_hit_rate']:.1%} | "
                     f"{_f(n['ttft_p50_ms'])} | {_f(n['ttft_p95_ms'])} | "
                     f"{n['ok']:,} / {n['requests']:,} |")
    lines += ["", "| mode | tenant | computed-cost share | sent-cost share | backlogged | "
              "tasks done / started | completion p50 / p95 s | TTFT p50 / p95 ms |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, n in results["modes"].items():
        for tenant, t in n["tenants"].items():
            lines.append(
                f"| {name} | {tenant} | {t['window_computed_share']:.1%} | "
                f"{t['window_sent_share']:.1%} | {t['backlogged']:.0%} | "
                f"{t['units_completed']:,} / {t['units_started']:,} | "
                f"{_f(t['completion_p50_s'], 1)} / {_f(t['completion_p95_s'], 1)} | "
                f"{_f(t['ttft_p50_ms'])} / {_f(t['ttft_p95_ms'])} |")
    lines.append("")
    for name, n in results["modes"].items():
        shares = {t: d["window_computed_share"] for t, d in n["tenants"].items()}
        equal = 1 / len(shares)
        worst = max(shares, key=lambda t: abs(shares[t] - equal))
        lines.append(f"- {name}: the share furthest from equal is {worst}'s, "
                     f"{shares[worst]:.1%} ({(shares[worst] - equal) * 100:+.1f} points, "
                     f"{shares[worst] / equal - 1:+.1%} of an equal share).")
    lines += [
        "",
        "A tenant gets no more than its share for making more calls: the fair queue charges "
        "tokens, and sessions change only the order inside a tenant's own queue. A tenant "
        "backlogged less than the whole window (its programs' calls wait on their tools) gets "
        "less, never more. Programs in progress first, oldest first, finish programs in the "
        "order they began instead of advancing all of them together; its cost is that a "
        "tenant's oldest programs carry its largest prompts to the head of its queue, where "
        "under KV pressure they wait for room in the fair order (pool tokens/s and the other "
        "tenants' TTFT in the rows above). Stickiness alone adds little here beside prefix "
        "affinity, which already follows the context's blocks.",
        ""]
    return "\n".join(lines)


START = "<!-- bench.prefix_sessions: written by python -m bench.prefix_sessions -->"
END = "<!-- /bench.prefix_sessions -->"


def splice(document: str, section: str) -> str:
    """``document`` with its sessions section (between ``START`` and ``END``) replaced by
    ``section`` (appended if it has none)."""
    block = f"{START}\n{section}\n{END}"
    if START in document and END in document:
        return document[:document.index(START)] + block + \
            document[document.index(END) + len(END):]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_sessions", description=__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help="directory holding prefix.md (its sessions section is replaced) "
                             "and for prefix_sessions.json (default: print only)")
    args = parser.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = " / ".join(f.read().split()[:3])
    results = measure()
    text = render(results, load)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        target = args.out / "prefix.md"
        old = target.read_text() if target.exists() else ""
        target.write_text(splice(old, text))
        (args.out / "prefix_sessions.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
