"""fairway beside upstream's endpoint picker: the same Envoy, the same servers, the same tenants.

Which picker should a platform team run? Each measure alternates the two pickers in ABBA blocks
(fairway, upstream, upstream, fairway) on one machine in one run: each block a fresh stack of
the same Envoy build and configuration (TLS to the picker, full-duplex bodies, the response
inline, ``override_host`` with retries), the same simulated vLLM servers (``fcfs`` and
``priority`` scheduling, each measure on both), and the same traffic and seeds.

- **upstream**: ``cmd/epp`` of the Gateway API Inference Extension (``scripts.upstream_picker``:
  its release, why, and its configuration) on a real API server (``scripts.cluster``), its
  InferencePool pointed at the block's servers, flow control on with its round-robin fairness
  policy. It takes no weights, so shares are judged at equal weights (fairway's 1:2:3 is shown
  beside, as what upstream cannot express).
- **fairway**: its defaults, the tenants named in its config at weight 1, ``queue.maxWait`` 60 s
  (upstream's request TTL here); with priority engines ``scheduling.enginePolicy: priority``.

Measures (``bench/results/peer.md``):
1. shares of three backlogged tenants sending different shapes (``peer_mixed.yaml``), in
   fairway's cost (prompt + 2 × output tokens) and in requests, and the drift between them;
2. a returning tenant's share in the seconds after it comes back (``peer_returning.yaml``);
3. a light tenant's TTFT under a heavy tenant's flood, against alone (``gateway_flood.yaml`` on
   the gateway benchmark's 2 × 1,024-token pool);
4. the pool's tokens/s in those floods against FCFS pass-through (fairway's ``fcfs`` policy:
   every request dispatched at once, the engines' queues decide);
5. latency added at 200 requests/s against Envoy alone, the highest rate with p99 added ≤ 10 ms,
   and CPU per request of each picker;
6. on issue 28's workloads that share prefixes (``bench/traffic/prefix_*.yaml``: a system prompt
   per tenant, chat sessions, RAG over shared documents, agent programs of 1, 10 and 30 calls),
   on prefix-caching servers: upstream with its default scheduling profile (prefix-cache scorer
   on), fairway with ``routing.prefixAffinity`` on the same Envoy (the response inline), the same
   on fairway's own response path (the meter stream) and fairway without affinity: the pool's
   tokens/s, the engines' own prefix hit rate, TTFT p50/p95, each tenant's session or program
   completion p50/p95 and its share of the computed-token cost (``PREFIX_TIMING``: the blocks'
   lengths).

    python -m bench.peer --out bench/results [--quick]
    python -m bench.peer --only prefix        # measure 6 alone, the others kept from peer.json
    python -m bench.peer --only prefix --agent-block 120   # agent programs alone, long blocks
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gateway.common import (
    DECODE_WEIGHT,
    POOL_KV_BUDGET,
    PREFILL_WEIGHT,
    GatewayRun,
    envoy_version,
    loadavg,
    make_traffic,
    percentile_ms,
    pool_numbers,
    process_cpu,
    run_stack,
    tenant_numbers,
    trace,
    traffic_data,
)
from bench.gateway.overhead import (
    FAST_SERVER_ARGS,
    LADDER_P99_LIMIT_MS,
    OVERHEAD_RATE,
    RawTarget,
    alternate,
    envoy_stats,
    raw_post,
)
from picker.sim.analysis import widest_swing
from picker.sim.load import RequestRecord, percentile, unit_completions
from picker.sim.traffic import DEFAULT_TENANT_HEADER, Traffic, load_traffic
from picker.stack.envoy import DESTINATION_HEADER, envoy_config
from picker.stack.launcher import Stack
from scripts.cluster import ControlPlane
from scripts.upstream_picker import (
    FAIRNESS_HEADER,
    FAIRNESS_POLICY,
    FAIRNESS_QUEUE_DEPTH,
    RELEASE,
    UpstreamPool,
)

PEERS = ("fairway", "upstream")
ENGINE_POLICIES = ("fcfs", "priority")
SHARE_SERVER_ARGS = ["--kv-budget-tokens", "4096", "--step-ms", "5"]
"""The shares pool: two servers of 4,096 tokens, so a long retrieval prompt does not fill one
alone, and three backlogs of 12 still hold about twice what the pool takes."""
FLOOD_SERVER_ARGS = ["--kv-budget-tokens", str(POOL_KV_BUDGET), "--step-ms", "5"]
"""The gateway benchmark's contended pool (2 × 1,024 tokens, 5 ms steps): the flood, and the
returning tenant (two backlogs of 12 short requests hold about twice what it takes)."""
RATIO_WEIGHTS = {"chat": 1.0, "rag": 2.0, "writer": 3.0}
ALONE_FACTOR_GOAL = 1.5
RETURNING_GOAL = (0.45, 0.55)
LADDER = (400.0, 800.0, 1600.0)

assert FAIRNESS_HEADER == DEFAULT_TENANT_HEADER, "the load client must send the header both read"


@dataclass(frozen=True)
class PeerPlan:
    """Durations of every part: the full measurement or the ``--quick`` smoke run."""

    quick: bool
    sample_interval: float = 0.25
    prefix_scale: float = 1.0
    """The prefix workloads' rates and backlogs times this (``--prefix-scale``: the files' own
    load overruns the simulated servers on a busy 2-core machine)."""
    agent_block_s: float = 0.0
    """``--agent-block``: measure 6 runs the agent programs alone, in blocks this long, so that
    the 30-call tenant's tasks finish and their completion p95 is reported (0: every workload
    in ``PREFIX_TIMING``'s blocks)."""
    workloads: tuple[str, ...] = ()
    """``--workload``: measure 6 on these workloads only (``PREFIX_WORKLOADS``' file names,
    e.g. ``system_prompt``), for iterating on one; () all."""
    order: str = ""
    """``--blocks``: measure 6's pickers in this order of letters (``PREFIX_LETTERS``, e.g.
    ``ABBA``), for iterating; "" the full order (``prefix_blocks``)."""
    block_s: float = 0.0
    """``--block-seconds``: measure 6's blocks this long (sessions and programs starting until
    the same share of the block as in ``PREFIX_TIMING``); 0: ``PREFIX_TIMING``'s."""
    diagnose: Path | None = None
    """``--diagnose DIR``: the Python pickers (fairway's, the floor) are sampled by py-spy and
    Envoy's ext_proc counters read at each block's end, into DIR, one file each per block
    (diagnosis, not a result: sampling costs the picker CPU)."""
    trace: bool = False
    """``--trace``: with ``diagnose``, fairway's pickers also write their trace."""

    @property
    def share_duration(self) -> float:
        return 8.0 if self.quick else 24.0

    @property
    def share_warmup(self) -> float:
        return 2.0 if self.quick else 4.0

    @property
    def returning_at(self) -> float:
        return 8.0 if self.quick else 18.0

    @property
    def returning_window(self) -> float:
        """Seconds after its return over which the returning tenant's share is taken."""
        return 4.0 if self.quick else 8.0

    @property
    def flood_duration(self) -> float:
        return 5.0 if self.quick else 20.0

    @property
    def light_start(self) -> float:
        return 1.0 if self.quick else 3.0

    @property
    def blocks(self) -> tuple[str, ...]:
        """The pickers' order: ABBA, so a drift of the machine over the run cancels."""
        return PEERS if self.quick else (*PEERS, *reversed(PEERS))

    @property
    def overhead_block(self) -> float:
        return 1.5 if self.quick else 3.0

    @property
    def overhead_pairs(self) -> int:
        return 1 if self.quick else 4

    @property
    def ladder(self) -> tuple[float, ...]:
        return LADDER[:1] if self.quick else LADDER

    @property
    def prefix_blocks(self) -> tuple[str, ...]:
        """The prefix measure's order: fairway with affinity (inline, and on the meter stream),
        upstream and the CPython gRPC floor twice each, fairway without affinity once in the
        middle (A D B F C F B D A: every picker's mean position in the run the same; nine
        blocks a workload keep the run near 15 minutes, so the variant that only shows what
        affinity buys runs once)."""
        if self.order:
            by_letter = {letter: peer for peer, letter in PREFIX_LETTERS.items()}
            return tuple(by_letter[letter] for letter in self.order)
        return PREFIX_PEERS if self.quick else (
            PREFIX_AFFINITY, PREFIX_METER, "upstream", PREFIX_FLOOR, PREFIX_PLAIN, PREFIX_FLOOR,
            "upstream", PREFIX_METER, PREFIX_AFFINITY)

    @property
    def prefix_workloads(self) -> dict[str, str]:
        """Measure 6's workloads: all, or the agent programs alone with ``agent_block_s``."""
        if self.agent_block_s:
            return {AGENT_WORKLOAD: PREFIX_WORKLOADS[AGENT_WORKLOAD]}
        if self.workloads:
            return {k: v for k, v in PREFIX_WORKLOADS.items() if v in self.workloads}
        return PREFIX_WORKLOADS

    def prefix_timing(self, workload: str) -> PrefixTiming:
        if self.agent_block_s and workload == AGENT_WORKLOAD:
            # Tasks start until AGENT_TAIL_S before the end: a 30-call task takes about a
            # minute (a call's reply and its tool's 0.2-1 s, thirty times) on a busy machine.
            return PrefixTiming(self.agent_block_s, 5.0,
                                stop_s=max(10.0, self.agent_block_s - AGENT_TAIL_S))
        timing = PREFIX_TIMING[workload]
        if self.block_s:
            scale = self.block_s / timing.duration_s
            timing = PrefixTiming(self.block_s, min(timing.warmup_s, self.block_s / 3),
                                  None if timing.stop_s is None else timing.stop_s * scale)
        if not self.quick:
            return timing
        return PrefixTiming(timing.duration_s / 2, timing.warmup_s / 2,
                            None if timing.stop_s is None else timing.stop_s / 2)


