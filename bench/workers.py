"""Does a pod's picker get faster with worker processes (``--workers``)?

``python -m bench.workers`` (``make bench-workers``): the overhead benchmark's request path (one
fast simulated server, one-token answers, open loop, ABBA against the same Envoy without
ext_proc) on a rate ladder, for one picker process on the memory backend (the default), one on
Redis (what the workers pay for sharing), and ``--workers 2`` on Redis. Every variant runs behind
the same Envoy configuration: the inline response path (workers cannot take a meter stream) over
TLS, at most ``STREAMS_PER_CONNECTION`` ext_proc streams on one connection (so that Envoy opens
several and the kernel has connections to spread). The picker's CPU is its process and its
workers'. Writes ``bench/results/workers.md`` and ``.json``.

On this 2-core machine Envoy, the server and the load client share the cores with the picker, so
the ceiling a second worker can lift is what they leave. A second measure (``direct``) takes
them away: ghz, a gRPC load generator in Go (``scripts/ghz_tool``, built from Go modules and
cached), plays Envoy's side of the inline ext_proc stream against the picker alone, at 8, 16 and
32 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from google.protobuf import descriptor_pb2, json_format

from bench.gateway.common import (
    PICKER_METRICS,
    client_cpu,
    clock_ticks,
    fetch_metrics,
    loadavg,
    msum,
    process_cpu,
    tree_ticks,
)
from bench.gateway.overhead import (
    ADMISSION_RULES,
    FAST_SERVER_ARGS,
    LADDER_P99_LIMIT_MS,
    RawTarget,
    _added,
    alternate,
    cpu_per_request,
    fixed_rate,
    raw_post,
)
from picker.sim.load import run_traffic
from picker.sim.traffic import DEFAULT_TENANT_HEADER, load_traffic
from picker.stack.envoy import DESTINATION_HEADER
from picker.stack.launcher import Stack
from picker.stack.redis import RedisServer
from scripts.gomodules import GoBuild

STREAMS_PER_CONNECTION = 8
VARIANTS: dict[str, tuple[int, str, bool]] = {
    "1 process, memory": (1, "memory", False),
    "1 process, redis": (1, "redis", False),
    "2 workers, redis": (2, "redis", False),
    "1 process, memory, budgets": (1, "memory", True),
    "2 workers, redis, budgets": (2, "redis", True),
}
"""Label: (worker processes, state backend, whether the tenant has budgets and caps). A tenant
with budgets costs replicas, and so workers, one Redis round trip a request (its reservation,
atomic across them); a picker alone reserves locally."""


LADDER = (200.0, 400.0, 600.0, 800.0, 1000.0, 1200.0, 1600.0)
"""Offered request rates, climbed until the picker path no longer delivers 95 % of one."""
DELIVERED = 0.95


@dataclass(frozen=True)
class WorkersPlan:
    """Seconds per block and blocks per path at each rate: the full run or ``--quick``."""

    quick: bool

    @property
    def rates(self) -> tuple[float, ...]:
        return LADDER[:2] if self.quick else LADDER

    @property
    def block(self) -> float:
        return 1.0 if self.quick else 2.5

    @property
    def pairs(self) -> int:
        return 1 if self.quick else 2


@contextlib.contextmanager
def _store(workdir: Path, backend: str) -> Iterator[RedisServer | None]:
    if backend != "redis":
        yield None
        return
    with RedisServer(workdir) as store:
        yield store


async def ladder(base: Stack, picked: Stack, store: RedisServer | None,
                 plan: WorkersPlan) -> list[dict[str, Any]]:
    """Each rate ABBA against the path without a picker, until the picker path delivers less
    than ``DELIVERED`` of the rate offered."""
    server = base.endpoint_addresses[0]
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 1, "ignore_eos": True}
    headers = {DEFAULT_TENANT_HEADER: "bench", DESTINATION_HEADER: server}
    targets = {name: (RawTarget(name, stack.gateway_port),
                      raw_post(stack.gateway_port, "/v1/completions", body, headers))
               for name, stack in (("baseline", base), ("picker", picked))}
    own = {"baseline": {f"{base.workdir.name}/envoy"},
           "picker": {f"{picked.workdir.name}/picker", f"{picked.workdir.name}/envoy"}}
    shared = {f"{base.workdir.name}/server0", "client"}
    def probe() -> dict[str, float]:
        cpu = process_cpu([base, picked])
        if store is not None and store.process is not None:
            cpu["redis"] = (tree_ticks(store.process.pid) or 0) / clock_ticks()
        return {**cpu, "client": client_cpu()}

    picker = f"{picked.workdir.name}/picker"
    rows = []
    for rate in plan.rates:
        for target, raw in targets.values():  # warm: connections open, caches hot
            await fixed_rate(target, raw, rate, 0.4)
        got = await alternate(targets, rate, plan.block, plan.pairs, probe)
        b, p = got["baseline"], got["picker"]
        span = p["span_s"] or 1.0
        rows.append({"rate": rate, "baseline": b, "picker": p,
                     "redis_cores": p["cpu_s"]["redis"] / span if store is not None else None,
                     "added_p50_ms": _added(b, p, "p50"), "added_p99_ms": _added(b, p, "p99"),
                     "picker_cpu_ms_per_request":
                         cpu_per_request(got, own, shared)["picker"].get(picker),
                     "picker_cores": p["cpu_s"].get(picker, 0.0) / span})
        if p["achieved_rate"] < DELIVERED * rate or p["errors"] > 0.01 * p["sent"]:
            break
    for target, _ in targets.values():
        target.close()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The highest rate kept within p99 added ≤ 10 ms and within 95 % delivered, and the most
    delivered."""
    def delivered(row: dict[str, Any]) -> bool:
        return bool(row["picker"]["achieved_rate"] >= DELIVERED * row["rate"])

    within = [r["rate"] for r in rows if delivered(r) and r["added_p99_ms"] is not None
              and r["added_p99_ms"] <= LADDER_P99_LIMIT_MS]
    return {"p99_within_10ms": max(within, default=None),
            "delivered_95": max((r["rate"] for r in rows if delivered(r)), default=None),
            "most_delivered": max(r["picker"]["achieved_rate"] for r in rows)}


