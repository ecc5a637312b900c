"""Where the default gate's tokens go, through real Envoy (issue 27, points 1 and 4).

It answers: *when fairway delivers fewer of the pool's tokens than FCFS pass-through, in which
moments did an engine have room and nothing to run while the picker held requests, and why?*
The same traffic runs through pass-through (``scheduling.policy: fcfs``: every request goes at
once, the engines' queues decide) and through the fairway default, each on a fresh
``picker.stack`` (real Envoy, the picker, two simulated vLLM servers), with the servers' step
trace (``python -m picker.sim.server --trace``: running and waiting requests, KV blocks, prompt
and decode tokens per step) and the picker's (``picker serve --trace``: its count, the scraped
figures, the queue's head and why ``has_room`` holds it, every 5 ms). Then the pool simulator
runs the same traffic in both modes, so its ratio stands beside the gateway's.

A *held-room step* is an engine step (or an idle gap) that starts with nothing waiting in the
engine and free KV blocks for the picker's next held prompt while the picker holds requests.
Its lost tokens are what the endpoint's pass-through run decoded a step more (its mean running
requests, less those running now). Each is put down to one cause, in this order:

* ``dispatch to engine``: the picker has sent more requests to the endpoint than have reached
  its engine (the time through Envoy and the server's HTTP stack);
* ``completion seen late``: the picker's own count holds the prompt off, and the engine has
  finished more requests than the picker has seen end (the meter stream's lag);
* ``scrape lag``: the scraped KV use holds it off (a scrape older than what it reports);
* ``waiting threshold``: the scraped waiting queue, less completions seen, is at
  ``capacity.maxWaiting`` while the engine's is empty;
* ``own count``: the picker's own count (tokens it saw, with every completion seen) is above
  the engine's blocks (a non-streamed request's output estimate counts there; this traffic
  streams every request, so the estimate holds nothing here);
* ``rule or fair order``: ``has_room`` says yes and the picker still holds (a rule of the gate,
  or no pump since the room appeared).

The servers run with ``--catch-up-ms`` (``CATCH_UP_MS``): a step their event loop noticed late
is made up by the next ones, as a GPU's pace does not depend on its host's CPU; without it the
steps ran 2-10 ms late on a 10 ms step on two shared cores, by a different amount per mode and
run, and that, not the gate, decided the ratio.

The issue's own time scale by default (steps 10 ms, 30 and 3 requests/s); ``--scale N`` runs
time N times slower (steps and prefill N times longer, rates ÷ N), as ``bench.isolation_envoy``
does; ratios keep their meaning.

Run: ``python -m bench.efficiency --out bench/results`` (about 3 minutes: four gateway runs of
31 s plus their stacks' start; ``--only 8k`` for one size, ``--repeat 2`` for each size twice,
the modes' order reversed the second time).

The issue's goal matrix (the default against pass-through; a Goals table in the report):
``python -m bench.efficiency --matrix --loop open,closed --engines fcfs,priority --endpoints 2,4
--seeds 3 --response-path meter-stream,inline,access-log --no-trace --out DIR``: 80 cells (2
sizes × 2 loops × 2 engine policies × 2 pool sizes × 3 seeds on the meter stream, one each on
the inline and access-log paths), each about 70 s with the simulator on two cores: about
1 h 40 min (``--duration 20``: about 1 h 10 min; ``--no-sim`` saves a few s a cell). Its goal
table prints the simulator's ratio beside Envoy's (issue 27 point 4: within 3 %).

Without a stack: ``--resim DIR/efficiency.json`` runs the pool simulator as it is now on every
run of a stored goal matrix (efficiency_sim_agreement.md); ``--sim-only --matrix --only 256k
--only 500k --endpoints 2,4,8 ...`` runs the matrix in the simulator alone on the issue's large
pools (efficiency_sim_large.md; about 50 min for 72 cells on the loaded two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway.common import (
    GatewayRun,
    Sample,
    Sampler,
    loadavg,
    measured,
    picker_overrides,
    pool_numbers,
)
from bench.isolation import PREFILL_S_PER_TOKEN, _numbers
from bench.isolation_envoy import _mode_config, _sim_config, server_args
from picker.sim.load import LoadResult, RequestRecord, percentile, run_traffic
from picker.sim.pool import PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic
from picker.stack.envoy import RESPONSE_PATHS
from picker.stack.launcher import Stack, merge_sections

SCALE = 1.0
DURATION_S = 30.0
WARMUP_S = 5.0
TIMEOUT_S = 120.0
"""Seconds a client waits for its answer (and the picker holds a request): longer than the run,
so that no request is given up inside it (a pass-through engine would spend its prefill on
requests whose clients have gone). The run is cut ``CUT_S`` after sending stops instead."""
CUT_S = 1.0
CATCH_UP_MS = 500.0
"""The servers' ``--catch-up-ms``: a step noticed late is made up by the next ones (0: the time
is lost, as a run with the servers' default; the steps then overrun their model by 2-10 ms on a
10 ms step on the shared cores, differently per mode and run)."""
BLOCK = 16

CAUSES = ("dispatch to engine", "completion seen late", "scrape lag", "waiting threshold",
          "own count", "rule or fair order")
MODES: dict[str, tuple[str, dict[str, Any]]] = {"pass-through": ("fcfs", {}),
                                                "default": ("vtc", {})}


@dataclass(frozen=True)
class Shape:
    name: str
    spec: PoolSpec
    prompt: tuple[int, int]
    output: tuple[int, int]
    heavy_rate_per_endpoint: float | None = None
    """Open loop: the heavy tenant's requests/s per endpoint, the light one's a tenth of it;
    None: the issue's 30 and 3 whatever the endpoints."""
    closed_heavy_per_endpoint: int = 32
    """Closed loop: requests the heavy tenant keeps open per endpoint
    (``CLOSED_HEAVY_PER_ENDPOINT``)."""


