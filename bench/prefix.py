"""Workloads that share prefixes, in the pool simulator: what do fcfs and vtc (and prefix affinity,
where the picker has it) give on the traffic people run?

It answers issue 28's point 4 measures on each workload of ``bench/traffic/prefix_*.yaml`` (a
shared system prompt per tenant, multi-turn chat sessions, RAG over shared documents, agent
programs of 1, 10 and 30 calls): the pool's output tokens/s, the engines' own prefix hit rate
(vLLM's ``prefix_cache_hits / prefix_cache_queries``), TTFT p50/p95, each tenant's session or
program completion time p50/p95 (first call sent to last reply; a single request's is its
end-to-end time), and each tenant's share of the computed-token cost, ``(prompt - cached) + 2 ×
output`` per request, beside its share of the sent-token cost ``prompt + 2 × output``.

The pool: 2 engines of 65,536 tokens of KV, 8,192 batched tokens a step, 10 ms a step plus
0.05 ms per prompt token computed (``bench.isolation``'s 64k size: an 8B model on an H100
prefills about 20k tokens/s), vLLM's prefix caching on. Each run lasts its traffic file's
``duration_s`` (60 s; 120 s for chat sessions and 150 s for agent programs, which start new units
only in the first 60 s so that those running can finish), tokens/s counted after a 10 s warm-up,
then up to 30 s for requests still in flight (no unit starts a call after ``duration_s``: a unit
cut there is not counted as completed).

Run: ``python -m bench.prefix --out bench/results`` (writes ``prefix.md`` and ``prefix.json``;
about a minute of CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from picker.config import schema
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.load import percentile
from picker.sim.pool import PoolRecord, PoolRun, PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "system prompt": "bench/traffic/prefix_system_prompt.yaml",
    "chat sessions": "bench/traffic/prefix_chat.yaml",
    "rag": "bench/traffic/prefix_rag.yaml",
    "agent programs": "bench/traffic/prefix_agent.yaml",
}
SPEC = PoolSpec(endpoints=2, kv_budget_tokens=65536, max_num_batched_tokens=8192,
                prefill_s_per_token=0.00005)
WARMUP_S = 10.0
DRAIN_S = 30.0
PREFILL_WEIGHT, DECODE_WEIGHT = 1, 2
"""The cost of ``picker.core.cost``'s defaults: a prompt token 1, an output token 2."""

POLICIES: dict[str, dict[str, Any]] = {
    "fcfs": {"scheduling": {"policy": "fcfs"}},
    "vtc": {"capacity": {"engineCache": "auto"}},
    "vtc, engineCache false": {"capacity": {"engineCache": False}},
}
"""vtc at its defaults (the engines' shared prompt blocks counted once in the room) and vtc
told the engines do not cache (each request's whole prompt counted: what vtc without affinity
did before ``capacity.engineCache``)."""


def affinity_available() -> bool:
    """The picker has a prefix-affinity scorer (``routing.prefixAffinity``) to turn on."""
    return hasattr(schema, "PrefixAffinity")


def modes(affinity: bool) -> dict[str, dict[str, Any]]:
    """Each policy; with affinity, vtc with ``routing.prefixAffinity`` on (its defaults), and
    the same charging the prompt as computed (``cost.chargeCachedPrompt: false``: cached tokens
    cost nothing). Not fcfs with affinity: fcfs is pass-through, every request dispatched at once
    without the scorer, so affinity changes nothing there (its rows were fcfs's, to the digit)."""
    out = dict(POLICIES)
    if affinity:
        out["vtc + affinity"] = {"routing": {"prefixAffinity": {}}}
        out["vtc + affinity, charged computed"] = {
            "routing": {"prefixAffinity": {}}, "cost": {"chargeCachedPrompt": False}}
    return out


def _config(mode: dict[str, Any]) -> PickerConfig:
    """A mode's picker config on the pool: its capacity settings beside the pool's budget."""
    return load(PickerConfig, {**mode, "capacity": {"kvBudgetTokens": SPEC.kv_budget_tokens,
                                                    **mode.get("capacity", {})}})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def unit_times(records: list[PoolRecord]) -> dict[tuple[str, int], float | None]:
    """Per unit (tenant, number): first call's arrival to last call's end when every call of it
    ended ok, else None."""
    units: dict[tuple[str, int], list[PoolRecord]] = {}
    for record in records:
        units.setdefault((record.tenant, record.seq), []).append(record)
    out: dict[tuple[str, int], float | None] = {}
    for key, calls in units.items():
        calls.sort(key=lambda r: r.call or 0)
        whole = (len(calls) == calls[0].calls and all(r.outcome == "ok" for r in calls))
        end = calls[-1].end_s
        out[key] = end - calls[0].arrival_s if whole and end is not None else None
    return out