@dataclass(frozen=True)
class PrefixTiming:
    """One prefix workload's block: ``duration_s`` of traffic, measured after ``warmup_s``;
    sessions and programs start until ``stop_s`` (None: the file's open loop to the end)."""

    duration_s: float
    warmup_s: float
    stop_s: float | None = None


PREFIX_AFFINITY = "fairway + affinity"
PREFIX_PLAIN = "fairway, no affinity"
PREFIX_METER = "fairway + affinity, meter stream"
"""fairway's recommended Envoy configuration (``response_path="meter-stream"``, as the overhead
measure's "fairway, meter stream"): the response is metered on a second ext_proc stream that
Envoy does not wait for, so streamed chunks no longer round-trip through the picker."""
PREFIX_FLOOR = "CPython gRPC floor"
"""``bench.floor_epp`` behind the inline Envoy: grpc.aio routing each request to the endpoint
with the fewest in flight and echoing every chunk, nothing else (``--blocks`` F only: what any
Python picker pays on this path before it decides anything)."""
PREFIX_PEERS = (PREFIX_AFFINITY, "upstream", PREFIX_PLAIN, PREFIX_METER)
PREFIX_SHOWN = (*PREFIX_PEERS, PREFIX_FLOOR)
"""Every picker a prefix block may run (the floor only when ``--blocks`` names it)."""
GOAL_CHECKS = ((PREFIX_AFFINITY, "goals", PREFIX_AFFINITY, "the issue's verdict"),
               (PREFIX_METER, "goals_meter_stream", PREFIX_METER, "fairway's own Envoy "
                "configuration, not upstream's; shown, not the issue's verdict"),
               (PREFIX_PLAIN, "goals_plain", PREFIX_PLAIN, "what affinity buys; shown, not the "
                "issue's verdict"),
               (PREFIX_FLOOR, "goals_floor", f"the {PREFIX_FLOOR}", "no picker's work at all on "
                "upstream's Envoy configuration; shown, not a verdict"))
"""The pickers held to the issue's goals against upstream, each with its summary key, its name
in a sentence and what its table is: fairway with affinity on upstream's Envoy configuration
(the verdict), then the others beside it."""
PREFIX_LETTERS = {PREFIX_AFFINITY: "A", "upstream": "B", PREFIX_PLAIN: "C", PREFIX_METER: "D",
                  PREFIX_FLOOR: "F"}
PREFIX_SHORT = {PREFIX_AFFINITY: "fairway", "upstream": "upstream", PREFIX_PLAIN: "fairway",
                PREFIX_METER: "fairway-meter", PREFIX_FLOOR: "floor"}
"""Block labels (work directories)."""
PREFIX_WORKLOADS = {"system prompt": "system_prompt", "chat sessions": "chat", "rag": "rag",
                    "agent programs": "agent"}
"""Issue 28's point 4 workloads: ``bench/traffic/prefix_<name>.yaml``."""
AGENT_WORKLOAD = "agent programs"
AGENT_TAIL_S = 100.0
"""With ``--agent-block``: seconds at a block's end in which no task starts, so that the tasks
running finish (a 30-call task took 60-80 s here)."""
PREFIX_TIMING = {
    "system prompt": PrefixTiming(10.0, 3.0),
    "rag": PrefixTiming(10.0, 3.0),
    "chat sessions": PrefixTiming(25.0, 5.0, stop_s=12.0),
    "agent programs": PrefixTiming(30.0, 5.0, stop_s=12.0),
}
"""Shorter than the files (60-150 s, for the pool simulator): five blocks of each workload
through real processes on a shared 2-core machine. Sessions and programs longer than a block
(a 30-call task, a 20-turn session) are counted as started, not completed."""
PREFIX_TIMEOUT_S = 30.0
"""A request still running when a block's traffic ends gets at most this long (the files' 60)."""
PREFIX_SERVER_ARGS = ["--kv-budget-tokens", "65536", "--step-ms", "10",
                      "--prefill-ms-per-1k-tokens", "50", "--max-num-batched-tokens", "8192",
                      "--block-size", "16", "--enable-prefix-caching"]
"""``bench.prefix``'s pool as servers: 65,536 tokens of KV each, 8,192 batched tokens a step,
10 ms a step plus 0.05 ms per prompt token computed, vLLM's prefix caching on (16-token
blocks)."""


# -- the two pickers' stacks -------------------------------------------------------------------


THROUGHPUT_FLAVOUR = "upstream, queueDepthThreshold 5"
"""Upstream at its detector's default ("for maximum throughput"), beside the fairness setting
in the flood measure."""


@dataclass
class Peers:
    """Builds a stack around either picker; upstream's is served on ``upstream``'s pool."""

    upstream: UpstreamPool
    started: dict[str, float] = field(default_factory=dict)
    """Seconds each upstream picker took to be ready, by stack name."""

    def stack(self, peer: str, workdir: Path, *, server_args: Sequence[str],
              picker_config: dict[str, Any] | None = None, policy: str = "vtc",
              endpoints: int = 2, external: Sequence[str] = (),
              response_path: str = "inline") -> Stack:
        """``response_path`` (fairway's): ``inline`` as upstream's (the same Envoy), or
        ``meter-stream``, fairway's own Envoy sample's."""
        common: dict[str, Any] = {"endpoints": endpoints, "external_endpoints": list(external),
                                  "server_args": list(server_args)}
        if peer == "fairway":
            return Stack(workdir, policy=policy, picker_config=picker_config or {},
                         response_path=response_path, **common)
        pools = {"upstream": self.upstream,
                 THROUGHPUT_FLAVOUR: dataclasses.replace(self.upstream, queue_depth=5)}
        if peer not in pools:
            raise ValueError(f"peer must be fairway or one of {sorted(pools)}, got {peer!r}")
        return Stack(workdir, with_picker=False,
                     envoy_bootstrap=functools.partial(self._upstream_envoy, pools[peer]),
                     **common)

    def _upstream_envoy(self, pool: UpstreamPool, stack: Stack) -> dict[str, Any]:
        """Start upstream's picker on the stack's servers; the Envoy that fairway's stack runs
        (``envoy_config`` as ``Stack`` calls it, inline) with upstream's port for the picker."""
        started = time.monotonic()
        process, ports = pool.serve(stack.endpoint_addresses, stack.workdir / "epp.log")
        self.started[stack.workdir.name] = time.monotonic() - started
        stack.processes.append(process)  # stopped, and its CPU read, with the stack's own
        stack.metrics_port = ports.metrics
        return envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                            picker_port=ports.grpc, access_log=stack.access_log,
                            response_path="inline", picker_tls=True, identity="trusted-client",
                            endpoints=stack.endpoint_addresses)


def floor_envoy(stack: Stack) -> dict[str, Any]:
    """Start ``bench.floor_epp`` on the stack's servers; the inline Envoy, dialling it."""
    process = subprocess.Popen([sys.executable, "-m", "bench.floor_epp", "--endpoints",
                                ",".join(stack.endpoint_addresses)], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    stack.processes.append(process)
    assert process.stdout is not None
    ports = dict(process.stdout.readline().split() for _ in range(2))
    stack.metrics_port = int(ports["metrics"])
    return envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                        picker_port=int(ports["ext_proc"]), access_log=stack.access_log,
                        response_path="inline", picker_tls=True, identity="trusted-client",
                        endpoints=stack.endpoint_addresses)


def fairway_config(traffic: Traffic, engine_policy: str,
                   weights: dict[str, float] | None = None) -> dict[str, Any]:
    tenants = [{"id": t.name, "weight": (weights or {}).get(t.name, 1.0)}
               for t in traffic.tenants]
    config: dict[str, Any] = {"tenants": tenants, "queue": {"maxWait": "60s"}}
    if engine_policy == "priority":
        config["scheduling"] = {"enginePolicy": "priority"}
    return config


def server_args(base: Sequence[str], engine_policy: str) -> list[str]:
    return [*base, "--scheduling-policy", engine_policy]


def run_peer(peers: Peers, peer: str, label: str, traffic: Traffic, window: tuple[float, float],
             workdir: Path, plan: PeerPlan, engine_policy: str, base_args: Sequence[str], *,
             weights: dict[str, float] | None = None, policy: str = "vtc") -> GatewayRun:
    stack = peers.stack(peer, workdir / label, server_args=server_args(base_args, engine_policy),
                        picker_config=fairway_config(traffic, engine_policy, weights),
                        policy=policy)
    name = peer if policy == "vtc" else f"{peer} {policy}"
    return run_stack(label, name, stack, traffic, window, plan.sample_interval)


