"""``bench.scale``'s simulated part, small: it runs, and its report carries the row."""

from __future__ import annotations

from bench.scale import report, simulated


def test_a_small_simulated_run_is_measured_and_reported() -> None:
    row = simulated(6, 2, 2, 4.0, backlog=20, latency_s=0.001, home_share=0.7)
    assert row["grants_max"] <= 1.0 + 1e-9
    assert 0 < row["view_age_ms"]["mean"] <= row["view_age_ms"]["max"] <= 101 + 1
    assert row["tokens_per_s"] > 0 and row["share_error"]["max"] >= row["share_error"]["median"]
    text = report({"date": "d", "machine": {"cores": 2, "loadavg_before": [0.0]},
                   "redis_cost": {"rate": 200, "memory": _latency(), "redis": _latency(),
                                  "added_ms": {"p50_ms": 0.1, "p99_ms": 0.2}},
                   "replicas": [], "simulated": [row]})
    assert "| 6 | 2 | 2 | 4 | 1 | 0.7 |" in text and "goal <= 0.3 ms at p50: met" in text


def _latency() -> dict:
    return {"p50_ms": 4.0, "p99_ms": 8.0, "achieved_rate": 199.0, "errors": 0}