def run_variant(label: str, workers: int, backend: str, budgets: bool, base: Stack,
                workdir: Path, plan: WorkersPlan) -> dict[str, Any]:
    fast = base.endpoint_addresses[0]
    config: dict[str, Any] = {"queue": {"maxWait": "10s"}, "endpoints": [{"address": fast}]}
    if budgets:  # never binding: admission runs on every request without refusing one
        config["tenants"] = [{"id": "bench", **ADMISSION_RULES}]
    name = label.replace(" ", "-").replace(",", "")
    with _store(workdir / f"{name}-redis", backend) as store:
        if store is not None:
            config["state"] = {"backend": "redis", "redis": {"url": store.url}}
        with Stack(workdir / name, endpoints=0, picker_config=config, response_path="inline",
                   picker_args=["--workers", str(workers)] if workers > 1 else [],
                   picker_streams_per_connection=STREAMS_PER_CONNECTION) as picked:
            print(f"  {label}: the ladder", flush=True)
            rows = asyncio.run(ladder(base, picked, store, plan))
    return {"workers": workers, "backend": backend, "budgets": budgets, "ladder": rows,
            **summary(rows)}


# -- the picker alone, driven by ghz ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
GHZ = GoBuild("ghz", "v0.93.0", ROOT / "scripts" / "ghz_tool", ("github.com/bojand/ghz/cmd/ghz",),
              "-s -w", "about a minute")
"""ghz, a gRPC load generator in Go: it plays Envoy's side of the ext_proc stream for a fraction
of the CPU that Envoy, a model server and a Python client take together."""
EXT_PROC_CALL = "envoy.service.ext_proc.v3.ExternalProcessor.Process"
DIRECT_VARIANTS = ("1 process, memory", "1 process, redis", "2 workers, redis")
DIRECT_CONCURRENCY = (8, 16, 32)
DIRECT_CONNECTIONS = 8
"""Connections ghz opens: the kernel spreads connections, not streams, over the workers."""


