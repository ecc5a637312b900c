"""A what-if over the picker's recent requests (issue 29 point 4; ``picker.whatif.recent``): the
admin API's records read as the log's, the window and its bounds, and a prediction that moves
with the candidate's weights."""

from __future__ import annotations

import random
from typing import Any

import pytest

from picker.admin.v1 import admin_pb2
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.whatif.recent import (
    PREDICTED,
    WINDOW_TOO_SHORT,
    Bounds,
    predict,
    record_of,
)

NOW = 1_800_000_000.0
QUICK = Bounds(minutes=5, min_records=20, min_span_s=5.0, timeout_s=30.0)


def config(tenants: list[dict[str, Any]]) -> PickerConfig:
    # A short queue wait: under the flood, who is served before the rest time out is the
    # scheduler's choice, so the shares show the weights.
    return load(PickerConfig, {"capacity": {"kvBudgetTokens": 4096}, "queue": {"maxWait": "3s"},
                               "tenants": tenants})


def record(at: float, tenant: str) -> dict[str, Any]:
    """A served streamed request of 200 + 50 tokens (10 ms a token) that arrived at ``at``."""
    ttft = 40.0
    return {"tenant_id": tenant, "model": "m", "priority_lane": "default", "lane_asked": None,
            "arrived_at": at, "timestamp": at + 0.53, "prompt_tokens": 200,
            "completion_tokens": 50, "cached_prompt_tokens": 0, "max_tokens": 50,
            "stream": True, "outcome": "ok", "endpoint": "10.0.0.1:8000", "queue_ms": 1.0,
            "ttft_ms": ttft, "e2e_ms": ttft + 49 * 10.0, "demoted": False}


def flood(seconds: float = 10.0, rate: float = 30.0) -> list[dict[str, Any]]:
    """Tenants a and b at ``rate`` requests a second each, ending a minute before NOW: more
    than one engine serves, so each tenant's share is the scheduler's choice."""
    rng = random.Random(7)
    start = NOW - 60 - seconds
    arrivals = sorted((start + rng.uniform(0, seconds), tenant) for tenant in ("a", "b")
                      for _ in range(int(seconds * rate)))
    return [record(at, tenant) for at, tenant in arrivals]


def test_an_admin_record_reads_as_the_metering_log_writes_it() -> None:
    message = admin_pb2.RequestRecord(tenant_id="a", priority_lane="batch", arrived_at=1.5,
                                      timestamp=2.0, prompt_tokens=9, completion_tokens=0,
                                      stream=False, outcome="queue_timeout", e2e_ms=500.0)
    data = record_of(message)
    assert data["tenant_id"] == "a" and data["arrived_at"] == 1.5
    # Absent and empty mean none, as the log writes null.
    assert data["max_tokens"] is None and data["ttft_ms"] is None
    assert data["endpoint"] is None and data["lane_asked"] is None and data["model"] is None
    assert data["completion_tokens"] == 0 and data["stream"] is False
    assert record_of(admin_pb2.RequestRecord(max_tokens=0, ttft_ms=0.0))["max_tokens"] == 0


def test_a_candidates_weights_move_the_predicted_shares() -> None:
    records = flood()
    even = config([{"id": "a"}, {"id": "b"}])
    tilted = config([{"id": "a", "weight": 1}, {"id": "b", "weight": 3}])
    answer = predict(records, even, tilted, bounds=QUICK, now=NOW, first=["b"])
    assert answer.verdict == PREDICTED, answer.message
    assert [row.tenant for row in answer.rows] == ["b", "a"]  # the policy's tenants first
    b, a = answer.rows
    assert b.share[0] == pytest.approx(0.5, abs=0.05) and b.share[1] > 0.6
    assert a.share[1] < 0.4 and sum(r.share[1] for r in answer.rows) == pytest.approx(1.0)
    assert b.ttft_p95_s[0] is not None and b.ttft_p95_s[1] is not None
    assert answer.window["requests"] == len(records) and not answer.window["truncated"]
    assert "endpoints 1 (served requests in the log)" in answer.pool


def test_a_window_too_short_says_so_instead_of_predicting() -> None:
    cfg = config([{"id": "a"}])
    few = [record(NOW - 30 + i, "a") for i in range(10)]
    answer = predict(few, cfg, cfg, bounds=Bounds(), now=NOW)
    assert answer.verdict == WINDOW_TOO_SHORT and not answer.rows
    assert "10 request(s)" in answer.message and "at least 50" in answer.message
    # Enough requests, but within 5 seconds: still too short for the default minute.
    quick = [record(NOW - 5 + i / 20, "a") for i in range(100)]
    assert predict(quick, cfg, cfg, bounds=Bounds(), now=NOW).verdict == WINDOW_TOO_SHORT


def test_only_the_last_minutes_and_the_latest_records_are_replayed() -> None:
    cfg = config([{"id": "a"}, {"id": "b"}])
    old = [record(NOW - 3600 + i, "b") for i in range(30)]  # an hour ago: outside 5 minutes
    recent = [record(NOW - 100 + i, "a") for i in range(40)]
    answer = predict(old + recent, cfg, cfg, bounds=QUICK, now=NOW)
    assert answer.verdict == PREDICTED and [r.tenant for r in answer.rows] == ["a"]
    assert answer.window["requests"] == 40 and answer.window["from"] == NOW - 100
    capped = predict(recent, cfg, cfg, now=NOW, bounds=Bounds(
        minutes=5, max_records=25, min_records=20, min_span_s=5.0))
    assert capped.window["requests"] == 25 and capped.window["truncated"]
    assert capped.window["from"] == NOW - 100 + 15  # the latest 25
    assert "the latest 25 only" in capped.message


def test_a_replay_past_its_time_stops() -> None:
    cfg = config([{"id": "a"}, {"id": "b"}])
    with pytest.raises(TimeoutError):
        predict(flood(), cfg, cfg, bounds=QUICK, now=NOW, expired=lambda: True)
