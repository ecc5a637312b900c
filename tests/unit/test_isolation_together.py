"""What ``bench.isolation_together`` concludes from its runs (without running the simulator)."""

from __future__ import annotations

from typing import Any

from bench.isolation_together import render


def _numbers(ratio: float, vs_fcfs: float, tokens: float, preemptions: float) -> dict[str, Any]:
    return {"ttft_ratio": ratio, "tokens_vs_fcfs": vs_fcfs, "tokens_per_s": tokens,
            "preemptions_per_1000": preemptions}


def test_a_run_meets_the_goals_only_at_both_bounds_and_the_cost_is_against_the_default() -> None:
    data = {"8k": [
        {"seed": 12, "default": _numbers(10.6, 1.25, 1000.0, 325),
         "together": _numbers(1.5, 0.97, 920.0, 9)},       # both at their bound: met
        {"seed": 13, "default": _numbers(4.0, 9.0, 1000.0, 194),
         "together": _numbers(1.51, 9.0, 1010.0, 2)},      # p95 just over
    ], "1k (hard case)": [
        {"seed": 5, "default": _numbers(3.5, 0.975, 881.0, 268),
         "together": _numbers(1.0, 0.969, 752.0, 18)},     # tokens just under
    ]}
    text = render(data)
    rows = [line for line in text.splitlines() if line.startswith("| 8k") or
            line.startswith("| 1k")]
    assert rows[0].endswith("| 0.920 | 325 → 9 | met |")
    assert rows[1].endswith("| 1.010 | 194 → 2 | NOT met |")
    assert rows[2].endswith("| NOT met |")
    assert "meet both goals in 1 of 3 runs" in text
