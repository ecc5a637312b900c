"""A preempted request's recompute in the pool simulator, with vLLM V1's prefix cache.

vLLM V1 frees a preempted request's blocks still cached (its tail first to the free queue) and,
when it is scheduled again, finds its leading blocks in the cache: only what was evicted
meanwhile is computed again. The load generator's requests are drawn as counts, but the server
tokenizes their filler words into ids of their own; does the pool simulator give them ids too,
so that its recompute is the server's and not the whole context, and does no request find
another's blocks? With prefix caching off, the whole context is computed again.
"""

from __future__ import annotations

from dataclasses import replace

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolRun, PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic

STEP_S = 0.01
COST = 0.0001


def _burst(count: int, prompt: int, output: int) -> Traffic:
    shape = {"api": "completions", "stream_fraction": 1.0, "include_usage": True}
    return load_traffic({"duration_s": 0.5, "seed": 3, "timeout_s": 60, "tenants": [
        {"name": "a", "bursts": [{"at_s": 0, "count": count}], "prompt_tokens": [prompt, prompt],
         "output_tokens": [output, output], **shape}]})


def _run(spec: PoolSpec, count: int = 2) -> PoolRun:
    config = load(PickerConfig, {"scheduling": {"policy": "fcfs"}})
    return simulate(config, _burst(count, 400, 300), spec, drain_s=60)


SPEC = PoolSpec(endpoints=1, kv_budget_tokens=1024, step_s=STEP_S, prefill_s_per_token=COST)
"""Two requests of 400 + 300 tokens fit 1,024 as prompts but not at their end."""


def test_a_preempted_request_recomputes_only_its_evicted_blocks() -> None:
    cached, uncached = _run(SPEC), _run(replace(SPEC, enable_prefix_caching=False))
    for run in (cached, uncached):
        assert [r.outcome for r in run.records] == ["ok", "ok"]
        assert sum(r.preemptions for r in run.records) >= 1
    # Without the cache the victim computes its whole context again (at least its prompt);
    # with it, only the blocks the survivor took from the free queue's head meanwhile.
    assert uncached.recomputed_tokens >= 400
    assert 0 < cached.recomputed_tokens < uncached.recomputed_tokens
    # Less prompt time on the one engine: the last request ends sooner.
    assert max(r.end_s or 0 for r in cached.records) < max(r.end_s or 0 for r in uncached.records)


def test_requests_drawn_as_counts_never_hit_each_others_blocks() -> None:
    # Eight at once, never preempted (a large cache): each looked up, nothing found.
    run = _run(replace(SPEC, kv_budget_tokens=65536), count=8)
    assert sum(r.preemptions for r in run.records) == 0
    assert run.prefix_cache_queries == 8 * 400 and run.prefix_cache_hits == 0
    assert all(r.cached_tokens == 0 for r in run.records)