def write_protoset(path: Path) -> Path:
    """ext_proc's service and every file it imports, as a FileDescriptorSet for ghz."""
    files = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(descriptor: Any) -> None:
        if descriptor.name in seen:
            return
        seen.add(descriptor.name)
        for dependency in descriptor.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        descriptor.CopyToProto(proto)
        files.file.append(proto)

    add(ext_proc_pb2.DESCRIPTOR)
    path.write_bytes(files.SerializeToString())
    return path


def exchange_messages() -> list[dict[str, Any]]:
    """One request as Envoy's inline path sends it (the overhead benchmark's: a one-token
    completion): headers, the whole body, the response's headers and its body."""
    def headers(fields: dict[str, str]) -> base_pb2.HeaderMap:
        return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                           for k, v in fields.items()])

    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    body = json.dumps({"model": "sim-model", "prompt": "hello there", "max_tokens": 1,
                       "ignore_eos": True}).encode()
    answer = json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": " hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
    messages = [
        ext_proc_pb2.ProcessingRequest(
            request_headers=ext_proc_pb2.HttpHeaders(headers=headers({
                ":method": "POST", ":path": "/v1/completions", ":scheme": "http",
                ":authority": "gateway", "content-type": "application/json",
                DEFAULT_TENANT_HEADER: "bench"})),
            protocol_config=ext_proc_pb2.ProtocolConfiguration(request_body_mode=duplex,
                                                              response_body_mode=duplex)),
        ext_proc_pb2.ProcessingRequest(request_body=ext_proc_pb2.HttpBody(body=body,
                                                                         end_of_stream=True)),
        ext_proc_pb2.ProcessingRequest(response_headers=ext_proc_pb2.HttpHeaders(
            headers=headers({":status": "200", "content-type": "application/json"}))),
        ext_proc_pb2.ProcessingRequest(response_body=ext_proc_pb2.HttpBody(
            body=answer, end_of_stream=True)),
    ]
    return [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in messages]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ghz_run(ghz: Path, protoset: Path, data: Path, port: int, concurrency: int,
            seconds: float, picker_pid: int) -> dict[str, Any]:
    """ghz at ``concurrency`` streams for ``seconds``, as fast as the picker answers."""
    ticks = clock_ticks()
    picker_before, ghz_before, started = tree_ticks(picker_pid) or 0, _children_cpu(), \
        time.monotonic()
    done = subprocess.run(
        [str(ghz), "--insecure", "--protoset", str(protoset), "--call", EXT_PROC_CALL,
         "--data-file", str(data), "-c", str(concurrency), "--connections",
         str(DIRECT_CONNECTIONS), "-z", f"{seconds:g}s", "-O", "json", f"127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=seconds + 60, check=False)
    wall = time.monotonic() - started
    picker_cpu = ((tree_ticks(picker_pid) or 0) - picker_before) / ticks
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"ghz failed ({done.returncode}): {done.stderr[-2000:]}")
    got = json.loads(done.stdout)
    latency = {row["percentage"]: row["latency"] / 1e6
               for row in got.get("latencyDistribution") or []}
    ok = got.get("statusCodeDistribution", {}).get("OK", 0)
    return {"concurrency": concurrency, "rps": got["rps"], "ok": ok,
            "not_ok": sum(n for code, n in got.get("statusCodeDistribution", {}).items()
                          if code != "OK"),
            "p50_ms": latency.get(50), "p99_ms": latency.get(99),
            "picker_cores": picker_cpu / wall, "ghz_cores": (_children_cpu() - ghz_before) / wall,
            "picker_cpu_ms_per_request": picker_cpu / ok * 1000 if ok else None}


def run_direct(workdir: Path, plan: WorkersPlan) -> dict[str, Any]:
    """Each variant's picker (plaintext ext_proc, one simulated server scraped, never sent a
    request) driven by ghz at each concurrency, the variants in the order A B C C B A."""
    ghz = GHZ.binaries() / "ghz"
    protoset = write_protoset(workdir / "ext_proc.protoset")
    data = workdir / "exchange.json"
    data.write_text(json.dumps(exchange_messages()))
    seconds = 2.0 if plan.quick else 6.0
    order = list(DIRECT_VARIANTS) if plan.quick else [*DIRECT_VARIANTS, *DIRECT_VARIANTS[::-1]]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in DIRECT_VARIANTS}
    concurrencies = DIRECT_CONCURRENCY[:1] if plan.quick else DIRECT_CONCURRENCY
    for label in order:
        workers, backend, _ = VARIANTS[label]
        name = "direct-" + label.replace(" ", "-").replace(",", "")
        with _store(workdir / f"{name}-redis", backend) as store:
            config: dict[str, Any] = {"queue": {"maxWait": "10s"}}
            if store is not None:
                config["state"] = {"backend": "redis", "redis": {"url": store.url}}
            with Stack(workdir / name, endpoints=1, server_args=FAST_SERVER_ARGS,
                       picker_config=config, response_path="inline", secure_serving=False,
                       gateway_retries=False,
                       picker_args=["--workers", str(workers)] if workers > 1 else []) as stack:
                print(f"  direct, {label}", flush=True)
                for concurrency in concurrencies:
                    runs[label].append(ghz_run(ghz, protoset, data, stack.grpc_port,
                                               concurrency, seconds, stack.picker_process.pid))
    return {"seconds": seconds, "connections": DIRECT_CONNECTIONS, "runs": runs}


