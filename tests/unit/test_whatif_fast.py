"""The replay's pool figures and fast mode (issue 29 point 3 and its speed goal): the KV budget
estimated from a log, a never-served request's prompt, and coarse engine steps that emit k tokens
a request yet serve the same tokens as the exact replay."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolSpec
from picker.sim.vllm import SeqRequest, VllmConfig, VllmScheduler
from picker.whatif.__main__ import KvOccupancy
from picker.whatif.coarse import CoarseScheduler, step_scale
from picker.whatif.log import Arrival, Skips, read_arrivals
from picker.whatif.replay import replay


def test_a_coarse_step_emits_k_tokens_and_holds_their_blocks() -> None:
    config = VllmConfig(total_blocks=64, block_size=16)
    fine, coarse = VllmScheduler(config), CoarseScheduler(config, 8)
    for engine in (fine, coarse):
        engine.add(SeqRequest(id="r", prompt_tokens=40, output_tokens=20))
    fine_steps = 0
    while fine.has_unfinished():
        fine.step(0.0)
        fine_steps += 1
    emitted = []
    while coarse.has_unfinished():
        out = coarse.step(0.0)
        emitted.append(out.emitted.get(next(iter(out.scheduled)), 1))
        if coarse.running:
            seq = coarse.running[0]
            # Its KV covers what it computed: prompt and every output token but the newest.
            assert seq.computed == seq.num_tokens - 1
            assert seq.blocks == -(-seq.computed // 16)
    assert fine_steps == 20 and emitted == [8, 8, 4]  # the prefill step emits 8 as well
    assert coarse.pool.used == 0


def flood(seconds: float = 8.0, rate: float = 20.0) -> list[Arrival]:
    rng = random.Random(3)
    times = sorted((rng.uniform(0, seconds), tenant) for tenant in ("a", "b")
                   for _ in range(int(seconds * rate)))
    return [Arrival(line=i, arrived=t, tenant=tenant, model="m", lane_asked=None,
                    prompt_tokens=rng.randint(50, 150), output_tokens=(out := rng.randint(20, 80)),
                    max_tokens=out, stream=True, finished=t + 1)
            for i, (t, tenant) in enumerate(times)]


def test_the_fast_mode_serves_what_the_exact_replay_does_within_a_few_points() -> None:
    config = load(PickerConfig, {"capacity": {"kvBudgetTokens": 1024}, "queue": {"maxWait": "3s"},
                                 "tenants": [{"id": "a", "weight": 3}, {"id": "b"}]})
    spec = PoolSpec(endpoints=1, kv_budget_tokens=1024, step_s=0.01)
    exact = replay(config, spec, flood(), start=0.0)
    outputs: dict[int, int] = {}
    for a in flood():
        outputs[a.output_tokens or 0] = outputs.get(a.output_tokens or 0, 0) + 1
    scale = step_scale(outputs, 8)
    assert 0.9 < scale < 0.97  # outputs of 20-80 tokens: about 3.5 idle fine steps in 53
    fast = replay(config, spec, flood(), start=0.0, coarse=8, coarse_scale=scale)
    assert fast.step_s == pytest.approx(0.08 * scale)
    for key in exact.lanes:
        assert abs(fast.share(key) - exact.share(key)) < 0.03
    assert exact.share(("a", "default")) > 0.6  # weight 3 of an overloaded engine
    assert fast.output_tokens == pytest.approx(exact.output_tokens, rel=0.05)


def test_the_kv_budget_is_what_a_full_endpoint_held() -> None:
    kv = KvOccupancy(window_s=60.0)
    # 20 requests of 100 prompt + 100 output, 10 at a time, back to back: about 10 × 150 held.
    for i in range(20):
        start = (i // 10) * 2.0 + (i % 10) * 0.001
        kv.add("e1", start, start + 2.0, 100 + 100 / 2, queue_ms=500.0)
    assert kv.budget() == 1504  # 1,500 in blocks of 16


def test_no_kv_budget_is_guessed_from_a_pool_never_full() -> None:
    kv = KvOccupancy(window_s=60.0)
    for i in range(20):
        kv.add("e1", float(i), i + 0.5, 150.0, queue_ms=0.0)
    assert kv.budget() is None


def test_a_request_never_served_is_given_its_tenants_mean_prompt(tmp_path: Path) -> None:
    def line(**changes: Any) -> str:
        fields: dict[str, Any] = {
            "timestamp": 1_764_000_001.0, "tenant_id": "a", "endpoint": "10.0.0.1:8000",
            "prompt_tokens": 100, "completion_tokens": 10, "e2e_ms": 1000.0,
            "arrived_at": 1_764_000_000.0, "max_tokens": 10, "stream": True, **changes}
        return json.dumps(fields)
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([line(), line(prompt_tokens=300),
                               line(endpoint=None, prompt_tokens=0, completion_tokens=0,
                                    outcome="queue_timeout"),
                               line(tenant_id="new", endpoint=None, prompt_tokens=0)]) + "\n")
    skips = Skips()
    prompts = [(a.tenant, a.prompt_tokens) for a in read_arrivals(path, skips)]
    assert sorted(prompts) == [("a", 100), ("a", 200), ("a", 300), ("new", 200)]
    assert skips.prompt_guessed == 2 and "2 never served" in skips.summary()
