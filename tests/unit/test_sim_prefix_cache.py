"""vLLM V1's automatic prefix caching in the simulated engine (``picker.sim.vllm``): each rule
pinned on a hand-worked case with 4-token blocks (hash chain, hit and its cap, no compute for a hit,
sharing by reference, a same-step hit, generated tokens' blocks, LRU eviction order, a hit taking a
free block back, the metrics, caching off, and requests given as counts untouched)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.sim.vllm import SeqRequest, VllmConfig, VllmScheduler


def engine(total_blocks: int = 64, caching: bool = True) -> VllmScheduler:
    return VllmScheduler(VllmConfig(total_blocks=total_blocks, block_size=4,
                                    enable_prefix_caching=caching))


def req(name: str, ids: list[int] | None, output: int, prompt: int | None = None,
        output_ids: list[int] | None = None) -> SeqRequest:
    return SeqRequest(id=name, prompt_tokens=len(ids) if ids is not None else prompt or 0,
                      output_tokens=output, token_ids=ids, output_ids=output_ids)


def run(sched: VllmScheduler, *requests: SeqRequest) -> list[int]:
    """Add the requests and step until all finish; returns each step's prefill tokens."""
    for r in requests:
        sched.add(r)
    prefill = []
    now = 0
    while sched.has_unfinished():
        prefill.append(sched.step(now).prefill_tokens)
        now += 1
    return prefill


def test_block_hashes_chain_their_parent() -> None:
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8], 1)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    c = req("c", [0, 2, 3, 4, 5, 6, 7, 8], 1)  # second block equal, first differs
    ha, hb, hc = (r.block_hashes(9, 4) for r in (a, b, c))
    assert len(ha) == 2 and len(hb) == 2  # full blocks only
    assert ha == hb
    assert hc[0] != ha[0] and hc[1] != ha[1]  # the same tokens after another prefix: a miss


def test_a_repeated_prefix_is_not_computed_again() -> None:
    sched = engine()
    first = req("first", list(range(12)), 1)
    assert run(sched, first) == [12]
    assert first.cached_tokens == 0
    again = req("again", [*list(range(12)), 99, 98, 97, 96], 1)
    assert run(sched, again) == [4]  # 12 of its 16 tokens were cached: only 4 computed
    assert again.cached_tokens == 12


def test_a_whole_prompt_hit_still_computes_its_last_block() -> None:
    """At most num_tokens - 1 tokens hit: a block-aligned repeat recomputes its last block."""
    sched = engine()
    run(sched, req("first", list(range(12)), 1))
    again = req("again", list(range(12)), 1)
    assert run(sched, again) == [4]
    assert again.cached_tokens == 8


def test_hit_blocks_are_shared_by_reference() -> None:
    sched = engine()
    a = req("a", list(range(8)), 10)
    sched.add(a)
    sched.step(0)
    assert sched.used_blocks == 2
    b = req("b", [*list(range(8)), 50, 51, 52], 10)
    sched.add(b)
    out = sched.step(1)
    assert out.scheduled[b] == 3 and b.cached_tokens == 8
    # a: 2 prompt blocks + 1 for its first generated token; b: the 2 shared + 1 of its own.
    assert a.blocks == 3 and b.blocks == 3 and sched.used_blocks == 4
    assert a._blocks[:2] == b._blocks[:2]
    assert all(block is not None and block.ref_cnt == 2 for block in a._blocks[:2])


def test_a_request_scheduled_later_in_the_same_step_hits_blocks_allocated_before_it() -> None:
    sched = engine()
    a, b = req("a", list(range(12)), 1), req("b", [*list(range(12)), 7], 1)
    sched.add(a)
    sched.add(b)
    out = sched.step(0)
    assert out.scheduled == {a: 12, b: 1} and out.prefill_tokens == 13
    assert b.cached_tokens == 12


def test_generated_tokens_blocks_are_cached() -> None:
    """A conversation's next turn (its prompt is this one's and the reply) hits the reply too."""
    sched = engine()
    a = req("a", [1, 2, 3, 4, 5, 6], 6, output_ids=[11, 12, 13, 14, 15, 16])
    run(sched, a)  # 11 tokens computed at the end (the last sampled one is never fed): 2 blocks
    turn = req("turn", [1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16, 20], 1)
    run(sched, turn)
    assert turn.cached_tokens == 8


def test_the_tail_of_the_least_recently_used_request_is_evicted_first() -> None:
    sched = engine(total_blocks=4)
    a, b = req("a", list(range(8)), 1), req("b", list(range(100, 108)), 1)
    run(sched, a)
    run(sched, b)
    assert sched.used_blocks == 0 and len(sched.pool.cached) == 4  # all free, all cached
    # Free queue: a took 0, 1 and gave them back last first (1, 0); b took 2, 3 (3, 2).
    assert list(sched.pool.free) == [1, 0, 3, 2]
    run(sched, req("c", [200, 201, 202], 1))  # one new block: a's last block is evicted
    assert list(sched.pool.free) == [0, 3, 2, 1]
    b2 = req("b2", [*list(range(100, 108)), 9], 1)
    run(sched, b2)  # hits b's 2 blocks, takes 1 new: a's first block is evicted
    assert b2.cached_tokens == 8 and sched.pool.evictions == 2
    a2 = req("a2", [*list(range(8)), 9], 1)
    run(sched, a2)
    assert a2.cached_tokens == 0


