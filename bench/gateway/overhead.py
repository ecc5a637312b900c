"""Goal 4: how much latency and CPU does the picker add, and how fast can one picker go?

At 200 requests/s, uncontended, the picker may add at most 1 ms at p50 and 3 ms at p99 to a short
non-streaming request, compared with the same Envoy routing on a fixed header without ext_proc,
both in front of the same server, alternated in ABBA blocks, measured by a minimal asyncio
HTTP/1.1 client (keep-alive, TCP_NODELAY). Each streamed chunk may be delayed by at most 0.5 ms
more than without the picker (chunks matched to the same engine step of a direct stream). And the
highest rate at which one picker process keeps p99 added ≤ 10 ms. CPU per request and per chunk
of every process is measured alongside.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gateway.common import (
    PICKER_METRICS,
    Metrics,
    Plan,
    client_cpu,
    fetch_metrics,
    measured,
    msum,
    percentile_ms,
    process_cpu,
)
from picker.sim.traffic import DEFAULT_TENANT_HEADER
from picker.stack.envoy import DESTINATION_HEADER
from picker.stack.launcher import Stack

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
LADDER_P99_LIMIT_MS = 10.0
OVERHEAD_RATE = 200.0
#: A path "sustains" a rate when it completes at least this fraction of it, with no more than
#: this fraction of errors.
SUSTAIN_FRACTION, ERROR_FRACTION = 0.95, 0.001
CLIENT_LAG_LIMIT_MS = 10.0


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
        "latency_ms": {"p50": percentile_ms(latencies, 50), "p90": percentile_ms(latencies, 90),
                       "p99": percentile_ms(latencies, 99), "p99.9": percentile_ms(latencies, 99.9),
                       "mean": statistics.fmean(latencies) * 1000 if latencies else None},
        "send_lag_ms": {"p50": percentile_ms(lags, 50), "p99": percentile_ms(lags, 99)},
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
        return {"p50": percentile_ms(values, 50), "p99": percentile_ms(values, 99),
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
