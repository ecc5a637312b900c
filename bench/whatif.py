"""How faithful is a what-if replay? Measured against real Envoy (issue 29 point 3).

``python -m bench.whatif --out bench/results [--duration 60]``. Three tenants send open-loop
streamed traffic (``TRAFFIC``: Poisson, together about 1.7 times what the pool serves, so that
the scheduler decides who gets what) through the local stack (real Envoy, the picker with a
metering log, two simulated vLLM servers). The run is done live under the current config and
under each candidate (weights 1:1:1 → 1:2:3; a burst budget on the heaviest tenant; a new lane
above the others for one tenant), each from a fresh stack with the same seeded arrivals. Then:

1. *Fidelity*: the baseline run's metering log is replayed under the baseline config
   (``python -m picker.whatif``) and each tenant's share of service and TTFT p95 compared with
   what the log measured (goals: share within 3 points, p95 within 20 %).
2. *Prediction*: the same log replayed under each candidate, compared with what the candidate's
   own live run measured (goals: share within 5 points, p95 within 25 %).

"Measured" is the metering log's own figures (the picker's view: arrival at the picker to first
token), which is what the replay models; the client's TTFT (through Envoy) is shown beside it.
Shares are of all tokens served (prompt + output); "within 3 %" is read as 3 percentage points.
Writes ``whatif.json`` and ``whatif_fidelity.md`` (the tables) in ``--out``. The live runs take
about ``5 × (duration + 25) s`` (the baseline runs twice: live against live); run it on a quiet
machine, once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from picker.sim.load import run_traffic
from picker.sim.traffic import load_traffic
from picker.stack.launcher import Stack
from picker.whatif.__main__ import main as whatif_main

ENDPOINTS = 2
KV_BUDGET = 2048
STEP_MS = 20.0
SERVER_ARGS = ["--kv-budget-tokens", str(KV_BUDGET), "--step-ms", f"{STEP_MS:g}"]
TENANTS = ("a", "b", "c")
TRAFFIC: dict[str, Any] = {
    "duration_s": 60, "seed": 29, "timeout_s": 30,
    "tenants": [
        {"name": name, "rate": rate, "api": "completions", "prompt_tokens": [50, 150],
         "output_tokens": [60, 180], "stream_fraction": 1.0, "include_usage": True}
        for name, rate in (("a", 6.0), ("b", 5.0), ("c", 2.0))],
}
BASE: dict[str, Any] = {
    "queue": {"maxWait": "10s"},
    "tenants": [{"id": t} for t in TENANTS],
}
CANDIDATES: dict[str, dict[str, Any]] = {
    "weights 1:2:3": {"tenants": [{"id": "a", "weight": 1}, {"id": "b", "weight": 2},
                                  {"id": "c", "weight": 3}]},
    "burst budget on a": {"tenants": [
        {"id": "a", "budgets": {"burst": {"tokens": 6000, "per": "10s"}}},
        {"id": "b"}, {"id": "c"}]},
    "new lane for b": {"lanes": [{"name": "interactive"}, {"name": "default"}],
                       "tenants": [{"id": "a", "lane": "default"},
                                   {"id": "b", "lane": "interactive"},
                                   {"id": "c", "lane": "default"}]},
}
REPEAT = "baseline again"
"""A second live run of the baseline: live against live."""
FAST_K = (4, 8)
"""The coarse mode's k (``--coarse``) compared with the exact replay; the event-driven fast
mode (``--fast``) is compared with both the exact replay and the live runs."""
GOALS = {"self": (0.03, 0.20), "predict": (0.05, 0.25)}
"""(share, in points; TTFT p95, relative)."""


def config_for(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, **overrides}


def live_run(name: str, config: dict[str, Any], duration: float, workdir: Path) -> dict[str, Any]:
    """The traffic through a fresh stack under ``config``; returns the log's path and the
    client's per-tenant TTFT p95."""
    run_dir = workdir / name.replace(" ", "_").replace(":", "")
    run_dir.mkdir(parents=True)
    log = run_dir / "metering.jsonl"
    picker_config = {**config, "metering": {"output": str(log)}}
    traffic = load_traffic(TRAFFIC)
    started = time.monotonic()
    with Stack(run_dir / "stack", endpoints=ENDPOINTS, server_args=SERVER_ARGS,
               picker_config=picker_config) as stack:
        result = asyncio.run(run_traffic(traffic, stack.gateway_url, duration_s=duration))
        # The picker writes a record when a request settles: give the last ones a moment.
        time.sleep(1.0)
        config_file = run_dir / "picker.yaml"
        config_file.write_text(stack.config_path.read_text())
    tenants = result.summary["tenants"]
    return {"log": str(log), "config": str(config_file), "wall_s": time.monotonic() - started,
            "client_ttft_p95_s": {t: tenants[t]["ttft_s"]["p95"] for t in TENANTS},
            "client_sent": {t: tenants[t]["sent"] for t in TENANTS},
            "client_ok": {t: tenants[t]["ok"] for t in TENANTS}}


