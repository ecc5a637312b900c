"""Programs and sessions (issue 28 point 5), in the pool simulator: does a tenant whose agents
make 30 calls per task get more than its share for making more calls, and what do sessions
(``routing.sessions``) do to each tenant's task completion time?

It runs ``bench/traffic/prefix_agent_sessions.yaml`` (agent programs of 1, 10 and 30 calls per
task, equal weights, tasks arriving open loop for 60 s) as filed, and with more tasks a second
(``RATES``) so that every tenant stays backlogged, on ``bench.prefix``'s pool under vtc with
prefix affinity, the prompt charged as computed (``cost.chargeCachedPrompt: false``), three
ways: sessions off; ``routing.sessions`` on with only stickiness (``resumeFirst: false``); and
sessions on (sticky, programs in progress first). Per tenant: its share of the computed-token
cost ``(prompt - cached) + 2 × output`` served (a prompt at dispatch, output evenly from first
token to end) in the seconds of 10 s to 60 s in which all three tenants had a request waiting in
the picker (the fair queue's promise is among backlogged tenants: a tenant whose calls wait on
their tools asks for less than its share then, and rightly gets less), beside the sent-token
share; the fraction of the window it had a request waiting; its tasks completed of those
started and their completion time p50/p95 (first call sent to last reply); TTFT p50/p95.

Run: ``python -m bench.prefix_sessions --out bench/results`` (writes the "programs and
sessions" section of ``prefix.md`` between its markers, replacing it, and
``prefix_sessions.json``; about two minutes of CPU).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

from bench.prefix import (
    DRAIN_S,
    ROOT,
    SPEC,
    WARMUP_S,
    _config,
    _f,
    numbers,
    pool_table,
    run_section,
    section_parser,
)
from bench.prefix_fairness import (
    all_backlogged,
    computed_service,
    length,
    shares,
    waiting_spans,
)
from picker.sim.pool import PoolRecord, simulate
from picker.sim.traffic import Traffic, load_traffic

TRAFFIC = "bench/traffic/prefix_agent_sessions.yaml"
WINDOW = (WARMUP_S, 60.0)
"""Seconds in which every tenant sends new tasks: where the tenants can all be backlogged."""
SHARE_GOAL = 0.05
"""Issue 28: with equal weights, each tenant's token share within 5 % of an equal share."""
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
    return length(waiting_spans(records, *window)) / (window[1] - window[0])


def backlogged_shares(records: list[PoolRecord], tenants: list[str]
                      ) -> tuple[float, dict[str, float], dict[str, float]]:
    """Seconds of ``WINDOW`` in which every tenant had a request waiting in the picker, and each
    tenant's share of the computed- and of the sent-token cost served in those seconds (the
    fair queue's promise holds among backlogged tenants: a tenant whose calls wait on their
    tools asks for less than its share then, and rightly gets less)."""
    spans = all_backlogged(records, tenants, *WINDOW)
    return (length(spans), shares(computed_service(records, spans)),
            shares(computed_service(records, spans, cached_weight=1.0)))


RATES: dict[str, dict[str, float] | None] = {
    "as filed": None,
    "all backlogged": {"k1": 60.0, "k10": 6.0, "k30": 2.4},
}
"""The traffic file's task rates, and three times (twice for k10) as many tasks a second, so
that each tenant has a request waiting in the picker nearly all the window (the 30-call
tenant's calls otherwise wait on their tools long enough to leave it idle a quarter of it)."""


def traffic_at(rates: dict[str, float] | None) -> Traffic:
    traffic = load_traffic(ROOT / TRAFFIC)
    if rates is None:
        return traffic
    return replace(traffic, tenants=tuple(replace(t, rate=rates[t.name])
                                          for t in traffic.tenants))


