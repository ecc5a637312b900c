"""How long and how much memory does a dry run's replay take at the operator's default bounds?

``python -m bench.whatif_window [--records 20000] [--minutes 15] [--endpoints 2]``: synthetic
records of three tenants (the admin API's RecentRequests fields), evenly spread over the window,
replayed by ``picker.whatif.recent.predict`` under a baseline and a candidate (tenant a's weight
1 → 3), as the operator's dry-run loop and ``picker.ctl whatif`` do. Prints CPU and wall seconds
and the process's peak RSS: the figures behind the operator's ``--whatif-timeout`` default
(120 s) and its memory limit.

Measured on the shared 2-core machine (2026-12-03): 20,000 records over 15 minutes on 2
endpoints, 38-40 s of CPU (49-54 s wall), peak RSS 100 MB.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.whatif.recent import Bounds, predict

NOW = 1_800_000_000.0


def records(count: int, minutes: float, endpoints: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    span = minutes * 60
    out = []
    for i in range(count):
        at = NOW - span + span * i / count
        out.append({
            "tenant_id": rng.choice("abc"), "model": "m", "priority_lane": "default",
            "lane_asked": None, "arrived_at": at, "timestamp": at + 1.0,
            "prompt_tokens": rng.randint(100, 800), "completion_tokens": rng.randint(20, 200),
            "cached_prompt_tokens": 0, "max_tokens": 256, "stream": True, "outcome": "ok",
            "endpoint": f"10.0.0.{rng.randint(1, endpoints)}:8000", "queue_ms": 1.0,
            "ttft_ms": 40.0, "e2e_ms": 40.0 + 99 * 10.0, "demoted": False})
    return out


def config(weight_a: float) -> PickerConfig:
    return load(PickerConfig, {"capacity": {"kvBudgetTokens": 16384},
                               "tenants": [{"id": "a", "weight": weight_a}, {"id": "b"},
                                           {"id": "c"}]})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.whatif_window")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--endpoints", type=int, default=2)
    args = parser.parse_args()
    data = records(args.records, args.minutes, args.endpoints)
    bounds = Bounds(minutes=args.minutes, max_records=args.records, timeout_s=3600)
    cpu, wall = time.process_time(), time.monotonic()
    answer = predict(data, config(1), config(3), bounds=bounds, now=NOW, first=["a"])
    print(f"{answer.verdict}: {answer.message}")
    print(f"cpu {time.process_time() - cpu:.1f} s, wall {time.monotonic() - wall:.1f} s, "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
