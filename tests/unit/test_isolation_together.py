"""What ``bench.isolation_together`` concludes from its runs (without running the simulator)."""

from __future__ import annotations

from typing import Any

from bench.isolation import SIZES
from bench.isolation_together import render, widened


def _numbers(ratio: float, vs_fcfs: float, tokens: float, preemptions: float) -> dict[str, Any]:
    return {"ttft_ratio": ratio, "tokens_vs_fcfs": vs_fcfs, "tokens_per_s": tokens,
            "preemptions_per_1000": preemptions}


def test_a_run_meets_the_goals_only_at_both_bounds_and_the_cost_is_against_the_default() -> None:
    data = {"8k": [
        {"seed": 12, "default": _numbers(10.6, 1.25, 1000.0, 325),
         "together": _numbers(1.5, 0.97, 920.0, 9),        # both at their bound: met
         "ready": _numbers(1.0, 0.969, 800.0, 4)},         # tokens just under
        {"seed": 13, "default": _numbers(4.0, 9.0, 1000.0, 194),
         "together": _numbers(1.51, 9.0, 1010.0, 2),       # p95 just over
         "ready": _numbers(1.2, 8.0, 890.0, 1)},
    ], "1k (hard case)": [
        {"seed": 5, "default": _numbers(3.5, 0.975, 881.0, 268),
         "together": _numbers(1.0, 0.969, 752.0, 18),      # tokens just under
         "ready": _numbers(1.0, 0.95, 740.0, 18)},
    ]}
    text = render(data, 2)
    rows = [line for line in text.splitlines() if line.startswith("| 8k") or
            line.startswith("| 1k")]
    assert rows[0].endswith("| 0.920 / 0.800 | 325 / 9 / 4 | met / NOT met |")
    assert rows[1].endswith("| 1.010 / 0.890 | 194 / 2 / 1 | NOT met / met |")
    assert rows[2].endswith("| NOT met / NOT met |")
    assert "*together* meets both goals in 1 of 3 runs" in text
    assert "*ready* meets both goals in 1 of 3 runs" in text
    assert "*default* meets both goals in 0 of 3 runs" in text


def test_a_widened_pool_scales_the_flood_not_the_light_tenant() -> None:
    size = next(s for s in SIZES if s.name == "64k")
    wide = widened(size, 4)
    assert wide.spec.endpoints == 4 and wide.spec.kv_budget_tokens == size.spec.kv_budget_tokens
    assert isinstance(size.traffic, dict) and isinstance(wide.traffic, dict)
    rates = {t["name"]: t["rate"] for t in wide.traffic["tenants"]}
    before = {t["name"]: t["rate"] for t in size.traffic["tenants"]}
    assert rates == {"flood": 2 * before["flood"], "light": before["light"]}
    assert widened(size, 2) is size