# -- what each run shows -----------------------------------------------------------------------


def service(records: Sequence[RequestRecord], tenant: str, t1: float, t2: float) -> float:
    """``tenant``'s service in fairway's cost (prompt + 2 × output tokens) within [t1, t2]."""
    return trace(records, tenant, PREFILL_WEIGHT, DECODE_WEIGHT).between(t1, t2)


def requests_started(records: Sequence[RequestRecord], tenant: str, t1: float,
                     t2: float) -> int:
    """Requests of ``tenant`` whose first token came within [t1, t2]: dispatch opportunities."""
    return sum(1 for r in records if r.tenant == tenant and r.ok and r.ttft_s is not None
               and t1 <= r.start_s + r.ttft_s <= t2)


def shares(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: v / total if total else 0.0 for k, v in values.items()}


def worst_error(got: dict[str, float], weights: dict[str, float]) -> float:
    """The largest relative error of a share against its weight's share."""
    total = sum(weights.values())
    return max(abs(got[t] - w / total) / (w / total) for t, w in weights.items())


def drift(records: Sequence[RequestRecord], tenants: Sequence[str], window: tuple[float, float],
          weights: dict[str, float], step: float = 0.01) -> float:
    """The largest ``|W_a(t1,t2)/w_a - W_b(t1,t2)/w_b|`` over sub-intervals of ``window`` and
    pairs of the (backlogged) tenants: what VTC bounds."""
    traces = {t: trace(records, t, PREFILL_WEIGHT, DECODE_WEIGHT) for t in tenants}
    steps = int((window[1] - window[0]) / step) + 1
    times = [window[0] + i * step for i in range(steps)]
    worst = 0.0
    for i, a in enumerate(tenants):
        for b in tenants[i + 1:]:
            gaps = (traces[a].at(t) / weights[a] - traces[b].at(t) / weights[b] for t in times)
            worst = max(worst, widest_swing(gaps))
    return worst


def share_run(run: GatewayRun, weights: dict[str, float]) -> dict[str, Any]:
    t1, t2 = run.window
    tenants = list(weights)
    cost = shares({t: service(run.records, t, t1, t2) for t in tenants})
    requests = shares({t: float(requests_started(run.records, t, t1, t2)) for t in tenants})
    return {"label": run.label, "picker": run.policy, "window_s": [t1, t2],
            "share": cost, "request_share": requests,
            "worst_error": worst_error(cost, weights),
            "request_worst_error": worst_error(requests, weights),
            "drift": drift(run.records, tenants, run.window, weights),
            # fairway's samples only (upstream's queue is not read): the share of samples at
            # which the picker held the tenant's requests, i.e. it stayed backlogged.
            "held_fraction": {t: tenant_numbers(run, t)["picker_queued_fraction"]
                              for t in tenants},
            "errors": sum(not r.ok for r in run.records),
            "pool": pool_numbers(run), "cpu_s": run.resources.get("cpu_s", {})}


def returning_run(run: GatewayRun, back_at: float, window: float) -> dict[str, Any]:
    t1, t2 = back_at, back_at + window
    got = shares({t: service(run.records, t, t1, t2) for t in ("steady", "returning")})
    early = shares({t: service(run.records, t, t1, t1 + window / 2)
                    for t in ("steady", "returning")})
    return {"label": run.label, "picker": run.policy, "window_s": [t1, t2],
            "returning_share": got["returning"], "first_half_share": early["returning"],
            "errors": sum(not r.ok for r in run.records)}


def light_run(run: GatewayRun) -> dict[str, Any]:
    t1, t2 = run.window
    ttft = [r.ttft_s for r in run.records if r.tenant == "light" and r.ok
            and r.ttft_s is not None and t1 <= r.start_s <= t2]
    light = [r for r in run.records if r.tenant == "light"]
    return {"label": run.label, "picker": run.policy, "window_s": [t1, t2],
            "light_ttft_ms": {"p50": percentile_ms(ttft, 50), "p95": percentile_ms(ttft, 95),
                              "n": len(ttft)},
            "light_errors": sum(not r.ok for r in light),
            "pool_tokens_per_s": pool_numbers(run)["server_output_tokens_per_s"],
            "errors": sum(not r.ok for r in run.records)}


def pooled(rows: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], float | None],
           ) -> float | None:
    """The mean over a picker's blocks of one figure (None where a block has none)."""
    values = [v for v in map(key, rows) if v is not None]
    return statistics.fmean(values) if values else None


# -- the measures ------------------------------------------------------------------------------


def exp_shares(peers: Peers, plan: PeerPlan, workdir: Path) -> dict[str, Any]:
    traffic = make_traffic("mixed", plan.share_duration, prefix="peer")
    window = (plan.share_warmup, plan.share_duration)
    equal = dict.fromkeys(RATIO_WEIGHTS, 1.0)
    out: dict[str, Any] = {"traffic": "bench/traffic/peer_mixed.yaml", "by_engine": {}}
    for engine in ENGINE_POLICIES:
        rows = [share_run(run_peer(peers, peer, f"shares-{engine}-{i}-{peer}", traffic, window,
                                   workdir, plan, engine, SHARE_SERVER_ARGS), equal)
                for i, peer in enumerate(plan.blocks)]
        weighted = share_run(run_peer(peers, "fairway", f"shares-{engine}-weighted", traffic,
                                      window, workdir, plan, engine, SHARE_SERVER_ARGS,
                                      weights=RATIO_WEIGHTS), RATIO_WEIGHTS)
        out["by_engine"][engine] = {"blocks": rows, "fairway_weighted_1_2_3": weighted}
    return out


def exp_returning(peers: Peers, plan: PeerPlan, workdir: Path) -> dict[str, Any]:
    traffic = make_traffic("returning", plan.returning_at + plan.returning_window + 2,
                           prefix="peer", returning=plan.returning_at)
    window = (plan.returning_at, plan.returning_at + plan.returning_window)
    out: dict[str, Any] = {"traffic": "bench/traffic/peer_returning.yaml", "by_engine": {}}
    for engine in ENGINE_POLICIES:
        out["by_engine"][engine] = {"blocks": [
            returning_run(run_peer(peers, peer, f"returning-{engine}-{i}-{peer}", traffic, window,
                                   workdir, plan, engine, FLOOD_SERVER_ARGS),
                          plan.returning_at, plan.returning_window)
            for i, peer in enumerate(plan.blocks)]}
    return out


def exp_flood(peers: Peers, plan: PeerPlan, workdir: Path) -> dict[str, Any]:
    flood = make_traffic("flood", plan.flood_duration, light=plan.light_start)
    alone = dataclasses.replace(flood, tenants=(flood.tenant("light"),))
    window = (plan.light_start, plan.flood_duration)
    out: dict[str, Any] = {"traffic": "bench/traffic/gateway_flood.yaml", "by_engine": {}}
    for engine in ENGINE_POLICIES:
        rows = []
        for i, peer in enumerate(plan.blocks):
            for kind, traffic in (("alone", alone), ("flood", flood)):
                row = light_run(run_peer(peers, peer, f"{kind}-{engine}-{i}-{peer}", traffic,
                                         window, workdir, plan, engine, FLOOD_SERVER_ARGS))
                rows.append({**row, "kind": kind})
        fcfs = light_run(run_peer(peers, "fairway", f"flood-{engine}-fcfs", flood, window,
                                  workdir, plan, engine, FLOOD_SERVER_ARGS, policy="fcfs"))
        throughput = light_run(run_peer(peers, THROUGHPUT_FLAVOUR, f"flood-{engine}-upstream-q5",
                                        flood, window, workdir, plan, engine, FLOOD_SERVER_ARGS))
        out["by_engine"][engine] = {"blocks": rows, "fcfs_pass_through": fcfs,
                                    "upstream_queue_depth_5": throughput}
    return out


def prefix_traffic(workload: str, timing: PrefixTiming, scale: float = 1.0) -> Traffic:
    """The workload's file with the block's duration (its sessions and programs starting until
    ``stop_s``), ``PREFIX_TIMEOUT_S``, and each tenant's rate and backlog times ``scale``."""
    data = traffic_data(PREFIX_WORKLOADS[workload], prefix="prefix")
    data["duration_s"] = timing.duration_s
    data["timeout_s"] = PREFIX_TIMEOUT_S
    for tenant in data["tenants"]:
        if timing.stop_s is not None and "stop_s" in tenant:
            tenant["stop_s"] = timing.stop_s
        if tenant.get("rate"):
            tenant["rate"] = tenant["rate"] * scale
        if tenant.get("backlog"):
            tenant["backlog"] = max(1, round(tenant["backlog"] * scale))
    return load_traffic(data)


def prefix_config(traffic: Traffic, affinity: bool) -> dict[str, Any]:
    """fairway's benchmark config (equal weights, ``queue.maxWait`` 60 s), with
    ``routing.prefixAffinity`` at its defaults when ``affinity``; ``capacity.engineCache:
    auto`` either way (the engines here cache prefixes)."""
    config = fairway_config(traffic, "fcfs")
    config.setdefault("capacity", {})["engineCache"] = "auto"
    if affinity:
        config["routing"] = {"prefixAffinity": {}}
    return config


