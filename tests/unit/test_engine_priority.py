"""Fairness-driven engine priority and dispatching for the engine to preempt (``picker.core.gate``,
``scheduling.enginePolicy: priority``), driven through the pure gate."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.build import admission_rules, endpoint_budgets, gate_rules
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import Usage
from picker.core.admission import Admission
from picker.core.gate import Gate, Passage
from picker.dispatch.dispatcher import Dispatcher
from picker.errors import ConfigError

A = "10.0.0.1:8000"


def _config(engine_policy: str = "priority", preempt: bool = True,
            lanes: list[dict[str, Any]] | None = None, budget: int = 1000) -> PickerConfig:
    return load(PickerConfig, {
        "endpoints": [{"address": A}],
        "capacity": {"kvBudgetTokens": budget},
        "scheduling": {"enginePolicy": engine_policy, "preempt": preempt},
        "lanes": lanes or [{"name": "default"}],
    })


def _gate(config: PickerConfig) -> Gate:
    gate = Gate(gate_rules(config), Dispatcher._new_scheduler(None, config),  # type: ignore[arg-type]
                Admission(*admission_rules(config)), now=0.0)
    gate.set_endpoints(endpoint_budgets(config))
    return gate


def _admit(gate: Gate, tenant: str, prompt: int = 100, *, lane: str | None = None,
           now: float = 0.0) -> Passage:
    passage = gate.admit(Passage, tenant, lane, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=True, now=now)
    assert isinstance(passage, Passage)
    return passage


def _flood(gate: Gate, count: int = 40, tenant: str = "flood",
           lane: str | None = None) -> list[Passage]:
    """A backlogged tenant: far more requests than the endpoint holds (1000 tokens, 200 each).
    Its first request left with nothing running (its lane's base priority); the next ones left
    while it held all the lane's running work, its whole share (the flood standing). They
    finish, and the endpoint fills with requests that left while it was backlogged."""
    sent = [_admit(gate, tenant, lane=lane) for _ in range(count)]
    first = [p for p in sent if p.dispatched_at is not None]
    base = gate.engine_priority(sent[0].lane)
    assert base is not None and len(first) > 1
    assert [p.engine_priority for p in first] == [base] + [base + 1] * (len(first) - 1)
    for passage in first:
        gate.complete(passage, Usage(100, 100, 0), "ok", 0.0)
    left = [p for p in sent if p.outcome is None]
    assert {p.engine_priority for p in left if p.dispatched_at is not None} \
        == {gate.engine_priority(first[0].lane) + 1}  # type: ignore[operator]
    return left


def test_light_tenant_gets_a_better_engine_priority_than_a_backlogged_one() -> None:
    gate = _gate(_config(preempt=False))
    flood = _flood(gate)
    running = [p for p in flood if p.dispatched_at is not None]
    assert running and len(running) < len(flood)
    # The flood was backlogged (several waiting) when each of these left.
    assert {p.engine_priority for p in running} == {1}
    light = _admit(gate, "light", now=1.0)
    assert light.dispatched_at is None  # no room, and no preemption: it waits
    head = next(p for p in flood if p.dispatched_at is None)
    assert (gate.engine_priority_for(light), gate.engine_priority_for(head)) == (0, 1)
    gate.drop(head, "cancelled", 1.0)
    gate.complete(running[0], Usage(100, 100, 0), "ok", 1.0)
    gate.complete(running[1], Usage(100, 100, 0), "ok", 1.0)
    assert light.dispatched_at == 1.0 and light.engine_priority == 0


def test_an_uncontended_tenant_runs_at_its_lanes_base() -> None:
    gate = _gate(_config(lanes=[{"name": "online"}, {"name": "batch"}]))
    first = _admit(gate, "a", lane="online")
    second = _admit(gate, "b", lane="batch")
    assert (first.engine_priority, second.engine_priority) == (0, 2)


def test_lanes_configured_priorities_are_the_base() -> None:
    gate = _gate(_config(lanes=[{"name": "online", "enginePriority": 10},
                                {"name": "batch", "enginePriority": 20}]))
    assert _admit(gate, "b", lane="batch").engine_priority == 20
    assert gate.engine_priority("online") == 10


def test_fcfs_engines_get_the_lanes_priority_only() -> None:
    gate = _gate(_config(engine_policy="fcfs"))
    flood = [_admit(gate, "flood") for _ in range(40)]
    for passage in [p for p in flood if p.dispatched_at is not None]:
        gate.complete(passage, Usage(100, 100, 0), "ok", 0.0)
    assert {p.engine_priority for p in flood if p.dispatched_at is not None} == {None}


def test_a_light_request_goes_to_a_full_endpoint_the_engine_preempts_for() -> None:
    gate = _gate(_config())
    flood = _flood(gate)
    held = sum(p.reserved_tokens for p in flood if p.dispatched_at is not None)
    light = _admit(gate, "light", prompt=150)
    assert light.dispatched_at is not None and light.preempting
    assert light.engine_priority == 0
    assert gate.endpoints[A].inflight_tokens == held + 150  # past the budget, by design


def test_without_preempt_the_light_request_waits_for_room() -> None:
    gate = _gate(_config(preempt=False))
    _flood(gate)
    light = _admit(gate, "light", prompt=150)
    assert light.dispatched_at is None


def test_a_backlogged_request_is_never_sent_for_preemption() -> None:
    gate = _gate(_config())
    flood = _flood(gate)
    assert not any(p.preempting for p in flood)
    assert any(p.dispatched_at is None for p in flood)


def test_preemption_is_bounded_by_what_worse_requests_hold() -> None:
    gate = _gate(_config())
    flood = _flood(gate)
    held = sum(p.reserved_tokens for p in flood if p.dispatched_at is not None)
    # Light tenants, each with one request: together they may claim what the flood holds.
    sent = [_admit(gate, f"light-{i}", prompt=150) for i in range(held // 150 + 3)]
    preempting = [p for p in sent if p.dispatched_at is not None]
    assert preempting and all(p.preempting for p in preempting)
    assert sum(p.reserved_tokens for p in preempting) <= held
    assert any(p.dispatched_at is None for p in sent)


def test_a_higher_lanes_request_preempts_a_lower_lanes() -> None:
    gate = _gate(_config(lanes=[{"name": "online"}, {"name": "batch"}]))
    batch = _flood(gate, tenant="b", lane="batch")
    assert {p.engine_priority for p in batch if p.dispatched_at is not None} == {3}
    online = _admit(gate, "o", lane="online")
    assert online.preempting and online.engine_priority == 0


@pytest.mark.parametrize(("lanes", "path"), [
    ([{"name": "a", "enginePriority": 0}, {"name": "b"}], "lanes[1].enginePriority"),
    ([{"name": "a", "enginePriority": 0}, {"name": "b", "enginePriority": 1}],
     "lanes[1].enginePriority"),
])
def test_lane_priorities_must_leave_room_for_the_standing(lanes: list[dict[str, Any]],
                                                          path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(lanes=lanes)
    assert path in str(caught.value)


def test_a_tenant_served_ahead_cannot_trickle_into_the_light_standing() -> None:
    """A hostile tenant sends one request at a time so that it is never backlogged: once it has
    been served more than a request ahead of the lane's floor, its requests get the backlogged
    standing and are no longer sent for the engine to preempt others."""
    gate = _gate(_config())
    _flood(gate)
    first = _admit(gate, "trickle", prompt=100)
    assert first.preempting and first.engine_priority == 0
    gate.charge_output(first, 2000)  # it streams far more than the flood got meanwhile
    second = _admit(gate, "trickle", prompt=100)
    assert second.dispatched_at is None  # waits for room like the flood
    assert gate.engine_priority_for(second) == 1


def test_a_light_tenant_with_two_requests_waiting_keeps_the_light_standing() -> None:
    """Two requests of a light tenant arriving together make it backlogged for a moment; it
    still holds none of the running work, so both keep the light standing."""
    gate = _gate(_config(preempt=False))
    flood = _flood(gate)
    first = _admit(gate, "light", now=1.0)
    second = _admit(gate, "light", now=1.0)
    assert first.dispatched_at is None and second.dispatched_at is None  # no room: both wait
    head = next(p for p in flood if p.dispatched_at is None)
    assert [gate.engine_priority_for(p) for p in (first, second, head)] == [0, 0, 1]
    for passage in [p for p in flood if p.dispatched_at is None]:
        gate.drop(passage, "cancelled", 1.0)
    for passage in [p for p in flood if p.outcome is None][:2]:
        gate.complete(passage, Usage(100, 100, 0), "ok", 1.0)
    assert (first.engine_priority, second.engine_priority) == (0, 0)


def test_a_tenant_holding_its_share_loses_the_light_standing_with_an_empty_queue() -> None:
    """A flood whose queue has just emptied still holds the running work: what it sends next
    goes at the flood standing, below a newcomer's."""
    gate = _gate(_config(budget=100_000))
    running = [_admit(gate, "flood") for _ in range(5)]
    assert all(p.dispatched_at is not None for p in running)  # room for all: never backlogged
    assert [p.engine_priority for p in running] == [0, 1, 1, 1, 1]
    assert _admit(gate, "newcomer").engine_priority == 0


def _unset_preempt(**capacity: Any) -> PickerConfig:
    return load(PickerConfig, {"endpoints": [{"address": A}],
                               "capacity": {"kvBudgetTokens": 1000, **capacity},
                               "scheduling": {"enginePolicy": "priority"}})


def test_the_default_holds_a_light_request_rather_than_send_it_for_preemption() -> None:
    # vLLM admits a request sent for preemption with the blocks of the flood request it
    # preempts, which then recomputes its whole prompt: the work-conserving default waits.
    config = _unset_preempt()
    assert config.scheduling.preempt is False and gate_rules(config).preempt is False
    gate = _gate(config)
    _flood(gate)
    light = _admit(gate, "light", prompt=150)
    assert light.dispatched_at is None and not light.preempting


def test_the_isolation_profile_keeps_sending_for_preemption() -> None:
    # What the gate then does with it:
    # test_a_light_request_goes_to_a_full_endpoint_the_engine_preempts_for.
    config = _unset_preempt(profile="isolation")
    assert config.scheduling.preempt is True and gate_rules(config).preempt is True


def test_preempt_written_out_wins_over_the_profile() -> None:
    on = load(PickerConfig, {"scheduling": {"enginePolicy": "priority", "preempt": True}})
    off = load(PickerConfig, {"capacity": {"profile": "isolation"},
                              "scheduling": {"enginePolicy": "priority", "preempt": False}})
    assert (on.scheduling.preempt, off.scheduling.preempt) == (True, False)
