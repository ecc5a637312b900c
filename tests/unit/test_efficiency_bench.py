"""bench.efficiency's reading of the traces: which steps are held room, and whose fault; and
picker.core.holds, which names the condition of has_room that holds a request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.efficiency import (
    FIRST_SEED,
    LARGE_SHAPES,
    SHAPES,
    Cell,
    Trace,
    cause_of,
    expand_matrix,
    goal_rows,
    goal_summary,
    goals_report,
    held_room,
    lag,
    light_p95,
    resim_report,
    shape_traffic,
)
from picker.core.holds import OWN_COUNT, ROOM, SCRAPED_KV, WAITING, hold_reason
from picker.core.selection import CapacityRules, EndpointState
from picker.sim.load import RequestRecord

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


def test_the_issues_goal_matrix_expands_to_80_cells_with_alternating_orders() -> None:
    cells = expand_matrix(SHAPES, ("open", "closed"), ("fcfs", "priority"), (2, 4), 3,
                          ("meter-stream", "inline", "access-log"))
    # 2 sizes x 2 loops x 2 engine policies x 2 pool sizes: 16 cells, three seeds on the meter
    # stream, one each on the inline and access-log paths.
    assert len(cells) == 16 * 3 + 16 * 2
    assert len({cell for cell, _ in cells}) == len(cells)
    stream = [(c, o) for c, o in cells if c.response_path == "meter-stream"]
    assert {c.seed for c, _ in stream} == {FIRST_SEED, FIRST_SEED + 1, FIRST_SEED + 2}
    assert {c.seed for c, _ in cells if c.response_path != "meter-stream"} == {FIRST_SEED}
    for cell, order in stream:
        first = "pass-through" if (cell.seed - FIRST_SEED) % 2 == 0 else "default"
        assert order[0] == first and set(order) == {"pass-through", "default"}
    # Without the meter stream in the matrix, a path runs every seed asked for.
    assert len(expand_matrix(SHAPES[:1], seeds=3, paths=("inline",))) == 3


def test_cell_names_keep_the_default_invocations_rows() -> None:
    assert Cell(SHAPES[0]).name == "8k"
    cell = Cell(SHAPES[1], "closed", "priority", 4, FIRST_SEED + 2, "access-log")
    assert cell.name == "64k, closed loop, priority engines, 4 endpoints, access-log, seed 29"
    assert cell.group == "64k, closed loop, priority engines, 4 endpoints, access-log"


def test_closed_loop_traffic_keeps_the_pool_above_capacity() -> None:
    two = shape_traffic(SHAPES[0], 1.0, loop="closed", endpoints=2, duration_s=10)
    four = shape_traffic(SHAPES[0], 1.0, loop="closed", endpoints=4)
    assert [(t.name, t.backlog, t.rate) for t in two.tenants] == [("light", 2, 0.0),
                                                                  ("flood", 64, 0.0)]
    assert [t.backlog for t in four.tenants] == [2, 128]
    assert two.duration_s == 10
    opened = shape_traffic(SHAPES[0], 2.0, seed=28)
    assert [t.rate for t in opened.tenants] == [1.5, 15.0] and opened.seed == 28


def test_large_pools_scale_the_flood_with_the_pool() -> None:
    # The simulator's goal pools: heavy 15 requests/s per endpoint and light 1.5 (the issue's
    # 30 and 3 on 2 endpoints), closed loop 32 open per endpoint per 64k of cache.
    large = {shape.name: shape for shape in LARGE_SHAPES}
    assert [t.rate for t in shape_traffic(large["500k"], 1.0, endpoints=8).tenants] == [12, 120]
    closed = shape_traffic(large["256k"], 1.0, loop="closed", endpoints=4)
    assert [t.backlog for t in closed.tenants] == [2, 4 * 128]
    assert large["500k"].closed_heavy_per_endpoint == 244
    # The issue's own shapes keep 30 and 3 on any pool.
    assert [t.rate for t in shape_traffic(SHAPES[1], 1.0, endpoints=4).tenants] == [3, 30]


def _record(start: float, ttft: float | None, end: float | None,
            tenant: str = "light") -> RequestRecord:
    return RequestRecord(tenant=tenant, seq=0, kind="open", api="completions", stream=True,
                         scheduled_s=start, start_s=start, ttft_s=ttft, end_s=end,
                         drawn_prompt_tokens=800, max_tokens=200)


def test_light_p95_counts_a_request_without_a_first_token_as_its_wait_so_far() -> None:
    records = [_record(5.0 + i * 0.1, 0.1, 6.0) for i in range(18)]
    records += [_record(6.0, None, None),  # open at the cut (11 s): waited 5 s so far
                _record(7.0, None, 8.0),  # ended without a token after 1 s
                _record(1.0, 9.0, 10.0),  # sent in the warm-up: not counted
                _record(6.0, 9.0, 10.0, tenant="flood")]
    got = light_p95(records, (5.0, 10.0), cut_s=11.0)
    assert got["samples"] == 20 and got["bounds"] == 2
    assert got["p50_ms"] == pytest.approx(100.0)
    assert got["p95_ms"] is not None and got["p95_ms"] >= 1000.0
    # Closed loop: also the request sent in the warm-up and still waiting at 5 s (9 s wait).
    closed = light_p95(records, (5.0, 10.0), cut_s=11.0, waiting_inside=True)
    assert closed["samples"] == 21 and closed["p95_ms"] > got["p95_ms"]


def _size(pt: float, default: float, group: str, seed: int) -> dict[str, Any]:
    def mode(tokens: float, p95: float) -> dict[str, Any]:
        return {"tokens_per_s": tokens, "light": {"p95_ms": p95}, "loadavg": [1.0, 2.0, 3.0]}

    return {"ratio": default / pt, "order": ["pass-through", "default"],
            "cell": {"group": group, "seed": seed},
            "modes": {"pass-through": mode(pt, 900.0), "default": mode(default, 300.0)}}


def test_goal_table_arithmetic() -> None:
    data = {"sizes": {"8k": _size(1000.0, 990.0, "8k", 27),
                      "8k, seed 28": _size(1000.0, 970.0, "8k", 28),
                      "64k": _size(800.0, 808.0, "64k", 27)}}
    rows = goal_rows(data)
    assert [(r["goal"], r["stretch"]) for r in rows] == [(True, False), (False, False),
                                                        (True, True)]
    assert rows[0]["light_p95_ms"] == {"pass-through": 900.0, "default": 300.0}
    summary = {g["group"]: g for g in goal_summary(rows)}
    assert summary["8k"]["runs"] == 2 and summary["8k"]["goal_met"] == 1
    assert summary["8k"]["min"] == pytest.approx(0.97)
    assert summary["8k"]["mean"] == pytest.approx(0.98)
    assert summary["64k"]["stretch_met"] == 1
    # The simulator's ratio beside Envoy's: 2.0 % off is within the 3 % of issue 27 point 4,
    # 3.1 % is not (bold), none given is a dash.
    data["sizes"]["8k"]["simulator"] = {"ratio": 0.99 * 1.02}
    data["sizes"]["8k, seed 28"]["simulator"] = {"ratio": 1.0}
    text = "\n".join(goals_report(data))
    assert "| 8k | 27 | pass-through first | 1000 | 990 | 0.990 | yes | no | 1.010 | +2.0% | " \
        "900 | 300 |" in text
    assert "| 8k | 28 | pass-through first | 1000 | 970 | 0.970 | **no** | no | 1.000 | " \
        "**+3.1%** | 900 | 300 |" in text
    assert "| 64k | 27 | pass-through first | 800 | 808 | 1.010 | yes | yes | – | – | 900 |" in text
    assert "within 3% of Envoy's in 1 of 2 runs" in text


def test_resim_report_counts_the_runs_within_three_percent() -> None:
    tokens = {"pass-through": 1000.0, "default": 1000.0}
    rows = {"8k": {"seed": 27, "envoy": 0.96, "recorded": 1.00, "now": 0.98,
                   "envoy_tokens_per_s": tokens, "tokens_per_s": tokens},
            "64k": {"seed": 27, "envoy": 1.00, "recorded": 1.05, "now": 0.99,
                    "envoy_tokens_per_s": tokens, "tokens_per_s": tokens}}
    text = "\n".join(resim_report(rows, "goals/efficiency.json", "--resim x", ([1.0], [2.0]),
                                  (0.0, 0.0)))
    # Then: 4.2 % and 5.0 % off, neither within; now: 2.1 % and 1.0 %, both.
    assert "Simulator then: within 3% of Envoy in 0 of 2 runs" in text
    assert "Simulator now: within 3% of Envoy in 2 of 2 runs, difference mean 1.5%" in text
    assert "| 8k | 27 | 0.960 | 1.000 | **+4.2%** | 0.980 | +2.1% |" in text