# -- weighted shares over workers -------------------------------------------------------------

SHARE_WEIGHTS = {"a": 1.0, "b": 2.0, "c": 3.0}
SHARE_VARIANTS = ("1 process, memory", "2 workers, redis")
SHARE_SERVER_ARGS = ["--kv-budget-tokens", "1024", "--step-ms", "5"]
"""Small engines, so that the tenants' backlogs wait in the picker's fair queue."""
SHARE_SPEC = {"backlog": 20, "prompt_tokens": [40, 120], "output_tokens": [20, 60],
              "stream_fraction": 0.5, "include_usage": True}


async def _shares_run(stack: Stack, plan: WorkersPlan) -> dict[str, Any]:
    """Three backlogged tenants weighted 1:2:3 through Envoy; each one's share of the picker's
    weighted service (summed over the workers) between the warm-up and the end of sending."""
    duration, warmup = (6.0, 1.5) if plan.quick else (24.0, 4.0)
    traffic = load_traffic({"duration_s": duration, "seed": 7, "timeout_s": 60, "tenants": [
        {"name": t, **SHARE_SPEC} for t in SHARE_WEIGHTS]})
    run = asyncio.create_task(run_traffic(traffic, stack.gateway_url))

    async def service() -> dict[str, float]:
        got = await asyncio.to_thread(fetch_metrics, stack.metrics_url, PICKER_METRICS)
        return {t: msum(got, "fairway_weighted_service_total", tenant=t) for t in SHARE_WEIGHTS}

    await asyncio.sleep(warmup)
    before = await service()
    await asyncio.sleep(duration - warmup)
    after = await service()
    result = await run
    served = {t: after[t] - before[t] for t in SHARE_WEIGHTS}
    total = sum(served.values()) or 1.0
    weight_sum = sum(SHARE_WEIGHTS.values())
    shares = {t: served[t] / total for t in SHARE_WEIGHTS}
    errors = {t: abs(shares[t] - w / weight_sum) / (w / weight_sum)
              for t, w in SHARE_WEIGHTS.items()}
    per_worker = {}
    for line in (await asyncio.to_thread(fetch_metrics, stack.metrics_url,
                                         frozenset({"fairway_requests_total"})))\
            .get("fairway_requests_total", ()):
        labels, value = line
        per_worker[labels.get("worker", "-")] = per_worker.get(labels.get("worker", "-"), 0) + value
    return {"window_s": [warmup, duration], "shares": shares, "worst_error": max(errors.values()),
            "statuses": sorted({r.status for r in result.records if r.status is not None}),
            "requests_by_worker": per_worker}