def whatif(log: str, baseline: str, candidates: list[str],
           extra: list[str] | None = None) -> tuple[dict[str, Any], float]:
    """``python -m picker.whatif LOG --baseline ... --candidate ... --json``, in process; its
    JSON and the CPU seconds it took."""
    out = io.StringIO()
    cpu = time.process_time()
    argv = [log, "--baseline", baseline, "--json", *(extra or [])]
    for candidate in candidates or [baseline]:
        argv += ["--candidate", candidate]
    with contextlib.redirect_stdout(out):
        status = whatif_main(argv)
    if status != 0:
        raise RuntimeError(f"picker.whatif exited {status}")
    return json.loads(out.getvalue()), time.process_time() - cpu


def per_tenant(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per tenant: share (summed over its lanes), TTFT p95 (its busiest lane's), ok, 429s."""
    out: dict[str, dict[str, Any]] = {}
    for row in section["tenants"]:
        tenant = out.setdefault(row["tenant"], {"share": 0.0, "p95": None, "ok": 0,
                                                "refused_429": 0, "_ok": -1})
        tenant["share"] += row["share"]
        tenant["ok"] += row["ok"]
        tenant["refused_429"] += row["refused_429"]
        if row["ok"] > tenant["_ok"]:
            tenant["p95"], tenant["_ok"] = row["ttft_s"]["p95"], row["ok"]
    for tenant in out.values():
        del tenant["_ok"]
    return out


def compare(measured: dict[str, dict[str, Any]], replayed: dict[str, dict[str, Any]],
            goal: tuple[float, float]) -> list[dict[str, Any]]:
    rows = []
    for tenant in TENANTS:
        m, r = measured.get(tenant, {}), replayed.get(tenant, {})
        share_m, share_r = m.get("share", 0.0), r.get("share", 0.0)
        p95_m, p95_r = m.get("p95"), r.get("p95")
        p95_err = None if not p95_m or p95_r is None else (p95_r - p95_m) / p95_m
        rows.append({"tenant": tenant, "share_measured": share_m, "share_replayed": share_r,
                     "share_err_points": share_r - share_m,
                     "p95_measured_s": p95_m, "p95_replayed_s": p95_r, "p95_err": p95_err,
                     "ok_measured": m.get("ok"), "ok_replayed": r.get("ok"),
                     "refused_429_replayed": r.get("refused_429"),
                     "share_met": abs(share_r - share_m) <= goal[0],
                     "p95_met": p95_err is not None and abs(p95_err) <= goal[1]})
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(rows: list[dict[str, Any]], client: dict[str, float | None] | None) -> str:
    head = ("| tenant | share measured | share replayed | Δ points | TTFT p95 measured (ms) "
            "| TTFT p95 replayed (ms) | Δ | client TTFT p95 (ms) | served measured / replayed "
            "| goals met |")
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        err = "-" if row["p95_err"] is None else f"{row['p95_err']:+.0%}"
        met = ("share " + ("yes" if row["share_met"] else "NO") + ", p95 "
               + ("yes" if row["p95_met"] else "NO"))
        lines.append(
            f"| {row['tenant']} | {row['share_measured']:.1%} | {row['share_replayed']:.1%} "
            f"| {row['share_err_points'] * 100:+.1f} | {_ms(row['p95_measured_s'])} "
            f"| {_ms(row['p95_replayed_s'])} | {err} "
            f"| {_ms((client or {}).get(row['tenant']))} "
            f"| {row['ok_measured']} / {row['ok_replayed']} | {met} |")
    return "\n".join(lines)


def write_tables(out: Path, result: dict[str, Any]) -> None:
    parts = [f"Load average at the start: {result['load_average_start']}; at the end: "
             f"{result['load_average_end']}. Live runs of {result['duration_s']:g} s each.",
             "", "Pool as the replay inferred it from the baseline's log: "
             + "; ".join(result["pool_notes"]) + ".", "",
             "### Fidelity: the baseline's log replayed under the baseline config", "",
             table(result["self"], result["live"]["baseline"]["client_ttft_p95_s"]), ""]
    if "live_repeat" in result:
        parts += ["### Live against live: the baseline run again (same arrivals), against the "
                  "first", "", table(result["live_repeat"], None).replace(
                      "measured", "first run").replace("replayed", "second run"), ""]
    for name, rows in result["predict"].items():
        pool = result["pools"][name]
        parts += [f"### Prediction: {name} (baseline log replayed under it, against the live "
                  "run under it)", "", table(rows, result["live"][name]["client_ttft_p95_s"]),
                  "", f"The same on the pool as that live run measured it (step "
                  f"{pool['step_s'] * 1000:.2f} ms, KV {pool['kv_budget_tokens']:,}):", "",
                  table(result["predict_same_speed"][name],
                        result["live"][name]["client_ttft_p95_s"]), ""]
    for k, fast in result["fast"].items():
        parts += [f"### Fast mode --coarse {k} against the exact replay ({fast['cpu_s']:.1f} s "
                  f"CPU against {result['replay_cpu_s']:.1f} s for the four configs)", ""]
        for name, rows in fast["rows"].items():
            parts += [f"{name}:", "", table(rows, None).replace("measured", "exact").replace(
                "replayed", f"k={k}"), ""]
    events = result.get("events")
    if events is not None:
        parts += [f"### Fast mode --fast against the exact replay ({events['cpu_s']:.1f} s CPU "
                  f"against {result['replay_cpu_s']:.1f} s for the four configs)", ""]
        for name, rows in events["against_exact"].items():
            parts += [f"{name}:", "", table(rows, None).replace("measured", "exact").replace(
                "replayed", "fast"), ""]
        parts += ["### Fast mode --fast against the live runs (the baseline's log replayed "
                  "under each config; the baseline against its own log's figures)", ""]
        for name, rows in events["against_live"].items():
            parts += [f"{name}:", "", table(rows, result["live"][name]["client_ttft_p95_s"])
                      .replace("replayed", "fast"), ""]
    if "replay_load_average" in result:
        parts.insert(1, f"Replayed again from the same logs (--replay-only) at load average "
                        f"{result['replay_load_average']}.")
    (out / "whatif_fidelity.md").write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.whatif", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of traffic per live run (default 60)")
    parser.add_argument("--workdir", type=Path, help="keep the runs' logs here")
    parser.add_argument("--replay-only", action="store_true",
                        help="replay the logs already in --workdir (no live runs)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="whatif-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"duration_s": args.duration,
                              "load_average_start": " ".join(f"{x:.2f}" for x in
                                                             os.getloadavg()),
                              "traffic": TRAFFIC, "server_args": SERVER_ARGS,
                              "baseline": BASE, "candidates": CANDIDATES}
    configs = {"baseline": config_for({}),
               **{name: config_for(c) for name, c in CANDIDATES.items()},
               REPEAT: config_for({})}
    state = workdir / "live.json"
    if args.replay_only:
        live = json.loads(state.read_text())
        previous = args.out / "whatif.json"
        if previous.is_file():
            # The live runs' load, not this replay's: the tables describe those runs.
            before = json.loads(previous.read_text())
            result["replay_load_average"] = result["load_average_start"]
            result["load_average_start"] = before.get("load_average_start", "?")
            result["live_load_average_end"] = before.get("load_average_end", "?")
    else:
        live = {}
        for name, config in configs.items():
            print(f"live run: {name}", flush=True)
            live[name] = live_run(name, config, args.duration, workdir)
            state.write_text(json.dumps(live, indent=2))
    result["live"] = live
    # Candidates as files: the picker's own config of each live run (its endpoints differ run to
    # run, which the replay does not read: it replays on the pool the log shows).
    base_cfg = live["baseline"]["config"]
    names = list(CANDIDATES)
    replay, cpu = whatif(live["baseline"]["log"], base_cfg, [live[n]["config"] for n in names])
    result["replay_cpu_s"] = cpu
    result["pool_notes"] = replay["pool"]["notes"]
    result["log"] = replay["log"]
    result["self"] = compare(per_tenant(replay["recorded"]), per_tenant(replay["baseline"]),
                             GOALS["self"])
    result["predict"], result["predict_same_speed"], result["pools"] = {}, {}, {}
    recorded = {"baseline": per_tenant(replay["recorded"])}
    for name, candidate in zip(names, replay["candidates"], strict=True):
        measured, _ = whatif(live[name]["log"], live[name]["config"], [])
        recorded[name] = per_tenant(measured["recorded"])
        result["pools"][name] = measured["pool"]
        result["predict"][name] = compare(per_tenant(measured["recorded"]),
                                          per_tenant(candidate), GOALS["predict"])
        # The shared machine's load changes the live pool's speed run to run: the same
        # prediction on the pool as the candidate's own run measured it (its step and KV)
        # separates the replay's error from that drift.
        pool = measured["pool"]
        same, _ = whatif(live["baseline"]["log"], base_cfg, [live[name]["config"]],
                         ["--step-ms", f"{pool['step_s'] * 1000:.4f}",
                          "--kv-budget-tokens", str(pool["kv_budget_tokens"])])
        result["predict_same_speed"][name] = compare(
            per_tenant(measured["recorded"]), per_tenant(same["candidates"][0]),
            GOALS["predict"])
    # The fast mode against the exact replay, on the same log and configs.
    # How far two live runs of the same config and arrivals are apart: the floor under any
    # comparison of a replay with a live run on this machine.
    if REPEAT in live:
        repeat, _ = whatif(live[REPEAT]["log"], live[REPEAT]["config"], [])
        result["live_repeat"] = compare(per_tenant(replay["recorded"]),
                                        per_tenant(repeat["recorded"]), GOALS["self"])
    result["fast"] = {}
    for k in FAST_K:
        fast, fast_cpu = whatif(live["baseline"]["log"], base_cfg,
                                [live[n]["config"] for n in names], ["--coarse", str(k)])
        rows = {"baseline": compare(per_tenant(replay["baseline"]),
                                    per_tenant(fast["baseline"]), GOALS["self"])}
        for name, exact, coarse in zip(names, replay["candidates"], fast["candidates"],
                                       strict=True):
            rows[name] = compare(per_tenant(exact), per_tenant(coarse), GOALS["self"])
        result["fast"][k] = {"cpu_s": fast_cpu, "rows": rows}
    # The event-driven fast mode against the exact replay and against the live runs.
    events, events_cpu = whatif(live["baseline"]["log"], base_cfg,
                                [live[n]["config"] for n in names], ["--fast"])
    result["events"] = {
        "cpu_s": events_cpu,
        "against_exact": {"baseline": compare(per_tenant(replay["baseline"]),
                                              per_tenant(events["baseline"]), GOALS["self"])},
        "against_live": {"baseline": compare(recorded["baseline"],
                                             per_tenant(events["baseline"]), GOALS["self"])}}
    for name, exact, fast in zip(names, replay["candidates"], events["candidates"],
                                 strict=True):
        result["events"]["against_exact"][name] = compare(per_tenant(exact), per_tenant(fast),
                                                          GOALS["self"])
        result["events"]["against_live"][name] = compare(recorded[name], per_tenant(fast),
                                                         GOALS["predict"])
    end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if "replay_load_average" in result:
        result["replay_load_average"] += f" to {end}"
        result["load_average_end"] = result.pop("live_load_average_end")
    else:
        result["load_average_end"] = end
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "whatif.json").write_text(json.dumps(result, indent=2, default=str))
    write_tables(args.out, result)
    print((args.out / "whatif_fidelity.md").read_text())
    print(yaml.safe_dump({"workdir": str(workdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
