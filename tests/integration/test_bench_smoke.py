"""Smoke test of the benchmark layer: do ``bench.experiments --quick`` and ``picker.sim`` run end to
end on the bench scenarios and write sane outputs?"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "bench" / "scenarios" / "two_overloaded.yaml"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    proc = _run("-m", "bench.experiments", "--quick", "--out", str(out))
    return out, json.loads((out / "experiments.json").read_text()), proc.stdout


def test_quick_run_writes_every_output(quick: tuple[Path, dict[str, Any], str]) -> None:
    out, data, stdout = quick
    for name in ("experiments.md", "experiments.json", "exp1_two_overloaded.png",
                 "exp2_returning_tenant.png", "exp5_weights_and_lanes.png"):
        assert (out / name).stat().st_size > 0, name
    assert set(data) >= {"two_overloaded", "returning_tenant", "kv_sweep", "rpm_sweep",
                         "weights_and_lanes", "seeds", "goals", "meta"}
    assert data["meta"]["quick"] is True
    for title in ("## 1. Two overloaded tenants", "## 2. Returning tenant", "## Goals"):
        assert title in stdout
        assert title in (out / "experiments.md").read_text()


def test_quick_run_numbers_are_sane(quick: tuple[Path, dict[str, Any], str]) -> None:
    _, data, _ = quick
    runs = data["two_overloaded"]["runs"]
    assert set(runs) == {"fcfs", "lcf", "vtc"}
    assert runs["vtc"]["max_drift"] < runs["fcfs"]["max_drift"]
    assert runs["vtc"]["backlogged_drift"] <= runs["vtc"]["vtc_bound"]
    for run in runs.values():
        assert 50 < run["weighted_service_per_step"] < 80
        assert 0 < run["output_tokens_per_step"] < run["weighted_service_per_step"]

    back = {p: r["returning_share"] for p, r in data["returning_tenant"]["runs"].items()}
    assert back["lcf"] > back["vtc"] > back["fcfs"]
    assert 0.4 < back["vtc"] < 0.6

    assert [row["kv_budget_tokens"] for row in data["kv_sweep"]["rows"]] == [
        2048, 4096, 8192, 16384, 32768]
    rpm = data["rpm_sweep"]["rows"]
    assert [row["rpm_limit"] for row in rpm] == [5, 20, 40, 80, None]
    throughput = [row["weighted_service_per_step"] for row in rpm]
    assert throughput == sorted(throughput)

    tenants = data["weights_and_lanes"]["weighted"]["tenants"]
    assert sum(t["share"] for t in tenants) == pytest.approx(1.0)
    for t in tenants:
        assert abs(t["share"] - t["target_share"]) < 0.02
    lanes = {row["min_share"]: row for row in data["weights_and_lanes"]["lanes"]}
    assert lanes[0.2]["batch_share_while_backlogged"] > lanes[0.0]["batch_share_while_backlogged"]

    assert data["goals"]
    for goal in data["goals"]:
        assert isinstance(goal["passed"], bool) and goal["goal"] and goal["measured"]


@pytest.mark.parametrize("policy", ["fcfs", "lcf", "vtc", "rpm"])
def test_sim_cli_on_a_bench_scenario(policy: str, tmp_path: Path) -> None:
    extra = ["--rpm", "40"] if policy == "rpm" else []
    _run("-m", "picker.sim", str(SCENARIO), "--policy", policy, *extra, "--out", str(tmp_path),
         timeout=60)
    with (tmp_path / "service.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "a", "b"]
    assert len(rows) == 1 + 20000
    assert rows[1][0] == "0" and rows[-1][0] == "19999"
    assert float(rows[-1][1]) > 0 and float(rows[-1][2]) > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) >= {"policy", "steps", "weighted_service_per_step",
                            "output_tokens_per_step", "service"}
    assert summary["policy"] == policy
    assert summary["steps"] == 20000
    assert set(summary["service"]) == {"a", "b"}
    assert summary["weighted_service_per_step"] > 0
