"""Prefix affinity (issue 28 points 2 and 3): the prompt's chained block hashes
(``picker.openai.prefix``), the bounded per-endpoint index (``picker.core.prefix``), the gate's
use of it (where, never who or whether), the charge of what was computed and what budgets
count, and the config that turns it on."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.build import affinity_rules, cost_function, gate_rules
from picker.config.schema import load_config
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, BucketRule, Reservation, TenantRules
from picker.core.cost import ComputedTokenCost, ContextAwareCost, LinearCost
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import AffinityRules, PrefixIndex, cached_estimate
from picker.errors import ConfigError
from picker.openai.paths import ApiKind
from picker.openai.prefix import chain_blocks, prompt_blocks, prompt_segments, token_blocks

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
BLOCK = 64
SYSTEM = "You are a careful assistant. " * 40  # 1,160 characters: 18 blocks of 64


def chat(*turns: str, model: str = "m", system: str = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": model, "messages": messages}


def blocks_of(body: dict[str, Any], kind: ApiKind = ApiKind.CHAT) -> tuple[int, ...]:
    return prompt_blocks(body["model"], body, kind, BLOCK)[0]


# -- the hashes --

def test_a_conversation_resent_shares_every_block_of_its_earlier_turn() -> None:
    first = blocks_of(chat("What is a KV cache? " * 10))
    second = blocks_of(chat("What is a KV cache? " * 10, "It holds keys. " * 20, "And?" * 30))
    assert len(first) >= 20 and len(second) > len(first)
    # The last block of the first turn may be cut differently (the trailing partial block is
    # not hashed, and the next turn continues it): all full blocks before it are shared.
    assert second[:len(first)] == first


def test_a_block_names_its_whole_prefix() -> None:
    a = blocks_of(chat("question one " * 20))
    b = blocks_of(chat("question one " * 20, system="X" + SYSTEM[1:]))
    # One byte changed in the first block: no block matches, though the rest of the text is
    # the same (chained, as vLLM's block hashes are).
    assert not set(a) & set(b)


def test_the_model_roles_and_message_boundaries_separate_prompts() -> None:
    base = chat("hello " * 40)
    assert blocks_of(base) != blocks_of(chat("hello " * 40, model="other"))
    swapped = {"model": "m", "messages": [{"role": "user", "content": SYSTEM},
                                          {"role": "user", "content": "hello " * 40}]}
    assert blocks_of(base)[0] != blocks_of(swapped)[0]
    split_a = {"model": "m", "prompt": None, "messages": [
        {"role": "user", "content": "ab" * 40}, {"role": "user", "content": "cd" * 40}]}
    split_b = {"model": "m", "messages": [
        {"role": "user", "content": "ab" * 40 + "c"}, {"role": "user", "content": "d" + "cd" * 39}]}
    assert blocks_of(split_a) != blocks_of(split_b)


def test_segments_come_in_template_order_tools_and_documents_included() -> None:
    body = {"model": "m", "tools": [{"type": "function", "function": {"name": "f"}}],
            "documents": [{"text": "doc"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    segments = prompt_segments(body, ApiKind.CHAT)
    assert segments[0].startswith("[{") and "function" in segments[0]
    assert segments[1] == '[{"text":"doc"}]' and segments[2:] == ["user", "hi"]
    anthropic = {"model": "m", "system": "be brief",
                 "messages": [{"role": "user", "content": "q"}]}
    assert prompt_segments(anthropic, ApiKind.MESSAGES) == ["system", "be brief", "user", "q"]
    responses = {"model": "m", "instructions": "rules", "input": "question"}
    assert prompt_segments(responses, ApiKind.RESPONSES) == ["system", "rules", "question"]
    assert prompt_segments({"model": "m", "prompt": "text"}, ApiKind.COMPLETIONS) == ["text"]


def test_only_full_blocks_are_hashed_and_a_short_prompt_has_none() -> None:
    assert chain_blocks(b"x" * 63, 64, 0) == ()
    assert len(chain_blocks(b"x" * 200, 64, 0)) == 3
    assert len(chain_blocks(b"x" * 10_000, 64, 0, max_blocks=5)) == 5
    blocks, length = prompt_blocks("m", {"model": "m", "prompt": "a" * 130}, ApiKind.COMPLETIONS,
                                   64)
    assert len(blocks) == 2 and length == 130


def test_token_ids_chain_the_same_way() -> None:
    ids = list(range(100))
    a, size = token_blocks("m", ids, 16)
    b, _ = token_blocks("m", [*ids[:48], 999, *ids[49:]], 16)
    assert size == 400 and len(a) == 6
    assert a[:3] == b[:3] and not set(a[3:]) & set(b[3:])


# -- the index --

def test_a_match_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    index = PrefixIndex(100)
    index.record(E1, (1, 2, 3, 4))
    assert index.matched(E1, (1, 2, 3, 4)) == 4
    assert index.matched(E1, (1, 2, 9, 10)) == 2
    # Chained hashes: a held last block names the whole prefix, and is taken as a full match
    # without walking (real block lists never hold 4 after a different third block).
    assert index.matched(E1, (1, 2, 9, 4)) == 4
    assert index.matched(E1, (9, 10, 11)) == 0
    assert index.matched(E2, (1, 2)) == 0 and index.matched(E1, ()) == 0


def test_the_index_is_bounded_per_endpoint_and_forgets_the_least_recent() -> None:
    index = PrefixIndex(5)
    index.record(E1, (1, 2, 3))
    index.record(E1, (4, 5))
    index.record(E1, (1,))  # 1 is now the most recent: 2 goes first
    index.record(E1, (6, 7))
    assert index.size(E1) == 5
    assert index.matched(E1, (1,)) == 1 and index.matched(E1, (2,)) == 0
    assert index.matched(E1, (3,)) == 0 and index.matched(E1, (4, 5, 6, 7)) == 4
    for start in range(0, 10_000, 10):
        index.record(E2, tuple(range(start, start + 10)))
    assert index.size(E2) == 5 and index.size(E1) == 5
    index.forget(E1)
    assert index.size(E1) == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.sampled_from((E1, E2)),
                                              st.lists(st.integers(0, 60), max_size=30)),
                                    max_size=40))
def test_any_sequence_of_dispatches_stays_within_the_bound(
        capacity: int, dispatches: list[tuple[str, list[int]]]) -> None:
    index = PrefixIndex(capacity)
    for address, blocks in dispatches:
        index.record(address, tuple(blocks))
        assert index.size(address) <= capacity
        # What was just sent is held, as far as the bound lets it be (its last blocks).
        kept = list(dict.fromkeys(reversed(blocks)))[:capacity]
        assert all(index.matched(address, (b,)) == 1 for b in kept)


def test_the_cached_estimate_is_the_matched_share_less_the_last_token() -> None:
    assert cached_estimate(1000, 0, 64, 6400) == 0
    assert cached_estimate(1000, 50, 64, 6400) == 500
    assert cached_estimate(1000, 100, 64, 6400) == 999  # vLLM computes the last token
    assert cached_estimate(1000, 10, 64, 0) == 0


# -- the gate --

def make_gate(*, weight: float = 1.0, cost: Any = None, budgets: dict[str, int] | None = None,
              tenants: dict[str, TenantRules] | None = None, **rules: Any) -> Gate:
    gate_rules = GateRules(affinity=AffinityRules(weight=weight, block_chars=BLOCK,
                                                  max_blocks_per_endpoint=1000), **rules)
    scheduler = Scheduler([LaneSpec("default")], cost=cost)
    gate = Gate(gate_rules, scheduler, RecordingAdmission(tenants or {}, TenantRules()), now=0.0)
    gate.set_endpoints(budgets or {E1: 10_000, E2: 10_000})
    return gate


class RecordingAdmission(Admission):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[int] = []

    def finish(self, reservation: Reservation, actual_tokens: int, now: float) -> None:
        super().finish(reservation, actual_tokens, now)
        self.finished.append(actual_tokens)


def send(gate: Gate, body: dict[str, Any], prompt: int, tenant: str = "t",
         now: float = 0.0) -> Passage:
    blocks, chars = prompt_blocks(body["model"], body, ApiKind.CHAT, BLOCK)
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=True, now=now, prefix_blocks=blocks,
                         prefix_chars=chars)
    assert isinstance(passage, Passage), passage
    return passage


def load(gate: Gate, address: str, tokens: int) -> None:
    """Another request's tokens on ``address`` (no prefix)."""
    gate.endpoints[address].inflight_tokens += tokens
    gate.endpoints[address].inflight_requests += 1


