"""bench.efficiency's reading of the traces: which steps are held room, and whose fault; and
picker.core.holds, which names the condition of has_room that holds a request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.efficiency import Trace, cause_of, held_room, lag
from picker.core.holds import OWN_COUNT, ROOM, SCRAPED_KV, WAITING, hold_reason
from picker.core.selection import CapacityRules, EndpointState

A = "127.0.0.1:1"


def step(t0: float, run: int, wait: int = 0, kv: int = 100, fin: int = 0) -> dict[str, Any]:
    return {"t0": t0, "s0": t0, "t": t0 + 0.01, "run": run, "wait": wait, "kv": kv, "kvt": 512,
            "pre": 0, "dec": run, "arr": 0, "fin": fin}


def view(t: float, why: str, queued: int = 5, head: int = 800) -> dict[str, Any]:
    return {"t": t, "q": queued, "head": head, "eps": [{"a": A, "why": why}]}


@pytest.mark.parametrize(("counts", "why", "cause"), [
    ((3, 2, 0, 0), "own_count", "dispatch to engine"),
    ((2, 2, 0, 0), "room", "rule or fair order"),
    ((2, 2, 0, 0), "waiting", "waiting threshold"),
    ((2, 2, 1, 0), "own_count", "completion seen late"),
    ((2, 2, 1, 0), "scraped_kv", "completion seen late"),
    ((2, 2, 1, 1), "scraped_kv", "scrape lag"),
    ((2, 2, 1, 1), "own_count", "own count"),
])
def test_cause_order(counts: tuple[int, int, int, int], why: str, cause: str) -> None:
    assert cause_of(*counts, why) == cause


def test_held_room_steps_and_their_loss() -> None:
    # Four steps of 10 ms, each judged as the engine stood after the one before. The second:
    # 8,192 - 1,600 tokens free, nothing waiting, the picker holds 5 with an 800-token head:
    # held room (a finished request the picker has not seen: completion seen late). The third:
    # the engine queues one, not held room. The fourth: the picker holds nothing.
    steps = [step(0.00, 8, fin=1), step(0.01, 8, wait=1, fin=1), step(0.02, 9, fin=1),
             step(0.03, 9, fin=1)]
    engine = Trace(steps, {})
    picker = Trace([view(0.0, "own_count"), view(0.025, "own_count"),
                    view(0.029, "own_count", queued=0)], {})
    got = held_room(engine, picker, A, (0.0, 1.0), 0.01, full_running=10.0)
    assert got["seconds"]["completion seen late"] == pytest.approx(0.01)
    assert sum(got["seconds"].values()) == pytest.approx(0.01)
    # Pass-through ran 10 a step, this one 8 (as the engine stood before it).
    assert got["lost_tokens"]["completion seen late"] == pytest.approx(2.0)
    assert got["intervals"] == [(pytest.approx(0.01), pytest.approx(0.02),
                                 "completion seen late")]


def test_no_held_room_when_the_head_does_not_fit() -> None:
    steps = [step(0.00, 8, kv=500), step(0.01, 8, kv=500)]  # 12 blocks free: 192 tokens
    got = held_room(Trace(steps, {}), Trace([view(0.0, "own_count")], {}), A, (0.0, 1.0),
                    0.01, full_running=10.0)
    assert sum(got["seconds"].values()) == 0


def test_lag_pairs_the_nth_events_inside_the_window() -> None:
    assert lag([1.0, 2.0, 9.0], [1.1, 2.3, 9.5], (0.0, 5.0)) == pytest.approx(0.2)
    assert lag([], [1.0], (0.0, 5.0)) is None


def test_hold_reason_names_the_condition() -> None:
    rules = CapacityRules(fallback_budget=1000, max_waiting=2, stale_after=1.0)
    endpoint = EndpointState(A, inflight_tokens=600, inflight_requests=2)
    assert hold_reason(endpoint, 0.0, rules, 300) == ROOM
    assert hold_reason(endpoint, 0.0, rules, 500) == OWN_COUNT
    endpoint.kv_usage, endpoint.scraped_at, endpoint.inflight_at_scrape = 0.9, 0.0, 600
    assert hold_reason(endpoint, 0.5, rules, 300) == SCRAPED_KV
    endpoint.kv_usage, endpoint.waiting = 0.1, 2.0
    assert hold_reason(endpoint, 0.5, rules, 300) == WAITING
    endpoint.completed_since_scrape = 1  # one finished since the scrape: one fewer waits
    assert hold_reason(endpoint, 0.5, rules, 300) == ROOM


def test_picker_trace_line_and_events() -> None:
    from types import SimpleNamespace

    from picker.config.schema import PickerConfig
    from picker.config.strict import load
    from picker.dispatch import Dispatcher
    from picker.dispatch.trace import PickerTrace

    dispatcher = Dispatcher(load(PickerConfig, {"endpoints": [{"address": A}]}),
                            clock=lambda: 5.0)
    trace = PickerTrace(dispatcher, Path("unused"))
    ticket: Any = SimpleNamespace(endpoint=SimpleNamespace(address=A))
    trace.dispatched(ticket, 4.0)
    trace.settled(ticket, 4.5)
    line = trace.line()
    # Nothing queued: no head, no reason; the counts of what was sent and seen end there.
    assert line["t"] == 5.0 and line["q"] == 0 and line["head"] is None
    (endpoint,) = line["eps"]
    assert endpoint["a"] == A and endpoint["why"] is None
    assert endpoint["d"] == 1 and endpoint["s"] == 1
    assert trace.events == ['{"ev":"d","t":4.00000,"a":"127.0.0.1:1"}\n',
                            '{"ev":"s","t":4.50000,"a":"127.0.0.1:1"}\n']