def run_shares(workdir: Path, plan: WorkersPlan) -> dict[str, Any]:
    runs = {}
    for label in SHARE_VARIANTS:
        workers, backend, _ = VARIANTS[label]
        name = "shares-" + label.replace(" ", "-").replace(",", "")
        with _store(workdir / f"{name}-redis", backend) as store:
            config: dict[str, Any] = {
                "tenants": [{"id": t, "weight": w} for t, w in SHARE_WEIGHTS.items()]}
            if store is not None:
                config["state"] = {"backend": "redis", "redis": {"url": store.url}}
            with Stack(workdir / name, endpoints=2, picker_config=config,
                       server_args=SHARE_SERVER_ARGS, response_path="inline",
                       picker_args=["--workers", str(workers)] if workers > 1 else [],
                       picker_streams_per_connection=STREAMS_PER_CONNECTION) as stack:
                print(f"  shares, {label}", flush=True)
                runs[label] = asyncio.run(_shares_run(stack, plan))
    return runs


def shares_report(runs: dict[str, Any]) -> list[str]:
    lines = ["", "## Weighted shares over workers", "",
             "Three backlogged tenants weighted 1:2:3 (20 requests outstanding each, prompts "
             "40–120, outputs 20–60 tokens, half streamed) through Envoy to two simulated "
             "servers of 1,024 tokens; each tenant's share of the picker's weighted service, "
             "summed over the workers, between the warm-up and the end of sending. Goal: within "
             "5 % of its weight's share.", "",
             "| variant | window (s) | a | b | c | worst error | requests by worker | "
             "statuses |", "|---|---|---:|---:|---:|---:|---|---|"]
    for label, got in runs.items():
        share = got["shares"]
        by_worker = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(got["requests_by_worker"].items()))
        lines.append(f"| {label} | {got['window_s'][0]:g}–{got['window_s'][1]:g} | "
                     f"{share['a']:.3f} | {share['b']:.3f} | {share['c']:.3f} | "
                     f"{got['worst_error']:.1%} | {by_worker} | "
                     f"{', '.join(str(x) for x in got['statuses'])} |")
    return lines


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def report(data: dict[str, Any]) -> str:
    measured = ", ".join(f"{name} {at}" for name, at in data.get("measured", {}).items()) \
        or data["generated"]
    lines = [
        "# Worker processes per pod (`--workers`)",
        "",
        f"Generated by `python -m bench.workers` ({measured}; {data['cpus']} cores shared by "
        "Envoy, the server, the load client and the picker). The overhead benchmark's request "
        "path "
        "(one simulated server with 1 ms steps, one-token answers, open loop) climbing a rate "
        "ladder, each rate in ABBA blocks against the same Envoy without ext_proc; every variant "
        "behind the same Envoy configuration (the inline response path over TLS, at most "
        f"{STREAMS_PER_CONNECTION} ext_proc streams per connection). The ladder stops once the "
        "picker path delivers less than 95 % of the rate offered. Picker CPU counts the "
        "picker's process and its workers.",
        "",
        "## Summary",
        "",
        "| variant | highest rate, p99 added ≤ 10 ms | highest rate, 95 % delivered "
        "| most delivered (req/s) | added p50 / p99 at 200 req/s (ms) "
        "| picker CPU ms per request at 200 req/s |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for label, got in data["variants"].items():
        first = got["ladder"][0]
        lines.append(
            f"| {label} | {_fmt(got['p99_within_10ms'], 0)} | {_fmt(got['delivered_95'], 0)} | "
            f"{got['most_delivered']:.0f} | {_fmt(first['added_p50_ms'])} / "
            f"{_fmt(first['added_p99_ms'])} | {_fmt(first['picker_cpu_ms_per_request'])} |")
    lines += ["", "## Every rate", "",
              "| variant | offered req/s | delivered req/s | errors | added p50 ms | "
              "added p99 ms | picker CPU ms / request | picker cores busy | Redis cores busy | "
              "every process, cores busy |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, got in data["variants"].items():
        for row in got["ladder"]:
            p = row["picker"]
            lines.append(
                f"| {label} | {row['rate']:g} | {p['achieved_rate']:.0f} | {p['errors']} | "
                f"{_fmt(row['added_p50_ms'])} | {_fmt(row['added_p99_ms'])} | "
                f"{_fmt(row['picker_cpu_ms_per_request'])} | {_fmt(row['picker_cores'])} | "
                f"{_fmt(row['redis_cores'])} | {_fmt(sum(p['cpu_s'].values()) / p['span_s'])} |")
    if "direct" in data:
        lines += direct_report(data["direct"])
    if "shares" in data:
        lines += shares_report(data["shares"])
    return "\n".join(lines) + "\n"


def direct_report(direct: dict[str, Any]) -> list[str]:
    first = next(iter(direct["runs"].values()))
    twice = len(first) > len({r["concurrency"] for r in first})
    lines = ["", "## The picker alone, driven by ghz", "",
             "ghz (a Go gRPC load generator, built from Go modules) plays Envoy's side of the "
             "inline ext_proc stream (headers, body, response headers, response body: the "
             "one-token completion above) as fast as the picker answers, over "
             f"{direct['connections']} plaintext connections, {direct['seconds']:g} s a run"
             f"{TWICE if twice else ''}"
             ". No Envoy, model server or Python client competes with the picker here, only "
             "ghz.",
             "",
             "| variant | concurrent streams | requests/s | p50 ms | p99 ms "
             "| picker cores busy | picker CPU ms / request | ghz cores busy | not OK |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, runs in direct["runs"].items():
        for concurrency in sorted({r["concurrency"] for r in runs}):
            same = [r for r in runs if r["concurrency"] == concurrency]

            def mean(key: str, rows: list[dict[str, Any]] = same) -> float | None:
                values = [r[key] for r in rows if r[key] is not None]
                return sum(values) / len(values) if values else None

            lines.append(
                f"| {label} | {concurrency} | {_fmt(mean('rps'), 0)} | {_fmt(mean('p50_ms'))} | "
                f"{_fmt(mean('p99_ms'))} | {_fmt(mean('picker_cores'))} | "
                f"{_fmt(mean('picker_cpu_ms_per_request'), 3)} | {_fmt(mean('ghz_cores'))} | "
                f"{sum(r['not_ok'] for r in same)} |")
    lines.append("")
    lines.append("Not OK: streams ghz had open when its time ran out (cancelled on its side).")
    return lines


MEASURES = ("ladder", "direct", "shares")
TWICE = "; each variant ran twice (A B C C B A) and each cell is the mean"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="folder for workers.md and .json")
    parser.add_argument("--workdir", default="/tmp/fairway-bench-workers")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--only", choices=sorted(VARIANTS), action="append",
                        help="the ladder: only these variants (repeatable)")
    parser.add_argument("--measure", choices=MEASURES, action="append",
                        help="only this measure (repeatable; default both), the other kept from "
                             "the last run's JSON")
    args = parser.parse_args(argv)
    plan = WorkersPlan(args.quick)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    name = "workers_quick" if args.quick else "workers"
    kept = out / f"{name}.json"
    data: dict[str, Any] = json.loads(kept.read_text()) if args.measure and kept.exists() \
        else {}
    data.update({"generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "loadavg_before": loadavg()})
    measures = args.measure or MEASURES
    data.setdefault("measured", {}).update(
        {m: f"{data['generated']}, load average before {data['loadavg_before']}"
         for m in measures})
    if "ladder" in measures:
        data["variants"] = {}
        with Stack(workdir / "base", with_picker=False, endpoints=1,
                   server_args=FAST_SERVER_ARGS) as base:
            for label, (workers, backend, budgets) in VARIANTS.items():
                if args.only and label not in args.only:
                    continue
                data["variants"][label] = run_variant(label, workers, backend, budgets, base,
                                                      workdir, plan)
    if "direct" in measures:
        data["direct"] = run_direct(workdir, plan)
    if "shares" in measures:
        data["shares"] = run_shares(workdir, plan)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(report(data))
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
