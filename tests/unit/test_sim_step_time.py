"""Step time in the pool simulator (``PoolSpec.prefill_s_per_token``).

Does a step that computes prompt tokens keep its engine busy for ``step_s`` plus their cost,
rounded up to ticks, with its tokens reported at its end; does a preempted request's recompute
cost its engine that time; does another engine go on stepping meanwhile; and does the default
(no prompt cost) keep the fixed one-tick step?
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolRecord, PoolRun, PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic
from picker.sim.vllm import SeqRequest, VllmConfig, VllmScheduler

STEP_S = 0.01
COST = 0.0001
"""Seconds per prompt token: 0.1 ms (10k prompt tokens/s)."""


def _pass_through() -> PickerConfig:
    return load(PickerConfig, {"scheduling": {"policy": "fcfs"}})


def _burst(count: int, prompt: int, output: int, *more: dict[str, Any]) -> Traffic:
    """``count`` requests of ``prompt`` tokens at t = 0 (and any further tenants)."""
    shape = {"api": "completions", "stream_fraction": 1.0, "include_usage": True}
    return load_traffic({"duration_s": 0.5, "seed": 3, "timeout_s": 60, "tenants": [
        {"name": "a", "bursts": [{"at_s": 0, "count": count}], "prompt_tokens": [prompt, prompt],
         "output_tokens": [output, output], **shape}, *more]})


def _run(traffic: Traffic, spec: PoolSpec) -> PoolRun:
    return simulate(_pass_through(), traffic, spec, drain_s=60)


def _ticks_alone(spec: PoolSpec, prompt: int) -> int:
    """Ticks until a lone request's first token: its prefill chunks, each a step, back to back
    on the engine's own clock; the last is reported at the first tick at or after its end."""
    budget = spec.max_num_batched_tokens
    chunks = [min(budget, prompt - start) for start in range(0, prompt, budget)]
    seconds = sum(spec.step_s + chunk * spec.prefill_s_per_token for chunk in chunks)
    return math.ceil(seconds / spec.step_s - 1e-9)


@pytest.mark.parametrize("prompt", [250, 3000, 1])
def test_a_lone_request_waits_one_step_plus_its_prompt(prompt: int) -> None:
    spec = PoolSpec(endpoints=1, step_s=STEP_S, prefill_s_per_token=COST)
    (record,) = _run(_burst(1, prompt, 3), spec).records
    # 250 tokens: 10 + 25 ms, 4 ticks; 3000: chunks of 2048 and 952, 214.8 + 105.2 ms on the
    # engine's clock, 32 ticks (33 if each step were rounded up to whole ticks).
    assert record.outcome == "ok" and record.ttft_s is not None
    assert record.first_token_s is not None
    assert record.ttft_s == pytest.approx(_ticks_alone(spec, prompt) * STEP_S)
    assert record.ttft_s > STEP_S + prompt * COST - 1e-9
    # Decode steps compute no prompt tokens: one tick each.
    assert record.end_s == pytest.approx(record.first_token_s + 2 * STEP_S)


def test_step_ticks_round_up_without_float_noise() -> None:
    spec = PoolSpec(step_s=STEP_S, prefill_s_per_token=COST)
    assert spec.step_ticks(0) == 1
    assert spec.step_ticks(1000) == 11  # 10 ms + 100 ms exactly, not 12 by 0.1 / 0.01 noise
    assert spec.step_ticks(1001) == 12
    assert PoolSpec(step_s=STEP_S).step_ticks(100_000) == 1
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        PoolSpec(prefill_s_per_token=-1e-6)


def test_the_engine_keeps_its_own_clock_from_step_to_step() -> None:
    # A 3,000-token prompt in chunks of 2,048 and 952: 214.8 + 105.2 ms back to back, its first
    # token at 320 ms, as the server (whose --catch-up-ms keeps its modelled pace) gives it; each
    # step rounded up to whole ticks would have given 220 + 110 ms.
    spec = PoolSpec(endpoints=1, step_s=STEP_S, prefill_s_per_token=COST)
    (record,) = _run(_burst(1, 3000, 3), spec).records
    assert record.ttft_s == pytest.approx(0.32)
    assert record.end_s == pytest.approx(0.34)  # then two decode steps of one tick


