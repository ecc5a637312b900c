"""The what-if replay's fast mode (``picker.whatif.fast``, ``--fast``; issue 29's speed goal):
a request's finish fixed at its dispatch on its endpoint's clock, a batch past its cache slowed,
the gate's fair order and budgets deciding as in the exact replay, and memory held by the
requests in flight only, not by the log."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import Request, Scheduler
from picker.sim.pool import PoolSpec
from picker.whatif.__main__ import main
from picker.whatif.fast import (
    MAX_ATTRIBUTES,
    FastReplay,
    _Endpoint,
    _Flow,
    replay_fast,
    unmodelled,
)
from picker.whatif.log import Arrival
from picker.whatif.replay import ReplayResult, replay
from tests.unit.test_whatif_log import record, write


class Capture(ReplayResult):
    """A result that also keeps each request's figures (the replay itself keeps none)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records: list[SimpleNamespace] = []

    def add_fields(self, tenant: str, lane: str, outcome: str, demoted: bool,
                   arrival_s: float, dispatched_s: float | None, first_token_s: float | None,
                   end_s: float | None, prompt_tokens: int, completion_tokens: int) -> None:
        self.records.append(SimpleNamespace(
            tenant=tenant, outcome=outcome, arrival_s=arrival_s, dispatched_s=dispatched_s,
            first_token_s=first_token_s, end_s=end_s, completion_tokens=completion_tokens))
        super().add_fields(tenant, lane, outcome, demoted, arrival_s, dispatched_s,
                           first_token_s, end_s, prompt_tokens, completion_tokens)


def captured(monkeypatch: pytest.MonkeyPatch) -> list[Capture]:
    made: list[Capture] = []

    def build(**kwargs: Any) -> Capture:
        made.append(Capture(**kwargs))
        return made[-1]

    monkeypatch.setattr("picker.whatif.fast.ReplayResult", build)
    monkeypatch.setattr("picker.whatif.replay.ReplayResult", build)
    return made


def config(tenants: list[dict[str, Any]], kv: int = 4096, **sections: Any) -> PickerConfig:
    return load(PickerConfig, {"capacity": {"kvBudgetTokens": kv}, "tenants": tenants,
                               **sections})


def arrival(at: float, tenant: str, *, line: int = 0, prompt: int = 100, output: int = 50,
            max_tokens: int | None = 50) -> Arrival:
    return Arrival(line=line, arrived=at, tenant=tenant, model="m", lane_asked=None,
                   prompt_tokens=prompt, output_tokens=output, max_tokens=max_tokens,
                   stream=True, finished=at + 1)


def test_a_lone_request_finishes_its_output_times_the_step_after_its_dispatch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made = captured(monkeypatch)
    spec = PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01)
    result = replay_fast(config([{"id": "a"}]), spec, [arrival(100.0, "a", output=50)],
                         start=99.0)
    (only,) = made[0].records
    assert only.outcome == "ok" and only.completion_tokens == 50
    assert only.dispatched_s == pytest.approx(1.0)
    assert only.first_token_s == pytest.approx(1.01)  # one step: its prompt and first token
    assert only.end_s == pytest.approx(1.5)  # 50 tokens, one a step
    assert result.output_tokens == 50 and result.unfinished == 0
    assert result.duration_s == pytest.approx(1.5)


def test_a_batch_past_its_cache_slows_in_proportion() -> None:
    # Two requests of 64 prompt tokens and 100 output on a cache of 160 tokens (10 blocks):
    # with half a block each they hold 144, full after 8 steps; then h² grows by
    # 2 × 2 × 160 a step until h = 144 + 2 × 100.
    endpoint = _Endpoint(kv=160.0, step=0.01, block_size=16)
    endpoint.n, endpoint.a = 2, 2 * (64 + 8)
    end = endpoint.time_to(100.0)
    assert end == pytest.approx(0.08 + ((144 + 200) ** 2 - 160 ** 2) * 0.01 / (2 * 2 * 160))
    assert end > 1.0  # slower than one token a step
    assert endpoint.at(end) == pytest.approx(100.0)
    # The clock is the same advanced in one go or in pieces.
    other = _Endpoint(kv=160.0, step=0.01, block_size=16)
    other.n, other.a = 2, 2 * (64 + 8)
    for t in (0.03, 0.08, 0.3, 0.31, end):
        other.at(t)
    assert other.v == pytest.approx(100.0)


def test_within_the_cache_a_batch_keeps_one_token_a_step() -> None:
    endpoint = _Endpoint(kv=4096.0, step=0.02, block_size=16)
    endpoint.n, endpoint.a = 3, 3 * 108.0
    assert endpoint.time_to(40.0) == pytest.approx(0.8)
    assert endpoint.at(0.5) == pytest.approx(25.0)


