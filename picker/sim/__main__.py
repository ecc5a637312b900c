"""``python -m picker.sim SCENARIO.yaml --policy vtc --out DIR``: run one simulation.

Writes ``DIR/service.csv`` (per step, each tenant's cumulative weighted service) and
``DIR/summary.json`` (policy, steps, throughput, per-tenant service, drift figures).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from itertools import combinations
from pathlib import Path

from picker.core import POLICIES
from picker.errors import ConfigError
from picker.sim.analysis import backlogged_drift, max_drift, vtc_bound
from picker.sim.engine import SimResult, simulate
from picker.sim.scenario import load_scenario


def write_outputs(result: SimResult, bound: float, out: Path) -> dict:
    """Write service.csv and summary.json for ``result`` into ``out``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "service.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *result.tenants])
        for step, row in enumerate(result.service):
            writer.writerow([step, *(f"{v:g}" for v in row)])
    summary = result.summary()
    summary["vtc_bound"] = bound
    summary["pairs"] = [
        {"tenants": [a, b], "max_drift": max_drift(result, a, b),
         "backlogged_drift": backlogged_drift(result, a, b)}
        for a, b in combinations(result.tenants, 2)
    ]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.sim",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("scenario", type=Path, help="scenario YAML file")
    parser.add_argument("--policy", choices=POLICIES, default="vtc")
    parser.add_argument("--rpm", type=float, default=None,
                        help="requests per tenant per window for --policy rpm (default: unlimited)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.rpm is not None and args.policy != "rpm":
        parser.error("--rpm applies only to --policy rpm")
    if args.rpm is not None and args.rpm < 0:
        parser.error("--rpm must be >= 0")
    try:
        scenario = load_scenario(args.scenario)
    except ConfigError as exc:
        print(f"{args.scenario}: {exc}", file=sys.stderr)
        return 2
    result = simulate(scenario, args.policy, args.rpm)
    summary = write_outputs(result, vtc_bound(scenario), args.out)
    print(json.dumps({k: summary[k] for k in ("policy", "steps", "weighted_service_per_step",
                                              "output_tokens_per_step")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
