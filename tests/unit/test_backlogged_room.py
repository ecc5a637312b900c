"""The room rules for a backlogged tenant's requests (``capacity.growthRoom``,
``capacity.maxPrefillTokens`` and ``capacity.readyReserve``; ``picker.core.selection``'s
``takes_backlogged`` and ``keeps_reserve``), driven through the pure gate: each holds a flood's
request that the default would send, and none ever holds a request of a tenant that is not
backlogged."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.build import capacity_rules
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.selection import (
    CapacityRules,
    EndpointState,
    keeps_reserve,
    peak_growth,
    peak_growth_with,
    takes_backlogged,
)
from picker.errors import ConfigError

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def _gate(**capacity: Any) -> Gate:
    rules = GateRules(capacity=CapacityRules(fallback_budget=1000, **capacity))
    gate = Gate(rules, Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({A: 1000})
    return gate


def _admit(gate: Gate, tenant: str, prompt: int = 100, *, stream: bool = True,
           now: float = 0.0) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=stream, now=now)
    assert isinstance(passage, Passage)
    return passage


def _backlog(gate: Gate) -> tuple[list[Passage], list[Passage]]:
    """A flood of 100-token prompts (expected to grow to 200 each) that fills the 1,000-token
    endpoint by its prompts and keeps five more waiting: (running, waiting)."""
    flood = [_admit(gate, "flood") for _ in range(15)]
    running = [p for p in flood if p.dispatched_at is not None]
    assert len(running) == 10  # each arrived with nothing else queued: its prompt fit
    return running, [p for p in flood if p.dispatched_at is None]


# -- growth room --

@pytest.mark.parametrize("growth_room", [False, True])
def test_growth_room_holds_a_backlogged_request_the_running_ones_will_grow_into(
        growth_room: bool) -> None:
    gate = _gate(growth_room=growth_room)
    running, waiting = _backlog(gate)
    for passage in running[:3]:
        gate.complete(passage, Usage(100, 0, 0), "ok", 1.0)
    # 700 tokens held now, room for three more prompts; but the seven still running are
    # expected to grow to 1,400: no room for anything once they have.
    sent = [p for p in waiting if p.dispatched_at is not None]
    assert len(sent) == (0 if growth_room else 3)


def test_growth_room_sends_a_backlogged_request_that_fits_once_all_have_grown() -> None:
    gate = _gate(growth_room=True)
    running, waiting = _backlog(gate)
    for passage in running[:7]:
        gate.complete(passage, Usage(100, 0, 0), "ok", 1.0)
    # Three running, expected at 600: room for two more of 200 each.
    assert [p.dispatched_at for p in waiting] == [1.0, 1.0, None, None, None]


def test_growth_room_never_holds_a_light_tenants_request() -> None:
    gate = _gate(growth_room=True)
    running, waiting = _backlog(gate)
    for passage in running[:3]:
        gate.complete(passage, Usage(100, 0, 0), "ok", 1.0)
    light = _admit(gate, "light", now=1.0)
    assert light.dispatched_at == 1.0  # its prompt fits beside what is held now
    assert all(p.dispatched_at is None for p in waiting)


# -- prefill pacing --

@pytest.mark.parametrize("bound", [0, 250])
def test_a_prefill_bound_holds_a_backlogged_request_while_prompts_are_outstanding(
        bound: int) -> None:
    gate = _gate(max_prefill_tokens=bound)
    running, waiting = _backlog(gate)
    assert gate.endpoints[A].prefill_tokens == 1000  # no first token back yet
    for passage in running[:3]:
        gate.complete(passage, Usage(100, 1, 0), "ok", 1.0)
    # Room for three prompts, but 700 prompt tokens are still to be computed there.
    sent = [p for p in waiting if p.dispatched_at is not None]
    assert len(sent) == (0 if bound else 3)
    assert gate.endpoints[A].prefill_tokens == 700 + 100 * len(sent)


def test_first_tokens_end_the_prefill_and_release_what_the_bound_held() -> None:
    gate = _gate(max_prefill_tokens=250)
    running, waiting = _backlog(gate)
    for passage in running[:5]:
        gate.complete(passage, Usage(100, 1, 0), "ok", 1.0)
    assert all(p.dispatched_at is None for p in waiting)  # 500 outstanding
    for passage in running[5:]:
        gate.charge_output(passage, 1, 1.5)
    # Nothing outstanding: the first goes whatever its size, the second fits (200), the third
    # would make 300.
    assert [p.dispatched_at for p in waiting] == [1.5, 1.5, None, None, None]
    assert gate.endpoints[A].prefill_tokens == 200
    gate.charge_output(waiting[0], 1, 2.0)
    assert waiting[2].dispatched_at == 2.0


def test_a_prefill_bound_never_holds_a_light_tenants_request() -> None:
    gate = _gate(max_prefill_tokens=250)
    running, waiting = _backlog(gate)
    for passage in running[:3]:
        gate.complete(passage, Usage(100, 1, 0), "ok", 1.0)
    light = _admit(gate, "light", now=1.0)
    assert light.dispatched_at == 1.0
    assert all(p.dispatched_at is None for p in waiting)
    assert gate.endpoints[A].prefill_tokens == 800


def test_outstanding_prefill_counts_streams_until_their_first_token_or_end() -> None:
    gate = _gate()
    stream, whole = _admit(gate, "a", 300), _admit(gate, "b", 200, stream=False)
    endpoint = gate.endpoints[A]
    assert (stream.prefilling, whole.prefilling, endpoint.prefill_tokens) == (True, False, 300)
    gate.charge_output(stream, 1)
    gate.charge_output(stream, 1)
    assert (stream.prefilling, endpoint.prefill_tokens) == (False, 0)
    cancelled = _admit(gate, "c", 150)
    gate.complete(cancelled, None, "cancelled", 1.0)
    assert endpoint.prefill_tokens == 0


def test_takes_backlogged_judges_an_endpoint() -> None:
    rules = CapacityRules(fallback_budget=1000, growth_room=True, max_prefill_tokens=500)
    empty = EndpointState(A)
    assert takes_backlogged(empty, 900, 5000, 0.0, rules)  # an empty endpoint takes any
    busy = EndpointState(A, inflight_tokens=400, inflight_requests=2, projected_tokens=700)
    assert takes_backlogged(busy, 100, 300, 0.0, rules)
    assert not takes_backlogged(busy, 100, 301, 0.0, rules)  # 700 + 301 > 1000
    busy.prefill_tokens = 450
    assert takes_backlogged(busy, 50, 300, 0.0, rules)
    assert not takes_backlogged(busy, 51, 300, 0.0, rules)  # 450 + 51 > 500
    off = CapacityRules(fallback_budget=1000)
    assert takes_backlogged(busy, 600, 5000, 0.0, off)


# -- the ready reserve --

def _on(gate: Gate, tenant: str, prompt: int, endpoint: str, now: float) -> Passage:
    """A stream of one output token at most, pinned to ``endpoint``."""
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt, max_tokens=1,
                         stream=True, now=now, subset=frozenset({endpoint}))
    assert isinstance(passage, Passage)
    return passage


def _flood_held_beside_a_prefill(ready: bool) -> tuple[Gate, Passage, list[Passage]]:
    """Two 1,000-token endpoints and a reserve for a light tenant served at 0 s (its footprint
    100: 50 prompt, 50 output). B computes another tenant's 300-token prompt; the flood, pinned
    to A, is backlogged there when two of its six running requests end at 1.5 s and leave
    room for both waiting ones and the reserve."""
    rules = GateRules(capacity=CapacityRules(fallback_budget=1000, ready_reserve=ready),
                      idle_tenant_reserve=10.0)
    gate = Gate(rules, Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({A: 1000, B: 1000})
    light = gate.admit(Passage, "light", None, model="m", prompt_tokens=50, max_tokens=50,
                       stream=True, now=0.0)
    assert isinstance(light, Passage)
    gate.complete(light, Usage(50, 50, 0), "ok", 0.0)
    other = _on(gate, "other", 300, B, 1.0)
    flood = [_on(gate, "flood", 150, A, 1.0) for _ in range(8)]
    assert [p.dispatched_at for p in flood] == [1.0] * 6 + [None, None]
    for passage in flood[:6]:
        gate.charge_output(passage, 1, 1.2)  # A computes no prompt now
    for passage in flood[:2]:
        gate.complete(passage, Usage(150, 1, 0), "ok", 1.5)
    return gate, other, flood


@pytest.mark.parametrize("ready", [False, True])
def test_a_ready_reserve_is_not_kept_where_a_prefill_is_under_way(ready: bool) -> None:
    gate, other, flood = _flood_held_beside_a_prefill(ready)
    assert gate.endpoints[B].prefill_tokens == 300
    # Unready, A keeps the reserve beside the flood's next prompt (1000 - 604 - 151 >= 100).
    # Ready, A is about to compute that prompt and B is computing one: a light request would
    # wait a prefill on either, so the flood waits for B's to end.
    assert [p.dispatched_at for p in flood[6:]] == ([None, None] if ready else [1.5, 1.5])
    gate.charge_output(other, 1, 2.0)  # its first token: B can start a light request at once
    assert [p.dispatched_at for p in flood[6:]] == ([2.0, 2.0] if ready else [1.5, 1.5])


def test_a_ready_reserve_never_holds_a_light_tenants_request() -> None:
    gate, _, flood = _flood_held_beside_a_prefill(ready=True)
    assert flood[6].dispatched_at is None
    light = gate.admit(Passage, "light", None, model="m", prompt_tokens=50, max_tokens=50,
                       stream=True, now=1.6)
    assert isinstance(light, Passage) and light.dispatched_at == 1.6


def test_keeps_reserve_judges_readiness() -> None:
    rules = CapacityRules(fallback_budget=1000, ready_reserve=True)
    chosen, other = EndpointState(A), EndpointState(B)
    # The chosen endpoint is about to compute the flood's prompt: only the other counts.
    assert keeps_reserve([chosen, other], chosen, 200, 300, 0.0, rules)
    other.prefill_tokens = 1
    assert not keeps_reserve([chosen, other], chosen, 200, 300, 0.0, rules)
    assert keeps_reserve([chosen, other], chosen, 200, 300, 0.0,
                         CapacityRules(fallback_budget=1000))  # unready: room is enough
    # Alone in service, the chosen endpoint's room counts: there is nowhere readier.
    other.draining = True
    assert keeps_reserve([chosen, other], chosen, 700, 300, 0.0, rules)
    assert not keeps_reserve([chosen, other], chosen, 701, 300, 0.0, rules)
    assert keeps_reserve([chosen], chosen, 700, 300, 0.0, rules)


def test_a_ready_reserve_is_judged_on_the_room_free_now() -> None:
    """The ready endpoint needs the light request's room now (it is admitted on the blocks
    free at the engine's next step); the room its output grows into is kept at the peak,
    wherever it is. Judged at the peak on the ready endpoint too, the flood was held off it
    while its streams had room left to grow into (2 x 8k at 1 request/s: 0.779 of the
    default's tokens, 0.866 judged now)."""
    rules = CapacityRules(fallback_budget=1000, growth_room=True, ready_reserve=True)
    chosen, ready = EndpointState(A), EndpointState(B)
    ready.inflight_tokens = ready.inflight_requests = 1
    ready.inflight_tokens = 500  # its streams grow by 300 at their peak: 200 free then
    growth = {A: 0.0, B: 300.0}
    # 500 free on the ready endpoint now; the peak's 300 kept on the chosen one (1000 - 200).
    assert keeps_reserve([chosen, ready], chosen, 200, 300, 0.0, rules, 300, growth)
    # Not where it computes a prompt, nor with less than the reserve free now.
    ready.prefill_tokens = 1
    assert not keeps_reserve([chosen, ready], chosen, 200, 300, 0.0, rules, 300, growth)
    ready.prefill_tokens = 0
    ready.inflight_tokens = 701
    assert not keeps_reserve([chosen, ready], chosen, 200, 300, 0.0, rules, 300, growth)
    # Nor when no endpoint keeps the peak's room (the chosen one then grows into it).
    ready.inflight_tokens = 500
    assert not keeps_reserve([chosen, ready], chosen, 701, 300, 0.0, rules, 300, growth)
    # Nor when the pool's total is not kept.
    assert not keeps_reserve([chosen, ready], chosen, 200, 300, 0.0, rules, 1001, growth)


# -- config --

def test_the_config_keys_reach_the_gate_rules() -> None:
    config = load(PickerConfig, {"capacity": {"growthRoom": True, "maxPrefillTokens": 4096}})
    rules = capacity_rules(config)
    assert (rules.growth_room, rules.max_prefill_tokens) == (True, 4096)
    default = capacity_rules(load(PickerConfig, {}))
    assert (default.growth_room, default.max_prefill_tokens) == (False, 0)
    with pytest.raises(ConfigError, match="maxPrefillTokens"):
        load(PickerConfig, {"capacity": {"maxPrefillTokens": -1}})
    with pytest.raises(ConfigError, match="growthRoom"):
        load(PickerConfig, {"capacity": {"growthRoom": "yes"}})
    ready = load(PickerConfig, {"capacity": {"idleTenantReserve": "10s", "readyReserve": True}})
    assert capacity_rules(ready).ready_reserve and not default.ready_reserve
    with pytest.raises(ConfigError, match="readyReserve"):
        load(PickerConfig, {"capacity": {"readyReserve": True}})


@pytest.mark.parametrize("growth_room", [False, True])
def test_growth_room_sends_a_light_request_where_its_prefill_starts_soonest(
        growth_room: bool) -> None:
    rules = GateRules(capacity=CapacityRules(fallback_budget=1000, growth_room=growth_room))
    gate = Gate(rules, Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({A: 1000, B: 1000})
    prefilling = _admit(gate, "p", 100)  # to A; its prompt is still being computed
    decoding = _admit(gate, "q", 400)  # to B, the emptier one then
    gate.charge_output(decoding, 1)
    assert (prefilling.endpoint.address, decoding.endpoint.address) == (A, B)  # type: ignore
    light = _admit(gate, "light", 50)
    # A has more room; B has no prompt outstanding.
    assert light.endpoint is not None and light.endpoint.address == (B if growth_room else A)


# -- growth room at the peak of an endpoint's use --

def _staggered(gate: Gate) -> list[Passage]:
    """Five flood requests left running, 100-token prompts expected to grow to 200 each, at
    every stage of their output (0, 20, 40, 60, 80 tokens written): 700 tokens held, 1,000
    projected, five more waiting."""
    running, waiting = _backlog(gate)
    for passage in running[5:]:
        gate.complete(passage, Usage(100, 0, 0), "ok", 1.0)
    assert all(p.dispatched_at is None for p in waiting)  # the five at the same stage: 1,000
    for written, passage in zip((0, 20, 40, 60, 80), running[:5], strict=True):
        for _ in range(written):
            gate.charge_output(passage, 1)
    endpoint = gate.endpoints[A]
    assert (endpoint.inflight_tokens, endpoint.projected_tokens) == (700, 1000)
    return waiting


def test_growth_room_judges_the_peak_of_use_as_requests_grow_and_end() -> None:
    """The sum of the running requests' expected sizes says 1,000 (no room); but the one 80
    tokens in ends 20 steps from now, before the others have grown by much: their use peaks
    at 800 (the four that remain, 20 steps on), 920 with one more request of 200 beside them
    (just before the one 80 tokens in ends), 1,040 with two."""
    gate = _gate(growth_room=True)
    waiting = _staggered(gate)
    gate.pump(2.0)
    assert [p.dispatched_at for p in waiting] == [2.0, None, None, None, None]


def test_peak_growth() -> None:
    assert peak_growth([]) == 0
    assert peak_growth([(100, 100)]) == 100  # alone: grows to its end
    assert peak_growth([(0, 50)]) == 0  # at its end now
    # Staggered: (rest, held) 100/100, 80/120, 60/140, 40/160, 20/180 peaks at 800 (700 now).
    assert peak_growth([(20, 180), (60, 140), (100, 100), (40, 160), (80, 120)]) == 100
    # The same stage: all grow to the end together.
    assert peak_growth([(50, 150)] * 3) == 150


@pytest.mark.parametrize("growing", [
    [], [(100, 100)], [(0, 50)], [(50, 150)] * 3,
    [(20, 180), (60, 140), (100, 100), (40, 160), (80, 120)],
    [(7, 3), (7, 3), (0, 9), (12, 1), (3, 40), (60, 0)]])
@pytest.mark.parametrize("joining", [(0, 0), (60, 140), (7, 3), (7, 2), (200, 50), (1, 500)])
def test_peak_growth_with_a_request_joining_sorts_once_and_agrees(
        growing: list[tuple[int, int]], joining: tuple[int, int]) -> None:
    assert peak_growth_with(growing, joining) == (peak_growth(growing),
                                                  peak_growth([*growing, joining]))


def test_running_registry_is_kept_only_with_the_growth_room() -> None:
    gate = _gate()
    running, _ = _backlog(gate)
    assert gate._running is None  # the default: nothing to maintain a request
    gate.set_rules(GateRules(capacity=CapacityRules(fallback_budget=1000, growth_room=True)))
    assert gate._running is not None and set(gate._running[A]) == set(running)
    gate.complete(running[0], Usage(100, 0, 0), "ok", 1.0)
    assert running[0] not in gate._running[A]
    gate.set_rules(GateRules(capacity=CapacityRules(fallback_budget=1000)))
    assert gate._running is None


def test_non_streaming_and_overrunning_requests_hold_what_they_hold() -> None:
    gate = _gate(growth_room=True)
    whole = _admit(gate, "a", 300, stream=False)  # 300 + 100 reserved at dispatch
    over = _admit(gate, "b", 100)
    for _ in range(150):  # past its expected 100
        gate.charge_output(over, 1)
    assert gate._peak_growth(A) == 0
    assert peak_growth_with(gate._growing(A), (100, 100)) == (0, 100)
    gate.complete(whole, Usage(300, 100, 0), "ok", 3.0)
    gate.complete(over, Usage(100, 150, 0), "ok", 3.0)
    assert not gate._running