def _quantile(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    got = percentile(values, q)
    return None if got is None else got * scale


def prefix_run(run: GatewayRun, tenants: Sequence[str]) -> dict[str, Any]:
    """One block: the pool's output tokens/s and the engines' prefix hit rate over the window
    (the servers' counters), TTFT of the requests sent in it, and per tenant its sessions' or
    programs' completion times (``unit_completions``: first call sent to last reply, units whose
    every call was answered) and its share of the computed-token cost, ``(prompt - cached) + 2 ×
    output`` of every request answered, beside the sent-token cost ``prompt + 2 × output``."""
    t1, t2 = run.window
    hits = run.delta(run.server_series("vllm:prefix_cache_hits_total"))
    queries = run.delta(run.server_series("vllm:prefix_cache_queries_total"))
    inside = [r for r in run.records if t1 <= r.start_s <= t2]
    ttft = [r.ttft_s for r in inside if r.ok and r.ttft_s is not None]
    units = unit_completions(run.records)
    computed = dict.fromkeys(tenants, 0.0)
    sent = dict.fromkeys(tenants, 0.0)
    for r in run.records:
        if r.ok:
            output = DECODE_WEIGHT * r.completion_tokens
            computed[r.tenant] += PREFILL_WEIGHT * (r.prompt_tokens - (r.cached_tokens or 0)) \
                + output
            sent[r.tenant] += PREFILL_WEIGHT * r.prompt_tokens + output
    computed_share, sent_share = shares(computed), shares(sent)
    per: dict[str, Any] = {}
    for name in tenants:
        mine = [r for r in inside if r.tenant == name and r.ok and r.ttft_s is not None]
        done = [s for (t, _), s in units.items() if t == name and s is not None]
        per[name] = {
            "ttft_ms": {"p50": _quantile([r.ttft_s for r in mine if r.ttft_s is not None], 50,
                                         1000),
                        "p95": _quantile([r.ttft_s for r in mine if r.ttft_s is not None], 95,
                                         1000)},
            "requests": sum(1 for r in run.records if r.tenant == name),
            "ok": sum(1 for r in run.records if r.tenant == name and r.ok),
            "units_started": sum(1 for (t, _) in units if t == name),
            "units_completed": len(done),
            "completion_s": {"p50": _quantile(done, 50), "p95": _quantile(done, 95)},
            "computed_cost_share": computed_share[name],
            "sent_cost_share": sent_share[name],
        }
    cpu = run.resources.get("cpu_s", {})
    pool = pool_numbers(run)
    return {
        "label": run.label, "picker": run.policy, "window_s": [t1, t2],
        "pool_tokens_per_s": pool["server_output_tokens_per_s"],
        "split_ms": ttft_split(run, ttft, pool),
        "prefix_hit_rate": hits / queries if queries else None,
        "ttft_ms": {"p50": percentile_ms(ttft, 50), "p95": percentile_ms(ttft, 95),
                    "n": len(ttft)},
        "requests": len(run.records), "ok": sum(r.ok for r in run.records),
        "errors": sum(not r.ok for r in run.records),
        "picker_cpu_s": sum(v for k, v in cpu.items() if k.rsplit("/", 1)[-1] in ("picker", "epp")),
        "cpu_s": {k.rsplit("/", 1)[-1]: v for k, v in cpu.items()},
        "loadavg": [run.resources.get("loadavg_before"), run.resources.get("loadavg_after")],
        "wall_s": run.resources.get("wall_s"),
        "tenants": per,
    }


def _window_mean_ms(run: GatewayRun, series: Callable[[str], Any], name: str) -> float | None:
    """The mean of histogram ``name`` over the observations made in the run's window (ms)."""
    count = run.delta(series(f"{name}_count"))
    return run.delta(series(f"{name}_sum")) / count * 1000 if count else None


def ttft_split(run: GatewayRun, ttft: Sequence[float], pool: dict[str, Any]) -> dict[str, Any]:
    """Where a request's time to first token went, as means over the window: the client's TTFT,
    the time fairway's picker held it in its fair queue and from its arrival there to the first
    response byte it saw (fairway only: upstream exports neither), the engines' own TTFT (arrival
    at the server to its first token: its waiting queue and prefill), and the engines' mean
    waiting and running requests and the picker's mean queue."""
    return {
        "client_mean": statistics.fmean(ttft) * 1000 if ttft else None,
        "picker_queue_wait_mean": _window_mean_ms(run, run.picker_series,
                                                  "fairway_queue_wait_seconds"),
        "picker_first_byte_mean": _window_mean_ms(run, run.picker_series,
                                                  "fairway_ttft_seconds"),
        "engine_ttft_mean": _window_mean_ms(run, run.server_series,
                                            "vllm:time_to_first_token_seconds"),
        "engine_waiting_mean": pool["mean_engine_waiting"],
        "engine_running_mean": pool["mean_running"],
        "picker_queued_mean": pool["mean_picker_queued"],
    }


@contextlib.contextmanager
def _py_spy(stack: Stack, out: Path) -> Any:
    """py-spy samples ``stack``'s picker (collapsed stacks into ``out``) while the block runs."""
    found = shutil.which("py-spy")
    picker = stack.picker_processes[0] if stack.picker_processes else next(
        (p for p in stack.processes if isinstance(p.args, list)
         and "bench.floor_epp" in p.args), None)
    if found is None or picker is None:
        yield
        return
    spy = subprocess.Popen([found, "record", "--pid", str(picker.pid),
                            "--rate", "200", "--format", "raw", "--output", str(out),
                            "--nonblocking", *(["--native"] if os.environ.get(
                                "FAIRWAY_PY_SPY_NATIVE") else [])],
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            out.with_suffix(".envoy.json").write_text(json.dumps(envoy_stats(stack)))
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=20)
        except subprocess.TimeoutExpired:
            spy.kill()


def trace_holds(path: Path, window: tuple[float, float]) -> dict[str, Any]:
    """From a picker trace (``picker.dispatch.trace``): the share of its lines in the block's
    window at which the picker held requests, and, over those, how often each endpoint gave
    each ``picker.core.holds`` reason for not taking the head."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if '"eps"' in line]
    if not lines:
        return {}
    t0 = lines[0]["t"]
    inside = [line for line in lines if window[0] <= line["t"] - t0 <= window[1]]
    held = [line for line in inside if line["q"]]
    reasons: dict[str, int] = {}
    for line in held:
        for endpoint in line["eps"]:
            reasons[endpoint["why"]] = reasons.get(endpoint["why"], 0) + 1
    return {"lines": len(inside), "held_fraction": len(held) / len(inside) if inside else None,
            "queued_max": max((line["q"] for line in inside), default=0),
            "reasons": reasons}


def exp_prefix(peers: Peers, plan: PeerPlan, workdir: Path) -> dict[str, Any]:
    """Each prefix workload through the same Envoy and prefix-caching servers, the pickers in
    ``plan.prefix_blocks`` order."""
    out: dict[str, Any] = {"server_args": PREFIX_SERVER_ARGS, "timeout_s": PREFIX_TIMEOUT_S,
                           "scale": plan.prefix_scale,
                           "agent_block_s": plan.agent_block_s,
                           "blocks_order": list(plan.prefix_blocks),
                           "engine_cache": True,
                           "loadavg_start": loadavg(), "by_workload": {}}
    started = time.monotonic()
    for workload, name in plan.prefix_workloads.items():
        timing = plan.prefix_timing(workload)
        traffic = prefix_traffic(workload, timing, plan.prefix_scale)
        tenants = [t.name for t in traffic.tenants]
        window = (timing.warmup_s, timing.duration_s)
        rows = []
        for i, peer in enumerate(plan.prefix_blocks):
            label = f"prefix-{name}-{i}-{PREFIX_SHORT[peer]}"
            stack_peer = "upstream" if peer == "upstream" else "fairway"
            if peer == PREFIX_FLOOR:
                stack_peer = "floor"
                stack = Stack(workdir / label, with_picker=False, envoy_bootstrap=floor_envoy,
                              server_args=list(PREFIX_SERVER_ARGS))
            else:
                stack = peers.stack(stack_peer, workdir / label,
                                    server_args=PREFIX_SERVER_ARGS,
                                    picker_config=prefix_config(
                                        traffic, peer in (PREFIX_AFFINITY, PREFIX_METER)),
                                    response_path="meter-stream" if peer == PREFIX_METER
                                    else "inline")
            during = None
            if plan.diagnose is not None and stack_peer in ("fairway", "floor"):
                plan.diagnose.mkdir(parents=True, exist_ok=True)
                if stack_peer == "fairway" and plan.trace:
                    stack.picker_args += ["--trace", str(plan.diagnose / f"{label}.trace")]
                spied = plan.diagnose / f"{label}.py-spy.txt"
                during = functools.partial(_py_spy, out=spied)
            row = prefix_run(run_stack(label, peer, stack, traffic, window,
                                       plan.sample_interval, during), tenants)
            if plan.diagnose is not None and stack_peer == "fairway" and plan.trace:
                row["holds"] = trace_holds(plan.diagnose / f"{label}.trace", window)
            rows.append(row)
        out["by_workload"][workload] = {
            "traffic": f"bench/traffic/prefix_{name}.yaml",
            "timing": dataclasses.asdict(timing), "tenants": tenants, "blocks": rows}
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["loadavg_end"] = loadavg()
    out["summary"] = prefix_summary(out)
    return out


DEFAULT_ORDERS = frozenset({"ADBFCFBDA", "ABCD", "ADBCBDA", "ABCBA"})
"""Orders of letters a run got without ``--blocks``: this default and quick's, and the defaults
of runs kept in ``peer.json`` from before the floor (F) ran, or the meter stream (D)."""

SPLIT_KEYS = ("client_mean", "picker_queue_wait_mean", "picker_first_byte_mean",
              "engine_ttft_mean", "engine_waiting_mean", "engine_running_mean",
              "picker_queued_mean")
"""``ttft_split``'s figures, averaged over a picker's blocks in the summary."""

PREFIX_HIT_RATE_SLACK = 0.02
"""The issue's goal: the engines' hit rate within 2 points of upstream's, or better."""


def prefix_summary(data: dict[str, Any]) -> dict[str, Any]:
    """Per workload and picker, the means over its blocks; and the issue's goals, fairway with
    affinity against upstream."""
    out: dict[str, Any] = {}
    for workload, got in data["by_workload"].items():
        per: dict[str, Any] = {}
        for peer in PREFIX_SHOWN:
            mine = [r for r in got["blocks"] if r["picker"] == peer]
            if not mine:
                continue
            tenants = {}
            for name in got["tenants"]:
                rows = [r["tenants"][name] for r in mine]
                tenants[name] = {
                    "ttft_p50_ms": pooled(rows, lambda r: r["ttft_ms"]["p50"]),
                    "ttft_p95_ms": pooled(rows, lambda r: r["ttft_ms"]["p95"]),
                    "units_started": sum(r["units_started"] for r in rows),
                    "units_completed": sum(r["units_completed"] for r in rows),
                    "completion_p50_s": pooled(rows, lambda r: r["completion_s"]["p50"]),
                    "completion_p95_s": pooled(rows, lambda r: r["completion_s"]["p95"]),
                    "computed_cost_share": pooled(rows, lambda r: r["computed_cost_share"]),
                    "sent_cost_share": pooled(rows, lambda r: r["sent_cost_share"]),
                }
            per[peer] = {
                "blocks": len(mine),
                "pool_tokens_per_s": pooled(mine, lambda r: r["pool_tokens_per_s"]),
                "prefix_hit_rate": pooled(mine, lambda r: r["prefix_hit_rate"]),
                "ttft_p50_ms": pooled(mine, lambda r: r["ttft_ms"]["p50"]),
                "ttft_p95_ms": pooled(mine, lambda r: r["ttft_ms"]["p95"]),
                "ok": sum(r["ok"] for r in mine), "requests": sum(r["requests"] for r in mine),
                "picker_cpu_s": pooled(mine, lambda r: r["picker_cpu_s"]),
                "picker_cpu_ms_per_request": pooled(
                    mine, lambda r: r["picker_cpu_s"] / r["requests"] * 1000
                    if r["requests"] else None),
                "split_ms": {key: pooled(mine, lambda r, k=key: r.get("split_ms", {}).get(k))
                             for key in SPLIT_KEYS} if all("split_ms" in r for r in mine)
                else None,
                "tenants": tenants,
            }
        # The issue's goal is judged on the same Envoy as upstream's (inline); fairway's own
        # configuration, fairway without affinity and the floor are shown against upstream
        # beside it.
        out[workload] = {"pickers": per, **{
            key: prefix_goals(per.get(peer), per.get("upstream"))
            for peer, key, _, _ in GOAL_CHECKS}}
    return out


def prefix_goals(mine: dict[str, Any] | None,
                 theirs: dict[str, Any] | None) -> dict[str, bool | None]:
    """Whether fairway (``mine``) meets each of the issue's goals against upstream (None: a
    figure is missing)."""
    if not mine or not theirs:
        return {}

    def judged(key: str, ok: Callable[[float, float], bool]) -> bool | None:
        x, y = mine[key], theirs[key]
        return None if x is None or y is None else ok(x, y)

    return {"tokens_per_s": judged("pool_tokens_per_s", lambda x, y: x >= y),
            "ttft_p50": judged("ttft_p50_ms", lambda x, y: x <= y),
            "ttft_p95": judged("ttft_p95_ms", lambda x, y: x <= y),
            "hit_rate": judged("prefix_hit_rate", lambda x, y: x >= y - PREFIX_HIT_RATE_SLACK)}


async def _ladder(targets: dict[str, tuple[RawTarget, bytes]], plan: PeerPlan,
                  probe: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """200 requests/s ABBA across the baseline and both pickers, then the rate ladder."""
    for target, raw in targets.values():
        await alternate({"warm": (target, raw)}, OVERHEAD_RATE, 0.4, 1)
    rungs = []
    for rate in (OVERHEAD_RATE, *plan.ladder):
        pairs = plan.overhead_pairs if rate == OVERHEAD_RATE else max(1, plan.overhead_pairs // 2)
        rungs.append({"rate": rate, **await alternate(targets, rate, plan.overhead_block,
                                                      pairs, probe)})
    for target, _ in targets.values():
        target.close()
    return {"rungs": rungs}


OVERHEAD_PATHS = ("fairway", METER_PATH := "fairway, meter stream", "upstream")
"""The paths beside the baseline: fairway and upstream behind the same Envoy (inline), and
fairway behind its own sample's (the response on an observe-only meter stream)."""


def exp_overhead(peers: Peers, plan: PeerPlan, workdir: Path) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 1, "ignore_eos": True}
    config = {"tenants": [{"id": "bench"}], "queue": {"maxWait": "10s"}}
    with Stack(workdir / "ovh-base", with_picker=False, endpoints=1,
               server_args=FAST_SERVER_ARGS) as base, contextlib.ExitStack() as started:
        server = base.endpoint_addresses[0]
        stacks: dict[str, Stack] = {"baseline": base}
        for path, peer, response in (("fairway", "fairway", "inline"),
                                     (METER_PATH, "fairway", "meter-stream"),
                                     ("upstream", "upstream", "inline")):
            stacks[path] = started.enter_context(peers.stack(
                peer, workdir / _stack_name(path), server_args=(), endpoints=0,
                external=[server], picker_config=config, response_path=response))
        headers = {DEFAULT_TENANT_HEADER: "bench", DESTINATION_HEADER: server}
        targets = {name: (RawTarget(name, s.gateway_port),
                          raw_post(s.gateway_port, "/v1/completions", body, headers))
                   for name, s in stacks.items()}
        print("  overhead: 200 req/s ABBA, then the rate ladder", flush=True)
        got = asyncio.run(_ladder(targets, plan, lambda: process_cpu(list(stacks.values()))))
    return {"server": "one simulated server, 1 ms steps, one-token answers", **got,
            **overhead_summary(got["rungs"])}


def _stack_name(path: str) -> str:
    return "ovh-" + path.replace(", ", "-").replace(" ", "-")


def _picker_cpu(stats: dict[str, Any], path: str) -> float:
    """CPU seconds the picker process of ``path``'s stack used during one path's blocks."""
    prefix = _stack_name(path) + "/"
    return sum(v for k, v in stats.get("cpu_s", {}).items()
               if k.startswith(prefix) and k.rsplit("/", 1)[1] in ("picker", "epp"))


def cpu_ms_per_request(rung: dict[str, Any], path: str) -> float | None:
    """CPU ms per request of ``path``'s picker on its own blocks, less what it uses idle (it
    scrapes its server while the other paths run) over the same span."""
    mine = rung[path]
    others = [rung[p] for p in ("baseline", *OVERHEAD_PATHS) if p != path and p in rung]
    idle_span = sum(o["span_s"] for o in others)
    idle_rate = sum(_picker_cpu(o, path) for o in others) / idle_span if idle_span else 0.0
    used = _picker_cpu(mine, path) - idle_rate * mine["span_s"]
    return max(0.0, used) / mine["ok"] * 1000 if mine["ok"] else None


def added_ms(rung: dict[str, Any], path: str) -> dict[str, float | None]:
    base, mine = rung["baseline"]["latency_ms"], rung[path]["latency_ms"]
    return {q: mine[q] - base[q] if mine[q] is not None and base[q] is not None else None
            for q in ("p50", "p99")}


def sustains(rung: dict[str, Any], path: str) -> bool:
    """``path`` keeps up with the rung's rate with p99 added ≤ ``LADDER_P99_LIMIT_MS``."""
    mine, p99 = rung[path], added_ms(rung, path)["p99"]
    return (mine["errors"] <= 0.001 * mine["sent"] and mine["achieved_rate"] >= 0.95 * rung["rate"]
            and p99 is not None and p99 <= LADDER_P99_LIMIT_MS)


def overhead_summary(rungs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Added latency against the baseline, the highest rate of the ladder each path sustains
    (every rung up to it sustained), and its picker's CPU per request at 200 requests/s."""
    out: dict[str, Any] = {"added_ms": {}, "max_sustained_rate": {}, "cpu_ms_per_request": {}}
    paths = [p for p in OVERHEAD_PATHS if p in rungs[0]]
    for rung in rungs:
        rung["added_ms"] = {path: added_ms(rung, path) for path in paths}
    for path in paths:
        sustained: float | None = None
        for rung in rungs:
            if not sustains(rung, path):
                break
            sustained = rung["rate"]
        out["added_ms"][path] = rungs[0]["added_ms"][path]
        out["max_sustained_rate"][path] = sustained
        out["cpu_ms_per_request"][path] = cpu_ms_per_request(rungs[0], path)
    ratio: dict[str, float | None] = {}
    for key, pick in (("added_p50", lambda p: out["added_ms"][p]["p50"]),
                      ("cpu_per_request", lambda p: out["cpu_ms_per_request"][p])):
        theirs = pick("upstream")
        for path, name in (("fairway", key), (METER_PATH, f"{key}_meter_stream")):
            mine = pick(path) if path in paths else None
            ratio[name] = mine / theirs if mine is not None and theirs else None
    out["fairway_over_upstream"] = ratio
    return out


# -- the report ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """Each picker's figure for each measure (means over its ABBA blocks), and who leads."""
    out: dict[str, Any] = {}
    for engine in ENGINE_POLICIES:
        shares_rows = data["shares"]["by_engine"][engine]["blocks"]
        back_rows = data["returning"]["by_engine"][engine]["blocks"]
        flood = data["flood"]["by_engine"][engine]
        fcfs_tokens = flood["fcfs_pass_through"]["pool_tokens_per_s"]
        per: dict[str, Any] = {}
        for peer in PEERS:
            mine = [r for r in shares_rows if r["picker"] == peer]
            alone = [r for r in flood["blocks"] if r["picker"] == peer and r["kind"] == "alone"]
            under = [r for r in flood["blocks"] if r["picker"] == peer and r["kind"] == "flood"]
            alone_p95 = pooled(alone, lambda r: r["light_ttft_ms"]["p95"])
            flood_p95 = pooled(under, lambda r: r["light_ttft_ms"]["p95"])
            tokens = pooled(under, lambda r: r["pool_tokens_per_s"])
            per[peer] = {
                "share_worst_error": pooled(mine, lambda r: r["worst_error"]),
                "request_share_worst_error": pooled(mine, lambda r: r["request_worst_error"]),
                "drift": pooled(mine, lambda r: r["drift"]),
                "returning_share": pooled([r for r in back_rows if r["picker"] == peer],
                                          lambda r: r["returning_share"]),
                "light_p50_alone_ms": pooled(alone, lambda r: r["light_ttft_ms"]["p50"]),
                "light_p95_alone_ms": alone_p95,
                "light_p50_flood_ms": pooled(under, lambda r: r["light_ttft_ms"]["p50"]),
                "light_p95_flood_ms": flood_p95,
                "light_p95_over_alone": flood_p95 / alone_p95
                if flood_p95 is not None and alone_p95 else None,
                "pool_tokens_per_s": tokens,
                "tokens_over_fcfs": tokens / fcfs_tokens if tokens is not None and fcfs_tokens
                else None,
            }
        out[engine] = per
    return out


def render(data: dict[str, Any]) -> str:
    s = data["summary"]
    lines = [
        "# fairway beside upstream's endpoint picker",
        "",
        f"Generated by `python -m bench.peer` ({'quick' if data['quick'] else 'full'} run; "
        + ", ".join(f"{m} {t}" for m, t in data["generated"].items())
        + f"). Envoy {data['envoy']}; upstream: "
        f"`sigs.k8s.io/gateway-api-inference-extension` {RELEASE} `cmd/epp`, flow control with "
        "`round-robin-fairness-policy` (`scripts/upstream_picker.py` says why this release and "
        "how it is configured); fairway: this commit's defaults. Each figure is the mean over "
        "a picker's blocks, run ABBA (fairway, upstream, upstream, fairway) with fresh stacks of "
        "the same Envoy configuration and simulated servers. Upstream takes no weights, so "
        "shares are judged at equal weights.",
        "",
        "## Summary",
        "",
        "| measure | engines | fairway | upstream | goal | ahead |",
        "|---|---|---|---|---|---|",
    ]

    def row(name: str, engine: str, key: str, spec: str, goal: str,
            better: Callable[[float, float], bool] | None) -> None:
        a, b = s[engine]["fairway"][key], s[engine]["upstream"][key]
        lead = "–" if a is None or b is None or better is None else (
            "fairway" if better(a, b) else "upstream" if better(b, a) else "even")
        lines.append(f"| {name} | {engine} | {_fmt(a, spec)} | {_fmt(b, spec)} | {goal} | "
                     f"{lead} |")

    def closer(target: float) -> Callable[[float, float], bool]:
        return lambda a, b: abs(a - target) < abs(b - target) - 0.005

    for engine in ENGINE_POLICIES:
        row("worst share error, cost (3 tenants, equal weights)", engine, "share_worst_error",
            ".1%", "≤ 5 %", lambda a, b: a < b - 0.005)
        # Not judged: requests differ in cost, so equal requests are not equal service (it is
        # what a round-robin over requests equalizes, the row above is what VTC does).
        row("worst share error, requests", engine, "request_share_worst_error", ".1%",
            "not a goal", None)
        row("drift (cost units)", engine, "drift", ",.0f", "–", lambda a, b: a < 0.9 * b)
        row("returning tenant's share", engine, "returning_share", ".1%", "45–55 %",
            closer(0.5))
        row("light p95 TTFT, flood ÷ alone", engine, "light_p95_over_alone", ".2f",
            f"≤ {ALONE_FACTOR_GOAL}", lambda a, b: a < 0.95 * b)
        row("pool tokens ÷ FCFS pass-through", engine, "tokens_over_fcfs", ".3f", "≥ 0.97",
            lambda a, b: a > b + 0.01)
    o = data["overhead"]
    paths = [p for p in OVERHEAD_PATHS if p in o["added_ms"]]
    ratio = o["fairway_over_upstream"]
    lines += [
        "",
        "Overhead at 200 requests/s against the same Envoy without a picker (fairway and "
        "upstream behind the same Envoy configuration, the response inline; fairway also "
        "behind its own sample's, the response on an observe-only meter stream):",
        "",
        "| overhead at 200 req/s | " + " | ".join(paths) + " |",
        "|---|" + "---|" * len(paths),
        "| added p50 ms | " + " | ".join(_fmt(o["added_ms"][p]["p50"]) for p in paths) + " |",
        "| added p99 ms | " + " | ".join(_fmt(o["added_ms"][p]["p99"]) for p in paths) + " |",
        "| picker CPU ms per request | "
        + " | ".join(_fmt(o["cpu_ms_per_request"][p]) for p in paths) + " |",
        f"| highest rate with p99 added ≤ {LADDER_P99_LIMIT_MS:g} ms (req/s, ladder "
        f"{', '.join(f'{r:g}' for r in (OVERHEAD_RATE, *data['ladder']))}) | "
        + " | ".join(_fmt(o["max_sustained_rate"][p], "g") for p in paths) + " |",
        "",
        f"fairway ÷ upstream: added p50 {_fmt(ratio['added_p50'])} (meter stream "
        f"{_fmt(ratio.get('added_p50_meter_stream'))}), CPU per request "
        f"{_fmt(ratio['cpu_per_request'])} (meter stream "
        f"{_fmt(ratio.get('cpu_per_request_meter_stream'))}).",
    ]
    lines += _detail_tables(data)
    for key in prefix_sections(data):
        lines += _prefix_tables(data[key])
    return "\n".join(lines) + "\n"


def _detail_tables(data: dict[str, Any]) -> list[str]:
    lines = ["", "## 1. Shares of three backlogged tenants (`peer_mixed.yaml`)", "",
             "Service in fairway's cost (prompt + 2 × output tokens) over the window, and the "
             "share of requests whose first token came in it. chat: short prompts and answers; "
             "rag: long prompts, short answers; writer: short prompts, long answers.", "",
             "| engines | block | picker | chat | rag | writer | worst error | requests "
             "chat / rag / writer | drift |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, got in data["shares"]["by_engine"].items():
        for i, r in enumerate([*got["blocks"], got["fairway_weighted_1_2_3"]]):
            name = "fairway 1:2:3" if i == len(got["blocks"]) else r["picker"]
            req = " / ".join(f"{r['request_share'][t]:.1%}" for t in RATIO_WEIGHTS)
            lines.append(f"| {engine} | {i} | {name} | " + " | ".join(
                f"{r['share'][t]:.1%}" for t in RATIO_WEIGHTS)
                + f" | {r['worst_error']:.1%} | {req} | {r['drift']:,.0f} |")
    lines += ["", "## 2. The returning tenant (`peer_returning.yaml`)", "",
              "Its share of service in the window after it is backlogged again (and in the "
              "window's first half).", "", "| engines | block | picker | share | first half |",
              "|---|---|---|---|---|"]
    for engine, got in data["returning"]["by_engine"].items():
        for i, r in enumerate(got["blocks"]):
            lines.append(f"| {engine} | {i} | {r['picker']} | {r['returning_share']:.1%} | "
                         f"{r['first_half_share']:.1%} |")
    lines += ["", "## 3–4. A light tenant under a flood, and the pool's tokens "
              "(`gateway_flood.yaml`, 2 × 1,024-token servers)", "",
              "| engines | block | picker | run | light p50 ms | light p95 ms | light n | "
              "light errors | pool tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for engine, got in data["flood"]["by_engine"].items():
        for i, r in enumerate([*got["blocks"], got["fcfs_pass_through"],
                               got["upstream_queue_depth_5"]]):
            kind = r.get("kind", "flood")
            lines.append(f"| {engine} | {i // 2 if 'kind' in r else '–'} | {r['picker']} | "
                         f"{kind} | {_fmt(r['light_ttft_ms']['p50'], '.0f')} | "
                         f"{_fmt(r['light_ttft_ms']['p95'], '.0f')} | {r['light_ttft_ms']['n']} "
                         f"| {r['light_errors']} | {_fmt(r['pool_tokens_per_s'], '.0f')} |")
    lines += ["", "## 5. Overhead (one server, one-token answers)", "",
              "| rate | path | p50 ms | p99 ms | added p50 | added p99 | achieved req/s | "
              "errors |", "|---|---|---|---|---|---|---|---|"]
    for rung in data["overhead"]["rungs"]:
        for path in ("baseline", *(p for p in OVERHEAD_PATHS if p in rung)):
            st = rung[path]
            added = rung.get("added_ms", {}).get(path, {})
            lines.append(f"| {rung['rate']:g} | {path} | {_fmt(st['latency_ms']['p50'])} | "
                         f"{_fmt(st['latency_ms']['p99'])} | {_fmt(added.get('p50'))} | "
                         f"{_fmt(added.get('p99'))} | {st['achieved_rate']:.0f} | "
                         f"{st['errors']} |")
    return lines


def _ms(value: float | None) -> str:
    return _fmt(value, ",.0f")


def _pct(value: float | None) -> str:
    return _fmt(value, ".1%")


def _goal_row(workload: str, goals: dict[str, bool | None]) -> str:
    return f"| {workload} | " + " | ".join(
        "–" if goals.get(k) is None else ("yes" if goals[k] else "**no**")
        for k in ("tokens_per_s", "ttft_p50", "ttft_p95", "hit_rate")) + " |"


def _goal_table(summary: dict[str, Any], peer: str, named: str, what: str) -> list[str]:
    """The issue's four checks of ``peer`` against upstream on every workload both ran
    (judged from the summary's pickers, so a stored run renders every table); the first of
    ``GOAL_CHECKS`` is the verdict, the others are shown beside it."""
    rows = [(workload, goals) for workload, got in summary.items()
            if (goals := prefix_goals(got["pickers"].get(peer), got["pickers"].get("upstream")))]
    if not rows:
        return []
    met = sum(v is True for _, goals in rows for v in goals.values())
    total = sum(len(goals) for _, goals in rows)
    if peer == GOAL_CHECKS[0][0]:
        head = (f"The issue's goals, {named} against upstream ("
                + ("met: yes" if met == total else f"met: no, {met} of {total}") + "):")
    else:
        head = f"The same checks for {named} against upstream ({what}: {met} of {total}):"
    return ["", head, "", "| workload | tokens/s ≥ upstream | TTFT p50 ≤ upstream | "
            "TTFT p95 ≤ upstream | hit rate ≥ upstream − 2 points |", "|---|---|---|---|---|",
            *(_goal_row(workload, goals) for workload, goals in rows)]


def _prefix_tables(data: dict[str, Any], detail: bool = True) -> list[str]:
    """Section 6: the prefix workloads, summary and goals first, then (``detail``) tenants and
    blocks."""
    scale = data.get("scale", 1.0)
    agent_block = data.get("agent_block_s") or 0.0
    order = " ".join(PREFIX_LETTERS[p] for p in data["blocks_order"])
    meter = PREFIX_METER in data["blocks_order"]
    floor = PREFIX_FLOOR in data["blocks_order"]
    letters = order.replace(" ", "")
    blocks_flag = "" if letters in DEFAULT_ORDERS else f" --blocks {letters}"
    timings = "; ".join(
        f"{w} {t['timing']['duration_s']:g} s"
        + (f" (units start until {t['timing']['stop_s']:g} s)" if t["timing"]["stop_s"] else "")
        + f", measured from {t['timing']['warmup_s']:g} s"
        for w, t in data["by_workload"].items())
    lines = [
        "", "## 6. Workloads that share prefixes (issue 28; `bench/traffic/prefix_*.yaml`)"
        + (f", at {scale:g} of their rates and backlogs" if scale != 1 else "")
        + (f", agent programs alone in blocks of {agent_block:g} s" if agent_block else ""), "",
        "`python -m bench.peer --only prefix"
        + (f" --prefix-scale {scale:g}" if scale != 1 else "")
        + (f" --agent-block {agent_block:g}" if agent_block else "") + blocks_flag
        + "`. The same Envoy and two simulated vLLM servers with prefix caching (`"
        + " ".join(data["server_args"]) + "`: `bench.prefix`'s pool) "
        f"behind each picker: A = {PREFIX_AFFINITY} (`routing.prefixAffinity` at its "
        f"defaults), B = upstream (its default scheduling profile: queue and KV-cache scorers at "
        f"weight 2, prefix-cache scorer at 3; flow control with {FAIRNESS_POLICY} at "
        f"queueDepthThreshold {FAIRNESS_QUEUE_DEPTH}), C = {PREFIX_PLAIN} (load alone "
        + ("decides where; `capacity.engineCache: auto`: a prompt block shared by "
           "requests running on an endpoint counted once in its room, as in A)"
           if data.get("engine_cache") else "decides where; a run from before "
           "`capacity.engineCache`: every request's whole prompt counted in the room)")
        + (f", D = {PREFIX_METER} (A's picker config on fairway's recommended Envoy "
           "configuration: the response metered on a second ext_proc stream in observability "
           "mode, so streamed chunks do not wait for the picker; A, B and C send every chunk "
           "through the picker and wait for its answer)" if meter else "")
        + (f", F = {PREFIX_FLOOR} (`bench/floor_epp.py` on upstream's Envoy configuration: "
           "grpc.aio over TLS, as fairway serves, routing each request to the endpoint with the "
           "fewest in flight and echoing every chunk, nothing else: what any Python picker pays "
           "on this path before it decides anything, the floor fairway's CPU is judged "
           "against)" if floor else "")
        + "; blocks "
        f"in the order {order}, each a fresh stack. Blocks are shorter than the files' "
        f"durations, which are sized for the pool simulator: {timings}; requests still running "
        f"at a block's end get {data['timeout_s']:g} s. The whole measure took "
        f"{data['wall_s']:,.0f} s, load average (1, 5, 15 min) "
        f"{', '.join(f'{x:g}' for x in data['loadavg_start'])} at its start and "
        f"{', '.join(f'{x:g}' for x in data['loadavg_end'])} at its end, on a 2-core machine "
        "shared with other work. Pool tokens/s: the servers' output tokens in the window; hit "
        "rate: the engines' own `vllm:prefix_cache_hits_total` ÷ `vllm:prefix_cache_queries_total` "
        "(tokens) in the window; TTFT: requests sent in the window; picker CPU: the picker "
        "process's CPU seconds over a block. Each figure is the mean over the picker's blocks.",
        "",
        "| workload | picker | pool tokens/s | prefix hit rate | TTFT p50 ms | TTFT p95 ms | "
        "answered / sent | picker CPU s a block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = data["summary"]
    for workload, got in summary.items():
        for peer, n in got["pickers"].items():
            lines.append(f"| {workload} | {peer} | {_fmt(n['pool_tokens_per_s'], ',.0f')} | "
                         f"{_pct(n['prefix_hit_rate'])} | {_ms(n['ttft_p50_ms'])} | "
                         f"{_ms(n['ttft_p95_ms'])} | {n['ok']:,} / {n['requests']:,} | "
                         f"{_fmt(n['picker_cpu_s'], '.1f')} |")
    for peer, _, named, what in GOAL_CHECKS:
        lines += _goal_table(summary, peer, named, what)
    splits = [(w, peer, n) for w, got in summary.items() for peer, n in got["pickers"].items()
              if n.get("split_ms")]
    if splits:
        lines += ["", "Where the time to first token goes (means over the window, then over the "
                  "picker's blocks): the client's TTFT; fairway's picker: held in its fair queue, "
                  "and from its arrival there (the request's body read and parsed) to the first "
                  "response byte it saw (fairway only: the others export neither); the engines' "
                  "own TTFT (arrival at the server to its first token: its waiting queue and "
                  "prefill); the engines' mean waiting requests; and the picker's CPU per request "
                  "(its CPU a block ÷ requests sent).", "",
                  "| workload | picker | client TTFT mean ms | picker queue wait ms | picker "
                  "arrival → first byte ms | engine TTFT ms | engine waiting | picker CPU ms a "
                  "request |", "|---|---|---|---|---|---|---|---|"]
        for workload, peer, n in splits:
            sp = n["split_ms"]
            lines.append(f"| {workload} | {peer} | {_fmt(sp['client_mean'], ',.0f')} | "
                         f"{_fmt(sp['picker_queue_wait_mean'], '.1f')} | "
                         f"{_fmt(sp['picker_first_byte_mean'], ',.0f')} | "
                         f"{_fmt(sp['engine_ttft_mean'], ',.0f')} | "
                         f"{_fmt(sp['engine_waiting_mean'], '.2f')} | "
                         f"{_fmt(n['picker_cpu_ms_per_request'], '.1f')} |")
    short = [f"{w} ({n['ok']:,} of {n['requests']:,})" for w, got in summary.items()
             if (n := got["pickers"].get(PREFIX_METER)) and n["ok"] < n["requests"]]
    if short:
        # Refused requests lighten the load the others met: those rows do not compare.
        lines += ["", f"{PREFIX_METER} answered fewer requests than it was sent on "
                  + ", ".join(short) + ": the rest were refused (503 `meter_backlog`: the "
                  "picker fell more than `METER_BACKLOG_SHED` behind reading meter streams), "
                  "so its figures there are for a lighter load and are not a comparison."]
    if not detail:
        return lines
    lines += ["", "Per tenant: TTFT, its sessions' or programs' completion (first call sent to "
              "last reply, over the units whose every call was answered within the block; "
              "units done / started summed over the picker's blocks; a single request is a "
              "unit of one call), and its share of the computed-token cost "
              "`(prompt − cached) + 2 × output` beside the sent-token cost "
              "`prompt + 2 × output` of the requests answered.", "",
              "| workload | tenant | picker | TTFT p50 / p95 ms | units done / started | "
              "completion p50 / p95 s | computed-cost share | sent-cost share |",
              "|---|---|---|---|---|---|---|---|"]
    for workload, got in summary.items():
        for tenant in data["by_workload"][workload]["tenants"]:
            for peer, n in got["pickers"].items():
                t = n["tenants"][tenant]
                lines.append(
                    f"| {workload} | {tenant} | {peer} | {_ms(t['ttft_p50_ms'])} / "
                    f"{_ms(t['ttft_p95_ms'])} | {t['units_completed']:,} / "
                    f"{t['units_started']:,} | {_fmt(t['completion_p50_s'])} / "
                    f"{_fmt(t['completion_p95_s'])} | {_pct(t['computed_cost_share'])} | "
                    f"{_pct(t['sent_cost_share'])} |")
    lines += ["", "Every block:", "",
              "| workload | block | picker | pool tokens/s | hit rate | TTFT p50 / p95 ms | "
              "errors | picker CPU s | wall s | load average before → after |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, got in data["by_workload"].items():
        for i, r in enumerate(got["blocks"]):
            before, after = r["loadavg"]
            lines.append(
                f"| {workload} | {i} | {r['picker']} | {_fmt(r['pool_tokens_per_s'], ',.0f')} | "
                f"{_pct(r['prefix_hit_rate'])} | {_ms(r['ttft_ms']['p50'])} / "
                f"{_ms(r['ttft_ms']['p95'])} | {r['errors']} | {_fmt(r['picker_cpu_s'], '.1f')} "
                f"| {_fmt(r['wall_s'], '.0f')} | {before[0] if before else '–'} → "
                f"{after[0] if after else '–'} |")
    return lines


MEASURES: dict[str, Callable[[Peers, PeerPlan, Path], dict[str, Any]]] = {
    "shares": exp_shares, "returning": exp_returning, "flood": exp_flood,
    "overhead": exp_overhead, "prefix": exp_prefix}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="folder for peer.md and .json")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--prefix-scale", type=float, default=1.0,
                        help="the prefix workloads' rates and backlogs times this (kept as a "
                             "section of its own beside the files' own load)")
    parser.add_argument("--only", choices=sorted(MEASURES), action="append",
                        help="run only these measures (repeatable), the others kept from the "
                             "run already in --out (e.g. overhead again on a quiet machine)")
    parser.add_argument("--agent-block", type=float, default=0.0, metavar="SECONDS",
                        help="measure 6 on the agent programs alone, in blocks this long (tasks "
                             f"start until {AGENT_TAIL_S:g} s before the end), so that the "
                             "30-call tenant's tasks finish (kept as a section of its own)")
    parser.add_argument("--workload", choices=sorted(PREFIX_WORKLOADS.values()),
                        action="append", help="measure 6 on this workload only (repeatable; "
                        "for iterating: write to another --out)")
    parser.add_argument("--blocks", default="", metavar="LETTERS",
                        help="measure 6's pickers in this order, e.g. ABBA (A fairway + "
                        "affinity, B upstream, C fairway without affinity, D fairway + "
                        "affinity on the meter stream)")
    parser.add_argument("--block-seconds", type=float, default=0.0, metavar="SECONDS",
                        help="measure 6's blocks this long (default: PREFIX_TIMING's)")
    parser.add_argument("--diagnose", type=Path, metavar="DIR",
                        help="the Python pickers are sampled by py-spy (when on PATH) and "
                        "Envoy's ext_proc counters read, into DIR")
    parser.add_argument("--trace", action="store_true",
                        help="with --diagnose: fairway's pickers also write their trace (picker "
                        "serve --trace) into DIR; each block's hold reasons in the JSON")
    args = parser.parse_args(argv)
    if args.blocks and set(args.blocks) - set(PREFIX_LETTERS.values()):
        parser.error(f"--blocks takes the letters {sorted(PREFIX_LETTERS.values())}")
    plan = PeerPlan(quick=args.quick, prefix_scale=args.prefix_scale,
                    agent_block_s=args.agent_block, workloads=tuple(args.workload or ()),
                    order=args.blocks, block_s=args.block_seconds, diagnose=args.diagnose,
                    trace=args.trace)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "peer_quick" if plan.quick else "peer"
    kept = out / f"{name}.json"
    data: dict[str, Any] = json.loads(kept.read_text()) if args.only and kept.exists() else {}
    if isinstance(data.get("generated"), str):  # a run written before measures had their own
        data["generated"] = dict.fromkeys(MEASURES, data["generated"])
    with tempfile.TemporaryDirectory(prefix="fairway-peer-") as tmp:
        workdir = Path(tmp)
        with ControlPlane(workdir / "control-plane") as plane:  # __enter__ starts it
            peers = Peers(UpstreamPool(plane, workdir).prepare())
            data.update({"quick": plan.quick, "envoy": envoy_version(),
                         "upstream_release": RELEASE, "ladder": list(plan.ladder)})
            for measure, run in MEASURES.items():
                if not args.only or measure in args.only:
                    if measure == "prefix" and plan.prefix_scale != 1:
                        measure = f"prefix at {plan.prefix_scale:g}"
                    if measure.startswith("prefix") and plan.agent_block_s:
                        measure += f", agent blocks of {plan.agent_block_s:g} s"
                    data[measure] = run(peers, plan, workdir)
                    data.setdefault("generated", {})[measure] = time.strftime(
                        "%Y-%m-%d %H:%M UTC", time.gmtime())
            data.setdefault("upstream_ready_s", {}).update(peers.started)
    if all(m in data for m in ("shares", "returning", "flood", "overhead")):
        data["summary"] = summary(data)
        text = render(data)
    else:  # e.g. a first --quick --only prefix: that section alone
        text = "\n".join(["# fairway beside upstream's endpoint picker",
                          *(line for key in prefix_sections(data)
                            for line in _prefix_tables(data[key]))]) + "\n"
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(text)
    if prefix_sections(data) and not plan.quick:
        quote_in_prefix_md(out / "prefix.md", [data[k] for k in prefix_sections(data)])
    print(text)
    return 0


QUOTE_START = "<!-- bench.peer: prefix workloads beside upstream -->"
QUOTE_END = "<!-- /bench.peer -->"
"""The markers of the section ``bench.peer`` writes into ``prefix.md`` (``bench.prefix`` keeps
it when it writes that file anew)."""


def prefix_sections(data: dict[str, Any]) -> list[str]:
    """The keys of measure 6's runs in ``data``: ``prefix`` (the files' load) and ``prefix at
    <scale>``."""
    return sorted((k for k in data if k == "prefix" or k.startswith(("prefix at ", "prefix, "))),
                  key=lambda k: (k != "prefix", k))


def quote_in_prefix_md(path: Path, sections: Sequence[dict[str, Any]]) -> None:
    """Put section 6's summary and goals into ``prefix.md`` between the markers (replacing an
    earlier quote), so the pool simulator's page shows the real processes' figures beside it."""
    body: list[str] = []
    for prefix in sections:
        tables = _prefix_tables(prefix, detail=False)
        body += ["", tables[1].replace("## 6.", "###"), *tables[2:]]
    quote = "\n".join([QUOTE_START, "## Beside upstream's endpoint picker (real processes)", "",
                       "From `bench/results/peer.md` section 6 (per-tenant completion times and "
                       "cost shares, and every block, are there).", *body, QUOTE_END])
    text = path.read_text() if path.exists() else ""
    if QUOTE_START in text and QUOTE_END in text:
        head, rest = text.split(QUOTE_START, 1)
        text = head + quote + rest.split(QUOTE_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + quote + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
