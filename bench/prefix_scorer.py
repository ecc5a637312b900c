"""What does prefix affinity cost the picker per request, and per endpoint in memory? And the
shared blocks' room alone (``capacity.engineCache`` without affinity)?

``python -m bench.prefix_scorer`` measures, at a 4k-token chat prompt (16,000 characters: a
12,000-character system prompt and a 4,000-character question) and at a 2k-token one (8,000
characters: 6,000 and 2,000), the CPU time (``time.process_time``, the best of ``--rounds``
interleaved rounds, so that other processes on a busy machine do not count) of:

* hashing the body's text into chained blocks (``picker.openai.prefix.prompt_blocks``), at
  several ``blockChars``;
* a request's whole passage through the gate (admit, rank, dispatch, settle) on a pool of
  ``--endpoints`` endpoints: counting its whole prompt in the room (``capacity.engineCache:
  false``, no blocks: what the picker did without affinity before), counting its blocks once
  in the room (the default, without affinity), and with affinity too, its indexes full
  (``maxBlocksPerEndpoint`` blocks of other prompts each): the differences are what each adds
  in the core;

and the memory an endpoint's full index holds (``tracemalloc``). The scorer's cost per request
is the hashing plus the gate's difference; the room's alone, without affinity, likewise.

It also runs the pool simulator (4 engines of 16k tokens, chat sessions and agent programs
sharing prefixes, 20 s) with one, two and three active-active pickers, each request reaching a
picker at random, with affinity and without: what the engines' prefix hit rate keeps when each
replica learns from its own dispatches only. Writes ``bench/results/prefix_scorer.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import AffinityRules, PrefixIndex
from picker.openai.paths import ApiKind
from picker.openai.prefix import prompt_blocks
from picker.sim.pool import PoolSpec, Sharing, simulate
from picker.sim.traffic import load_traffic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "the",
         "picker", "counts", "every", "token", "of", "a", "long", "system", "prompt", "that",
         "each", "request", "of", "the", "tenant", "carries")
BATCH = 200


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def _body(rng: random.Random, tokens: int = 4000) -> dict[str, Any]:
    """A chat prompt of about ``tokens`` tokens (four characters a token), three quarters of
    it the system prompt."""
    chars = 4 * tokens
    return {"model": "m", "messages": [
        {"role": "system", "content": _text(rng, chars * 3 // 4)},
        {"role": "user", "content": _text(rng, chars // 4)}]}


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " / ".join(f.read().split()[:3])


def _best(fn: Callable[[], None], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(BATCH):
            fn()
        best = min(best, (time.process_time() - start) / BATCH)
    return best


def _gate(endpoints: int, affinity: AffinityRules | None, engine_cache: bool = True) -> Gate:
    gate = Gate(GateRules(affinity=affinity, engine_cache=engine_cache),
                Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({f"10.0.0.{i}:8000": 10_000_000 for i in range(endpoints)})
    if gate.prefix_index is not None and affinity is not None:
        filler = random.Random(7)
        for address in gate.endpoints:
            gate.prefix_index.record(address, tuple(
                filler.getrandbits(32) for _ in range(affinity.max_blocks_per_endpoint)))
    return gate


def _cycle(gate: Gate, blocks: tuple[int, ...], chars: int,
           tokens: int = 4000) -> Callable[[], None]:
    clock = [0.0]

    def once() -> None:
        clock[0] += 0.001
        passage = gate.admit(Passage, "t", None, model="m", prompt_tokens=tokens,
                             max_tokens=100, stream=True, now=clock[0], prefix_blocks=blocks,
                             prefix_chars=chars)
        assert isinstance(passage, Passage) and passage.dispatched_at is not None
        assert bool(passage.prefix_block_chars) is bool(blocks) and gate.rules.engine_cache
        gate.complete(passage, Usage(tokens, 100, 0), "ok", clock[0])

    return once


def _cycle_whole(gate: Gate, tokens: int) -> Callable[[], None]:
    """The request's whole prompt in the room: no blocks (engines without a cache)."""
    clock = [0.0]

    def once() -> None:
        clock[0] += 0.001
        passage = gate.admit(Passage, "t", None, model="m", prompt_tokens=tokens,
                             max_tokens=100, stream=True, now=clock[0])
        assert isinstance(passage, Passage) and passage.dispatched_at is not None
        gate.complete(passage, Usage(tokens, 100, 0), "ok", clock[0])

    return once