def numbers(run: PoolRun, traffic: Traffic, cpu_s: float) -> dict[str, Any]:
    """One run's measures, in total and per tenant."""
    ok = [r for r in run.records if r.outcome == "ok"]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    computed = {t.name: 0 for t in traffic.tenants}
    sent = dict(computed)
    for r in ok:
        computed[r.tenant] += (PREFILL_WEIGHT * (r.prompt_tokens - r.cached_tokens)
                               + DECODE_WEIGHT * r.completion_tokens)
        sent[r.tenant] += PREFILL_WEIGHT * r.prompt_tokens + DECODE_WEIGHT * r.completion_tokens
    units = unit_times(run.records)
    tenants: dict[str, Any] = {}
    for tenant in traffic.tenants:
        name = tenant.name
        mine = [r for r in run.records if r.tenant == name]
        done = [s for (t, _), s in units.items() if t == name and s is not None]
        tenants[name] = {
            "requests": len(mine),
            "ok": sum(1 for r in mine if r.outcome == "ok"),
            "ttft_p50_ms": _ms(percentile([r.ttft_s for r in mine if r.outcome == "ok"
                                           and r.ttft_s is not None], 50)),
            "ttft_p95_ms": _ms(percentile([r.ttft_s for r in mine if r.outcome == "ok"
                                           and r.ttft_s is not None], 95)),
            "units_started": sum(1 for (t, _) in units if t == name),
            "units_completed": len(done),
            "completion_p50_s": percentile(done, 50),
            "completion_p95_s": percentile(done, 95),
            "computed_cost_share": computed[name] / total if (total := sum(computed.values()))
            else 0.0,
            "sent_cost_share": sent[name] / whole if (whole := sum(sent.values())) else 0.0,
        }
    return {
        "tokens_per_s": run.tokens_per_s(),
        "prefix_hit_rate": run.prefix_cache_hits / run.prefix_cache_queries
        if run.prefix_cache_queries else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p95_ms": _ms(percentile(ttft, 95)),
        "requests": len(run.records),
        "ok": len(ok),
        "preemptions": run.preemptions,
        "tenants": tenants,
        "sim_cpu_s": round(cpu_s, 2),
    }


def run_one(path: str, mode: dict[str, Any]) -> dict[str, Any]:
    """One workload under one picker config."""
    traffic = load_traffic(ROOT / path)
    started = time.process_time()
    run = simulate(_config(mode), traffic, SPEC, warmup_s=WARMUP_S, drain_s=DRAIN_S)
    return numbers(run, traffic, time.process_time() - started)


