"""The pool simulator's network (``PoolSpec.dispatch_latency_s``, ``completion_lag_s``).

Does a dispatch reach its engine that many ticks later, does the gate see a finished request end
that much later (so the next held request goes that much later), and does a request whose client
gave up on the way never reach its engine?
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolSpec, simulate
from picker.sim.traffic import Traffic, load_traffic

SPEC = PoolSpec(endpoints=1, kv_budget_tokens=1024, step_s=0.01)


def _burst(count: int, timeout_s: float = 60) -> Traffic:
    """``count`` requests of 600 prompt and 5 output tokens at t = 0: two do not fit at once."""
    return load_traffic({"duration_s": 0.5, "seed": 3, "timeout_s": timeout_s, "tenants": [
        {"name": "a", "bursts": [{"at_s": 0, "count": count}], "prompt_tokens": [600, 600],
         "output_tokens": [5, 5], "api": "completions", "stream_fraction": 1.0,
         "include_usage": True}]})


def _config(policy: str = "vtc") -> PickerConfig:
    return load(PickerConfig, {"scheduling": {"policy": policy},
                               "capacity": {"kvBudgetTokens": 1024}})


def test_a_dispatch_reaches_its_engine_after_the_latency() -> None:
    base = simulate(_config("fcfs"), _burst(1), SPEC, drain_s=5).records[0]
    late = simulate(_config("fcfs"), _burst(1), replace(SPEC, dispatch_latency_s=0.03),
                    drain_s=5).records[0]
    assert base.dispatched_s == late.dispatched_s == 0
    assert late.ttft_s == pytest.approx(base.ttft_s + 0.03)
    assert late.engine_started_s == pytest.approx(0.03)


def test_a_completion_seen_late_holds_the_next_request_as_long() -> None:
    base = simulate(_config(), _burst(2), SPEC, drain_s=5).records
    late = simulate(_config(), _burst(2), replace(SPEC, completion_lag_s=0.05),
                    drain_s=5).records
    # The second waits in the gate until it sees the first end (as its client does, through
    # the same gateway): 50 ms after the engine's step.
    assert late[0].end_s == pytest.approx(base[0].end_s + 0.05)
    assert base[1].dispatched_s == pytest.approx(base[0].end_s)
    assert late[1].dispatched_s == pytest.approx(base[1].dispatched_s + 0.05)
    assert all(r.outcome == "ok" for r in late)


def test_a_request_given_up_on_the_way_never_reaches_its_engine() -> None:
    spec = replace(SPEC, dispatch_latency_s=0.05)
    (record,) = simulate(_config("fcfs"), _burst(1, timeout_s=0.02), spec, drain_s=5).records
    assert record.outcome == "cancelled"
    assert record.engine_started_s is None
    with pytest.raises(ValueError, match="dispatch_latency_s"):
        PoolSpec(dispatch_latency_s=-0.01)