def test_a_conversations_turns_go_to_the_endpoint_holding_its_prefix_when_it_fits() -> None:
    gate = make_gate()
    turn = send(gate, chat("first question " * 10), 400)
    home = turn.endpoint
    assert home is not None
    other = E2 if home.address == E1 else E1
    # The home endpoint is now busier than the other (2,000 more tokens of 10,000), yet the
    # next turn, which resends the conversation, goes home: a full match is worth 1.
    load(gate, home.address, 2000)
    second = send(gate, chat("first question " * 10, "an answer " * 10, "follow-up " * 5), 600)
    assert second.endpoint is home
    # A prompt sharing nothing goes by load.
    stranger = send(gate, chat("unrelated " * 20, system="Another system prompt. " * 30), 300)
    assert stranger.endpoint is gate.endpoints[other]


def test_load_wins_when_the_affinity_weight_is_low() -> None:
    gate = make_gate(weight=0.05)
    turn = send(gate, chat("first question " * 10), 400)
    home = turn.endpoint
    assert home is not None
    load(gate, home.address, 2000)  # 0.2 of the budget: more than the 0.05 a match is worth
    second = send(gate, chat("first question " * 10, "an answer " * 10, "follow-up " * 5), 600)
    assert second.endpoint is not home


def test_a_full_endpoint_is_never_chosen_for_its_prefix() -> None:
    """A prefix the endpoint has cached, with nothing running there that holds it, is no room:
    the engine counts such blocks free and a hit takes them back out of its free queue."""
    gate = make_gate()
    turn = send(gate, chat("first question " * 10), 400)
    home = turn.endpoint
    assert home is not None
    gate.complete(turn, Usage(400, 10), "ok", 0.5)
    load(gate, home.address, 9_500)  # 9,500 of 10,000: a 600-token prompt does not fit
    resend = chat("first question " * 10, "an answer " * 10, "follow-up " * 5)
    second = send(gate, resend, 600, now=1.0)
    assert second.endpoint is not None and second.endpoint is not home
    gate.complete(second, Usage(600, 10), "ok", 1.5)
    # With nowhere else to go it waits rather than overfill its home.
    load(gate, second.endpoint.address, 9_500)
    third = send(gate, resend, 600, now=2.0)
    assert third.dispatched_at is None