def measure(only: list[str] | None = None, affinity: bool | None = None) -> dict[str, Any]:
    """Every workload (``only``: these) under every mode."""
    chosen = modes(affinity_available() if affinity is None else affinity)
    results: dict[str, Any] = {}
    for workload, path in WORKLOADS.items():
        if only and workload not in only:
            continue
        runs: dict[str, Any] = {}
        for name, mode in chosen.items():
            runs[name] = run_one(path, mode)
            print(f"{workload}, {name}: {runs[name]['sim_cpu_s']} s of CPU", file=sys.stderr)
        results[workload] = {"traffic": path, "modes": runs}
    return results


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pool_table(modes: dict[str, Any], label: str = "picker") -> list[str]:
    """The pool's figures of each mode's run (``numbers``), a markdown table's lines."""
    lines = [f"| {label} | pool tokens/s | prefix hit rate | TTFT p50 ms | TTFT p95 ms | "
             "requests ok | preemptions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, n in modes.items():
        lines.append(f"| {name} | {_f(n['tokens_per_s'])} | {n['prefix_hit_rate']:.1%} | "
                     f"{_f(n['ttft_p50_ms'])} | {_f(n['ttft_p95_ms'])} | "
                     f"{n['ok']:,} / {n['requests']:,} | {n['preemptions']:,} |")
    return lines


def render(results: dict[str, Any]) -> str:
    spec = dataclasses.asdict(SPEC)
    lines = [
        "# Workloads that share prefixes (issue 28, point 4)",
        "",
        "`python -m bench.prefix --out bench/results`, in the pool simulator (`picker.sim.pool`: "
        "the picker's gate over vLLM V1's scheduler with automatic prefix caching). Pool: "
        f"{spec['endpoints']} engines × {spec['kv_budget_tokens']:,} tokens of KV, "
        f"{spec['max_num_batched_tokens']:,} batched tokens a step, "
        f"{spec['step_s'] * 1000:g} ms a step + {spec['prefill_s_per_token'] * 1000:g} ms per "
        "prompt token computed. Each run lasts its traffic file's duration_s (tokens/s after "
        f"a {WARMUP_S:g} s warm-up), up to {DRAIN_S:g} s more for requests in flight. Pool "
        "tokens/s: output tokens. Hit rate: the "
        "engines' own (prefix_cache_hits / prefix_cache_queries, tokens). Completion: a session's "
        "or program's first call sent to its last reply (a single request's end-to-end), over "
        "the units whose every call was answered before the end. Cost shares: computed "
        "`(prompt − cached) + 2 × output`, beside sent `prompt + 2 × output`, of requests "
        "answered.",
        "",
        "fcfs is the picker's pass-through (every request dispatched at once, "
        "ranked by load, without the affinity bonus), so it runs without affinity; vtc holds "
        "requests in its fair queue while no endpoint has room by its KV budget, which counts "
        "each request's prompt and output, but a prompt block that requests running on the "
        "same endpoint share once, as the engine stores it (`capacity.engineCache: auto`, the "
        "default, reads in each engine's `vllm:cache_config_info` that these cache; with "
        "affinity or without). vtc, engineCache false counts each request's "
        "whole prompt, as for engines without a prefix cache: on these engines, which have "
        "one, it holds requests they have room for (it is what vtc without affinity did "
        "before the engine cache became its own setting). On four traffic seeds "
        "(`prefix_engine_cache_seeds.md`) counting shared blocks once gives vtc without "
        "affinity pass-through's tokens and TTFT on the system prompt and RAG, leaves chat "
        "sessions within -1.4 to +0.4 %, and on agent programs costs 3.2-4.8 % of tokens/s "
        "and 1-2.4 points of hit rate (more calls at once, more of their contexts evicted) "
        "for 40 % off the TTFT p95: near pass-through's figures (771 against 782 tokens/s), "
        "where holding whole prompts had kept the engines below their room.",
        "",
    ]
    for workload, data in results.items():
        lines += [f"## {workload} (`{data['traffic']}`)", "", *pool_table(data["modes"]),
                  "", "| picker | tenant | TTFT p50 / p95 ms | units done / started | "
                  "completion p50 / p95 s | computed-cost share | sent-cost share |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, n in data["modes"].items():
            for tenant, t in n["tenants"].items():
                lines.append(
                    f"| {name} | {tenant} | {_f(t['ttft_p50_ms'])} / {_f(t['ttft_p95_ms'])} | "
                    f"{t['units_completed']:,} / {t['units_started']:,} | "
                    f"{_f(t['completion_p50_s'], 2)} / {_f(t['completion_p95_s'], 2)} | "
                    f"{t['computed_cost_share']:.1%} | {t['sent_cost_share']:.1%} |")
        lines.append("")
    return "\n".join(lines)


SECTION = re.compile(r"<!-- (bench\.[a-z_]+):.*?<!-- /\1 -->", re.S)
"""A section another benchmark writes into ``prefix.md`` (``bench.peer``,
``bench.prefix_sessions``, ``bench.prefix_fairness``), between its markers."""


def sections(document: str) -> list[str]:
    """The sections other benchmarks wrote into ``document``, markers included, in order."""
    return [m.group(0) for m in SECTION.finditer(document)]


def splice(document: str, section: str, start: str, end: str) -> str:
    """``document`` with the part between the markers ``start`` and ``end`` replaced by
    ``section`` (appended, with its markers, if it has none)."""
    block = f"{start}\n{section}\n{end}"
    if start in document and end in document:
        return document[:document.index(start)] + block + \
            document[document.index(end) + len(end):]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def write_section(out: Path, text: str, start: str, end: str, name: str,
                  results: dict[str, Any]) -> None:
    """Into directory ``out``: ``text`` as the section of ``prefix.md`` between the markers
    ``start`` and ``end`` (the rest of the page kept), and ``results`` as ``name``.json."""
    out.mkdir(parents=True, exist_ok=True)
    page = out / "prefix.md"
    page.write_text(splice(page.read_text() if page.exists() else "", text, start, end))
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")


def section_parser(name: str, doc: str | None, what: str) -> argparse.ArgumentParser:
    """The command line of a benchmark ``bench.<name>`` that writes one section of
    ``prefix.md`` (``what``): its ``--out``."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory holding prefix.md (its {what} section is replaced) "
                             f"and for {name}.json (default: print only)")
    return parser


def run_section(out: Path | None, name: str, measure: Callable[[], dict[str, Any]],
                render: Callable[[dict[str, Any], tuple[str, str]], str], start: str,
                end: str) -> int:
    """Measure, render with the load average at the start and at the end, print, and with
    ``out`` write the section and ``name``.json there (``write_section``)."""
    before = load_average()
    results = measure()
    text = render(results, (before, load_average()))
    print(text)
    if out is not None:
        write_section(out, text, start, end, name, results)
    return 0


def load_average() -> str:
    """The machine's load average over 1, 5 and 15 minutes, as ``a / b / c``."""
    with open("/proc/loadavg") as f:
        return " / ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for prefix.md and prefix.json (default: print only)")
    parser.add_argument("--only", action="append", choices=list(WORKLOADS),
                        help="run only this workload (repeatable)")
    parser.add_argument("--affinity", choices=["auto", "on", "off"], default="auto",
                        help="add modes with routing.prefixAffinity (auto: when the picker "
                             "has it)")
    args = parser.parse_args(argv)
    affinity = None if args.affinity == "auto" else args.affinity == "on"
    results = measure(args.only, affinity)
    text = render(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        page = args.out / "prefix.md"
        # bench.peer, bench.prefix_sessions and bench.prefix_fairness write their sections
        # there between markers: keep them.
        page.write_text(text + "\n" + "".join(
            f"\n{k}\n" for k in sections(page.read_text() if page.exists() else "")))
        (args.out / "prefix.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