def _per_request(endpoints: int, max_blocks: int, tokens: int, rounds: int,
                 rng: random.Random) -> dict[str, Any]:
    """At a prompt of ``tokens``: hashing at 256 characters a block, and a request's passage
    through the gate with its whole prompt counted, its blocks counted once (no affinity), and
    with affinity (indexes full), best of interleaved rounds."""
    block_chars = 256
    body = _body(rng, tokens)
    blocks, chars = prompt_blocks("m", body, ApiKind.CHAT, block_chars)
    hashing = 1e6 * _best(lambda: prompt_blocks("m", body, ApiKind.CHAT, block_chars) and None,
                          rounds)
    cycles = {
        "whole": _cycle_whole(_gate(endpoints, None, engine_cache=False), tokens),
        "room": _cycle(_gate(endpoints, None), blocks, chars, tokens),
        "affinity": _cycle(_gate(endpoints, AffinityRules(1.0, block_chars, max_blocks)),
                           blocks, chars, tokens),
    }
    best = dict.fromkeys(cycles, float("inf"))
    for _ in range(rounds):  # interleaved: each gate's best over the same stretch of time
        for name, once in cycles.items():
            best[name] = min(best[name], _best(once, 1))
    gate_us = {name: 1e6 * value for name, value in best.items()}
    return {"prompt_chars": chars, "blocks": len(blocks), "hashing_us": hashing,
            "gate_us": gate_us,
            "room_us_per_request": hashing + gate_us["room"] - gate_us["whole"],
            "affinity_us_per_request": hashing + gate_us["affinity"] - gate_us["whole"]}


def _index_bytes(blocks: int) -> int:
    rng = random.Random(3)
    values = [rng.getrandbits(32) | 1 << 31 for _ in range(blocks)]  # ints outside the cache
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(blocks)
    index.record("e", values)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # The hashes (ints of 32 bytes) are made before tracing: they are the request's, shared by
    # every endpoint holding them; an index alone keeping one alive adds its 32 bytes.
    return after - before


POOL = PoolSpec(endpoints=4, kv_budget_tokens=16384, step_s=0.02)
SHAPE = {"stream_fraction": 1.0, "include_usage": True, "backlog": 4}
WORKLOADS: dict[str, list[dict[str, Any]]] = {
    "chat sessions": [
        {"name": name, "system_prompt_tokens": 300, "prompt_tokens": [20, 120],
         "output_tokens": [50, 200], "chat": {"turns": [5, 20], "think_s": [2, 8]}, **SHAPE}
        for name in ("many-users", "some-users", "few-users")],
    "agent programs (1, 10, 30 calls)": [
        {"name": f"k{k}", "system_prompt_tokens": 1000, "prompt_tokens": [200, 400],
         "output_tokens": [40, 150], **SHAPE,
         "agent": {"calls": k, "tool_result_tokens": [100, 300], "tool_latency_s": [0.2, 1.0]}}
        for k in (1, 10, 30)],
}


