"""Several ``bench.efficiency`` runs as one goal report, beside an earlier goal matrix.

``python -m bench.efficiency_merge --before bench/results/goals/efficiency.json --out
bench/results/goals/efficiency_reruns A/efficiency.json B/efficiency.json ... [--section TITLE
C/efficiency.json ...]`` writes
``efficiency_reruns.json`` (the runs' cells together) and ``efficiency_reruns.md``: the goal
table of ``bench.efficiency`` over them, then each rerun cell's ratio beside the one the
``--before`` matrix measured for the same cell (its name: size, loop, engines, endpoints, path,
seed), and how many cells meet the goal now and did then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.efficiency import GOAL, _f, goals_report


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' cells in one ``efficiency.json``-shaped dict (a later run's cell of the same
    name replaces an earlier one's)."""
    sizes: dict[str, Any] = {}
    for run in runs:
        sizes.update(run["sizes"])
    return {"scale": runs[0]["scale"], "catch_up_ms": runs[0]["catch_up_ms"], "sizes": sizes,
            "commands": [run.get("command") for run in runs], "plot": None}


def compare(data: dict[str, Any], before: dict[str, Any], label: str) -> list[str]:
    """Each cell's ratio now beside ``before``'s for the same name."""
    lines = [f"## Against {label}", "",
             f"| cell | ratio before | ≥ {GOAL:g} before | ratio now | ≥ {GOAL:g} now |",
             "|---|---|---|---|---|"]
    met_before = met_now = 0
    for name, size in data["sizes"].items():
        old = before["sizes"].get(name, {}).get("ratio")
        new = size["ratio"]
        met_before += old is not None and old >= GOAL
        met_now += new is not None and new >= GOAL
        lines.append(f"| {name} | {_f(old, '.3f')} | "
                     f"{'–' if old is None else 'yes' if old >= GOAL else '**no**'} | "
                     f"{_f(new, '.3f')} | "
                     f"{'–' if new is None else 'yes' if new >= GOAL else '**no**'} |")
    lines += ["", f"Cells meeting ≥ {GOAL:g}: {met_now} of {len(data['sizes'])} now, "
              f"{met_before} of them in {label}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="efficiency.json files of bench.efficiency runs")
    parser.add_argument("--before", required=True, help="the goal matrix's efficiency.json")
    parser.add_argument("--label", default="the goal matrix", help="what --before is")
    parser.add_argument("--out", required=True, help="path without suffix (.json, .md added)")
    parser.add_argument("--note", default="", help="a paragraph put under the title")
    parser.add_argument("--section", nargs="+", action="append", default=[],
                        metavar=("TITLE", "JSON"),
                        help="more runs in a section of their own, after the comparison: "
                             "its title, then efficiency.json files (an A/A run's 'default' "
                             "column is a second pass-through)")
    args = parser.parse_args()
    data = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in args.runs])
    data["merge_command"] = " ".join(sys.argv[1:])
    before = json.loads(Path(args.before).read_text(encoding="utf-8"))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    lines = ["# The goal matrix's missed cells, run again (issue 27)", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["Runs: " + "; ".join(f"`python -m bench.efficiency {c}`" for c in data["commands"]),
              "", *goals_report(data), "", *compare(data, before, args.label)]
    sections = {}
    for title, *paths in args.section:
        extra = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in paths])
        sections[title] = extra
        report = goals_report(extra)
        report[0] = f"## {title}"
        lines += ["", "Runs: " + "; ".join(f"`python -m bench.efficiency {c}`"
                                           for c in extra["commands"]), "", *report]
    if sections:
        data["sections"] = sections
        out.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
