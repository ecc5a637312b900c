"""Shared prefix blocks in an endpoint's room: counted once, as the engine stores them.

vLLM's prefix cache shares a block held by a running request by reference, so a request whose
prompt starts with blocks a request running on an endpoint holds needs room there only for the
rest (``picker.core.prefix.InflightBlocks``). A block the endpoint merely has cached is free room
by the engine's count and the picker's, and costs room again when a hit takes it back.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import AffinityRules, InflightBlocks, covered_tokens
from picker.openai.paths import ApiKind
from picker.openai.prefix import prompt_blocks

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
BLOCK = 64
SYSTEM = "You are a careful assistant who answers in one sentence. " * 10


def chat(*turns: str, system: str = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def make_gate(budgets: dict[str, int], *, weight: float = 1.0, engine_cache: bool = True,
              **rules: Any) -> Gate:
    gate_rules = GateRules(engine_cache=engine_cache,
                           affinity=AffinityRules(weight=weight, block_chars=BLOCK,
                                                  max_blocks_per_endpoint=1000), **rules)
    gate = Gate(gate_rules, Scheduler([LaneSpec("default")]),
                Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints(budgets)
    return gate


def send(gate: Gate, body: dict[str, Any], prompt: int | None, tenant: str = "t",
         now: float = 0.0, stream: bool = True) -> Passage:
    """``prompt``: its tokens (None: four characters a token)."""
    blocks, chars = prompt_blocks("m", body, ApiKind.CHAT, BLOCK)
    if prompt is None:
        prompt = chars // 4
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=stream, now=now, prefix_blocks=blocks,
                         prefix_chars=chars)
    assert isinstance(passage, Passage), passage
    return passage


def ledger_matches(gate: Gate) -> None:
    """Each endpoint's count is its requests' own tokens plus its in-flight blocks, once."""
    for address, endpoint in gate.endpoints.items():
        mine = [p for p in gate.passages.values()
                if p.dispatched_at is not None and p.endpoint is endpoint]
        blocks = gate.inflight_blocks.tokens(address)
        assert endpoint.inflight_requests == len(mine)
        assert endpoint.inflight_tokens == sum(
            p.reserved_tokens - p.prefix_tokens for p in mine) + blocks
        assert endpoint.projected_tokens == sum(
            p.projected_tokens - p.prefix_tokens for p in mine) + blocks


LONG = "the shared document, paragraph after paragraph " * 40  # about 1,900 characters


def test_a_request_whose_prefix_runs_on_an_endpoint_fits_there_where_its_whole_prompt_would_not(
        ) -> None:
    gate = make_gate({E1: 1000})
    holder = send(gate, chat(LONG), 800)
    assert holder.endpoint is gate.endpoints[E1]
    # 800 of 1,000 held: a 700-token prompt does not fit whole, but all but its question is
    # in the blocks the holder keeps in the engine.
    sharer = send(gate, chat(LONG, "an answer", "and a follow-up question"), 700, now=0.1)
    assert sharer.dispatched_at == 0.1 and sharer.endpoint is gate.endpoints[E1]
    shared = sharer.prefix_tokens - (gate.endpoints[E1].inflight_tokens - 800)
    assert shared > 600  # counted once: the endpoint holds 800 plus the follow-up's tail
    ledger_matches(gate)
    # The same prompt size sharing nothing waits for room.
    stranger = send(gate, chat("unrelated " * 200, system="Another system. " * 40), 700,
                    tenant="u", now=0.2)
    assert stranger.dispatched_at is None


def test_without_engine_cache_each_prompt_counts_whole_yet_affinity_still_routes() -> None:
    """``engineCache: false`` (engines without a prefix cache): the request that fits above only
    by its shared blocks waits for room, and where both fit the prefix still picks the
    endpoint, the prompt expected computed whole."""
    gate = make_gate({E1: 1000}, engine_cache=False)
    holder = send(gate, chat(LONG), 800)
    sharer = send(gate, chat(LONG, "an answer", "and a follow-up question"), 700, now=0.1)
    assert sharer.dispatched_at is None
    assert gate.endpoints[E1].inflight_tokens == holder.reserved_tokens
    gate.complete(holder, Usage(800, 10), "ok", 0.5)
    assert sharer.dispatched_at == 0.5 and sharer.prefix_tokens == 0
    gate.complete(sharer, Usage(700, 10), "ok", 1.0)
    assert gate.endpoints[E1].inflight_tokens == 0

    roomy = make_gate({E1: 10_000, E2: 10_000}, engine_cache=False)
    first = send(roomy, chat(LONG), 800)
    again = send(roomy, chat(LONG, "an answer", "and a follow-up question"), 700, now=0.1)
    assert again.endpoint is first.endpoint
    assert again.request.cached_prompt_tokens == 0  # charged as computed: nothing is cached
    home = first.endpoint
    assert home is not None and home.inflight_tokens == first.reserved_tokens \
        + again.reserved_tokens


def test_a_prefix_cached_but_held_by_no_running_request_is_no_room() -> None:
    gate = make_gate({E1: 1000})
    first = send(gate, chat(LONG), 800)
    gate.complete(first, Usage(800, 10), "ok", 0.5)
    filler = send(gate, chat("unrelated " * 200, system="Another system. " * 40), 800,
                  tenant="u", now=0.6)
    again = send(gate, chat(LONG, "an answer", "and a follow-up question"), 700, now=0.7)
    assert filler.dispatched_at == 0.6 and again.dispatched_at is None
    gate.complete(filler, Usage(800, 10), "ok", 1.0)
    assert again.dispatched_at == 1.0


def test_the_shared_prefix_picks_the_endpoint_where_it_fits_whatever_the_affinity_weight(
        ) -> None:
    gate = make_gate({E1: 1000, E2: 1000}, weight=0.0)
    holder = send(gate, chat(LONG), 800)
    home = holder.endpoint
    assert home is not None
    other = gate.endpoints[E2 if home.address == E1 else E1]
    other.inflight_tokens, other.inflight_requests = 800, 1  # as full, holding nothing shared
    sharer = send(gate, chat(LONG, "an answer", "and a follow-up question"), 700, now=0.1)
    assert sharer.endpoint is home


def test_release_gives_back_the_shared_blocks_once_whoever_ends_first() -> None:
    for holder_ends_first in (True, False):
        gate = make_gate({E1: 10_000})
        holder = send(gate, chat(LONG), None)
        sharer = send(gate, chat(LONG, "an answer", "and a follow-up question"), None, now=0.1)
        endpoint = gate.endpoints[E1]
        whole = holder.request.prompt_tokens + sharer.request.prompt_tokens
        assert endpoint.inflight_tokens < whole - 500  # the shared ~550 tokens counted once
        gate.charge_output(holder, 5)
        gate.charge_output(sharer, 7)
        ledger_matches(gate)
        first, last = (holder, sharer) if holder_ends_first else (sharer, holder)
        gate.complete(first, None, "ok", 1.0)
        ledger_matches(gate)
        # The one still running is counted whole again: the blocks are its alone now (to a
        # token a block: each block keeps the estimate it entered with).
        own = last.request.prompt_tokens + (7 if last is sharer else 5)
        assert abs(endpoint.inflight_tokens - own) <= len(last.prefix_blocks)
        gate.complete(last, None, "ok", 2.0)
        assert (endpoint.inflight_tokens, endpoint.projected_tokens,
                endpoint.inflight_requests) == (0, 0, 0)
        assert gate.inflight_blocks.blocks(E1) == 0


def test_a_request_moved_to_the_endpoint_that_served_it_takes_its_blocks_along() -> None:
    gate = make_gate({E1: 10_000, E2: 10_000})
    holder = send(gate, chat(LONG), 800)
    sharer = send(gate, chat(LONG, "an answer", "and a follow-up question"), 900, now=0.1)
    assert sharer.endpoint is holder.endpoint and holder.endpoint is not None
    other = E2 if holder.endpoint.address == E1 else E1
    gate.served_by(sharer, other, 0.2)
    ledger_matches(gate)
    assert gate.endpoints[other].inflight_tokens == 900  # nothing shared there
    assert holder.endpoint.inflight_tokens == 800
    for passage in (holder, sharer):
        gate.complete(passage, None, "ok", 1.0)
    assert all(e.inflight_tokens == e.projected_tokens == 0 for e in gate.endpoints.values())


def test_sharing_changes_whether_a_request_fits_never_who_goes_first() -> None:
    """Both queued requests fit once room opens: the fair queue's head goes first, as
    without sharing; the sharer follows at once, where its whole prompt would not fit."""
    gate = make_gate({E1: 1600})
    holder = send(gate, chat(LONG), 800, tenant="a")
    filler = send(gate, chat("unrelated " * 200, system="C's system. " * 40), 800, tenant="c",
                  now=0.1)
    b = send(gate, chat("b's question " * 60, system="B's system. " * 40), 700, tenant="b",
             now=0.2)
    a = send(gate, chat(LONG, "an answer", "and a follow-up question"), 700, tenant="a",
             now=0.3)
    # E1 holds 1,600 of 1,600: the sharer goes ahead of nobody (only the light-tenant rule
    # could send it, and it needs room too: the blocks it shares plus its tail).
    assert b.dispatched_at is None
    gate.complete(filler, Usage(800, 10), "ok", 1.0)
    assert b.dispatched_at == 1.0  # the head: a's counter (800 served) is ahead of b's
    assert a.dispatched_at == 1.0 and a.endpoint is holder.endpoint  # 100 left: its tail fits
    ledger_matches(gate)


def test_the_leading_held_run_is_found_by_bisection() -> None:
    inflight = InflightBlocks()
    inflight.hold(E1, [1, 2, 3, 4, 5, 6, 7], 700, 100, 700)
    for blocks, expected in (([1, 2, 3, 4, 5, 6, 7, 8], 7), ([1, 2, 3, 9], 3), ([9], 0),
                             ([1], 1), ([1, 2, 3, 4, 5, 6, 7], 7), ([], 0)):
        assert inflight.held(E1, blocks) == expected
    assert inflight.held(E2, [1]) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "grow", "end", "move", "drop"]),
                          st.integers(0, 3), st.integers(0, 30), st.integers(200, 900)),
                max_size=40))
def test_any_sequence_returns_every_count_to_zero(ops: list[tuple[str, int, int, int]]) -> None:
    """Requests sharing prefixes of four conversations, sent, grown, moved, ended and
    dropped in any order, over two small endpoints (so some wait): the counts match the
    ledger at every step and return to 0 once everything has ended."""
    gate = make_gate({E1: 2000, E2: 2000})
    passages: list[Passage] = []
    now = 0.0
    for op, conversation, pick, size in ops:
        now += 0.01
        live = [p for p in passages if p.outcome is None]
        running = [p for p in live if p.dispatched_at is not None]
        if op == "send":
            turns = [f"conversation {conversation} " * 30] + ["turn " * 10] * (pick % 4)
            passages.append(send(gate, chat(*turns), size, tenant=f"t{conversation % 2}",
                                 now=now, stream=pick % 3 != 0))
        elif op == "grow" and running:
            gate.charge_output(running[pick % len(running)], pick + 1, now)
        elif op == "end" and running:
            gate.complete(running[pick % len(running)], None, "ok", now)
        elif op == "move" and running:
            passage = running[pick % len(running)]
            assert passage.endpoint is not None
            gate.served_by(passage, E2 if passage.endpoint.address == E1 else E1, now)
        elif op == "drop" and live:
            waiting = [p for p in live if p.dispatched_at is None]
            if waiting:
                gate.drop(waiting[pick % len(waiting)], "cancelled", now)
        ledger_matches(gate)
    while any(p.outcome is None for p in passages):
        now += 0.01
        for passage in passages:
            if passage.outcome is None and passage.dispatched_at is not None:
                gate.complete(passage, None, "ok", now)
        ledger_matches(gate)
    for address, endpoint in gate.endpoints.items():
        assert (endpoint.inflight_tokens, endpoint.projected_tokens,
                endpoint.inflight_requests) == (0, 0, 0)
        assert gate.inflight_blocks.blocks(address) == 0
    assert gate.occupancy.tenants() == 0


def test_covered_tokens_is_what_hold_counts_block_by_block() -> None:
    inflight = InflightBlocks()
    added = inflight.hold(E1, list(range(1, 12)), 977, 64, 700)
    assert added == covered_tokens(977, 11, 64, 700) == 976  # all but the last token
    assert inflight.tokens(E1) == added
    assert inflight.hold(E1, list(range(1, 6)), 500, 64, 700) == 0  # all held already
    assert covered_tokens(400, 3, 64, 1000) == 400 * 3 * 64 // 1000
    assert inflight.release(E1, list(range(1, 6))) == 0  # still held by the first
    assert inflight.release(E1, list(range(1, 12))) == 976 and inflight.blocks(E1) == 0


def test_when_the_engine_shares_less_than_expected_its_scraped_kv_use_decides() -> None:
    """The backstop: the picker counts the shared blocks once, but the engine reports more in
    use (it did not share them, or evicted and recomputed them): its figure wins until the
    picker's own count is the higher again. Prompts at four characters a token."""
    twins = []
    for scrape in (False, True):
        gate = make_gate({E1: 1600})
        send(gate, chat(LONG), None)
        send(gate, chat(LONG, "an answer", "and a follow-up question"), None, now=0.1)
        endpoint = gate.endpoints[E1]
        assert endpoint.inflight_tokens < 700  # two prompts of over 600 tokens, shared
        before = endpoint.inflight_tokens
        if scrape:  # the engine holds both prompts whole, and more: 1,500 of 1,600
            gate.scraped(endpoint, 0.0, 2.0, 1500 / 1600, None, sent_at=0.2, now=0.2)
        twins.append(send(gate, chat(LONG, "an answer", "another question " * 25), None,
                          now=0.3))
        if not scrape:
            assert 60 < endpoint.inflight_tokens - before < 200  # its own tail only
    trusted, corrected = twins
    # About 110 tokens of its own beyond the shared blocks: they fit by the picker's count,
    # not beside the 1,500 the engine reports.
    assert trusted.dispatched_at == 0.3
    assert corrected.dispatched_at is None