def _replicas() -> dict[str, dict[int, tuple[float, float]]]:
    """Per workload and picker count, the engines' hit rate without and with affinity."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for workload, tenants in WORKLOADS.items():
        traffic = load_traffic({"duration_s": 20, "seed": 28, "timeout_s": 60,
                                "tenants": tenants})
        rates: dict[int, tuple[float, float]] = {}
        for pickers in (1, 2, 3):
            pair = []
            modes: tuple[dict[str, Any], ...] = ({}, {"routing": {"prefixAffinity": {}}})
            for sections in modes:
                config = load(PickerConfig, {"tenants": [{"id": t["name"]} for t in tenants],
                                             **sections})
                run = simulate(config, traffic, POOL, drain_s=30,
                               sharing=None if pickers == 1 else Sharing(pickers=pickers))
                pair.append(run.prefix_cache_hits / max(1, run.prefix_cache_queries))
            rates[pickers] = (pair[0], pair[1])
        out[workload] = rates
    return out


REPLICAS_HEADING = "## Several replicas (Redis backend): each learns from its own dispatches"


def replicas_lines(replicas: dict[str, dict[int, tuple[float, float]]]) -> list[str]:
    """The several-replicas section of ``prefix_scorer.md``: its heading to its end."""
    return [
        REPLICAS_HEADING,
        "",
        "The index is not exchanged through the shared store: each replica remembers what it "
        "sent. A request reaching another replica than its conversation's last turn is routed "
        "by load (a cache miss, never a request where it does not fit). Pool simulator, "
        "4 engines of 16k tokens, 20 s, 4 sessions or tasks a tenant, each request reaching a "
        "picker at random; the engines' prefix hit rate (hits / queried prompt tokens). "
        "Without affinity: `capacity.engineCache` unset, so `false` (each prompt counted whole "
        "in the room); with affinity: `routing.prefixAffinity` at its defaults, so "
        "`engineCache: auto` (shared blocks counted once after each engine's first read), "
        "the index aging its blocks by the new KV sent to each endpoint since:",
        "",
        "| workload | pickers | without affinity | with affinity |",
        "|---|---:|---:|---:|",
        *(f"| {w} | {n} | {r[0]:.3f} | {r[1]:.3f} |"
          for w, rates in replicas.items() for n, r in rates.items()),
        "",
        "Affinity still raises the hit rate with several replicas, by less: a gateway that "
        "keeps a client's requests on one replica (consistent hashing on a session header) "
        "keeps the whole gain. Sharing the index through the sync exchange is not built.",
        "",
    ]


def replicas_only(out: Path) -> int:
    """Rerun the several-replicas hit rates alone (the pool simulator: no timing, no bench
    lock) and replace that section of ``out``.md and its numbers in ``out``.json, the CPU
    figures left as they were measured."""
    before = _loadavg()
    replicas = _replicas()
    load = (before, _loadavg())
    page = out.with_suffix(".md")
    text = page.read_text()
    lines = replicas_lines(replicas)
    lines.insert(1, f"\n(`python -m bench.prefix_scorer --replicas-only`, load average "
                    f"{load[0]} at its start and {load[1]} at its end; the simulator's "
                    "numbers do not depend on it.)")
    page.write_text(text[:text.index(REPLICAS_HEADING)] + "\n".join(lines))
    data = json.loads(out.with_suffix(".json").read_text())
    data["replicas_hit_rate"] = {w: {str(n): list(r) for n, r in rates.items()}
                                 for w, rates in replicas.items()}
    data["replicas_loadavg"] = list(load)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--max-blocks", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_scorer")
    parser.add_argument("--replicas-only", action="store_true",
                        help="rerun only the several-replicas hit rates (simulator) and "
                             "replace their section")
    args = parser.parse_args(argv)
    if args.replicas_only:
        return replicas_only(args.out)
    load_before = _loadavg()
    rng = random.Random(28)
    body = _body(rng)
    text_chars = sum(len(m["content"]) for m in body["messages"])
    hashing = {}
    for block_chars in (64, 128, 256):
        hashing[block_chars] = {
            "blocks": len(prompt_blocks("m", body, ApiKind.CHAT, block_chars)[0]),
            "us": 1e6 * _best(lambda b=block_chars: prompt_blocks(  # type: ignore[misc]
                "m", body, ApiKind.CHAT, b) and None, args.rounds)}
    block_chars = 256
    sizes = {tokens: _per_request(args.endpoints, args.max_blocks, tokens, args.rounds,
                                  random.Random(tokens)) for tokens in (2000, 4000)}
    four = sizes[4000]
    memory = {n: _index_bytes(n) for n in (1024, args.max_blocks)}
    replicas = _replicas()
    load = (load_before, _loadavg())
    most = memory[args.max_blocks] + 32 * args.max_blocks
    result = {
        "prompt_chars": text_chars, "endpoints": args.endpoints,
        "max_blocks_per_endpoint": args.max_blocks, "rounds": args.rounds,
        "loadavg": list(load), "hashing": hashing,
        "per_request": {str(t): v for t, v in sizes.items()},
        "scorer_us_per_request": four["affinity_us_per_request"],
        "room_us_per_request": {str(t): v["room_us_per_request"] for t, v in sizes.items()},
        "index_bytes": memory,
        "replicas_hit_rate": {w: {str(n): list(r) for n, r in rates.items()}
                              for w, rates in replicas.items()},
    }
    lines = [
        "# Prefix affinity and the shared blocks' room: CPU per request, memory per endpoint",
        "",
        f"`python -m bench.prefix_scorer` (best of {args.rounds} rounds of {BATCH}, CPU time, "
        f"on the shared 2-core machine, load average {load[0]} at its start and {load[1]} at "
        "its end). A chat prompt of "
        f"{text_chars:,} characters (about 4k tokens: a 12,000-character system prompt and a "
        "4,000-character question), and one of about 2k tokens (6,000 and 2,000 characters).",
        "",
        "## Hashing the body's text (`picker.openai.prefix.prompt_blocks`), 4k tokens",
        "",
        "| blockChars | blocks | µs per request |",
        "|---:|---:|---:|",
        *(f"| {b} | {h['blocks']} | {h['us']:.1f} |" for b, h in hashing.items()),
        "",
        f"## In the gate ({args.endpoints} endpoints; with affinity each index full: "
        f"{args.max_blocks:,} blocks of other prompts)",
        "",
        "A request's admit, rank, dispatch and settle, alone on the pool, blockChars "
        f"{block_chars}. Whole prompt: `capacity.engineCache: false`, no blocks cut (what the "
        "picker did without affinity before the engine cache became its own setting); "
        "blocks counted once: the default without affinity; with affinity: "
        "`routing.prefixAffinity` at its defaults. Per request: hashing plus the gate's "
        "difference from the whole-prompt row.",
        "",
        "| prompt | blocks | hashing µs | gate µs: whole prompt | blocks counted once "
        "| with affinity | per request µs: blocks counted once | with affinity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {t // 1000}k tokens ({v['prompt_chars']:,} chars) | {v['blocks']} | "
          f"{v['hashing_us']:.1f} | {v['gate_us']['whole']:.1f} | {v['gate_us']['room']:.1f} | "
          f"{v['gate_us']['affinity']:.1f} | {v['room_us_per_request']:.1f} | "
          f"{v['affinity_us_per_request']:.1f} |" for t, v in sizes.items()),
        "",
        f"**Scorer cost per request at a 4k-token prompt: {four['affinity_us_per_request']:.1f} "
        f"µs** (hashing at blockChars {block_chars} plus the gate's difference; the goal is "
        "at most 100 µs). The shared blocks' room alone (`capacity.engineCache`, on by "
        f"default, affinity off): {sizes[2000]['room_us_per_request']:.1f} µs a request at "
        f"2k tokens, {four['room_us_per_request']:.1f} µs at 4k.",
        "",
        "## Memory per endpoint (`tracemalloc`)",
        "",
        "| blocks remembered | bytes | bytes per block |",
        "|---:|---:|---:|",
        *(f"| {n:,} | {b:,} | {b / n:.0f} |" for n, b in memory.items()),
        "",
        "Beside these, a hash only an index still holds keeps its int alive (32 bytes). At "
        f"the default bound ({args.max_blocks:,} blocks of 256 bytes, about 500k tokens of "
        f"prompt) an endpoint costs at most {most / 1e6:.2f} MB.",
        "",
        "The bound is `maxBlocksPerEndpoint`: an endpoint's index never holds more blocks "
        "(tests/unit/test_prefix_affinity.py).",
        "",
        *replicas_lines(replicas),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