def flood(seconds: float = 8.0, rate: float = 20.0, seed: int = 3) -> list[Arrival]:
    rng = random.Random(seed)
    times = sorted((rng.uniform(0, seconds), tenant) for tenant in ("a", "b")
                   for _ in range(int(seconds * rate)))
    out = []
    for i, (t, tenant) in enumerate(times):
        output = rng.randint(20, 80)
        out.append(arrival(t, tenant, line=i, prompt=rng.randint(50, 150), output=output,
                           max_tokens=output))
    return out


def test_the_fair_order_weighs_tenants_as_the_exact_replay_does() -> None:
    weighted = config([{"id": "a", "weight": 3}, {"id": "b"}], kv=1024,
                      queue={"maxWait": "3s"})
    spec = PoolSpec(endpoints=1, kv_budget_tokens=1024, step_s=0.01)
    exact = replay(weighted, spec, flood(), start=0.0)
    fast = replay_fast(weighted, spec, flood(), start=0.0)
    assert fast.share(("a", "default")) > 0.6  # weight 3 of an overloaded engine
    for key in exact.lanes:
        assert abs(fast.share(key) - exact.share(key)) < 0.03
    # Swapped weights swap the order: the fair queue's counters, not arrival order, decide.
    swapped = replay_fast(config([{"id": "a"}, {"id": "b", "weight": 3}], kv=1024,
                                 queue={"maxWait": "3s"}), spec, flood(), start=0.0)
    assert swapped.share(("b", "default")) > 0.6
    assert fast.output_tokens == pytest.approx(exact.output_tokens, rel=0.05)


def test_a_budget_refuses_the_same_requests_as_in_the_exact_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made = captured(monkeypatch)
    # Requests 0.3 s apart that end within 0.1 s: each meets the budget as the last left it.
    rng = random.Random(5)
    arrivals = [arrival(i * 0.3, "ab"[rng.random() < 0.3], line=i, prompt=rng.randint(50, 300),
                        output=(n := rng.randint(2, 8)), max_tokens=n) for i in range(120)]
    budgeted = config([{"id": "a", "budgets": {"burst": {"tokens": 1000, "per": "5s"}}},
                       {"id": "b"}])
    spec = PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01)
    replay(budgeted, spec, arrivals, start=0.0)
    replay_fast(budgeted, spec, arrivals, start=0.0)
    exact, fast = ({round(r.arrival_s, 3) for r in capture.records if r.outcome == "over_budget"}
                   for capture in made)
    assert len(exact) >= 10, len(exact)  # the budget bites
    assert fast == exact


def test_memory_holds_the_requests_in_flight_not_the_log() -> None:
    spec = PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01)
    held: list[int] = []

    def arrivals(count: int) -> Iterator[Arrival]:
        # 20 a second of 0.2 s requests: a handful in flight at any time, whatever the count.
        for i in range(count):
            if i % 2000 == 1999:
                gc.collect()
                held.append(sum(1 for o in gc.get_objects() if isinstance(o, _Flow)))
            yield arrival(i * 0.05, "ab"[i % 2], line=i, output=20, max_tokens=20)

    result = replay_fast(config([{"id": "a"}, {"id": "b"}]), spec, arrivals(10_000),
                         start=0.0)
    assert sum(s.ok for s in result.lanes.values()) == 10_000
    assert held and max(held) <= 20, held  # the log's 10,000 were never held together
    # Per tenant a number a bucket: one bucket a minute of the 500 s.
    assert all(len(series) <= 10 for series in result.series.values())


def test_the_rules_the_fast_mode_leaves_out_are_named() -> None:
    assert unmodelled(config([{"id": "a"}])) == []
    named = unmodelled(config([{"id": "a"}], capacity={"kvBudgetTokens": 4096,
                                                       "growthRoom": True}))
    assert named == ["capacity.growthRoom"]