def test_affinity_never_reorders_the_fair_queue() -> None:
    gate = make_gate(budgets={E1: 1000})
    earlier = send(gate, chat("hold " * 100), 900, tenant="a")
    gate.complete(earlier, Usage(900, 10), "ok", 0.5)  # a's prefix is cached on E1
    holder = send(gate, chat("unrelated " * 100, system="C's system. " * 20), 900, tenant="c",
                  now=0.6)
    # b's request waits first, then a's resend of its own prefix: b still goes first.
    b = send(gate, chat("b's question " * 20, system="B's system. " * 20), 600, tenant="b",
             now=0.7)
    a = send(gate, chat("hold " * 100, "more " * 10), 600, tenant="a", now=0.8)
    assert b.dispatched_at is None and a.dispatched_at is None
    gate.complete(holder, Usage(900, 10), "ok", 1.0)
    assert b.dispatched_at == 1.0 and a.dispatched_at is None


def test_the_expected_cached_prompt_is_charged_at_dispatch_and_settled_from_usage() -> None:
    gate = make_gate(cost=ComputedTokenCost(1.0, 2.0))
    first = send(gate, chat("question " * 100), 400)
    assert first.request.cached_prompt_tokens == 0 and first.request.charged == 400
    gate.complete(first, Usage(400, 0, 0), "ok", 1.0)
    again = send(gate, chat("question " * 100), 400, now=2.0)
    assert again.endpoint is first.endpoint
    # Every full block matched: the share they cover of the text, less the last token.
    assert 300 < again.request.cached_prompt_tokens < 400
    assert again.request.charged == 400 - again.request.cached_prompt_tokens
    gate.complete(again, Usage(400, 10, 384), "ok", 3.0)
    assert again.request.charged == 16 + 20  # settled: 16 computed, 10 output at 2


def test_budgets_count_sent_prompt_tokens_by_default_and_computed_when_configured() -> None:
    rules = {"t": TenantRules(burst=BucketRule(capacity_tokens=100_000, refill_seconds=60.0))}
    sent = make_gate(tenants=rules)
    computed = make_gate(tenants=rules, charge_sent_to_budgets=False)
    for gate in (sent, computed):
        passage = send(gate, chat("question " * 100), 400)
        gate.complete(passage, Usage(400, 10, 384), "ok", 1.0)
    assert isinstance(sent.admission, RecordingAdmission)
    assert isinstance(computed.admission, RecordingAdmission)
    assert sent.admission.finished == [410]
    assert computed.admission.finished == [26]


def test_each_replica_learns_from_its_own_dispatches() -> None:
    """Two pickers (replicas) before the same endpoints: the index is not shared. A turn sent
    through the replica that routed the conversation goes home; through the other it goes by
    load, which is a cache miss and nothing worse."""
    a, b = make_gate(), make_gate()
    first = send(a, chat("first question " * 10), 400)
    assert first.endpoint is not None
    home = first.endpoint.address
    other = E2 if home == E1 else E1
    for gate in (a, b):
        load(gate, home, 2000)  # both see home as the busier endpoint
    resend = chat("first question " * 10, "an answer " * 10, "follow-up " * 5)
    assert send(a, resend, 600).endpoint is a.endpoints[home]
    via_b = send(b, resend, 600)
    assert via_b.endpoint is b.endpoints[other] and via_b.request.cached_prompt_tokens == 0


