"""bench.peer's arithmetic: shares, their error, drift, and what the overhead ladder concludes.

The benchmark itself runs upstream's picker (built from Go modules) and is not part of the
suite; these pin what its tables mean.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.peer import (
    PEERS,
    cpu_ms_per_request,
    drift,
    overhead_summary,
    requests_started,
    service,
    shares,
    worst_error,
)
from picker.sim.load import RequestRecord


def _record(tenant: str, start: float, prompt: int, output: int, ttft: float = 0.0,
            duration: float = 1.0, status: int = 200) -> RequestRecord:
    return RequestRecord(tenant=tenant, seq=0, kind="backlog", api="completions", stream=True,
                         scheduled_s=start, start_s=start, drawn_prompt_tokens=prompt,
                         max_tokens=output, status=status, ttft_s=ttft, end_s=start + duration,
                         prompt_tokens=prompt, completion_tokens=output, usage_source="usage")


def test_service_is_prompt_plus_twice_the_output_inside_the_window() -> None:
    # Prompt at the first token (t=1), 11 outputs spread evenly over t=1..2.
    records = [_record("a", 1.0, prompt=100, output=11), _record("b", 1.0, 50, 1)]
    assert service(records, "a", 0.0, 5.0) == 100 + 2 * 11
    assert service(records, "a", 1.5, 5.0) == 2 * 5  # outputs at 1.6 .. 2.0
    assert service(records, "b", 0.0, 5.0) == 50 + 2


def test_failed_requests_are_no_service_and_no_dispatch() -> None:
    records = [_record("a", 1.0, 100, 10, status=503), _record("a", 1.0, 100, 10)]
    assert service(records, "a", 0.0, 5.0) == 120
    assert requests_started(records, "a", 0.0, 5.0) == 1


def test_worst_error_is_relative_to_each_weights_share() -> None:
    assert worst_error(shares({"a": 1.0, "b": 1.0}), {"a": 1.0, "b": 1.0}) == 0.0
    # a third for a tenant weighted 1 of 1:2 is on target; 2/3 for b too.
    assert worst_error({"a": 1 / 3, "b": 2 / 3}, {"a": 1.0, "b": 2.0}) == pytest.approx(0.0)
    # 40 % against a fair 50 %: 20 % off.
    assert worst_error({"a": 0.4, "b": 0.6}, {"a": 1.0, "b": 1.0}) == pytest.approx(0.2)


def test_drift_is_the_widest_swing_between_tenants_not_their_total_gap() -> None:
    # a runs first for 2 s, then b for 2 s, each 1 token per 0.5 s (cost 2 each).
    interleaved = [_record(t, start, 0, 1, duration=0.0) for start, t in
                   ((0.0, "a"), (0.5, "a"), (1.0, "a"), (1.5, "a"),
                    (2.0, "b"), (2.5, "b"), (3.0, "b"), (3.5, "b"))]
    weights = {"a": 1.0, "b": 1.0}
    assert drift(interleaved, ["a", "b"], (0.0, 4.0), weights) == pytest.approx(8.0)
    alternating = [_record("a" if i % 2 == 0 else "b", i * 0.5, 0, 1, duration=0.0)
                   for i in range(8)]
    assert drift(alternating, ["a", "b"], (0.0, 4.0), weights) == pytest.approx(2.0)
    # With weights, service is divided by weight first: b at twice a's rate is no drift.
    weighted = [_record("a", float(i), 0, 1, duration=0.0) for i in range(4)] + \
               [_record("b", i + 0.5, 0, 2, duration=0.0) for i in range(4)]
    assert drift(weighted, ["a", "b"], (0.0, 4.0), {"a": 1.0, "b": 2.0}) == pytest.approx(2.0)


def _path(p50: float, p99: float, *, ok: int = 1000, sent: int = 1000, rate: float = 200.0,
          cpu: dict[str, float] | None = None, span: float = 5.0) -> dict[str, Any]:
    return {"latency_ms": {"p50": p50, "p99": p99}, "ok": ok, "sent": sent,
            "errors": sent - ok, "achieved_rate": rate, "span_s": span, "cpu_s": cpu or {}}


def _rung(rate: float, fairway_p99: float, upstream_p99: float) -> dict[str, Any]:
    return {"rate": rate, "baseline": _path(1.0, 2.0, rate=rate),
            "fairway": _path(3.0, 2.0 + fairway_p99, rate=rate),
            "upstream": _path(2.0, 2.0 + upstream_p99, rate=rate)}


def test_the_sustained_rate_is_the_last_rung_of_an_unbroken_run() -> None:
    rungs = [_rung(200, 3.0, 1.0), _rung(400, 12.0, 2.0), _rung(800, 4.0, 11.0)]
    got = overhead_summary(rungs)
    # fairway fails at 400: passing again at 800 does not count.
    assert got["max_sustained_rate"] == {"fairway": 200, "upstream": 400}
    assert got["added_ms"]["fairway"] == {"p50": 2.0, "p99": 3.0}
    assert got["fairway_over_upstream"]["added_p50"] == pytest.approx(2.0)
    assert set(got["cpu_ms_per_request"]) == set(PEERS)


def test_a_rung_with_errors_or_a_missed_rate_is_not_sustained() -> None:
    rung = _rung(200, 1.0, 1.0)
    rung["fairway"] = _path(3.0, 3.0, ok=990)  # 1 % errors
    rung["upstream"] = _path(2.0, 3.0, rate=150.0)  # fell behind
    got = overhead_summary([rung])
    assert got["max_sustained_rate"] == {"fairway": None, "upstream": None}


def test_cpu_per_request_takes_off_what_the_picker_uses_while_the_other_paths_run() -> None:
    rung = _rung(200, 1.0, 1.0)
    # fairway's picker: 0.1 s a second idle (scraping) while the others run, 1.5 s over its
    # own 5 s block of 1,000 requests: (1.5 - 0.5) s / 1,000 = 1 ms a request.
    idle = {"ovh-fairway/picker": 0.5}
    rung["baseline"]["cpu_s"], rung["upstream"]["cpu_s"] = idle, idle
    rung["fairway"]["cpu_s"] = {"ovh-fairway/picker": 1.5, "ovh-fairway/envoy": 9.0}
    assert cpu_ms_per_request(rung, "fairway") == pytest.approx(1.0)
    rung["upstream"]["cpu_s"] = {"ovh-upstream/epp": 0.7, **idle}
    rung["baseline"]["cpu_s"] = {**idle}
    assert cpu_ms_per_request(rung, "upstream") == pytest.approx(0.7)
