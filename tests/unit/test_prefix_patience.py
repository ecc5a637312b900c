"""Keeping a light tenant's cached prefix working under a flood (issue 28's second goal): the
prefix index ages what an endpoint was sent by the new KV sent there since (``freshness``),
and the fair queue's head may wait, a bounded time worth less than the prefill it saves, for
the endpoint holding its prefix while the next request in fair order takes the room elsewhere
(``routing.prefixAffinity.patience``)."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.build import affinity_rules
from picker.config.schema import load_config
from picker.core import LaneSpec, Request, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import AffinityRules, PrefixIndex, freshness, prefix_patience
from picker.errors import ConfigError
from tests.unit.test_prefix_affinity import send as prefix_send

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
BLOCK = 64
SYSTEM = "You are a careful assistant. " * 150  # 4,350 characters: 67 blocks of 64


def chat(question: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": question}]}


def make_gate(*, patience: float = 0.0, policy: str = "vtc") -> Gate:
    rules = GateRules(affinity=AffinityRules(block_chars=BLOCK, max_blocks_per_endpoint=10_000,
                                             patience=patience, prefill_s_per_token=0.0001))
    gate = Gate(rules, Scheduler([LaneSpec("default")], policy=policy),
                Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({E1: 10_000, E2: 10_000})
    return gate


def send(gate: Gate, body: dict[str, Any], prompt: int, tenant: str = "light",
         now: float = 0.0) -> Passage:
    return prefix_send(gate, body, prompt, tenant, now)


def load(gate: Gate, address: str, tokens: int) -> None:
    """Another client's tokens on ``address`` (no prefix); negative: they end."""
    gate.endpoints[address].inflight_tokens += tokens
    gate.endpoints[address].inflight_requests += 1 if tokens > 0 else -1


def other(address: str) -> str:
    return E2 if address == E1 else E1


# -- the index's ages --

def test_a_match_counts_only_blocks_sent_within_the_horizon() -> None:
    index = PrefixIndex(100)
    index.sent(E1, 500)
    index.record(E1, (1, 2, 3))
    index.sent(E1, 300)
    index.record(E1, (1, 2, 9))  # the shared head is sent again: younger than block 3
    assert index.age(E1, (1, 2, 3), 3) == 300 and index.age(E1, (1, 2, 9), 3) == 0
    assert index.matched(E1, (1, 2, 3)) == 3  # no horizon: as before
    assert index.matched(E1, (1, 2, 3), within=301) == 3
    assert index.matched(E1, (1, 2, 3), within=300) == 2  # block 3 is 300 tokens old
    index.sent(E1, 1000)
    assert index.matched(E1, (1, 2, 9), within=1000) == 0
    # A request's end puts its blocks in the engine's free queue: they age from then.
    index.released(E1, (1, 2))
    assert index.age(E1, (1, 2), 2) == 0 and index.age(E1, (1, 2, 9), 3) == 1000
    index.released(E1, (7,))  # a block not remembered is not added
    assert index.size(E1) == 4


def test_freshness_is_whole_within_the_free_room_and_none_past_the_budget() -> None:
    assert freshness(0, 0, 10_000) == 1.0
    assert freshness(3_000, 4_000, 10_000) == 1.0
    assert freshness(7_000, 4_000, 10_000) == pytest.approx(0.5)
    assert freshness(10_000, 4_000, 10_000) == 0.0 and freshness(20_000, 0, 10_000) == 0.0


def test_patience_is_the_prefill_saved_at_most_the_bound() -> None:
    rules = AffinityRules(patience=0.2, prefill_s_per_token=0.0001)
    assert prefix_patience(1000, rules) == pytest.approx(0.1)
    assert prefix_patience(5000, rules) == 0.2
    assert prefix_patience(0, rules) == 0.0
    assert prefix_patience(1000, AffinityRules()) == 0.0  # patience 0: never


# -- where affinity sends a request --