def test_the_cli_replays_in_fast_mode_and_refuses_two_modes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [record(i * 0.2, e2e_s=0.5, tenant="ab"[i % 2], prompt_tokens=100,
                    completion_tokens=50, max_tokens=50, ttft_ms=20.0) for i in range(40)]
    log = write(tmp_path, lines)
    base = tmp_path / "base.yaml"
    base.write_text("capacity: {kvBudgetTokens: 4096}\ntenants:\n  - {id: a}\n  - {id: b}\n")
    assert main([str(log), "--baseline", str(base), "--candidate", str(base), "--json",
                 "--fast"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "fast mode (picker.whatif.fast)" in out["pool"]["notes"]
    rows = {row["tenant"]: row for row in out["baseline"]["tenants"]}
    assert rows["a"]["ok"] == rows["b"]["ok"] == 20
    with pytest.raises(SystemExit):
        main([str(log), "--baseline", str(base), "--candidate", str(base), "--fast",
              "--coarse", "8"])


def test_idle_tenants_are_forgotten_as_the_gate_forgets_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A log of endless tenant ids, one request each: the replay keeps the active ones only.
    spec = PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01)
    kept: list[int] = []

    class Watched(FastReplay):
        def prune(self, now: float) -> None:
            super().prune(now)
            kept.append(len(self.scheduler.service))

    monkeypatch.setattr("picker.whatif.fast.FastReplay", Watched)
    result = replay_fast(config([{"id": "a"}]), spec,
                         (arrival(i * 0.1, f"t{i}", line=i, output=5, max_tokens=5)
                          for i in range(3000)), start=0.0)
    assert sum(s.ok for s in result.lanes.values()) == 3000
    # Every 30 simulated seconds, of 300 new tenants those with a request in flight remain.
    assert len(kept) >= 9 and max(kept) <= 5


def test_a_request_finding_the_queue_empty_goes_as_it_would_through_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The shortcut (``Scheduler.dispatch_alone``) against the queue's round trip, on traffic that
    # queues at times (lanes, a budget that demotes, a cap, minShare, the adaptive LIFO): every
    # request's figures are the same.
    made = captured(monkeypatch)
    rules = config([{"id": "a", "lane": "default", "limits": {"maxConcurrent": 3},
                     "budgets": {"burst": {"tokens": 4000, "per": "5s"}},
                     "overBudget": {"action": "demote", "lane": "batch"}},
                    {"id": "b", "weight": 2, "lane": "interactive"}, {"id": "c"}],
                   kv=1024, queue={"maxWait": "2s", "newestFirstAfter": "1s"},
                   lanes=[{"name": "interactive"}, {"name": "default", "minShare": 0.2},
                          {"name": "batch"}])
    spec = PoolSpec(endpoints=2, kv_budget_tokens=1024, step_s=0.01)
    arrivals = flood(seconds=6.0, rate=12.0, seed=7)
    arrivals += [arrival(a.arrived + 0.001, "c", line=a.line, prompt=a.prompt_tokens,
                         output=4, max_tokens=4) for a in arrivals[::3]]
    arrivals.sort(key=lambda a: a.arrived)
    taken: list[bool] = []
    alone = Scheduler.dispatch_alone

    def counted(self: Scheduler, request: Any, now: float) -> bool:
        taken.append(alone(self, request, now))
        return taken[-1]

    monkeypatch.setattr(Scheduler, "dispatch_alone", counted)
    short = replay_fast(rules, spec, arrivals, start=0.0)
    monkeypatch.setattr(Scheduler, "dispatch_alone", lambda self, request, now: False)
    plain = replay_fast(rules, spec, arrivals, start=0.0)
    assert sum(taken) >= 50 and len(made[0].records) == len(arrivals)
    assert short.as_dict() == plain.as_dict()
    assert [vars(r) for r in made[0].records] == [vars(r) for r in made[1].records]
    outcomes = {r.outcome for r in made[0].records}
    assert {"ok", "queue_timeout"} <= outcomes  # it queued, and waited past maxWait


def test_a_flow_is_the_request_the_gate_would_have_made() -> None:
    # ``_Flow`` sets the Request's fields itself (per request, no call): every one of them, as
    # Request's own __init__ would.
    for cap in (None, 0, 64):
        flow = _Flow("a", "batch", 12.5, 300, 40, True, cap, None, False)
        made = Request(tenant="a", prompt_tokens=300, lane="batch", max_output_tokens=cap or 0,
                       arrival=12.5)
        for name in (f.name for f in dataclasses.fields(Request)):
            assert getattr(flow, name) == getattr(made, name), name


def test_the_replay_keeps_few_enough_attributes_to_share_their_names() -> None:
    # Past MAX_ATTRIBUTES, CPython stops sharing the instances' attribute names and every
    # ``self.x`` of the replay is a dictionary lookup: the replay's own state stays within it,
    # while it runs too (nothing is added on the way).
    spec = PoolSpec(endpoints=2, kv_budget_tokens=4096, step_s=0.01)
    rules = config([{"id": "a"}, {"id": "b", "limits": {"maxConcurrent": 1}}],
                   lanes=[{"name": "default"}, {"name": "batch", "minShare": 0.2}])
    pool = FastReplay(rules, spec, ReplayResult(bucket_s=60.0), client_timeout_s=120.0)
    for i in range(200):
        now = i * 0.05
        pool.advance(now)
        pool.send(tuple(arrival(now, "ab"[i % 2], line=i + 1, output=80)), now)
        if i == 100:
            pool.prune(now)
    pool.advance(1e6)
    assert len(vars(pool)) <= MAX_ATTRIBUTES