def _replay(spec: PoolSpec,
            records: list[PoolRecord]) -> tuple[dict[Hashable, int], int, int]:
    """The requests on one engine, added at t = 0 in order and stepped back to back: each
    request's end tick, the busy ticks, and the ticks the recomputed tokens cost."""
    engine = VllmScheduler(VllmConfig(total_blocks=spec.kv_budget_tokens // spec.block_size,
                                      block_size=spec.block_size,
                                      max_num_batched_tokens=spec.max_num_batched_tokens))
    seqs = [SeqRequest(id=i, prompt_tokens=r.prompt_tokens, output_tokens=r.max_tokens)
            for i, r in enumerate(records)]
    for seq in seqs:
        engine.add(seq, 0, 0.0)
    ends: dict[Hashable, int] = {}
    tick = recompute_ticks = 0
    while engine.has_unfinished():
        out = engine.step(tick * spec.step_s)
        ticks = spec.step_ticks(out.prefill_tokens)
        recompute_ticks += ticks - spec.step_ticks(out.prefill_tokens - out.recomputed_tokens)
        tick += ticks
        ends.update({seq.id: tick for seq in out.finished})
    return ends, tick, recompute_ticks


def test_a_preempted_request_costs_its_engine_the_recompute() -> None:
    # Two requests that fit the cache as prompts but not at their end: the later is preempted
    # and recomputes its prompt and the tokens it had generated (prefix caching off, so that
    # none of it is found cached: test_sim_recompute.py has the cached case).
    spec = PoolSpec(endpoints=1, kv_budget_tokens=1024, step_s=STEP_S, prefill_s_per_token=COST,
                    enable_prefix_caching=False)
    run = _run(_burst(2, 400, 300), spec)
    assert [r.dispatched_s for r in run.records] == [0.0, 0.0]
    assert sum(r.preemptions for r in run.records) >= 1 and run.recomputed_tokens > 0
    ends, busy, recompute_ticks = _replay(spec, run.records)
    assert [r.end_s for r in run.records] == pytest.approx([ends[0] * STEP_S, ends[1] * STEP_S])
    assert recompute_ticks >= 1  # the replay's end ticks, matched above, include the recompute
    # Without the prompt cost the same steps take one tick each: the difference is what the
    # prompts and their recompute cost.
    free = _run(_burst(2, 400, 300), replace(spec, prefill_s_per_token=0.0))
    steps = _replay(replace(spec, prefill_s_per_token=0.0), run.records)[1]
    assert max(r.end_s or 0 for r in free.records) == pytest.approx(steps * STEP_S)
    assert busy - steps >= (800 + run.recomputed_tokens) * COST / STEP_S - 1e-9


def test_another_engine_steps_on_while_one_is_busy() -> None:
    spec = PoolSpec(endpoints=2, step_s=STEP_S, prefill_s_per_token=COST)
    short = {"name": "b", "bursts": [{"at_s": 0.05, "count": 3}], "prompt_tokens": [10, 10],
             "output_tokens": [2, 2], "api": "completions", "stream_fraction": 1.0}
    run = _run(_burst(1, 3000, 2, short), spec)
    (long,) = [r for r in run.records if r.tenant == "a"]
    shorts = [r for r in run.records if r.tenant == "b"]
    assert all(r.endpoint != long.endpoint for r in shorts)
    assert long.ttft_s == pytest.approx(_ticks_alone(spec, 3000) * STEP_S)
    # They arrive while the long prompt's engine is busy and are done well before it is.
    assert all(r.outcome == "ok" and r.end_s is not None for r in shorts)
    assert long.first_token_s is not None
    assert max(r.end_s or 0 for r in shorts) < long.first_token_s - 0.1


