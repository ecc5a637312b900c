"""vLLM V1's scheduler model (``picker.sim.vllm``): each rule pinned on a hand-worked case, plus a
property over random workloads (blocks never overcommitted, every request finishes with exactly
its output tokens, no token emitted twice)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.sim.vllm import SeqRequest, StepOutput, VllmConfig, VllmScheduler


def engine(total_blocks: int = 64, block_size: int = 4, policy: str = "fcfs",
           max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> VllmScheduler:
    return VllmScheduler(VllmConfig(total_blocks=total_blocks, block_size=block_size,
                                    max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    policy=policy))


def req(name: str, prompt: int, output: int) -> SeqRequest:
    return SeqRequest(id=name, prompt_tokens=prompt, output_tokens=output)


def names(requests: object) -> list[str]:
    return [str(r.id) for r in requests]  # type: ignore[attr-defined]


# -- KV blocks --


def test_blocks_round_up_and_the_newest_token_has_no_kv_yet() -> None:
    sched = engine(block_size=16)
    a = req("a", 16, 3)
    sched.add(a)
    used = []
    for now in range(3):
        sched.step(now)
        used.append(sched.used_blocks)
    # 16 prompt tokens: 1 block; feeding token 1 makes 17 computed: 2 blocks; then finished.
    assert used == [1, 2, 0]
    assert a.status == "finished" and a.generated == 3


def test_kv_usage_is_used_over_total_blocks() -> None:
    sched = engine(total_blocks=8, block_size=4)
    sched.add(req("a", 9, 5))
    sched.step(0)
    assert sched.used_blocks == 3 and sched.kv_usage == 3 / 8


def test_a_request_outgrowing_the_cache_runs_alone_past_it() -> None:
    """The simulator's stand-in for vLLM's start-up check that one whole request fits."""
    sched = engine(total_blocks=2, block_size=4)
    big, small = req("big", 4, 10), req("small", 4, 2)  # big peaks at 13 tokens: 4 blocks
    sched.add(big, arrival=0)
    sched.add(small, arrival=1)
    peak, order, now = 0, [], 0
    while sched.has_unfinished():
        out = sched.step(now)
        now += 1
        if sched.used_blocks > 2:
            assert sched.running == [big]  # only ever alone
        peak = max(peak, sched.used_blocks)
        order += names(out.finished)
    # between steps big holds up to 12 computed tokens: 3 blocks of a 2-block cache
    assert peak == 3 and order == ["big", "small"] and big.generated == 10
    assert sched.preemptions_total == 1  # small, once big needed its block


# -- token budget, chunked prefill, max_num_seqs --


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    sched = engine(max_num_batched_tokens=8)
    a = req("a", 20, 2)
    sched.add(a)
    outs = [sched.step(now) for now in range(4)]
    assert [o.scheduled[a] for o in outs] == [8, 8, 4, 1]
    assert [o.prefill_tokens for o in outs] == [8, 8, 4, 0]
    # the step that completes the prefill also yields the first token
    assert [o.tokens.get(a) for o in outs] == [None, None, 1, 2]
    assert outs[3].finished == [a]


def test_running_requests_take_the_budget_first() -> None:
    sched = engine(max_num_batched_tokens=8)
    a, b = req("a", 6, 3), req("b", 6, 3)
    sched.add(a, arrival=0)
    sched.add(b, arrival=1)
    first = sched.step(0)
    assert first.scheduled == {a: 6, b: 2} and first.tokens == {a: 1}
    second = sched.step(1)
    assert second.scheduled == {a: 1, b: 4} and second.tokens == {a: 2, b: 1}


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = engine(max_num_seqs=2)
    requests = [req(f"r{i}", 4, 3) for i in range(3)]
    for i, r in enumerate(requests):
        sched.add(r, arrival=i)
    out = sched.step(0)
    assert names(out.scheduled) == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    for now in range(1, 3):
        sched.step(now)
    assert sched.step(3).scheduled == {requests[2]: 4}  # a slot freed


# -- preemption --


def _two_running(policy: str) -> tuple[VllmScheduler, SeqRequest, SeqRequest]:
    """A (priority 5) runs alone, then B (priority 0) joins; 2 blocks of 4 tokens are full."""
    sched = engine(total_blocks=2, block_size=4, policy=policy)
    a, b = req("a", 3, 6), req("b", 4, 5)  # each peaks at 8 tokens: the whole cache
    sched.add(a, priority=5 if policy == "priority" else 0, arrival=0)
    sched.step(0)
    sched.add(b, priority=0, arrival=1)
    sched.step(1)
    assert sched.running == [a, b] and sched.used_blocks == 2
    return sched, a, b


def test_fcfs_preempts_the_last_running_request() -> None:
    sched, a, b = _two_running("fcfs")
    out = sched.step(2)  # A needs a second block
    assert out.preempted == [b] and out.scheduled == {a: 1}
    assert b.computed == 0 and b.blocks == 0 and b.status == "waiting"
    assert sched.preemptions_total == 1


def test_priority_preempts_the_largest_priority_even_the_one_being_scheduled() -> None:
    sched, a, b = _two_running("priority")
    out = sched.step(2)
    # A (priority 5) is the victim and the request being scheduled: it is not scheduled, and
    # vLLM stops scheduling running requests there, so B computes nothing this step either.
    assert out.preempted == [a] and out.scheduled == {}
    assert sched.running == [b] and sched.used_blocks == 1
    assert sched.step(3).scheduled == {b: 1}


def test_priority_victim_already_scheduled_gives_its_tokens_back() -> None:
    sched = engine(total_blocks=3, block_size=4, policy="priority", max_num_batched_tokens=64)
    x, y = req("x", 4, 8), req("y", 4, 8)
    sched.add(x, priority=5, arrival=0)
    sched.step(0)
    sched.add(y, priority=0, arrival=1)
    sched.step(1)  # x: 2 blocks, y: 1 block
    out = sched.step(2)  # x is scheduled first; y then needs a block and x is the victim
    assert out.preempted == [x] and out.scheduled == {y: 1} and out.tokens == {y: 2}
    assert x.status == "waiting" and sched.used_blocks == 2


def test_recompute_prefills_the_prompt_and_the_generated_tokens_again() -> None:
    sched, a, b = _two_running("fcfs")
    sched.step(2)  # b preempted with 1 token generated, 4 tokens of KV lost
    assert b.generated == 1 and b.lost == 4
    now = 3
    while b.status != "running":
        out = sched.step(now)
        now += 1
    assert a.status == "finished"  # b waited for a's blocks
    # resumed: prompt (4) + generated (1) computed again; the step yields token 2, not 1 again
    assert out.scheduled[b] == 5 and out.tokens[b] == 2
    assert out.recomputed_tokens == 4 and out.prefill_tokens == 5
    assert sched.recomputed_tokens_total == 4


def test_fcfs_puts_the_preempted_request_at_the_front_of_waiting() -> None:
    sched = engine(total_blocks=2, block_size=4, max_num_seqs=2)
    a, b, c = req("a", 3, 6), req("b", 4, 5), req("c", 1, 1)
    for i, r in enumerate((a, b, c)):
        sched.add(r, arrival=i)
    sched.step(0)  # a and b run, c waits (max_num_seqs)
    assert sched.step(1).preempted == [b]  # b, the last, preempts itself
    order: list[str] = []
    for now in range(2, 30):
        order += names(sched.step(now).finished)
    assert order == ["a", "b", "c"]  # b went back in front of c


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = engine(total_blocks=3, block_size=4, policy="priority", max_num_seqs=2)
    a, b, c = req("a", 4, 8), req("b", 4, 8), req("c", 1, 1)
    sched.add(a, priority=0, arrival=0)
    sched.add(b, priority=5, arrival=1)
    sched.step(0)
    sched.add(c, priority=1, arrival=2)
    out = sched.step(1)  # a takes the last block, b preempts itself: 1 block free, c fits
    assert out.preempted == [b] and c not in out.scheduled and c.status == "waiting"
    assert sched.used_blocks == 2  # the block c needs is free
    out = sched.step(2)
    assert out.tokens.get(c) == 1 and out.finished == [c]


def test_a_waiting_request_never_preempts() -> None:
    sched = engine(total_blocks=2, block_size=4, policy="priority")
    a = req("a", 5, 4)  # peaks at 8 computed tokens: the whole cache
    sched.add(a, priority=5, arrival=0)
    sched.step(0)
    urgent = req("urgent", 1, 1)
    sched.add(urgent, priority=0, arrival=1)
    steps = 1
    while a.status == "running":
        assert urgent.status == "waiting"
        sched.step(steps)
        steps += 1
    assert sched.preemptions_total == 0
    assert sched.step(steps).finished == [urgent]


# -- waiting order --


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    sched = engine(total_blocks=3, block_size=4)
    a, b, c = req("a", 8, 5), req("b", 8, 1), req("c", 1, 1)
    for i, r in enumerate((a, b, c)):
        sched.add(r, arrival=i)
    out = sched.step(0)
    # b needs 2 blocks, 1 is free: vLLM breaks, so c (which would fit) waits behind it
    assert out.scheduled == {a: 8}
    assert b.status == c.status == "waiting"


def test_priority_waiting_order_is_priority_then_arrival() -> None:
    sched = engine(policy="priority", max_num_seqs=1)
    a = req("a", 4, 3)
    sched.add(a, priority=0, arrival=0)
    sched.step(0)
    for i, (name, priority) in enumerate([("b", 5), ("c", 5), ("d", 1)]):
        sched.add(req(name, 4, 2), priority=priority, arrival=1 + i)
    order: list[str] = []
    for now in range(1, 20):
        order += names(sched.step(now).finished)
    assert order == ["a", "d", "b", "c"]


# -- abort --


def test_abort_frees_the_blocks_of_a_running_request() -> None:
    sched = engine(total_blocks=4, block_size=4)
    a, b = req("a", 12, 5), req("b", 8, 1)
    sched.add(a, arrival=0)
    sched.add(b, arrival=1)
    sched.step(0)  # a holds 3 blocks; b (2 blocks) waits
    assert sched.used_blocks == 3 and b.status == "waiting"
    sched.abort(a)
    assert sched.used_blocks == 0 and a.status == "aborted" and sched.running == []
    assert sched.step(1).finished == [b]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_removes_a_waiting_request(policy: str) -> None:
    sched = engine(policy=policy, max_num_seqs=1)
    a, b = req("a", 4, 2), req("b", 4, 2)
    sched.add(a, arrival=0)
    sched.add(b, arrival=1)
    sched.abort(b)
    assert sched.num_waiting == 1 and b.status == "aborted"
    sched.step(0)
    assert sched.num_waiting == 0 and sched.step(1).finished == [a]


# -- the property --


@st.composite
def workloads(draw: st.DrawFn) -> tuple[VllmConfig, list[tuple[int, int, int, int]]]:
    block_size = draw(st.sampled_from([1, 4, 16]))
    config = VllmConfig(total_blocks=draw(st.integers(4, 20)), block_size=block_size,
                        max_num_seqs=draw(st.integers(1, 8)),
                        max_num_batched_tokens=draw(st.integers(1, 64)),
                        policy=draw(st.sampled_from(["fcfs", "priority"])))
    capacity = config.total_blocks * block_size
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        # mostly requests that fit the cache alone (their last token is never fed back)
        prompt = draw(st.integers(1, min(capacity, 60)))
        fitting = draw(st.integers(0, 9)) > 0
        output = draw(st.integers(0, min(capacity - prompt + 1, 30) if fitting else 40))
        requests.append((draw(st.integers(0, 10)), prompt, output, draw(st.integers(0, 3))))
    return config, requests


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_blocks_never_overcommitted_and_every_request_gets_exactly_its_tokens(
        workload: tuple[VllmConfig, list[tuple[int, int, int, int]]]) -> None:
    config, specs = workload
    sched = VllmScheduler(config)
    requests = [(at, req(f"r{i}", prompt, output), priority)
                for i, (at, prompt, output, priority) in enumerate(specs)]
    emitted: dict[SeqRequest, list[int]] = {r: [] for _, r, _ in requests}
    finished: list[SeqRequest] = []
    for now in range(5000):
        for at, r, priority in requests:
            if at == now:
                sched.add(r, priority=priority, arrival=now)
        if now > 10 and not sched.has_unfinished():
            break
        out: StepOutput = sched.step(now)
        # only a request alone in the engine may hold more than the cache
        assert sched.used_blocks <= config.total_blocks or len(sched.running) == 1
        assert sched.used_blocks == sum(r.blocks for r in sched.running)
        assert sum(out.scheduled.values()) <= config.max_num_batched_tokens
        assert sched.num_running <= config.max_num_seqs
        for r, index in out.tokens.items():
            emitted[r].append(index)
        finished += out.finished
    assert not sched.has_unfinished(), "a request never finished"
    assert sorted(names(finished)) == sorted(names(r for _, r, _ in requests))
    for r, indices in emitted.items():
        assert indices == list(range(1, r.output_tokens + 1))
    assert sched.used_blocks == 0