def test_of_two_endpoints_sent_a_prefix_the_one_likelier_to_still_cache_it_wins() -> None:
    """The old rule counted any remembered block as held: both endpoints matched in full and
    load decided. Since then one endpoint has allocated more new KV than it had free."""
    gate = make_gate()
    first = send(gate, chat("question one"), 1200)
    assert first.endpoint is not None
    home = first.endpoint.address
    gate.complete(first, Usage(1200, 10), "ok", 0.5)
    load(gate, home, 9_900)  # the prefix cannot go home: it goes to the other endpoint too
    second = send(gate, chat("question two"), 1200, now=1.0)
    assert second.endpoint is not None and second.endpoint.address == other(home)
    gate.complete(second, Usage(1200, 10), "ok", 1.5)
    load(gate, home, -9_900)
    # A flood's large request runs at home since: 8,000 tokens of new KV where 10,000 were
    # free at most, and only 2,000 free now.
    load(gate, other(home), 9_900)
    flood = send(gate, chat("a long document " * 2000, system="Flood. " * 10), 8000,
                 tenant="flood", now=2.0)
    assert flood.endpoint is not None and flood.endpoint.address == home
    load(gate, other(home), -9_900)
    load(gate, other(home), 8_200)  # the other endpoint is busier than home
    third = send(gate, chat("question three"), 1200, now=3.0)
    # By load home wins (0.2 free against 0.18) and both were sent the prefix; the other
    # endpoint is where it is still cached.
    assert third.endpoint is not None and third.endpoint.address == other(home)


# -- patience --

def _held_home(patience: float) -> tuple[Gate, str, Passage]:
    """A light tenant's prefix sent home once; home is now full and the other endpoint empty;
    the light tenant's next request arrives at 1.0."""
    gate = make_gate(patience=patience)
    first = send(gate, chat("question one"), 1200)
    assert first.endpoint is not None
    home = first.endpoint.address
    gate.complete(first, Usage(1200, 10), "ok", 0.5)
    load(gate, home, 9_500)
    return gate, home, send(gate, chat("question two"), 1200, now=1.0)


def test_without_patience_the_head_goes_where_there_is_room_and_recomputes() -> None:
    _, home, light = _held_home(0.0)
    assert light.endpoint is not None and light.endpoint.address == other(home)


def test_the_head_waits_for_its_prefix_and_the_next_in_fair_order_takes_the_room() -> None:
    gate, home, light = _held_home(0.2)
    # 1,200 tokens of which about 1,150 are its cached system prompt: worth 0.115 s of prefill.
    assert light.dispatched_at is None and light.prefix_wait_for == home
    flood = send(gate, chat("unrelated", system="Flood. " * 100), 500, tenant="flood",
                 now=1.01)
    # The flood's request is after it in fair order (the light tenant's counter is the lower
    # one, its request older) and goes to the other endpoint's room meanwhile.
    assert flood.endpoint is not None and flood.endpoint.address == other(home)
    assert light.dispatched_at is None
    load(gate, home, -9_500)  # home has room again at 1.05: the light request goes there
    gate.pump(1.05)
    assert light.endpoint is not None and light.endpoint.address == home
    assert light.dispatched_at == 1.05


def test_the_wait_is_bounded_by_the_prefill_it_saves() -> None:
    gate, home, light = _held_home(0.2)
    gate.pump(1.1)
    assert light.dispatched_at is None  # 0.1 s waited, 0.115 s is worth it
    gate.pump(1.12)
    assert light.endpoint is not None and light.endpoint.address == other(home)


def test_the_room_kept_for_the_head_is_not_given_to_the_next() -> None:
    gate = make_gate(patience=0.2)
    first = send(gate, chat("question one"), 1200)
    assert first.endpoint is not None
    home = first.endpoint.address
    gate.complete(first, Usage(1200, 10), "ok", 0.5)
    flood_prompt = chat("small", system="Flood. " * 100)
    load(gate, other(home), 9_900)
    earlier = send(gate, flood_prompt, 300, tenant="flood", now=0.6)  # the flood's, home too
    assert earlier.endpoint is not None and earlier.endpoint.address == home
    gate.complete(earlier, Usage(300, 10), "ok", 0.7)
    load(gate, other(home), -9_900)
    load(gate, home, 8_900)  # home: room for a small request, not for the light one
    light = send(gate, chat("question two"), 1200, now=1.0)
    assert light.dispatched_at is None and light.prefix_wait_for == home
    small = send(gate, flood_prompt, 300, tenant="flood", now=1.01)
    # Its own prefix would take it home; that room is what the head waits for.
    assert small.endpoint is not None and small.endpoint.address == other(home)
    assert light.dispatched_at is None


