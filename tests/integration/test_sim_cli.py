"""``python -m picker.sim`` as a user runs it: outputs on success, a named error on bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "fixtures" / "scenarios"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker.sim", *args],
                          capture_output=True, text=True, timeout=120)


def _small_scenario(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(
        "steps: 3000\nkv_budget_tokens: 2048\nseed: 7\n"
        "tenants:\n"
        "  - {name: a, arrivals: [{backlog: 10}]}\n"
        "  - {name: b, weight: 3, arrivals: [{backlog: 10}]}\n"
    )
    return path


def test_writes_service_csv_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(str(_small_scenario(tmp_path)), "--policy", "vtc", "--out", str(out))
    assert done.returncode == 0, done.stderr
    with (out / "service.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "a", "b"]
    assert len(rows) == 3001
    last = [float(v) for v in rows[-1][1:]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "vtc" and summary["steps"] == 3000
    assert summary["service"] == {"a": last[0], "b": last[1]}
    assert summary["weighted_service_per_step"] * 3000 == sum(last)
    # Weight 3 against 1, both backlogged the whole run: b gets about three quarters.
    assert 0.70 < last[1] / sum(last) < 0.80


def test_rpm_limit_throttles(tmp_path: Path) -> None:
    scenario = _small_scenario(tmp_path)
    _run(str(scenario), "--policy", "rpm", "--rpm", "2", "--out", str(tmp_path / "rpm"))
    _run(str(scenario), "--policy", "fcfs", "--out", str(tmp_path / "fcfs"))
    rpm = json.loads((tmp_path / "rpm" / "summary.json").read_text())
    fcfs = json.loads((tmp_path / "fcfs" / "summary.json").read_text())
    assert rpm["weighted_service_per_step"] < fcfs["weighted_service_per_step"] / 2


def test_bad_scenario_exits_2_naming_the_field(tmp_path: Path) -> None:
    done = _run(str(FIXTURES / "bad" / "negative_rate.yaml"), "--out", str(tmp_path))
    assert done.returncode == 2
    assert "tenants[1].arrivals[0].rate: must be >= 0" in done.stderr
    assert not (tmp_path / "service.csv").exists()


def test_rpm_flag_needs_rpm_policy(tmp_path: Path) -> None:
    done = _run(str(_small_scenario(tmp_path)), "--policy", "vtc", "--rpm", "5",
                "--out", str(tmp_path))
    assert done.returncode == 2
    assert "--rpm applies only to --policy rpm" in done.stderr


def test_unknown_policy_is_refused(tmp_path: Path) -> None:
    done = _run(str(_small_scenario(tmp_path)), "--policy", "wfq", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