def test_a_request_served_by_a_fallback_teaches_the_index_where_it_went() -> None:
    gate = make_gate()
    passage = send(gate, chat("question " * 100), 400)
    assert passage.endpoint is not None and gate.prefix_index is not None
    other = E2 if passage.endpoint.address == E1 else E1
    gate.served_by(passage, other, 0.5)
    assert gate.prefix_index.matched(other, passage.prefix_blocks) == \
        len(passage.prefix_blocks)


def test_a_drained_endpoint_is_forgotten_and_without_affinity_no_index_is_kept() -> None:
    gate = make_gate()
    passage = send(gate, chat("question " * 100), 400)
    assert passage.endpoint is not None and gate.prefix_index is not None
    address = passage.endpoint.address
    gate.complete(passage, Usage(400, 1), "ok", 1.0)
    assert gate.prefix_index.size(address) > 0
    gate.set_endpoints({a: 10_000 for a in (E1, E2) if a != address})
    assert gate.prefix_index.size(address) == 0
    gate.set_rules(GateRules())
    assert gate.prefix_index is None
    # The engines still cache: the blocks count in the room while the request runs, and no
    # index remembers them after, nor expects any part of the prompt cached.
    cached = send(gate, chat("question " * 100), 400)
    assert cached.prefix_blocks and cached.prefix_block_chars
    assert cached.request.cached_prompt_tokens == 0
    gate.complete(cached, Usage(400, 1), "ok", 2.0)
    assert all(gate.inflight_blocks.blocks(a) == 0 for a in gate.endpoints)
    gate.set_rules(GateRules(engine_cache=False))
    plain = send(gate, chat("question " * 100), 400, now=3.0)
    assert plain.prefix_blocks == () and plain.request.cached_prompt_tokens == 0


# -- cost and config --

def test_cached_prompt_tokens_cost_their_weight() -> None:
    assert ComputedTokenCost(1.0, 2.0).prompt_cost(1000, 800) == 200
    assert ComputedTokenCost(1.0, 2.0, cached_weight=0.1).prompt_cost(1000, 800) == \
        pytest.approx(280)
    assert ComputedTokenCost(2.0, 2.0).prompt_cost(1000, 5000) == 0  # capped at the prompt
    assert ContextAwareCost(1.0, 2.0, 0.1).prompt_cost(1000, 800) == 1000  # sent, by default
    assert ContextAwareCost(1.0, 2.0, 0.1, cached_weight=0.0).prompt_cost(1000, 800) == 200
    assert LinearCost().prompt_cost(1000, 800) == 1000


def test_the_config_turns_affinity_and_computed_charging_on() -> None:
    config = load_config({
        "routing": {"prefixAffinity": {"weight": 2, "blockChars": 128,
                                       "maxBlocksPerEndpoint": 500}},
        "cost": {"chargeCachedPrompt": False, "cachedPromptWeight": 0.25,
                 "budgetTokens": "computed"}})
    assert affinity_rules(config) == AffinityRules(2.0, 128, 500)
    rules = gate_rules(config)
    assert rules.affinity == AffinityRules(2.0, 128, 500) and not rules.charge_sent_to_budgets
    assert cost_function(config) == ComputedTokenCost(1.0, 2.0, 0.25)
    default = load_config({})
    assert affinity_rules(default) is None and gate_rules(default).charge_sent_to_budgets
    assert cost_function(default) == LinearCost()
    on = load_config({"routing": {"prefixAffinity": {}}})
    assert affinity_rules(on) == AffinityRules()


@pytest.mark.parametrize(("data", "path"), [
    ({"routing": {"prefixAffinity": {"blockSize": 64}}}, "routing.prefixAffinity.blockSize"),
    ({"routing": {"prefixAffinity": {"blockChars": 8}}}, "routing.prefixAffinity.blockChars"),
    ({"routing": {"prefixAffinity": {"weight": -1}}}, "routing.prefixAffinity.weight"),
    ({"routing": {"prefixAffinity": {"maxBlocksPerEndpoint": 0}}},
     "routing.prefixAffinity.maxBlocksPerEndpoint"),
    ({"cost": {"cachedPromptWeight": 2}}, "cost.cachedPromptWeight"),
    ({"cost": {"budgetTokens": "cached"}}, "cost.budgetTokens"),
])
def test_bad_affinity_and_cost_settings_are_refused_by_path(data: dict[str, Any],
                                                             path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(data)
    assert caught.value.path == path