def test_a_light_request_going_past_a_waiting_head_waits_for_its_prefix_too() -> None:
    gate = make_gate(patience=0.2)
    first = send(gate, chat("question one"), 1200)
    assert first.endpoint is not None
    home = first.endpoint.address
    gate.complete(first, Usage(1200, 10), "ok", 0.5)
    load(gate, home, 9_500)
    load(gate, other(home), 5_000)
    flood = [send(gate, chat(f"long {i}", system="Flood. " * 100), 6000, tenant="flood",
                  now=0.9) for i in range(2)]
    light = send(gate, chat("question two"), 1200, now=1.0)
    # The flood's head fits nowhere; the light request may go past it (it fits on the other
    # endpoint), but its prefix is home: it waits the prefill that saves.
    assert all(f.dispatched_at is None for f in flood) and light.dispatched_at is None
    gate.pump(1.2)
    assert light.endpoint is not None and light.endpoint.address == other(home)


def test_a_policy_that_cannot_look_past_the_head_lets_the_room_wait() -> None:
    fcfs = make_gate(patience=0.2, policy="fcfs")
    first = send(fcfs, chat("question one"), 1200)
    assert first.endpoint is not None
    home = first.endpoint.address
    fcfs.complete(first, Usage(1200, 10), "ok", 0.5)
    load(fcfs, home, 9_500)
    waiting = send(fcfs, chat("question two"), 1200, now=1.0)
    flood = send(fcfs, chat("unrelated", system="Flood. " * 100), 500, tenant="flood",
                 now=1.01)
    assert waiting.dispatched_at is None and flood.dispatched_at is None
    fcfs.pump(1.2)  # past the patience: the head goes where the room is, then the next
    assert waiting.endpoint is not None and waiting.endpoint.address == other(home)
    assert flood.dispatched_at == 1.2


def test_a_prefix_on_an_endpoint_too_small_for_the_prompt_is_not_waited_for() -> None:
    gate, home, _ = _held_home(0.2)
    gate.endpoints[home].configured_budget = 1000  # the prompt can never fit there now
    light = send(gate, chat("question three"), 1200, now=1.2)
    assert light.endpoint is not None and light.endpoint.address == other(home)


def test_peek_besides_is_the_next_in_fair_order() -> None:
    scheduler = Scheduler([LaneSpec("default")])
    a, b, c = (Request(tenant=t, prompt_tokens=100) for t in "abc")
    for request in (a, b, c):
        scheduler.enqueue(request, 0.0)
    scheduler.dispatch(scheduler.peek(0.0) or a, 0.0)  # a goes: its counter is the highest
    second = Request(tenant="a", prompt_tokens=100)
    scheduler.enqueue(second, 0.1)
    assert scheduler.peek(0.1) is b
    assert scheduler.peek_besides(0.1, {"b"}) is c
    assert scheduler.peek_besides(0.1, {"b", "c"}) is second
    assert scheduler.peek_besides(0.1, {"a", "b", "c"}) is None
    assert scheduler.queued() == 3 and scheduler.peek(0.1) is b  # nothing taken
    fcfs = Scheduler([LaneSpec("default")], policy="fcfs")
    x, y = Request(tenant="x", prompt_tokens=1), Request(tenant="y", prompt_tokens=1)
    fcfs.enqueue(x, 0.0)
    fcfs.enqueue(y, 0.0)
    assert fcfs.peek_besides(0.0, {"x"}) is None  # fcfs cannot skip its head


# -- config --

def test_the_config_sets_the_patience_and_the_prefill_cost() -> None:
    config = load_config({"routing": {"prefixAffinity": {
        "patience": "150ms", "prefillMsPer1kTokens": 40}}})
    rules = affinity_rules(config)
    assert rules is not None and rules.patience == pytest.approx(0.15)
    assert rules.prefill_s_per_token == pytest.approx(0.00004)
    default = affinity_rules(load_config({"routing": {"prefixAffinity": {}}}))
    assert default is not None and default.patience == 0.0


@pytest.mark.parametrize(("data", "path"), [
    ({"patience": -1}, "routing.prefixAffinity.patience"),
    ({"patience": "11s"}, "routing.prefixAffinity.patience"),
    ({"patience": "soon"}, "routing.prefixAffinity.patience"),
    ({"prefillMsPer1kTokens": 0}, "routing.prefixAffinity.prefillMsPer1kTokens"),
    ({"prefillMsPer1KTokens": 50}, "routing.prefixAffinity.prefillMsPer1KTokens"),
])
def test_bad_patience_settings_are_refused_by_path(data: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"routing": {"prefixAffinity": data}})
    assert caught.value.path == path