def _flood() -> Traffic:
    shape = {"api": "completions", "stream_fraction": 1.0, "include_usage": True}
    return load_traffic({"duration_s": 4.0, "seed": 5, "timeout_s": 30, "tenants": [
        {"name": "light", "rate": 6, "start_s": 1.0, "prompt_tokens": [20, 40],
         "output_tokens": [5, 10], **shape},
        {"name": "flood", "backlog": 8, "prompt_tokens": [200, 400],
         "output_tokens": [100, 200], **shape}]})


def test_no_prompt_cost_is_the_fixed_step_and_a_cost_slows_the_pool() -> None:
    config = load(PickerConfig, {"tenants": [{"id": "light"}, {"id": "flood"}]})
    base = PoolSpec(endpoints=2, kv_budget_tokens=1024, step_s=0.005)

    def run(spec: PoolSpec) -> PoolRun:
        return simulate(config, _flood(), spec, warmup_s=1.0, drain_s=30)

    default, zero = run(base), run(replace(base, prefill_s_per_token=0.0))
    costly = run(replace(base, prefill_s_per_token=0.00005))
    assert zero.records == default.records
    assert (zero.output_tokens_in_window, zero.computed_tokens, zero.preemptions, zero.steps) == (
        default.output_tokens_in_window, default.computed_tokens, default.preemptions,
        default.steps)
    # Every first token of a fixed-step run lands on a tick.
    for record in default.records:
        if record.first_token_s is not None:
            ticks = record.first_token_s / base.step_s
            assert ticks == pytest.approx(round(ticks))
    assert costly.output_tokens_in_window < default.output_tokens_in_window
    assert _median_ttft(costly, "light") > _median_ttft(default, "light")


def _median_ttft(run: PoolRun, tenant: str) -> float:
    ttfts = sorted(r.ttft_s for r in run.records
                   if r.tenant == tenant and r.ttft_s is not None)
    return ttfts[len(ttfts) // 2]


def test_ttft_parts_say_where_a_requests_time_went() -> None:
    """Two 1,000-token prompts at once on one engine with a 1,024-token step budget: the first
    is prefilled in one step (1,024 tokens: 10 + 102.4 ms, 12 ticks); the second gets the 24
    tokens left in it, then its other 976 in the next step, which a 10-token request arriving at
    50 ms shares once it has waited out the rest of the first (986 tokens: 11 ticks)."""
    spec = PoolSpec(endpoints=1, step_s=STEP_S, prefill_s_per_token=COST,
                    max_num_batched_tokens=1024)
    late = {"name": "b", "bursts": [{"at_s": 0.05, "count": 1}], "prompt_tokens": [10, 10],
            "output_tokens": [3, 3], "api": "completions", "stream_fraction": 1.0}
    run = _run(_burst(2, 1000, 3, late), spec)
    first, second, third = sorted(run.records, key=lambda r: (r.arrival_s, r.prompt_tokens))
    assert [s.prefill_tokens for s in run.step_log["10.0.0.1:8000"][:2]] == [1024, 986]
    parts = run.ttft_parts(first)
    assert parts is not None and parts.engine_wait_s == 0 and parts.prefill_steps == 1
    assert parts.prefill_s == pytest.approx(12 * STEP_S)
    parts = run.ttft_parts(second)
    assert parts is not None and parts.prefill_steps == 2
    assert parts.prefill_s == pytest.approx(23 * STEP_S)
    parts = run.ttft_parts(third)
    assert parts is not None and third.ttft_s is not None
    assert parts.queued_s == 0 and parts.in_flight_s == pytest.approx(0.07)  # 120 - 50 ms
    assert parts.engine_wait_s == pytest.approx(0.07) and parts.steps_waited == 0
    assert parts.longest_step_waited_s == pytest.approx(12 * STEP_S)
    assert parts.prefill_s == pytest.approx(11 * STEP_S) and parts.prefill_steps == 1
    assert parts.queued_s + parts.engine_wait_s + parts.prefill_s == pytest.approx(third.ttft_s)