SHAPES = (
    Shape("8k", PoolSpec(kv_budget_tokens=8192, prefill_s_per_token=PREFILL_S_PER_TOKEN),
          (600, 900), (150, 250)),
    Shape("64k", PoolSpec(kv_budget_tokens=65536, max_num_batched_tokens=8192,
                          prefill_s_per_token=PREFILL_S_PER_TOKEN), (3000, 6000), (300, 500)),
)
LARGE_SHAPES = tuple(
    Shape(name, PoolSpec(kv_budget_tokens=kv, max_num_batched_tokens=8192,
                         prefill_s_per_token=PREFILL_S_PER_TOKEN), (3000, 6000), (300, 500),
          heavy_rate_per_endpoint=15.0, closed_heavy_per_endpoint=32 * kv // 65536)
    for name, kv in (("256k", 262_144), ("500k", 500_000)))
"""Issue 27's simulator goal: the 64k requests on 256k- and 500k-token engines. An engine runs
about 55 and 110 of them at once and, prefill-bound, finishes about 3.4 and 3.8 a second, so
the flood is scaled with the pool (heavy 15 requests/s per endpoint, light 1.5: the issue's 30
and 3 on 2 endpoints) and closed loop keeps 32 per 64k of cache open per endpoint (128, 244)."""


# -- the goal matrix (issue 27's "Goals": the default against pass-through through Envoy) ---------

LOOPS = ("open", "closed")
ENGINES = ("fcfs", "priority")
ENDPOINTS = (2, 4)
FIRST_SEED = 27
"""The traffic seed of the first (or only) run of a cell; ``--seeds N`` adds the next N-1."""
CLOSED_HEAVY_PER_ENDPOINT = 32
"""Closed loop: the heavy tenant keeps this many requests open per endpoint (64 on 2, 128 on
4). An engine runs about 9 at a time at 8k and 14 at 64k, so at least twice the pool's
capacity is always outstanding: the pool stays above capacity, as the open-loop flood does."""
CLOSED_LIGHT = 2
"""Closed loop: the light tenant keeps this many requests open."""
GOAL = 0.98
STRETCH = 1.00
SIM_AGREEMENT = 0.03
"""Issue 27 point 4: the simulator's default ÷ pass-through within 3 % of Envoy's."""


@dataclass(frozen=True)
class Cell:
    """One cell of the goal matrix: a size, the load's loop, the engines' scheduling policy,
    the endpoints, a traffic seed and the response path. Both variants run it."""

    shape: Shape
    loop: str = "open"
    engines: str = "fcfs"
    endpoints: int = 2
    seed: int = FIRST_SEED
    response_path: str = "meter-stream"

    @property
    def group(self) -> str:
        """The cell without its seed; the size alone for the issue's first row (so that the
        bench's default invocation names its rows as before)."""
        parts = [self.shape.name]
        if self.loop != "open":
            parts.append(f"{self.loop} loop")
        if self.engines != "fcfs":
            parts.append(f"{self.engines} engines")
        if self.endpoints != 2:
            parts.append(f"{self.endpoints} endpoints")
        if self.response_path != "meter-stream":
            parts.append(self.response_path)
        return ", ".join(parts)

    @property
    def name(self) -> str:
        return self.group if self.seed == FIRST_SEED else f"{self.group}, seed {self.seed}"


def expand_matrix(shapes: Sequence[Shape], loops: Sequence[str] = ("open",),
                  engines: Sequence[str] = ("fcfs",), endpoints: Sequence[int] = (2,),
                  seeds: int = 1, paths: Sequence[str] = ("meter-stream",)
                  ) -> list[tuple[Cell, tuple[str, ...]]]:
    """Every combination, each with the order its two variants run in: the k-th seed of a
    cell runs pass-through first when k is even, the default first when odd (the machine's
    load drifts). As the issue's goal has it, the inline and access-log paths run one seed
    each when the meter stream is in the matrix too (all ``seeds`` when it is not)."""
    cells = []
    for shape, loop, engine, n, path in itertools.product(shapes, loops, engines, endpoints,
                                                          paths):
        count = 1 if path != "meter-stream" and "meter-stream" in paths else seeds
        for k in range(count):
            order = tuple(MODES) if k % 2 == 0 else tuple(reversed(MODES))
            cells.append((Cell(shape, loop, engine, n, FIRST_SEED + k, path), order))
    return cells


def cell_spec(cell: Cell, scale: float) -> PoolSpec:
    """The engines of ``cell`` at ``scale``: its endpoints and scheduling policy; with the
    access-log path the simulator sees a streamed answer's tokens at its end, as the picker
    does."""
    spec = cell.shape.spec
    return replace(spec, endpoints=cell.endpoints, engine_policy=cell.engines,
                   step_s=spec.step_s * scale, prefill_s_per_token=spec.prefill_s_per_token * scale,
                   output_seen_at_end=cell.response_path == "access-log")


def shape_traffic(shape: Shape, scale: float, seed: int = FIRST_SEED, loop: str = "open",
                  endpoints: int = 2, duration_s: float = DURATION_S) -> Traffic:
    """The issue's traffic: a heavy tenant open-loop at 30 requests/s, a light one at 3, both
    streamed with ``max_tokens`` and ``ignore_eos``; rates ÷ ``scale`` (a shape with
    ``heavy_rate_per_endpoint``: that × ``endpoints``, the light a tenth). Closed loop: the heavy
    tenant keeps the shape's ``closed_heavy_per_endpoint`` (``CLOSED_HEAVY_PER_ENDPOINT``) ×
    ``endpoints`` requests open, the light one ``CLOSED_LIGHT``. ``seed`` draws the arrivals,
    prompts and output lengths."""
    kind = {"api": "completions", "prompt_tokens": list(shape.prompt),
            "output_tokens": list(shape.output), "stream_fraction": 1.0, "include_usage": True}
    if loop == "closed":
        light: dict[str, Any] = {"backlog": CLOSED_LIGHT}
        heavy: dict[str, Any] = {"backlog": shape.closed_heavy_per_endpoint * endpoints}
    else:
        rate = 30.0 if shape.heavy_rate_per_endpoint is None else \
            shape.heavy_rate_per_endpoint * endpoints
        light, heavy = {"rate": rate / 10 / scale}, {"rate": rate / scale}
    return load_traffic({"duration_s": duration_s, "seed": seed, "timeout_s": TIMEOUT_S,
                         "tenants": [{"name": "light", **light, **kind},
                                     {"name": "flood", **heavy, **kind}]})


def light_p95(records: Sequence[RequestRecord], window: tuple[float, float],
              cut_s: float, waiting_inside: bool = False) -> dict[str, Any]:
    """The light tenant's time to first token, its requests sent inside ``window`` (seconds
    from the load's start): p50 and p95 in ms. A request without a first token counts its wait
    to its end, or to the cut (``cut_s``) when still open there: a lower bound that still
    counts against the percentiles (``bounds`` says how many). ``waiting_inside`` (closed
    loop, where a light client sends its next request only once one ends and may send none
    inside the window): also the requests sent before it that were still waiting for their
    first token when it began."""
    values, bounds = [], 0
    for r in records:
        if r.tenant != "light" or r.start_s > window[1]:
            continue
        first = r.start_s + r.ttft_s if r.ttft_s is not None else (
            cut_s if r.end_s is None else r.end_s)
        if r.start_s < window[0] and not (waiting_inside and first >= window[0]):
            continue
        if r.ttft_s is not None:
            values.append(r.ttft_s)
        else:
            values.append((cut_s if r.end_s is None else r.end_s) - r.start_s)
            bounds += 1
    p50, p95 = percentile(values, 50), percentile(values, 95)
    return {"samples": len(values), "bounds": bounds,
            "p50_ms": None if p50 is None else round(1000 * p50, 1),
            "p95_ms": None if p95 is None else round(1000 * p95, 1)}


def goal_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run of a cell: pool tokens default ÷ pass-through against the goal (≥ ``GOAL``) and
    the stretch (≥ ``STRETCH``), the light tenant's p95 under each variant, the load average
    after each."""
    rows = []
    for name, size in data["sizes"].items():
        modes = size["modes"]
        ratio = size["ratio"]
        rows.append({"name": name, "cell": size.get("cell", {}), "order": size.get("order"),
                     "ratio": ratio,
                     "goal": ratio is not None and ratio >= GOAL,
                     "stretch": ratio is not None and ratio >= STRETCH,
                     "tokens_per_s": {m: modes[m]["tokens_per_s"] for m in modes},
                     "sim_ratio": size.get("simulator", {}).get("ratio"),
                     "light_p95_ms": {m: modes[m].get("light", {}).get("p95_ms") for m in modes},
                     "loadavg": {m: modes[m]["loadavg"] for m in modes}})
    return rows


def goal_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (its seeds and repeats together): runs, the ratio's min and mean, how many runs
    meet the goal and the stretch."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["cell"].get("group", row["name"].split(" #")[0]), []).append(row)
    out = []
    for group, got in groups.items():
        ratios = [r["ratio"] for r in got if r["ratio"] is not None]
        out.append({"group": group, "runs": len(got),
                    "min": min(ratios) if ratios else None,
                    "mean": statistics.fmean(ratios) if ratios else None,
                    "goal_met": sum(r["goal"] for r in got),
                    "stretch_met": sum(r["stretch"] for r in got)})
    return out


# -- reading the traces ---------------------------------------------------------------------------


@dataclass
class Trace:
    """One process's trace: its periodic lines and its events' times by kind and endpoint."""

    lines: list[dict[str, Any]]
    events: dict[tuple[str, str], list[float]]

    def count(self, kind: str, address: str, t: float) -> int:
        """Events of ``kind`` at ``address`` up to ``t``."""
        return bisect.bisect_right(self.events.get((kind, address), []), t)


def read_trace(path: Path, address: str = "") -> Trace:
    """A trace file: lines with an ``ev`` key are events (``address``: theirs when they name
    none, an engine's)."""
    lines, events = [], {}
    for item in read_lines(path):
        if "ev" in item:
            events.setdefault((item["ev"], item.get("a", address)), []).extend(
                [item["t"]] * item.get("n", 1))
        else:
            lines.append(item)
    for times in events.values():
        times.sort()
    # When each step really began: its planned start (``t0``), or the end of the step before
    # if that was later; a server catching up (``--catch-up-ms``) plans starts in the past.
    end = float("-inf")
    for line in lines:
        if "t0" in line:
            line["s0"] = max(line["t0"], end)
            end = line["t"]
    return Trace(lines, events)


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process stopped mid-write
            continue
    return out


def engine_summary(steps: Sequence[dict[str, Any]], t1: float, t2: float,
                   spec: PoolSpec) -> dict[str, float]:
    """One engine's steps inside [t1, t2]: time-weighted running, waiting, KV use; prompt and
    decode tokens a nominal step; the share of the time it was idle; how much longer its steps
    lasted than the server's model of them (``step_s`` + prompt tokens × their cost: the time
    its event loop woke late, the CPU busy elsewhere); decode tokens per second of modelled
    step time (what the engine would have delivered had no step run late)."""
    step_s = spec.step_s
    inside = [s for s in steps if t1 <= s["s0"] and s["t"] <= t2]
    span = t2 - t1
    if not inside or span <= 0:
        return {}
    busy = sum(s["t"] - s["s0"] for s in inside)

    def weighted(key: str) -> float:
        return sum(s[key] * (s["t"] - s["s0"]) for s in inside) / span

    return {"running": weighted("run"), "waiting": weighted("wait"),
            "kv_use": sum(s["kv"] / s["kvt"] * (s["t"] - s["s0"]) for s in inside) / span,
            "prefill_per_step": sum(s["pre"] for s in inside) / (span / step_s),
            "decode_per_step": sum(s["dec"] for s in inside) / (span / step_s),
            "idle_share": max(0.0, 1.0 - busy / span),
            "step_overrun_ms": 1000 * statistics.fmean(
                s["t"] - s["s0"] - step_s - s["pre"] * spec.prefill_s_per_token for s in inside),
            # Idle time counts as it was (an engine with nothing to run loses it either way).
            "decode_per_model_s": sum(s["dec"] for s in inside) / (span - busy + sum(
                step_s + s["pre"] * spec.prefill_s_per_token for s in inside)),
            "preempted": float(sum(s.get("pmt", 0) for s in inside)),
            "prefill_tokens": float(sum(s["pre"] for s in inside)),
            "recomputed_tokens": float(sum(s.get("rec", 0) for s in inside)),
            "decode_tokens": float(sum(s["dec"] for s in inside)),
            "finished_prompt_tokens": float(sum(s.get("fp", 0) for s in inside)),
            "finished_output_tokens": float(sum(s.get("fo", 0) for s in inside)),
            "steps": float(len(inside))}


def _view_at(times: list[float], lines: Sequence[dict[str, Any]],
             t: float) -> dict[str, Any] | None:
    i = bisect.bisect_right(times, t) - 1
    return lines[i] if i >= 0 else None


def cause_of(sent: int, arrived: int, finished: int, settled: int, why: str) -> str:
    """Why the picker held its queue while an engine had room: requests the picker had
    ``sent`` there and the engine had seen ``arrived``, requests the engine had ``finished``
    and the picker had ``settled``, and ``why`` the picker's view (``picker.core.holds``) kept
    its head off that endpoint."""
    if sent > arrived:
        return "dispatch to engine"
    if why == "room":
        return "rule or fair order"
    if why == "waiting":
        return "waiting threshold"
    if finished > settled:
        return "completion seen late"
    if why == "scraped_kv":
        return "scrape lag"
    return "own count"


def held_room(engine: Trace, picker: Trace, address: str, window: tuple[float, float],
              step_s: float, full_running: float) -> dict[str, Any]:
    """The held-room steps of one engine inside ``window``: the engine's seconds and the tokens
    lost (``full_running`` less the requests running, a nominal step) by cause. An idle gap
    between two steps counts as steps with nothing running."""
    t1, t2 = window
    steps, views = engine.lines, picker.lines
    times = [v["t"] for v in views]
    ends = _finish_times(steps)
    seconds = dict.fromkeys(CAUSES, 0.0)
    lost = dict.fromkeys(CAUSES, 0.0)
    intervals: list[tuple[float, float, str]] = []
    for before, step in itertools.pairwise(steps):
        # The gap before the step (engine idle), then the step itself, both as the engine stood
        # after ``before``.
        for start, end, running in ((before["t"], step["s0"], 0), (step["s0"], step["t"],
                                                                    before["run"])):
            if end <= start or start < t1 or end > t2:
                continue
            view = _view_at(times, views, start)
            if view is None or not view["q"] or not view["head"] or before["wait"]:
                continue
            free = (before["kvt"] - before["kv"]) * BLOCK
            if free < view["head"]:
                continue
            endpoint = next((e for e in view["eps"] if e["a"] == address), None)
            if endpoint is None:
                continue
            cause = cause_of(picker.count("d", address, start), engine.count("a", address, start),
                             bisect.bisect_right(ends, start),
                             picker.count("s", address, start), endpoint["why"])
            seconds[cause] += end - start
            lost[cause] += max(0.0, full_running - running) * (end - start) / step_s
            if intervals and intervals[-1][2] == cause and abs(intervals[-1][1] - start) < 1e-6:
                intervals[-1] = (intervals[-1][0], end, cause)
            else:
                intervals.append((start, end, cause))
    return {"seconds": seconds, "lost_tokens": lost, "intervals": intervals}


def picker_summary(views: Sequence[dict[str, Any]], t1: float, t2: float) -> dict[str, Any]:
    """Mean queue, and how often the head was held for each reason, per endpoint."""
    inside = [v for v in views if t1 <= v["t"] <= t2]
    if not inside:
        return {}
    reasons: dict[str, dict[str, int]] = {}
    for v in inside:
        for e in v["eps"]:
            if e["why"] is not None:
                got = reasons.setdefault(e["a"], {})
                got[e["why"]] = got.get(e["why"], 0) + 1
    held = sum(1 for v in inside if v["q"])
    return {"mean_queued": statistics.fmean(v["q"] for v in inside),
            "held_share": held / len(inside),
            "reasons": {a: {k: n / max(1, held) for k, n in r.items()}
                        for a, r in reasons.items()},
            "mean_inflight_tokens": {e["a"]: statistics.fmean(
                x["it"] for v in inside for x in v["eps"] if x["a"] == e["a"])
                for e in inside[0]["eps"]},
            "mean_scrape_age_ms": 1000 * statistics.fmean(
                x["age"] for v in inside for x in v["eps"] if x["age"] is not None)}


def _finish_times(steps: Sequence[dict[str, Any]]) -> list[float]:
    """The end of the step each finished request finished in, in order."""
    out: list[float] = []
    for step in steps:
        out.extend([step["t"]] * (step["fin"] - len(out)))
    return out


def lag(earlier: Sequence[float], later: Sequence[float],
        window: tuple[float, float]) -> float | None:
    """Mean seconds from the n-th of ``earlier`` to the n-th of ``later``, for the n-th of
    ``earlier`` inside ``window`` (the picker's n-th dispatch to an endpoint and its engine's
    n-th arrival; the engine's n-th finished request and the picker's n-th settlement)."""
    pairs = [b - a for a, b in zip(earlier, later, strict=False) if window[0] <= a <= window[1]]
    return statistics.fmean(pairs) if pairs else None


# -- runs -----------------------------------------------------------------------------------------


def run_mode(shape: Shape, mode: str, spec: PoolSpec, traffic: Traffic, scale: float,
             workdir: Path, catch_up_ms: float = CATCH_UP_MS, response_path: str = "meter-stream",
             trace: bool = True) -> dict[str, Any]:
    policy = MODES[mode][0]
    config = mode_config(mode, spec, traffic, scale)
    label = f"{shape.name}-{mode}"
    where = workdir / label
    where.mkdir(parents=True, exist_ok=True)
    traces = (["--trace", str(where / "engine-{port}.jsonl")],
              ["--trace", str(where / "picker.jsonl")]) if trace else ([], [])
    stack = Stack(where / "stack", policy=policy, endpoints=spec.endpoints,
                  server_args=[*server_args(spec), *traces[0], "--catch-up-ms", f"{catch_up_ms:g}"],
                  picker_config=config, picker_args=traces[1], response_path=response_path)
    load_before = loadavg()
    print(f"  {label}: {policy}, {traffic.duration_s:g} s of traffic", flush=True)
    resources: dict[str, Any] = {}
    records: list[RequestRecord] = []
    with stack, measured(resources, lambda: [stack]):
        samples, t0 = asyncio.run(_drive_cut(stack, traffic, 0.25, traffic.duration_s + CUT_S,
                                             records))
    run = GatewayRun(label, policy, traffic.duration_s, (WARMUP_S, traffic.duration_s),
                     LoadResult([], {}, 0.0), samples, resources)
    pool = pool_numbers(run)
    light = light_p95(records, (WARMUP_S, traffic.duration_s), traffic.duration_s + CUT_S,
                      waiting_inside=any(t.backlog is not None for t in traffic.tenants))
    picker = read_trace(where / "picker.jsonl")
    engines = {}
    for path in sorted(where.glob("engine-*.jsonl")):
        address = f"127.0.0.1:{path.stem.split('-')[1]}"
        engines[address] = read_trace(path, address)
    window = (t0 + WARMUP_S, t0 + traffic.duration_s)
    return {"tokens_per_s": pool["server_output_tokens_per_s"], "pool": pool, "light": light,
            "loadavg_before": load_before, "loadavg_after": loadavg(),
            "cpu_busy_fraction": resources.get("cpu_busy_fraction"),
            "cpu_s": {k.split("/")[-1]: v for k, v in resources.get("cpu_s", {}).items()},
            "window": window, "picker": picker, "engines": engines, "config": config}


def mode_config(mode: str, spec: PoolSpec, traffic: Traffic, scale: float) -> dict[str, Any]:
    """The picker's config sections for ``mode`` on ``spec``'s engines (the stack's, and the
    simulator's through ``_sim_config``)."""
    policy, extra = MODES[mode]
    if mode == "default" and policy == "vtc" and spec.engine_policy == "priority":
        # As bench.isolation_envoy: the picker tells priority engines whom to run first;
        # pass-through sends no priority (the engines then run their queue first come).
        extra = merge_sections(extra, {"scheduling": {"enginePolicy": "priority"}})
    return merge_sections(picker_overrides(traffic, {}, "0s"),
                          _mode_config(policy, extra, spec, traffic, scale))


async def _drive_cut(stack: Stack, traffic: Traffic, interval: float, cut_s: float,
                     records: list[RequestRecord] | None = None) -> tuple[list[Sample], float]:
    """``traffic`` through ``stack``, its metrics sampled every ``interval``, cut ``cut_s``
    after the start (requests still open are cancelled; ``records`` keeps every request's
    record as it stood): the samples and the start on the monotonic clock the traces use."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sampler = Sampler(stack, t0, interval)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        sampling = asyncio.create_task(sampler.run(session, stop))
        load = asyncio.create_task(run_traffic(traffic, stack.gateway_url, records=records))
        await asyncio.wait({load}, timeout=cut_s)
        stop.set()
        await sampling
        await sampler.take(session)  # the counters at the cut
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return sampler.samples, t0


def analyse(shape: Shape, spec: PoolSpec, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    step_s = spec.step_s
    out: dict[str, Any] = {"modes": {}}
    for mode, run in runs.items():
        t1, t2 = run["window"]
        picker: Trace = run["picker"]
        engines: dict[str, Trace] = run["engines"]
        out["modes"][mode] = {
            "tokens_per_s": run["tokens_per_s"], "loadavg": run["loadavg_after"],
            "loadavg_before": run["loadavg_before"], "light": run["light"],
            "cpu_busy_fraction": run["cpu_busy_fraction"],
            "engines": {a: engine_summary(e.lines, t1, t2, spec) for a, e in engines.items()},
            "cpu_s": run["cpu_s"],
            "picker": picker_summary(picker.lines, t1, t2),
            "dispatch_latency_ms": {a: _ms(lag(picker.events.get(("d", a), []),
                                               e.events.get(("a", a), []), (t1, t2)))
                                    for a, e in engines.items()},
            "completion_lag_ms": {a: _ms(lag(_finish_times(e.lines),
                                             picker.events.get(("s", a), []), (t1, t2)))
                                  for a, e in engines.items()}}
    passthrough, default = out["modes"]["pass-through"], out["modes"]["default"]
    out["ratio"] = default["tokens_per_s"] / passthrough["tokens_per_s"] \
        if passthrough["tokens_per_s"] else None
    out["traced"] = all(run["engines"] and run["picker"].lines for run in runs.values())
    if not out["traced"]:
        out["ratio_model_time"] = None
        return out
    # Pass-through's engines, as full as their queues kept them: the running a step there.
    full = statistics.fmean(e.get("running", 0.0) for e in passthrough["engines"].values())
    run = runs["default"]
    lost = dict.fromkeys(CAUSES, 0.0)
    seconds = dict.fromkeys(CAUSES, 0.0)
    intervals: dict[str, list[tuple[float, float, str]]] = {}
    for address, engine in run["engines"].items():
        got = held_room(engine, run["picker"], address, run["window"], step_s, full)
        intervals[address] = got["intervals"]
        for cause in CAUSES:
            lost[cause] += got["lost_tokens"][cause]
            seconds[cause] += got["seconds"][cause]
    span = run["window"][1] - run["window"][0]
    measured = (passthrough["tokens_per_s"] - default["tokens_per_s"]) * span
    out["breakdown"] = {"lost_tokens": lost, "engine_seconds": seconds,
                        "measured_lost_tokens": measured, "full_running": full,
                        "window_s": span}
    out["intervals"] = intervals
    modelled = [sum(e.get("decode_per_model_s", 0.0) for e in m["engines"].values())
                for m in (default, passthrough)]
    out["ratio_model_time"] = modelled[0] / modelled[1] if modelled[1] else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def simulator_ratio(spec: PoolSpec, traffic: Traffic, runs: dict[str, dict[str, Any]]
                    ) -> dict[str, Any]:
    """The same traffic and configs in the pool simulator: tokens/s per mode and the ratio."""
    got = {}
    for mode, run in runs.items():
        started = time.process_time()
        sim = simulate(_sim_config(traffic, run["config"], spec), traffic, spec,
                       warmup_s=WARMUP_S, duration_s=traffic.duration_s, drain_s=0.0)
        got[mode] = _numbers(sim, time.process_time() - started)["tokens_per_s"]
    return {"tokens_per_s": got, "ratio": got["default"] / got["pass-through"]
            if got["pass-through"] else None,
            "dispatch_latency_s": spec.dispatch_latency_s,
            "completion_lag_s": spec.completion_lag_s}


def measured_latencies(mode: dict[str, Any]) -> tuple[float, float]:
    """The default run's mean dispatch-to-engine latency and completion lag, seconds."""
    lat = [v for v in mode["dispatch_latency_ms"].values() if v is not None]
    lag_ = [v for v in mode["completion_lag_ms"].values() if v is not None]
    return (statistics.fmean(lat) / 1000 if lat else 0.0,
            statistics.fmean(lag_) / 1000 if lag_ else 0.0)


def run_shape(shape: Shape, scale: float, workdir: Path, sim_spec: PoolSpec | None = None,
              order: Sequence[str] = tuple(MODES), label: str = "",
              catch_up_ms: float = CATCH_UP_MS, cell: Cell | None = None,
              duration_s: float = DURATION_S, trace: bool = True, sim: bool = True
              ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Both variants of ``cell`` (the issue's first row of ``shape`` by default) on fresh
    stacks in ``order``; then, unless ``sim`` is off, the pool simulator on the same traffic.
    Without ``trace`` the servers and the picker write no trace: no breakdown, less CPU."""
    cell = cell or Cell(shape)
    spec = cell_spec(cell, scale)
    traffic = shape_traffic(shape, scale, cell.seed, cell.loop, cell.endpoints, duration_s)
    runs = {mode: run_mode(shape, mode, spec, traffic, scale, workdir / label, catch_up_ms,
                           cell.response_path, trace)
            for mode in order}
    result = analyse(shape, spec, runs)
    result["spec"] = {k: v for k, v in spec.__dict__.items()}
    result["order"] = list(order)
    result["cell"] = {"group": cell.group, "size": shape.name, "loop": cell.loop,
                      "engines": cell.engines, "endpoints": cell.endpoints, "seed": cell.seed,
                      "response_path": cell.response_path, "duration_s": duration_s}
    none: dict[str, Any] = {"ratio": None}
    result["simulator"] = simulator_ratio(sim_spec or spec, traffic, runs) if sim else none
    if sim and result["traced"]:
        latency, completion = measured_latencies(result["modes"]["default"])
        result["simulator_latencies"] = simulator_ratio(
            replace(sim_spec or spec, dispatch_latency_s=latency, completion_lag_s=completion),
            traffic, runs)
    else:
        result["simulator_latencies"] = none
    return result, runs


# -- the simulator alone (issue 27: "Default, in the pool simulator") ------------------------------

SIM_ENDPOINTS = (2, 4, 8)
SIM_DURATION_S = 90.0
SIM_WARMUP_S = 30.0
"""At 500k a request stays about 30 s in its engine (prefill-bound, about 14 decode steps a
second): the window opens once the pool is full and holds two such lifetimes."""
SIM_DISPATCH_LATENCY_S = 0.015
SIM_COMPLETION_LAG_S = 0.05
"""The default's dispatch-to-engine time and completion lag through Envoy on the meter stream
(``efficiency.md``: 15-17 ms and 44-62 ms; 170 ms once)."""


def sim_cell(cell: Cell, duration_s: float = SIM_DURATION_S, warmup_s: float = SIM_WARMUP_S,
             dispatch_latency_s: float = SIM_DISPATCH_LATENCY_S,
             completion_lag_s: float = SIM_COMPLETION_LAG_S) -> dict[str, Any]:
    """Both variants of ``cell`` in the pool simulator alone: tokens/s in the window, the
    engines' preemptions and recomputed tokens, the simulator's CPU seconds."""
    spec = replace(cell_spec(cell, 1.0), dispatch_latency_s=dispatch_latency_s,
                   completion_lag_s=completion_lag_s)
    traffic = shape_traffic(cell.shape, 1.0, cell.seed, cell.loop, cell.endpoints, duration_s)
    modes = {}
    for mode in MODES:
        started = time.process_time()
        run = simulate(_sim_config(traffic, mode_config(mode, spec, traffic, 1.0), spec),
                       traffic, spec, warmup_s=warmup_s, duration_s=duration_s, drain_s=0.0)
        modes[mode] = {"tokens_per_s": run.tokens_per_s(), "preemptions": run.preemptions,
                       "recomputed_tokens": run.recomputed_tokens,
                       "requests": len(run.records),
                       "cpu_s": round(time.process_time() - started, 1)}
    passthrough = modes["pass-through"]["tokens_per_s"]
    return {"cell": {"group": cell.group, "size": cell.shape.name, "loop": cell.loop,
                     "engines": cell.engines, "endpoints": cell.endpoints, "seed": cell.seed,
                     "kv_budget_tokens": spec.kv_budget_tokens},
            "spec": {k: v for k, v in spec.__dict__.items()},
            "duration_s": duration_s, "warmup_s": warmup_s,
            "traffic": {t.name: t.backlog if t.backlog is not None else t.rate
                        for t in traffic.tenants},
            "modes": modes,
            "ratio": modes["default"]["tokens_per_s"] / passthrough if passthrough else None,
            "loadavg": loadavg()}


def sim_report(data: dict[str, Any]) -> list[str]:
    """The simulator-alone matrix: per run, default ÷ pass-through against the goal; per cell,
    its seeds together."""
    rows = list(data["cells"].values())
    first = rows[0] if rows else {"duration_s": SIM_DURATION_S, "warmup_s": SIM_WARMUP_S,
                                  "spec": {}}
    spec = first["spec"]
    lines = [
        "# The default against pass-through in the pool simulator, large pools (issue 27)", "",
        f"Generated by `python -m bench.efficiency {data['command']}` (the pool simulator "
        "alone, no lock: no process is started); load average "
        f"{' '.join(map(str, data['loadavg_before']))} at the start, "
        f"{' '.join(map(str, data['loadavg_after']))} at the end, "
        f"{data['wall_s']:.0f} s.", "",
        "Goal (issue 27, *Default, in the pool simulator*): pool tokens default ÷ FCFS "
        f"pass-through ≥ {GOAL:g} (stretch {STRETCH:.2f}) at 256k and 500k tokens per endpoint "
        "and on 8 endpoints. The issue's requests (prompts 3,000-6,000 tokens, outputs "
        "300-500, streamed, `ignore_eos`); open loop: heavy 15 requests/s per endpoint and "
        "light 1.5 (the issue's 30 and 3 on 2 endpoints: an engine finishes about 3.4 a second "
        "at 256k and 3.8 at 500k, so the pool is 4-5 times overloaded); closed loop: heavy "
        "32 requests open per endpoint per 64k of cache (128 at 256k, 244 at 500k), light 2. "
        "Engines: vLLM V1's scheduler (`picker.sim.vllm`), steps "
        f"{spec.get('step_s', 0.01) * 1000:g} ms "
        f"+ {spec.get('prefill_s_per_token', 0) * 1e6:g} ms per 1k prompt tokens, "
        f"{spec.get('max_num_batched_tokens', 8192)} tokens a step, prefix caching on (a "
        "preempted request recomputes only its evicted blocks, as vLLM V1). Through Envoy's "
        "latencies as measured (`efficiency.md`): a dispatch reaches its engine "
        f"{spec.get('dispatch_latency_s', 0) * 1000:g} ms after the picker sends it, the "
        f"picker sees a request end {spec.get('completion_lag_s', 0) * 1000:g} ms after its "
        f"last step. {first['duration_s']:g} s of traffic, tokens counted from "
        f"{first['warmup_s']:g} s. Pass-through: `scheduling.policy: fcfs`, every request to "
        "an engine at once (their queues decide); default: the fairway default (VTC; on "
        "priority engines `scheduling.enginePolicy: priority`).", "",
        "The pass-through baseline is what vLLM V1 does with the same queue: when a running "
        "request cannot get a block, the engine preempts by recompute the newest running "
        "request (fcfs: `self.running.pop()`; priority: the largest (priority, arrival)), frees "
        "its blocks still cached (tail first into the free queue) and puts it back at the head "
        "of the waiting queue; admission stops for that step. When it is scheduled again its "
        "leading blocks are a prefix-cache hit (`get_computed_blocks` for a request with no "
        "computed tokens, preempted ones included): only the blocks evicted meanwhile are "
        "computed again. Until the simulator gave requests drawn as counts token ids of their "
        "own, it recomputed a preempted request's whole context, which made pass-through "
        "thrash at large sizes and read 5-11 % below the simulated servers at 64k; the "
        "preemptions and recomputed tokens (whole run) are in the table.", "",
        "| cell | KV tokens per endpoint | endpoints | seed | pass-through tok/s | default tok/s "
        f"| default ÷ pass-through | ≥ {GOAL:g} | ≥ {STRETCH:.2f} | preemptions pass-through / "
        "default | recomputed tokens pass-through / default | simulator CPU s |",
        "|" + "---|" * 12]
    for r in rows:
        c, m = r["cell"], r["modes"]
        ratio = r["ratio"]
        lines.append(
            f"| {c['group']} | {c['kv_budget_tokens']:,} | {c['endpoints']} | {c['seed']} | "
            f"{m['pass-through']['tokens_per_s']:.0f} | {m['default']['tokens_per_s']:.0f} | "
            f"{_f(ratio, '.3f')} | {'yes' if ratio is not None and ratio >= GOAL else '**no**'} "
            f"| {'yes' if ratio is not None and ratio >= STRETCH else 'no'} | "
            f"{m['pass-through']['preemptions']} / {m['default']['preemptions']} | "
            f"{m['pass-through']['recomputed_tokens']:,} / {m['default']['recomputed_tokens']:,}"
            f" | {m['pass-through']['cpu_s'] + m['default']['cpu_s']:.0f} |")
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r["ratio"] is not None:
            groups.setdefault(r["cell"]["group"], []).append(r["ratio"])
    lines += ["", "| cell | runs | ratio min | ratio mean | runs ≥ goal | verdict |",
              "|---|---|---|---|---|---|"]
    for group, ratios in groups.items():
        met = sum(x >= GOAL for x in ratios)
        verdict = "met" if met == len(ratios) else f"**not met** ({len(ratios) - met} below)"
        lines.append(f"| {group} | {len(ratios)} | {min(ratios):.3f} | "
                     f"{statistics.fmean(ratios):.3f} | {met} | {verdict} |")
    ratios = [x for g in groups.values() for x in g]
    if ratios:
        met = sum(x >= GOAL for x in ratios)
        lines += ["", f"All runs: {met} of {len(ratios)} at {GOAL:g} or more, "
                  f"{sum(x >= STRETCH for x in ratios)} at {STRETCH:.2f} or more; ratio "
                  f"{min(ratios):.3f}-{max(ratios):.3f}, median "
                  f"{statistics.median(ratios):.3f}."]
    return lines


def resim(data: dict[str, Any], latencies: tuple[float, float] = (0.0, 0.0)
          ) -> dict[str, Any]:
    """The pool simulator as it is now on every cell of a stored goal-matrix run (its traffic
    drawn again from the cell's seed): per cell, Envoy's ratio, the simulator's as that run
    recorded it, and now (``latencies``: dispatch latency and completion lag, seconds)."""
    shapes = {shape.name: shape for shape in (*SHAPES, *LARGE_SHAPES)}
    out = {}
    for name, size in data["sizes"].items():
        c = size["cell"]
        cell = Cell(shapes[c["size"]], c["loop"], c["engines"], c["endpoints"], c["seed"],
                    c["response_path"])
        spec = replace(cell_spec(cell, data["scale"]), dispatch_latency_s=latencies[0],
                       completion_lag_s=latencies[1])
        traffic = shape_traffic(cell.shape, data["scale"], cell.seed, cell.loop, cell.endpoints,
                                c.get("duration_s") or DURATION_S)
        got = {}
        for mode in MODES:
            run = simulate(_sim_config(traffic, mode_config(mode, spec, traffic, data["scale"]),
                                       spec), traffic, spec, warmup_s=WARMUP_S,
                           duration_s=traffic.duration_s, drain_s=0.0)
            got[mode] = run.tokens_per_s()
        out[name] = {"group": c["group"], "seed": c["seed"], "envoy": size["ratio"],
                     "envoy_tokens_per_s": {m: size["modes"][m]["tokens_per_s"] for m in MODES},
                     "recorded": size["simulator"]["ratio"], "tokens_per_s": got,
                     "now": got["default"] / got["pass-through"] if got["pass-through"] else None}
        print(f"  {name}: Envoy {_f(size['ratio'], '.3f')}, simulator then "
              f"{_f(size['simulator']['ratio'], '.3f')}, now {_f(out[name]['now'], '.3f')}",
              flush=True)
    return out


def resim_report(rows: dict[str, Any], source: str, command: str,
                 loads: tuple[list[float], list[float]], latencies: tuple[float, float]
                 ) -> list[str]:
    """Envoy's ratio beside the simulator's, then and now, with the agreement counts."""
    def agree(key: str) -> list[float]:
        return [abs(r[key] / r["envoy"] - 1) for r in rows.values()
                if r[key] is not None and r["envoy"]]

    def pool_ratio(mode: str) -> str:
        got = [r["tokens_per_s"][mode] / r["envoy_tokens_per_s"][mode] for r in rows.values()
               if r["envoy_tokens_per_s"][mode]]
        return f"{statistics.fmean(got):.3f} ({min(got):.3f}-{max(got):.3f})" if got else "–"

    lines = ["# The pool simulator against the gateway on the goal matrix (issue 27 point 4)", "",
             f"Generated by `python -m bench.efficiency {command}`: the pool simulator as it is "
             f"now, on the traffic and configs of every run in `{source}` (each cell's traffic "
             "drawn again from its seed), beside the default ÷ pass-through those runs measured "
             "through real Envoy and the simulator's ratio they recorded then. Simulator "
             f"latencies: dispatch {latencies[0] * 1000:g} ms, completion seen "
             f"{latencies[1] * 1000:g} ms after the last step. Load average "
             f"{' '.join(map(str, loads[0]))} at the start, {' '.join(map(str, loads[1]))} at "
             "the end (the simulator's numbers do not depend on it).", ""]
    for key, label in (("recorded", "then"), ("now", "now")):
        d = agree(key)
        if d:
            lines.append(f"- Simulator {label}: within {SIM_AGREEMENT:.0%} of Envoy in "
                         f"{sum(x <= SIM_AGREEMENT for x in d)} of {len(d)} runs, difference "
                         f"mean {statistics.fmean(d):.1%}, largest {max(d):.1%}.")
    lines.append(f"- The simulator's pool tokens now ÷ Envoy's, mean (range): pass-through "
                 f"{pool_ratio('pass-through')}, default {pool_ratio('default')}.")
    lines += ["", "| run | seed | Envoy | simulator then | difference then | simulator now | "
              "difference now |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['seed']} | {_f(r['envoy'], '.3f')} | "
                     f"{_f(r['recorded'], '.3f')} | {_difference(r['envoy'], r['recorded'])} | "
                     f"{_f(r['now'], '.3f')} | {_difference(r['envoy'], r['now'])} |")
    return lines


# -- the report -----------------------------------------------------------------------------------


def _f(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def write_report(data: dict[str, Any], out: Path) -> None:
    lines = ["# Where the default gate's tokens go (issue 27)", ""]
    traced = {n: z for n, z in data["sizes"].items() if z.get("traced", True)}
    if traced:
        lines += breakdown_report({**data, "sizes": traced})
    lines += ["", *goals_report(data)]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def breakdown_report(data: dict[str, Any]) -> list[str]:
    """The traced runs: engines and picker side by side, the held-room steps and their causes,
    why the picker held its head."""
    scale = data["scale"]
    lines = [
             "Generated by `python -m bench.efficiency`. Each size runs the same traffic through "
             "FCFS pass-through and the fairway default, each on a fresh stack (real Envoy, the "
             "picker over TLS, two simulated vLLM servers, engines fcfs, open loop, unless the "
             "row's name says otherwise), with the servers' step "
             "trace and the picker's trace on; then through the pool simulator. Traffic: a "
             "heavy tenant open-loop at 30 requests/s and a light one at 3, streamed, "
             f"`max_tokens` with `ignore_eos`, {DURATION_S:g} s (clients wait {TIMEOUT_S:g} s, so "
             "none gives up inside the run; the run is cut when sending stops), tokens counted "
             f"from {WARMUP_S:g} s to the end of sending; "
             + ("the issue's own time scale (steps 10 ms)" if scale == 1 else
                f"time {scale:g}× slower (steps {10 * scale:g} ms, prefill {scale:g}× longer, "
                f"rates ÷ {scale:g}), as `bench.isolation_envoy` runs") + ". "
             "A '#2' row runs the two modes in the other order.", "",
             "Columns: *÷ pass-through (Envoy)*: the servers' output tokens/s; *per modelled "
             "step time*: decode tokens per second of the time the servers' steps would have "
             "taken by their own model (`--step-ms` + prompt tokens × their cost, idle time as "
             "it was), i.e. without the time each simulated engine's event loop woke late "
             "(*step overrun*: the mean of that per step; two cores carry every process and "
             "other runs, and a GPU's steps do not slow when its host's CPU is busy); "
             "*simulator*: the pool simulator on the same traffic and configs; *with the "
             "measured latencies*: the same with `PoolSpec.dispatch_latency_s` and "
             "`completion_lag_s` set to the default run's mean dispatch→engine and "
             "completion-seen-after times.", "",
             "| size | mode | tokens/s | ÷ pass-through (Envoy) | same, per modelled step time "
             "| ÷ pass-through (simulator) | same, with the measured latencies "
             "| step overrun ms | picker CPU s | engine running "
             "| engine waiting | KV use | prompt tok/step | decode tok/step "
             "| engine idle | picker queue | dispatch→engine ms | completion seen after ms "
             "| load avg |", "|" + "---|" * 19]
    for name, size in data["sizes"].items():
        sim = size["simulator"]
        for mode, m in size["modes"].items():
            engines = list(m["engines"].values())

            def mean(key: str, engines: list[dict[str, float]] = engines) -> float | None:
                got = [e[key] for e in engines if key in e]
                return statistics.fmean(got) if got else None

            lat = [v for v in m["dispatch_latency_ms"].values() if v is not None]
            lag = [v for v in m["completion_lag_ms"].values() if v is not None]
            ratio = size["ratio"] if mode == "default" else 1.0
            sim_ratio = sim["ratio"] if mode == "default" else 1.0
            model_ratio = size["ratio_model_time"] if mode == "default" else 1.0
            sim_late = size["simulator_latencies"]["ratio"] if mode == "default" else 1.0
            cpu = m.get("cpu_s", {}).get("picker")
            lines.append(
                f"| {name} | {mode} | {m['tokens_per_s']:.0f} | {_f(ratio, '.3f')} | "
                f"{_f(model_ratio, '.3f')} | {_f(sim_ratio, '.3f')} | {_f(sim_late, '.3f')} | "
                f"{_f(mean('step_overrun_ms'), '.2f')} | {_f(cpu, '.1f')} | "
                f"{_f(mean('running'), '.1f')} | "
                f"{_f(mean('waiting'), '.1f')} | {_f(mean('kv_use'), '.0%')} | "
                f"{_f(mean('prefill_per_step'), '.0f')} | {_f(mean('decode_per_step'), '.1f')} | "
                f"{_f(mean('idle_share'), '.1%')} | "
                f"{_f(m['picker'].get('mean_queued'), '.1f')} | "
                f"{_f(statistics.fmean(lat) if lat else None, '.1f')} | "
                f"{_f(statistics.fmean(lag) if lag else None, '.1f')} | "
                f"{' '.join(str(x) for x in m['loadavg'])} |")
    lines += ["", *reading(data)]
    lines += ["", "## Held-room steps: the default's engines had room and nothing waiting while "
              "the picker held requests", "",
              "Lost tokens: per such step, pass-through's mean running requests less the "
              "default's, a nominal step. 'Measured' is the window's token difference between "
              "the two runs (shares only where pass-through delivered more).", "",
              "| size | cause | engine seconds | lost tokens | share of the held-room loss | "
              "share of the measured loss |", "|---|---|---|---|---|---|"]
    for name, size in data["sizes"].items():
        b = size["breakdown"]
        total = sum(b["lost_tokens"].values())
        measured = b["measured_lost_tokens"]
        for cause in CAUSES:
            lost = b["lost_tokens"][cause]
            lines.append(f"| {name} | {cause} | {b['engine_seconds'][cause]:.2f} | {lost:.0f} | "
                         f"{_f(lost / total if total else None, '.0%')} | "
                         f"{_f(lost / measured if measured > 0 else None, '.0%')} |")
        lines.append(f"| {name} | **all** | {sum(b['engine_seconds'].values()):.2f} | "
                     f"{total:.0f} | 100% | {_f(total / measured if measured > 0 else None, '.0%')}"
                     f" (measured {measured:.0f}) |")
    lines += ["", "## Why the picker held its head, by endpoint (share of held samples)", ""]
    for name, size in data["sizes"].items():
        reasons = size["modes"]["default"]["picker"].get("reasons", {})
        for address, got in reasons.items():
            text = ", ".join(f"{k} {v:.0%}" for k, v in sorted(got.items(), key=lambda kv: -kv[1]))
            lines.append(f"- {name}, {address}: {text}")
    if data.get("plot"):
        lines += ["", f"![engines and picker over time]({data['plot']})"]
    return lines


def goals_report(data: dict[str, Any]) -> list[str]:
    """Issue 27's goal table: per run of a cell, pool tokens default ÷ pass-through against
    the goal, the light tenant's p95 under each variant, the load average."""
    rows = goal_rows(data)
    durations = sorted({r["cell"].get("duration_s", DURATION_S) for r in rows})
    lines = ["## Goals: the default against FCFS pass-through, through real Envoy", "",
             f"Goal: pool tokens default ÷ pass-through ≥ {GOAL:g} (stretch {STRETCH:.2f}), "
             "both variants of a row in one run, each on a fresh stack, their order alternated "
             "between seeds. Open loop: heavy 30 requests/s, light 3 (÷ scale); closed loop: "
             f"heavy {CLOSED_HEAVY_PER_ENDPOINT} requests open per endpoint, light "
             f"{CLOSED_LIGHT}. Sending lasts {'/'.join(f'{d:g}' for d in durations)} s, tokens "
             f"and the light tenant's TTFT (requests sent from {WARMUP_S:g} s to the end of "
             "sending, and in closed loop those still waiting for their first token at "
             f"{WARMUP_S:g} s; one without a first token at the cut counts its wait so far) are "
             "counted inside it. Traffic seed: arrivals, prompts and output lengths. Load "
             "average: the 1/5/15-minute figures after each variant.", "",
             "*Simulator*: the pool simulator's default ÷ pass-through on the same traffic and "
             "configs (issue 27 point 4: within 3 % of Envoy's); *difference*: simulator ÷ "
             "Envoy − 1.", "",
             "| cell | seed | order | pass-through tok/s | default tok/s | default ÷ "
             f"pass-through | ≥ {GOAL:g} | ≥ {STRETCH:.2f} | simulator | difference | light p95 "
             "ms, pass-through | light p95 ms, default | load avg after pass-through / default |",
             "|" + "---|" * 13]
    for r in rows:
        cell = r["cell"]
        first = (r["order"] or ["pass-through"])[0]
        tok, p95, load = r["tokens_per_s"], r["light_p95_ms"], r["loadavg"]
        lines.append(
            f"| {cell.get('group', r['name'])}{r['name'][len(r['name'].split(' #')[0]):]} | "
            f"{cell.get('seed', FIRST_SEED)} | {first} first | "
            f"{tok['pass-through']:.0f} | {tok['default']:.0f} | {_f(r['ratio'], '.3f')} | "
            f"{'yes' if r['goal'] else '**no**'} | {'yes' if r['stretch'] else 'no'} | "
            f"{_f(r['sim_ratio'], '.3f')} | {_difference(r['ratio'], r['sim_ratio'])} | "
            f"{_f(p95['pass-through'], '.0f')} | {_f(p95['default'], '.0f')} | "
            f"{' '.join(str(x) for x in load['pass-through'])} / "
            f"{' '.join(str(x) for x in load['default'])} |")
    lines += ["", "| cell | runs | ratio min | ratio mean | runs ≥ goal | runs ≥ stretch |",
              "|---|---|---|---|---|---|"]
    for g in goal_summary(rows):
        lines.append(f"| {g['group']} | {g['runs']} | {_f(g['min'], '.3f')} | "
                     f"{_f(g['mean'], '.3f')} | {g['goal_met']} | {g['stretch_met']} |")
    diffs = [abs(r["sim_ratio"] / r["ratio"] - 1) for r in rows
             if r["sim_ratio"] is not None and r["ratio"]]
    if diffs:
        lines += ["", f"The simulator's ratio lies within {SIM_AGREEMENT:.0%} of Envoy's in "
                  f"{sum(d <= SIM_AGREEMENT for d in diffs)} of {len(diffs)} runs (difference "
                  f"mean {statistics.fmean(diffs):.1%}, largest {max(diffs):.1%})."]
    return lines


def _difference(envoy: float | None, sim: float | None) -> str:
    """The simulator's ratio against Envoy's, signed; bold past ``SIM_AGREEMENT``."""
    if envoy is None or sim is None or not envoy:
        return "–"
    text = f"{sim / envoy - 1:+.1%}"
    return text if abs(sim / envoy - 1) <= SIM_AGREEMENT else f"**{text}**"


def reading(data: dict[str, Any]) -> list[str]:
    """What the table says, in numbers drawn from it."""
    sizes = data["sizes"]

    def spread(values: list[float], spec: str = ".3f") -> str:
        return f"{min(values):{spec}}–{max(values):{spec}}" if values else "–"

    raw = [z["ratio"] for z in sizes.values() if z["ratio"] is not None]
    overrun = [e["step_overrun_ms"] for z in sizes.values() for m in z["modes"].values()
               for e in m["engines"].values() if "step_overrun_ms" in e]
    step_ms = data['sizes'][next(iter(sizes))]['spec']['step_s'] * 1000
    catch_up = data.get("catch_up_ms", 0.0)
    lines = ["## Reading", ""]
    if catch_up:
        lines.append(
            f"- The servers ran with `--catch-up-ms {catch_up:g}`: a step whose end their event "
            "loop noticed late is made up by the next ones, so the engines keep their modelled "
            f"pace (step overrun {spread(overrun, '.2f')} ms a step on a {step_ms:g} ms step) "
            "however busy the two shared cores are. The raw ratio through Envoy is then "
            f"{spread(raw)}. Without it (`--catch-up-ms 0`, the servers' default) the steps "
            "overran their model by 2-10 ms, by a different amount per mode and run, and the "
            "same traffic read 0.91-1.25 in nine run pairs of this bench (the issue's "
            "0.86-0.92 were such runs).")
    else:
        lines.append(
            f"- The raw ratio through Envoy is {spread(raw)} over these runs of the same "
            "traffic. What moves it is how late each simulated engine's steps ran: they "
            f"overran their model by {spread(overrun, '.1f')} ms on a {step_ms:g} ms step, by "
            "a different amount per mode and run (the two cores carry Envoy, the picker, both "
            "servers, the load client and other runs).")
    lines.append("- Both modes keep the engines equally full: the running requests and KV use "
                 "columns; neither engine is ever idle (engine idle column).")
    for name in dict.fromkeys(n.split(" #")[0] for n in sizes):
        rows = [z for n, z in sizes.items() if n.split(" #")[0] == name]
        model = [z["ratio_model_time"] for z in rows if z.get("ratio_model_time") is not None]
        sim = [z["simulator"]["ratio"] for z in rows if z["simulator"]["ratio"] is not None]
        late = [z["simulator_latencies"]["ratio"] for z in rows
                if z["simulator_latencies"]["ratio"] is not None]
        lines.append(f"- {name}: per modelled step time the default delivers {spread(model)} "
                     f"of pass-through; the simulator says {spread(sim)} ({spread(late)} with "
                     "the measured dispatch and completion latencies).")
    lines.append("- At 64k one prompt's prefill is about 225 ms of an engine's time and the "
                 "window holds about 60 requests per engine: whether a few prefills fall inside "
                 "it moves a 30 s run's ratio by a few percent, through Envoy and in the "
                 "simulator alike.")
    lines.append("- The held-room estimate below is an upper bound (pass-through's mean "
                 "running requests against each step's, which vary by one or two from step to "
                 "step in both modes); it is at most about 1.5 % of the window's tokens.")
    return lines


def plot(data: dict[str, Any], runs: dict[str, dict[str, dict[str, Any]]],
         out: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colours = dict(zip(CAUSES, ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:gray",
                                "tab:green"), strict=True))
    names = list(runs)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 3.4 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        size_runs = runs[name]
        spec = data["sizes"][name]["spec"]
        ax, pace = row
        for mode, style in (("pass-through", ":"), ("default", "-")):
            run = size_runs[mode]
            address = sorted(run["engines"])[0]
            m0 = run["window"][0]
            steps = [s for s in run["engines"][address].lines if m0 <= s["s0"] <= m0 + 8.0]
            ax.plot([s["t"] - m0 for s in steps], [s["run"] for s in steps], style, lw=1,
                    label=f"{mode}: engine running")
            # Each step's time beyond the server's model of it, a moving mean of 25 steps.
            over = [1000 * (s["t"] - s["s0"] - spec["step_s"]
                            - s["pre"] * spec["prefill_s_per_token"]) for s in steps]
            smooth = [statistics.fmean(over[max(0, i - 24):i + 1]) for i in range(len(over))]
            pace.plot([s["t"] - m0 for s in steps], smooth, style, lw=1, label=mode)
            if mode == "default":
                for start, end, cause in data["sizes"][name]["intervals"].get(address, []):
                    if m0 <= start and end <= m0 + 8.0:
                        ax.axvspan(start - m0, end - m0, color=colours[cause], alpha=0.3, lw=0)
        for cause, colour in colours.items():
            ax.plot([], [], color=colour, alpha=0.4, lw=6, label=f"held room: {cause}")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: one endpoint's running requests, 8 s after the warm-up")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=6, loc="lower right", ncol=2)
        pace.set_title(f"{name}: how much longer each step ran than modelled (25-step mean)")
        pace.set_xlabel("seconds")
        pace.set_ylabel("ms")
        pace.set_ylim(bottom=0)
        pace.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out.name


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--only", action="append", help="run only this size (8k, 64k)")
    parser.add_argument("--scale", type=float, default=SCALE)
    parser.add_argument("--keep", help="keep the runs' traces in this directory")
    parser.add_argument("--catch-up-ms", type=float, default=CATCH_UP_MS,
                        help="the servers' --catch-up-ms (0: a late step's time is lost)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each cell this many times, the modes' order reversed each "
                             "time (the machine's load drifts)")
    parser.add_argument("--loop", default="open", metavar="A[,B]",
                        help=f"open (30 and 3 requests/s) or closed (heavy "
                             f"{CLOSED_HEAVY_PER_ENDPOINT} open per endpoint, light "
                             f"{CLOSED_LIGHT}); comma list with --matrix")
    parser.add_argument("--engines", default="fcfs", metavar="A[,B]",
                        help="the servers' --scheduling-policy: fcfs or priority (the default "
                             "variant then sets scheduling.enginePolicy: priority)")
    parser.add_argument("--endpoints", default="2", metavar="A[,B]",
                        help="simulated servers: 2 or 4")
    parser.add_argument("--response-path", default="meter-stream", metavar="A[,B]",
                        help=f"one of {', '.join(RESPONSE_PATHS)}")
    parser.add_argument("--seeds", type=int, default=1,
                        help=f"traffic seeds {FIRST_SEED}.. per cell (arrivals, prompts, "
                             "outputs); the variants' order alternates between them")
    parser.add_argument("--resim", metavar="JSON",
                        help="no stack: the pool simulator as it is now on every cell of this "
                             "goal-matrix efficiency.json, beside its Envoy and simulator "
                             "ratios; writes efficiency_sim_agreement.md (latencies: "
                             "--dispatch-latency-ms, --completion-lag-ms, 0 unless given)")
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED,
                        help="the first traffic seed (then the next --seeds - 1)")
    parser.add_argument("--matrix", action="store_true",
                        help="run every combination of the comma lists (the issue's goal "
                             "matrix; the inline and access-log paths one seed each)")
    parser.add_argument("--duration", type=float, default=None,
                        help=f"seconds of sending per run (the issue's {DURATION_S:g}; "
                             f"--sim-only: {SIM_DURATION_S:g})")
    parser.add_argument("--sim-only", action="store_true",
                        help="the pool simulator alone on the matrix (no stack, no lock "
                             "needed), the large pools by default (--only 256k, 500k, 8k, 64k); "
                             f"endpoints up to 8; tokens counted after --warmup "
                             f"(default {SIM_WARMUP_S:g} s); writes efficiency_sim_large.md")
    parser.add_argument("--append", action="store_true",
                        help="--sim-only: add the cells to efficiency_sim_large.json's, "
                             "the report then covers both runs")
    parser.add_argument("--warmup", type=float, default=SIM_WARMUP_S,
                        help="--sim-only: seconds before the tokens are counted")
    parser.add_argument("--dispatch-latency-ms", type=float, default=None,
                        help="--sim-only, --resim: PoolSpec.dispatch_latency_s, ms (--sim-only: "
                             f"{SIM_DISPATCH_LATENCY_S * 1000:g} unless given)")
    parser.add_argument("--completion-lag-ms", type=float, default=None,
                        help="--sim-only, --resim: PoolSpec.completion_lag_s, ms (--sim-only: "
                             f"{SIM_COMPLETION_LAG_S * 1000:g} unless given)")
    parser.add_argument("--no-trace", action="store_true",
                        help="no step or picker traces: no breakdown, less CPU")
    parser.add_argument("--no-sim", action="store_true", help="skip the pool simulator")
    parser.add_argument("--aa", action="store_true",
                        help="an A/A run: the 'default' variant runs pass-through too, so the "
                             "ratio shows what two runs of one policy differ by (the noise "
                             "floor of the goal's ratio)")
    args = parser.parse_args()
    if args.aa:
        MODES["default"] = MODES["pass-through"]
    if args.resim:
        latencies = ((args.dispatch_latency_ms or 0.0) / 1000,
                     (args.completion_lag_ms or 0.0) / 1000)
        before = loadavg()
        rows = resim(json.loads(Path(args.resim).read_text(encoding="utf-8")), latencies)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "efficiency_sim_agreement.json").write_text(json.dumps(rows, indent=1),
                                                           encoding="utf-8")
        (out / "efficiency_sim_agreement.md").write_text("\n".join(resim_report(
            rows, args.resim, " ".join(sys.argv[1:]), (before, loadavg()), latencies)) + "\n",
            encoding="utf-8")
        print(f"wrote {out / 'efficiency_sim_agreement.md'}")
        return
    if args.dispatch_latency_ms is None:
        args.dispatch_latency_ms = SIM_DISPATCH_LATENCY_S * 1000
    if args.completion_lag_ms is None:
        args.completion_lag_ms = SIM_COMPLETION_LAG_S * 1000
    if args.sim_only:
        shapes = [s for s in (*SHAPES, *LARGE_SHAPES)
                  if s.name in (args.only or [z.name for z in LARGE_SHAPES])]
    else:
        shapes = [s for s in SHAPES if not args.only or s.name in args.only]
    choices = {"loop": LOOPS, "engines": ENGINES, "response_path": RESPONSE_PATHS,
               "endpoints": tuple(str(n) for n in (SIM_ENDPOINTS if args.sim_only
                                                   else ENDPOINTS))}
    given = {}
    for key, allowed in choices.items():
        given[key] = [v.strip() for v in getattr(args, key).split(",") if v.strip()]
        bad = [v for v in given[key] if v not in allowed]
        if bad or not given[key] or (len(given[key]) > 1 and not args.matrix):
            parser.error(f"--{key.replace('_', '-')}: one of {', '.join(allowed)}"
                         + ("" if args.matrix else " (a comma list needs --matrix)"))
    cells = expand_matrix(shapes, given["loop"], given["engines"],
                          [int(n) for n in given["endpoints"]], args.seeds,
                          given["response_path"])
    cells = [(replace(cell, seed=cell.seed - FIRST_SEED + args.first_seed), order)
             for cell, order in cells]
    if args.sim_only:
        sim_main(args, [cell for cell, _ in cells])
        return
    args.duration = DURATION_S if args.duration is None else args.duration
    data: dict[str, Any] = {"scale": args.scale, "catch_up_ms": args.catch_up_ms, "sizes": {},
                            "command": " ".join(sys.argv[1:]), "aa": args.aa}
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fairway-efficiency-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for i, ((cell, order), n) in enumerate(
                (c, n) for c in cells for n in range(args.repeat)):
            name = cell.name if n == 0 else f"{cell.name} #{n + 1}"
            if n % 2:
                order = tuple(reversed(order))
            print(f"[{i + 1}/{len(cells) * args.repeat}, {time.monotonic() - started:.0f} s] "
                  f"{name}: {', '.join(order)}", flush=True)
            data["sizes"][name], runs[name] = run_shape(
                cell.shape, args.scale, workdir, order=order, label=_slug(name),
                catch_up_ms=args.catch_up_ms, cell=cell, duration_s=args.duration,
                trace=not args.no_trace, sim=not args.no_sim)
            size = data["sizes"][name]
            light = {m: size["modes"][m]["light"]["p95_ms"] for m in order}
            print(f"  ratio through Envoy {_f(size['ratio'], '.3f')}, per modelled step time "
                  f"{_f(size['ratio_model_time'], '.3f')}; simulator "
                  f"{_f(size['simulator']['ratio'], '.3f')}, with the measured latencies "
                  f"{_f(size['simulator_latencies']['ratio'], '.3f')}; light p95 ms {light}; "
                  f"load {loadavg()}", flush=True)
        traced_runs = {k: v for k, v in runs.items() if data["sizes"][k]["traced"]}
        data["plot"] = plot(data, traced_runs, out / "efficiency.png") if traced_runs else None
    (out / "efficiency.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    write_report(data, out / "efficiency.md")
    print(f"wrote {out / 'efficiency.md'}")


def sim_main(args: argparse.Namespace, cells: Sequence[Cell]) -> None:
    """``--sim-only``: every cell in the pool simulator; efficiency_sim_large.md and .json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"command": " ".join(sys.argv[1:]), "loadavg_before": loadavg(),
                            "cells": {}}
    before: dict[str, Any] = {}
    if args.append and (out / "efficiency_sim_large.json").exists():
        before = json.loads((out / "efficiency_sim_large.json").read_text(encoding="utf-8"))
    started = time.monotonic()
    # Every cell's first seed before any cell's second: a run cut short still covers them all.
    for i, cell in enumerate(sorted(cells, key=lambda c: c.seed)):
        got = sim_cell(cell, args.duration or SIM_DURATION_S, args.warmup,
                       args.dispatch_latency_ms / 1000, args.completion_lag_ms / 1000)
        name = cell.name
        data["cells"][name] = got
        print(f"[{i + 1}/{len(cells)}, {time.monotonic() - started:.0f} s] {name}: "
              f"default ÷ pass-through {_f(got['ratio'], '.3f')} "
              f"({got['modes']['pass-through']['tokens_per_s']:.0f} / "
              f"{got['modes']['default']['tokens_per_s']:.0f} tok/s); load {got['loadavg']}",
              flush=True)
        _write_sim(out, data, before, started)  # after each cell: a cut run keeps its cells
    print(f"wrote {out / 'efficiency_sim_large.md'}")


def _write_sim(out: Path, data: dict[str, Any], before: dict[str, Any], started: float) -> None:
    report = {**data, "loadavg_after": loadavg(), "wall_s": time.monotonic() - started}
    if before:  # the earlier run's cells first; the commands and load averages of both
        report["cells"] = {**before["cells"], **data["cells"]}
        report["command"] = (f"{before['command']}` then `python -m bench.efficiency "
                             f"{data['command']}")
        report["loadavg_before"] = before["loadavg_before"]
        report["wall_s"] += before["wall_s"]
    (out / "efficiency_sim_large.json").write_text(json.dumps(report, indent=1),
                                                   encoding="utf-8")
    (out / "efficiency_sim_large.md").write_text("\n".join(sim_report(report)) + "\n",
                                                 encoding="utf-8")


if __name__ == "__main__":
    main()
