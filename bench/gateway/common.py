"""What every measure of the gateway benchmark shares: how long each part runs (``Plan``), the
contended pool, each process's CPU time and the load average, the picker's and servers' metrics
sampled during a run, each tenant's service as the client saw it, and one traffic run through a
fresh stack (``run_gateway``) with its pool and per-tenant numbers.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import os
import resource
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker.config.strict import safe_load
from picker.sim.load import LoadResult, RequestRecord, percentile, run_traffic
from picker.sim.traffic import Traffic, load_traffic
from picker.stack.envoy import envoy_binary
from picker.stack.launcher import Stack, merge_sections

TRAFFIC = Path(__file__).resolve().parents[1] / "traffic"

#: The contended pool of goals 1, 2, 3 and 5: two small servers, so a few requests fill them.
POOL_ENDPOINTS = 2
POOL_KV_BUDGET = 1024
POOL_STEP_MS = 5.0
POOL_ENGINE_POLICY = "fcfs"
"""The servers' ``--scheduling-policy`` (vLLM's default)."""
POOL_SERVER_ARGS = ["--kv-budget-tokens", str(POOL_KV_BUDGET), "--step-ms", f"{POOL_STEP_MS:g}",
                    "--scheduling-policy", POOL_ENGINE_POLICY]

PREFILL_WEIGHT, DECODE_WEIGHT = 1.0, 2.0  # the picker's default cost (w_p, w_q)
#: The overhead ladder's rates above 200 req/s (goal 4d; the quick run climbs one rung).
LADDER_RATES = (400.0, 800.0, 1600.0, 3200.0)


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
        return 3.0 if self.quick else 24.0

    @property
    def fair_warmup(self) -> float:
        return 1.0 if self.quick else 4.0

    @property
    def flood_duration(self) -> float:
        return 2.5 if self.quick else 20.0

    @property
    def light_start(self) -> float:
        return 1.0 if self.quick else 3.0

    @property
    def drift_duration(self) -> float:
        return 2.5 if self.quick else 24.0

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


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def process_cpu(stacks: Sequence[Stack]) -> dict[str, float]:
    """CPU seconds (user + system) each stack process has used so far, by a readable name."""
    out: dict[str, float] = {}
    ticks = clock_ticks()
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
            elif "bench.floor_epp" in args:
                name = "epp"
            elif Path(args[0]).name == "envoy":
                name = "envoy"
            else:
                name = Path(args[0]).name
            used = tree_ticks(process.pid)
            if used is not None:
                out[f"{prefix}/{name}"] = used / ticks
    return out


def tree_ticks(pid: int) -> int | None:
    """CPU ticks (user + system) of ``pid`` and its living descendants (a picker's worker
    processes); None if ``pid`` is gone."""
    total: int | None = None
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = [int(child) for task in Path(f"/proc/{current}/task").iterdir()
                        for child in (task / "children").read_text().split()]
        except OSError:
            continue
        total = (total or 0) + int(fields[11]) + int(fields[12])
        pending.extend(children)
    return total


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
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
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


def percentile_ms(values: Sequence[float], q: float) -> float | None:
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


def traffic_data(name: str, prefix: str = "gateway") -> dict[str, Any]:
    return safe_load((TRAFFIC / f"{prefix}_{name}.yaml").read_text(encoding="utf-8"))


def make_traffic(name: str, duration: float, backlog_scale: float = 1.0, *,
                 prefix: str = "gateway", **starts: float) -> Traffic:
    """``bench/traffic/<prefix>_<name>.yaml`` with its duration (and tenants' start_s) replaced;
    ``backlog_scale`` shrinks backlogs (quick runs: less to drain after sending stops)."""
    data = copy.deepcopy(traffic_data(name, prefix))
    data["duration_s"] = duration
    for tenant in data["tenants"]:
        if tenant["name"] in starts:
            tenant["start_s"] = starts[tenant["name"]]
        if tenant.get("backlog"):
            tenant["backlog"] = max(1, round(tenant["backlog"] * backlog_scale))
    return load_traffic(data)


async def drive(stack: Stack, traffic: Traffic, interval: float) -> tuple[LoadResult, Sampler]:
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


def picker_overrides(traffic: Traffic, weights: dict[str, float],
                     idle_tenant_reserve: str) -> dict[str, Any]:
    """What a contended-pool run sets in the picker's config over the stack's own (the pool
    simulator's comparison runs the same)."""
    tenants = [{"id": t.name, "weight": weights.get(t.name, 1.0)} for t in traffic.tenants]
    return {"tenants": tenants, "queue": {"maxWait": "60s"},
            "capacity": {"idleTenantReserve": idle_tenant_reserve}}


def run_gateway(label: str, policy: str, traffic: Traffic, weights: dict[str, float],
                window: tuple[float, float], workdir: Path, plan: Plan,
                idle_tenant_reserve: str | None = None, *,
                server_args: Sequence[str] = tuple(POOL_SERVER_ARGS),
                picker_config: dict[str, Any] | None = None,
                endpoints: int = POOL_ENDPOINTS) -> GatewayRun:
    """``traffic`` through a fresh stack (Envoy, picker with ``policy``, a pool of
    ``endpoints`` servers started with ``server_args``, the contended pool's by default);
    ``idle_tenant_reserve`` overrides the plan's, ``picker_config`` sections are merged over the
    run's."""
    reserve = plan.idle_tenant_reserve if idle_tenant_reserve is None else idle_tenant_reserve
    config = merge_sections(picker_overrides(traffic, weights, reserve), picker_config or {})
    stack = Stack(workdir / label, policy=policy, endpoints=endpoints,
                  server_args=list(server_args), picker_config=config,
                  response_path=plan.response_path, secure_serving=plan.secure_serving)
    return run_stack(label, policy, stack, traffic, window, plan.sample_interval)


def run_stack(label: str, policy: str, stack: Stack, traffic: Traffic,
              window: tuple[float, float], sample_interval: float,
              during: Callable[[Stack], contextlib.AbstractContextManager[Any]] | None = None,
              ) -> GatewayRun:
    """``traffic`` through ``stack`` (started here, stopped after), sampling its picker's and
    servers' metrics every ``sample_interval``; ``during``: a context entered once the stack
    runs, around the traffic (e.g. a profiler attached to the picker)."""
    print(f"  {label}: {policy}, {traffic.duration_s:g} s of traffic", flush=True)
    resources: dict[str, Any] = {}
    with stack, measured(resources, lambda: [stack]), \
            (during(stack) if during is not None else contextlib.nullcontext()):
        result, sampler = asyncio.run(drive(stack, traffic, sample_interval))
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
        "ttft_ms": {"p50": percentile_ms(ttft, 50), "p95": percentile_ms(ttft, 95),
                    "p99": percentile_ms(ttft, 99)},
    }
