"""Prefill the picker cannot see end (``Gate.scraped``, ``still_waiting``).

On the access-log response path no first token comes back before a request ends, so a stream's
prompt would count as outstanding prefill for its whole life and hold a backlogged tenant behind
``capacity.maxPrefillTokens`` and ``readyReserve`` for as long. Does a read of the engine end the
prefill of every such stream it shows out of the engine's waiting queue, keep the ones it may
still hold (those vLLM serves last), leave alone what the read cannot have seen and the streams
whose first token the picker does see, and let the request a bound held go?
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage, still_waiting
from picker.core.selection import CapacityRules

A = "10.0.0.1:8000"


def _gate(**capacity: Any) -> Gate:
    rules = GateRules(capacity=CapacityRules(fallback_budget=10_000, **capacity))
    gate = Gate(rules, Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({A: 10_000})
    return gate


def _send(gate: Gate, tenant: str, prompt: int, now: float, *, seen: bool = False) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=True, now=now, output_seen=seen)
    assert isinstance(passage, Passage)
    return passage


def _read(gate: Gate, waiting: float | None, sent_at: float, now: float) -> None:
    gate.scraped(gate.endpoints[A], waiting, 1.0, 0.1, None, sent_at=sent_at, now=now)


# -- which requests an engine still holds --

def _sent(priorities: list[int | None]) -> list[Passage]:
    passages = []
    for i, priority in enumerate(priorities):
        passage = Passage(tenant="t", lane="default", request=None,  # type: ignore[arg-type]
                          arrived_at=float(i), model="m", body_prompt_tokens=1,
                          body_max_tokens=None, stream=True)
        passage.dispatched_at, passage.engine_priority = float(i), priority
        passages.append(passage)
    return passages


def _brute_force(sent: list[Passage], waiting: float) -> set[Passage]:
    """The ``waiting`` requests vLLM serves last: every set of that size whose members no
    outsider follows in (priority, arrival) order."""
    count = min(len(sent), max(0, -int(-waiting // 1)))

    def key(p: Passage) -> tuple[int, float]:
        return (p.engine_priority or 0, p.dispatched_at or 0.0)

    for chosen in itertools.combinations(sent, count):
        outside = [p for p in sent if p not in chosen]
        if all(key(o) < key(c) for o in outside for c in chosen):
            return set(chosen)
    raise AssertionError("no set is served last")


def test_still_waiting_are_the_latest_sent_to_an_fcfs_engine() -> None:
    sent = _sent([None] * 5)
    assert still_waiting(sent, 2) == set(sent[3:])
    assert still_waiting(sent, 0.4) == {sent[4]}  # a count between reads rounds up
    assert still_waiting(sent, 0) == set()
    assert still_waiting(sent, 9) == set(sent)


def test_still_waiting_are_the_worst_priority_first() -> None:
    # vLLM serves the lower priority value first: 5 waits longest, then 1 (the later one).
    sent = _sent([1, 5, 0, 1, 0])
    assert still_waiting(sent, 1) == {sent[1]}
    assert still_waiting(sent, 3) == {sent[1], sent[3], sent[0]}


@pytest.mark.parametrize("seed", range(40))
def test_still_waiting_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    sent = _sent([rng.choice([None, 0, 1, 2]) for _ in range(rng.randint(0, 7))])
    waiting = rng.choice([0, 0.5, 1, 2, 3, 10])
    assert still_waiting(sent, waiting) == _brute_force(sent, waiting)


# -- reads of the engine end the prefill --

def test_a_read_ends_the_prefill_of_all_but_the_waiting_count() -> None:
    gate = _gate()
    streams = [_send(gate, "t", 100 * (i + 1), now=0.1 * i) for i in range(4)]
    endpoint = gate.endpoints[A]
    assert endpoint.prefill_tokens == 100 + 200 + 300 + 400
    # The read went out after the third was sent: the fourth may not have reached the engine.
    _read(gate, waiting=1, sent_at=0.25, now=0.3)
    assert [s.prefilling for s in streams] == [False, False, True, True]
    assert endpoint.prefill_tokens == 300 + 400
    _read(gate, waiting=0, sent_at=0.4, now=0.45)
    assert endpoint.prefill_tokens == 0 and not any(s.prefilling for s in streams)
    # Ending them later settles nothing twice.
    for stream in streams:
        gate.complete(stream, Usage(stream.request.prompt_tokens, 5, 0), "ok", 1.0)
    assert (endpoint.prefill_tokens, endpoint.inflight_requests) == (0, 0)


def test_a_read_without_a_waiting_count_ends_nothing() -> None:
    gate = _gate()
    stream = _send(gate, "t", 300, now=0.0)
    _read(gate, waiting=None, sent_at=1.0, now=1.0)
    assert stream.prefilling and gate.endpoints[A].prefill_tokens == 300


def test_streams_whose_tokens_the_picker_sees_wait_for_their_first_token() -> None:
    gate = _gate()
    seen, unseen = _send(gate, "t", 300, 0.0, seen=True), _send(gate, "u", 200, 0.0)
    _read(gate, waiting=0, sent_at=1.0, now=1.0)
    assert (seen.prefilling, unseen.prefilling) == (True, False)
    assert gate.endpoints[A].prefill_tokens == 300
    gate.charge_output(seen, 1, 1.1)
    assert gate.endpoints[A].prefill_tokens == 0


def test_ended_streams_are_forgotten_at_once() -> None:
    """An endpoint whose engine is never read (no metrics page) holds no ended stream."""
    gate = _gate()
    first, second = _send(gate, "t", 300, 0.0), _send(gate, "u", 200, 0.0)
    gate.complete(first, None, "cancelled", 0.5)
    assert gate.endpoints[A].prefill_tokens == 200
    assert list(gate._unseen_prefill[A]) == [second]
    _read(gate, waiting=0, sent_at=1.0, now=1.0)
    assert gate.endpoints[A].prefill_tokens == 0 and not second.prefilling
    assert not gate._unseen_prefill[A]


def test_a_prefill_bound_lets_what_it_held_go_once_a_read_shows_the_prompts_taken_in() -> None:
    gate = _gate(max_prefill_tokens=250)
    gate.set_endpoints({A: 1000})
    # Ten 100-token prompts fill the endpoint (each arrived alone, so it went); five wait.
    flood = [_send(gate, "flood", 100, now=0.0) for _ in range(15)]
    running, waiting = flood[:10], flood[10:]
    assert all(p.dispatched_at == 0.0 for p in running)
    for passage in running[:3]:
        gate.complete(passage, Usage(100, 1, 0), "ok", 1.0)
    # Room for three, but no first token will say the other seven prompts are computed.
    assert all(p.dispatched_at is None for p in waiting)
    assert gate.endpoints[A].prefill_tokens == 700
    _read(gate, waiting=0, sent_at=1.1, now=1.2)
    gate.pump(1.2)
    # Nothing outstanding: the first goes whatever its size, the second fits (200), the third
    # would make 300.
    assert [p.dispatched_at for p in waiting] == [1.2, 1.2, None, None, None]
    # The engine has taken one of the two in: the other, sent last, still counts.
    _read(gate, waiting=1, sent_at=1.3, now=1.4)
    assert [p.prefilling for p in waiting[:2]] == [False, True]
    gate.pump(1.4)
    assert [p.dispatched_at for p in waiting] == [1.2, 1.2, 1.4, None, None]