def test_a_hit_on_a_free_block_takes_it_back_from_the_free_queue() -> None:
    sched = engine(total_blocks=4)
    run(sched, req("a", list(range(8)), 1))
    b = req("b", [*list(range(8)), 1, 2, 3, 4, 5, 6, 7, 8], 10)
    sched.add(b)
    sched.step(0)
    # b holds a's 2 cached blocks (out of the free queue) and 2 new ones; none was evicted.
    assert b.cached_tokens == 8 and b.blocks == 4 and sched.used_blocks == 4
    assert len(sched.pool.free) == 0 and sched.pool.evictions == 0


def test_a_hit_that_needs_free_blocks_held_by_no_one_counts_them() -> None:
    """Touching a free cached block uses a free block: the allocation must fit both."""
    sched = engine(total_blocks=3)
    run(sched, req("a", list(range(8)), 1))  # 2 cached free blocks, 1 plain free block
    holder = req("holder", [300], 50)  # takes the plain free block and keeps it
    sched.add(holder)
    sched.step(0)
    b = req("b", [*list(range(8)), 1, 2, 3, 4, 5], 1)  # 2 hit blocks + 2 new: 4 > 3 free
    sched.add(b)
    out = sched.step(1)
    assert b not in out.scheduled and b.status == "waiting"


def test_prefix_cache_metrics_count_tokens_at_admission() -> None:
    sched = engine()
    run(sched, req("a", list(range(12)), 1))
    run(sched, req("b", [*list(range(12)), 5, 6], 1))
    assert sched.prefix_cache_queries == 12 + 14
    assert sched.prefix_cache_hits == 0 + 12


def test_caching_off_never_hits() -> None:
    sched = engine(caching=False)
    run(sched, req("a", list(range(12)), 1))
    b = req("b", [*list(range(12)), 5], 1)
    assert run(sched, b) == [13]
    assert b.cached_tokens == 0 and sched.prefix_cache_queries == 0 and not sched.pool.cached


def test_requests_given_as_counts_neither_hit_nor_cache() -> None:
    sched = engine()
    first, second = req("a", None, 1, prompt=12), req("b", None, 1, prompt=12)
    assert run(sched, first, second) == [24]
    assert not sched.pool.cached and sched.prefix_cache_queries == 0
    assert second.cached_tokens == 0


@st.composite
def shared_workloads(draw: st.DrawFn) -> tuple[VllmConfig, list[tuple[int, list[int], int]]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    config = VllmConfig(total_blocks=draw(st.integers(4, 24)), block_size=block_size,
                        max_num_seqs=draw(st.integers(1, 8)),
                        max_num_batched_tokens=draw(st.integers(1, 48)),
                        policy=draw(st.sampled_from(["fcfs", "priority"])))
    capacity = config.total_blocks * block_size
    prefixes = [list(range(100 * p, 100 * p + draw(st.integers(0, 24)))) for p in range(1, 3)]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        ids = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 3), max_size=12))
        ids = ids[:min(capacity, 40)] or [7]
        output = draw(st.integers(0, min(capacity - len(ids) + 1, 20)))
        requests.append((draw(st.integers(0, 8)), ids, output))
    return config, requests


@settings(max_examples=150, deadline=None)
@given(shared_workloads())
def test_shared_blocks_are_counted_once_and_all_come_back(
        workload: tuple[VllmConfig, list[tuple[int, list[int], int]]]) -> None:
    config, specs = workload
    sched = VllmScheduler(config)
    requests = [(at, SeqRequest(id=f"r{i}", prompt_tokens=len(ids), output_tokens=output,
                                token_ids=ids, output_ids=[9] * output))
                for i, (at, ids, output) in enumerate(specs)]
    emitted: dict[SeqRequest, list[int]] = {r: [] for _, r in requests}
    for now in range(5000):
        for at, r in requests:
            if at == now:
                sched.add(r, arrival=now)
        if now > 8 and not sched.has_unfinished():
            break
        out = sched.step(now)
        held: dict[int, int] = {}
        for r in sched.running:
            for block in r._blocks:
                if block is not None:
                    held[block.id] = held.get(block.id, 0) + 1
        assert sched.used_blocks == len(held) + sched.pool.lent
        assert sched.used_blocks <= config.total_blocks or len(sched.running) == 1
        for r in sched.running:
            for block in r._blocks:
                assert block is None or block.ref_cnt == held[block.id]
        assert sum(out.scheduled.values()) <= config.max_num_batched_tokens
        for r, index in out.tokens.items():
            emitted[r].append(index)
    assert not sched.has_unfinished()
    for r, indices in emitted.items():
        assert indices == list(range(1, r.output_tokens + 1))
        assert r.cached_tokens is not None and r.cached_tokens < r.prompt_tokens
    assert sched.used_blocks == 0 and len(sched.pool.free) == config.total_blocks
    for block_hash, blocks in sched.pool.cached.items():
        assert all(block.hash == block_hash and block.ref_cnt == 0 for block in blocks.values())
