"""Several runs of the overhead benchmark (``python -m bench.gateway --only 4``), summed up.

One run's p99 and per-chunk figures move by a third between runs on a shared 2-core machine, so a
claim about them rests on the median of several. ``python -m bench.overhead_runs --out
bench/results/overhead.md RUN.json...`` writes a table of every run (its ``gateway.json``) and
the medians, beside the figures they are compared with (``--before``, a JSON object of the same
keys, e.g. the previous stop's medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

MEASURES = (("added_p50_ms", "added p50 ms", "+{:.2f}"),
            ("added_p99_ms", "added p99 ms", "+{:.2f}"),
            ("picker_cpu_ms_per_request", "picker CPU ms / request", "{:.3f}"),
            ("chunk_added_mean_ms", "added per chunk, mean ms", "+{:.3f}"),
            ("chunk_added_p50_ms", "added per chunk, p50 ms", "+{:.3f}"),
            ("picker_cpu_ms_per_chunk", "picker CPU ms / chunk", "{:.3f}"),
            ("max_sustained_rate", "highest rate, p99 added <= 10 ms", "{:.0f}"))


def figures(run: dict[str, Any]) -> dict[str, float]:
    requests, streams = run["overhead"]["requests"], run["overhead"]["streams"]
    at = requests["at_200"]
    return {"added_p50_ms": at["added_ms"]["p50"], "added_p99_ms": at["added_ms"]["p99"],
            "picker_cpu_ms_per_request": sum(v for k, v in at["cpu_ms_per_request"]["picker"]
                                             .items() if k.endswith("/picker")),
            "chunk_added_mean_ms": streams["added_per_chunk_ms"]["mean"],
            "chunk_added_p50_ms": streams["added_per_chunk_ms"]["p50"],
            "picker_cpu_ms_per_chunk": streams["picker_cpu_ms_per_chunk"],
            "max_sustained_rate": requests["max_sustained_rate"]}


def report(runs: list[dict[str, float]], before: dict[str, float] | None, title: str) -> str:
    header = "| run | " + " | ".join(label for _, label, _ in MEASURES) + " |"
    lines = [f"# {title}", "", __doc__.split("\n\n")[1].replace("\n", " "), "", header,
             "|---|" + "---:|" * len(MEASURES)]
    for i, run in enumerate(runs, 1):
        lines.append(f"| {i} | " + " | ".join(form.format(run[key]) for key, _, form in MEASURES)
                     + " |")
    medians = {key: statistics.median(run[key] for run in runs) for key, _, _ in MEASURES}
    lines.append("| **median** | " + " | ".join(f"**{form.format(medians[key])}**"
                                                for key, _, form in MEASURES) + " |")
    if before:
        lines.append("| before | " + " | ".join(
            form.format(before[key]) if key in before else "-" for key, _, form in MEASURES)
            + " |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead_runs")
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", help="JSON: the figures compared with")
    parser.add_argument("--title", default="The picker's overhead over several runs")
    args = parser.parse_args()
    runs = [figures(json.loads(path.read_text())) for path in args.runs]
    text = report(runs, json.loads(args.before) if args.before else None, args.title)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