def measure() -> dict[str, Any]:
    out: dict[str, Any] = {"traffic": TRAFFIC, "window_s": list(WINDOW), "scenarios": {}}
    for scenario, rates in RATES.items():
        traffic = traffic_at(rates)
        names = [t.name for t in traffic.tenants]
        runs: dict[str, Any] = {}
        for name, mode in MODES.items():
            started = time.process_time()
            run = simulate(_config(mode), traffic, SPEC, warmup_s=WARMUP_S, drain_s=DRAIN_S)
            result = numbers(run, traffic, time.process_time() - started)
            both, computed, sent = backlogged_shares(run.records, names)
            result["all_backlogged_s"] = both
            for tenant, data in result["tenants"].items():
                mine = [r for r in run.records if r.tenant == tenant]
                data["backlogged_computed_share"] = computed.get(tenant, 0.0)
                data["backlogged_sent_share"] = sent.get(tenant, 0.0)
                data["backlogged"] = backlogged_fraction(mine, WINDOW)
            runs[name] = result
            print(f"{scenario}, {name}: {result['sim_cpu_s']} s of CPU", file=sys.stderr)
        out["scenarios"][scenario] = {
            "rates": {t.name: t.rate for t in traffic.tenants}, "modes": runs}
    return out


def render(results: dict[str, Any], load: tuple[str, str]) -> str:
    low, high = results["window_s"]
    lines = [
        "## programs and sessions",
        "",
        f"`python -m bench.prefix_sessions --out bench/results` (`bench/prefix_sessions.py`), "
        f"one run of the modes, load average {load[0]} at its start and {load[1]} at its end on "
        "the shared 2-core machine (the simulator's numbers do not depend on it). Traffic: "
        f"`{results['traffic']}` (agent programs of 1, 10 and 30 calls per task, equal "
        "weights, tasks arriving open loop until 60 s, each tenant asking more than a third of "
        "the pool); the pool above; vtc with prefix affinity, the prompt charged as computed "
        "(`cost.chargeCachedPrompt: false`). Shares: of the computed-token cost "
        "`(prompt − cached) + 2 × output` (what the fair queue charges; a prompt at its "
        "dispatch, the output evenly from first token to end), beside the sent-token cost, "
        f"served in the seconds between {low:g} and {high:g} s in which all three tenants had "
        "a request waiting in the picker (all backlogged: the fair queue's promise is among "
        "backlogged tenants); backlogged: the fraction of that window the tenant had one. "
        "Completion: a task's first call sent to its last reply, over the tasks completed "
        "before the end (150 s + up to 30 s for calls in flight).",
    ]
    for scenario, data in results["scenarios"].items():
        rates = ", ".join(f"{t} {r:g}" for t, r in data["rates"].items())
        lines += ["", f"### {scenario} (tasks a second: {rates})", "",
                  *pool_table(data["modes"], "mode"), "",
                  "| mode | tenant | computed-cost share | sent-cost share | backlogged | "
                  "tasks done / started | completion p50 / p95 s | TTFT p50 / p95 ms |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, n in data["modes"].items():
            for tenant, t in n["tenants"].items():
                lines.append(
                    f"| {name} | {tenant} | {t['backlogged_computed_share']:.1%} | "
                    f"{t['backlogged_sent_share']:.1%} | {t['backlogged']:.0%} | "
                    f"{t['units_completed']:,} / {t['units_started']:,} | "
                    f"{_f(t['completion_p50_s'], 1)} / {_f(t['completion_p95_s'], 1)} | "
                    f"{_f(t['ttft_p50_ms'])} / {_f(t['ttft_p95_ms'])} |")
        lines.append("")
        for name, n in data["modes"].items():
            got = {t: d["backlogged_computed_share"] for t, d in n["tenants"].items()}
            equal = 1 / len(got)
            worst = max(got, key=lambda t: abs(got[t] - equal))
            error = got[worst] / equal - 1
            met = "met" if abs(error) <= SHARE_GOAL else "**not met**"
            lines.append(f"- {name}: all three backlogged {n['all_backlogged_s']:.1f} s of "
                         f"{high - low:g}; the share furthest from equal is {worst}'s, "
                         f"{got[worst]:.1%} ({error:+.1%} of an equal share: goal within "
                         f"{SHARE_GOAL:.0%}, {met}).")
    lines += ["", *NOTES, ""]
    return "\n".join(lines)


NOTES = [
    "Shares (issue 28: with 1, 10 and 30 calls per task and equal weights, each within 5 % of "
    "equal). All backlogged, the goal is met in every mode: each tenant's share of the "
    "computed-token cost served while all three had a request waiting (46 of the 50 s) is "
    "within 1.2 % of a third, the 30-call tenant's included; a tenant gets no more than its "
    "share for making more calls (the fair queue charges tokens, sessions only reorder a "
    "tenant's own queue). As filed, the 1-call tenant is served as fast as it asks for about "
    "half the window (its queue empties and refills, and it re-enters at the floor each "
    "time), so all three wait together only about 20-22 s of 50, in short pieces; shares over "
    "those pieces read 29.7-39.9 % (11-20 % from a third), which says how the fair queue's charges "
    "lag what was computed, not the promise: its counters charge a call's prompt at dispatch "
    "on the picker's estimate of the cached part (its prefix index, in the run before the "
    "index aged its blocks (6d5dfbc): 3,122 of a 3,729-token prompt on average for the "
    "30-call tenant in sessions off, where the engines, whose LRU evicts contexts under this "
    "load, reported 1,085) and settle the rest when the call ends, "
    "and a piece of a few tenths of a second sees the dispatch, not the settlement. (Charging "
    "the whole prompt at dispatch instead, a trial not kept, moves the error to the other "
    "tenants: 28.6 / 38.4 / 33.0 %.) The earlier section's 34.0 / 34.3 / 31.6 % were the "
    "cost of requests dispatched 10-60 s whatever the backlog, before the picker counted "
    "shared prompt blocks once (6a5e4c4), which changed every figure here.",
    "",
    "This run is after the prefix index ages its blocks by the new KV sent to each "
    "endpoint (6d5dfbc; patience is off here, its default) and after `capacity.engineCache` "
    "became learned at each engine's first read: against the run before, as filed with "
    "sessions off, pool tokens/s 2,011 -> 1,907, TTFT p95 7.8 -> 3.9 s, the 30-call "
    "tenant's tasks done 0 -> 6 of 57; all backlogged 3,102 -> 3,019 tokens/s.",
    "",
    "Programs in progress first (sessions on against off): the 10-call tenant finishes 111 "
    "tasks instead of 88 as filed, 84 instead of 75 all backlogged. Its cost, at the same "
    "commit: pool tokens/s -1.4 % as filed (1,907 to 1,880) and the 1-call tenant's TTFT p95 "
    "590 to 910 ms (the run before: -2.2 % and 590 to 892 ms; before 6a5e4c4, -4 % and 11 to "
    "30 s); all backlogged, -11.8 % (3,019 to 2,663), as the tenants' oldest programs, "
    "their largest prompts, stand at the head of their queues and wait for room. Two rules "
    "that let a tenant's call that fits go instead of a resumed head that does not, tried in the "
    "simulator on the all-backlogged traffic and not kept: any of the tenant's calls that "
    "fits (3,458 tokens/s, but the 10-call tenant finishes 52 tasks and the 10- and 30-call "
    "tenants' TTFT p95 read 47 and 40 s against 11 and 9 s: their largest calls starve "
    "behind smaller ones), and only the tenant's other resumed calls (2,875 tokens/s, 79 "
    "tasks, TTFT p95 41 and 39 s). Neither keeps the benefit without a cost; resumeFirst "
    "stays as it was.",
]
"""What the run shows, in words (written from the numbers of the run committed)."""
START = "<!-- bench.prefix_sessions: written by python -m bench.prefix_sessions -->"
END = "<!-- /bench.prefix_sessions -->"


def main(argv: list[str] | None = None) -> int:
    args = section_parser("prefix_sessions", __doc__, "sessions").parse_args(argv)
    return run_section(args.out, "prefix_sessions", measure, render, START, END)


if __name__ == "__main__":
    raise SystemExit(main())
