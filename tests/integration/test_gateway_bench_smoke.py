"""Smoke test of the gateway benchmark: does ``bench.gateway --quick`` run every goal end to end
through real Envoy and write outputs of the right shape, with numbers present and sane?

It asserts no PASS/FAIL of the timing goals: timing lives in the benchmark's own output, not in
test assertions (a loaded CI machine must not turn a measurement into a test failure).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("## Goals", "## 1. Weighted shares", "## 2. A light tenant", "## 3. Pool throughput",
            "## 4. The picker's overhead", "## 5. Gateway-level VTC")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _finite(value) and value > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gateway")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-m", "bench.gateway", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads((out / "gateway.json").read_text()), proc.stdout


def test_writes_every_output(quick: tuple[Path, dict[str, Any], str]) -> None:
    out, data, stdout = quick
    for name in ("gateway.md", "gateway.json", "gateway.png"):
        assert (out / name).stat().st_size > 0, name
    markdown = (out / "gateway.md").read_text()
    for title in SECTIONS:
        assert title in markdown, title
        assert title in stdout, title
    assert "shared" in markdown.lower() and "load average" in markdown
    # The light runs beside the same traffic in the pool simulator (issue 12).
    assert "### Gateway vs pool simulator" in markdown
    versus = markdown.split("### Gateway vs pool simulator", 1)[1]
    table = [line for line in versus.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run |") and "light TTFT p50 ms" in table[0]
    assert sum("| gateway |" in line for line in table) == 4
    assert sum("| simulator |" in line for line in table) == 4
    assert set(data) >= {"meta", "goals", "fairness", "light", "throughput", "overhead", "drift"}


def test_meta_records_the_machine(quick: tuple[Path, dict[str, Any], str]) -> None:
    meta = quick[1]["meta"]
    assert meta["quick"] is True
    assert meta["goals"] == [1, 2, 3, 4, 5]
    assert meta["cpu_count"] >= 1
    for key in ("loadavg_start", "loadavg_end"):
        assert len(meta[key]) == 3 and all(_finite(v) and v >= 0 for v in meta[key])
    assert _positive(meta["runtime_seconds"])
    assert set(meta["phase_seconds"]) == {"overhead", "fairness", "light", "drift"}


def test_goals_have_verdicts_and_numbers(quick: tuple[Path, dict[str, Any], str]) -> None:
    goals = quick[1]["goals"]
    labels = [g["goal"].split(".")[0] for g in goals]
    assert labels == ["1", "2", "3", "4a", "4b", "4c", "4d", "5"]
    for goal in goals:
        assert goal["measured"] and goal["threshold"]
        assert goal["passed"] in (True, False, None)
        assert goal["value"] is None or _finite(goal["value"])
    assert [g["passed"] is None for g in goals] == [False] * 6 + [True, False]


def test_fairness_numbers_are_sane(quick: tuple[Path, dict[str, Any], str]) -> None:
    fair = quick[1]["fairness"]
    assert set(fair["runs"]) == {"vtc", "fcfs"}
    for run in fair["runs"].values():
        tenants = run["tenants"]
        assert set(tenants) == {"w1", "w2", "w3"}
        assert sum(t["share"] for t in tenants.values()) == pytest.approx(1.0, abs=1e-4)
        assert sum(t["target_share"] for t in tenants.values()) == pytest.approx(1.0, abs=1e-4)
        for t in tenants.values():
            assert 0 < t["share"] < 1 and t["ok"] > 0 and _positive(t["service_in_window"])
            assert _positive(t["ttft_ms"]["p50"])
        pool = run["pool"]
        assert _positive(pool["server_output_tokens_per_s"])
        assert _positive(pool["client_output_tokens_per_s"])
        assert pool["samples"] > 3
        assert all(_finite(v) and v >= 0 for v in run["resources"]["cpu_s"].values())
    vtc = fair["runs"]["vtc"]["tenants"]
    assert sum(t["picker_share"] for t in vtc.values()) == pytest.approx(1.0, abs=1e-4)
    # Weights 1:2:3: the heavier tenant gets more (a sanity check, not the 5 % goal), once
    # every tenant had enough requests served for a share to mean something (a starved machine
    # serves a handful in the smoke run's 3 s).
    if min(t["ok"] for t in vtc.values()) >= 10:
        assert vtc["w3"]["share"] > vtc["w1"]["share"]


def test_light_and_throughput_numbers_are_sane(quick: tuple[Path, dict[str, Any], str]) -> None:
    data = quick[1]
    runs = data["light"]["runs"]
    assert set(runs) == {"alone", "flood_vtc", "flood_fcfs", "flood_vtc_other"}
    assert data["light"]["other_reserve"] == "2s"  # the judged runs use the default, 0s
    for run in runs.values():
        assert run["ok"] > 0
        ttft = run["ttft_ms"]
        assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"] <= ttft["max"]
        assert _positive(run["p95_over_alone"])
        assert _finite(run["picker_hold_ms_mean"]) and run["picker_hold_ms_mean"] >= 0
    assert runs["alone"]["p95_over_alone"] == pytest.approx(1.0, abs=1e-4)
    versus = data["light"]["vs_simulator"]
    assert set(versus) == set(runs)
    for name, sides in versus.items():
        gateway, sim = sides["gateway"], sides["simulator"]
        # Same traffic on both sides: the same tenants and the same light requests.
        assert set(gateway["sent"]) == set(sim["sent"])
        assert gateway["sent"]["light"] == sim["sent"]["light"] == runs[name]["sent"]
        for side in (gateway, sim):
            assert side["ok"]["light"] > 0
            assert 0 < side["light_ttft_ms"]["p50"] <= side["light_ttft_ms"]["p95"]
            assert _positive(side["pool_tokens_per_s"])
            assert _positive(side["output_tokens_per_s"]["light"])
        if name != "alone":
            assert _positive(sim["output_tokens_per_s"]["flood"])
    rows = data["throughput"]["rows"]
    assert len(rows) == 2
    assert _positive(data["throughput"]["other_reserve_ratio"])
    for row in rows:
        assert _positive(row["ratio"]) and _positive(row["client_ratio"])
        assert _positive(row["vtc"]["server_output_tokens_per_s"])
        assert _positive(row["fcfs"]["server_output_tokens_per_s"])


def test_overhead_numbers_are_sane(quick: tuple[Path, dict[str, Any], str]) -> None:
    overhead = quick[1]["overhead"]
    at = overhead["requests"]["at_200"]
    for path in ("baseline", "picker"):
        stats = at[path]
        assert stats["ok"] > 0 and stats["sent"] >= stats["ok"]
        lat = stats["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"]
        assert _positive(stats["achieved_rate"])
    assert all(_finite(v) for v in at["added_ms"].values())
    assert at["ext_proc"]["sent_per_request"] >= 2  # headers and body at least
    assert set(at["cpu_ms_per_request"]) == {"baseline", "picker"}
    ladder = overhead["requests"]["ladder"]
    assert ladder[0]["rate"] == 200
    assert all(row.get("verdict") for row in ladder[:1])
    # The ladder climbs only past a rate that was sustained; whether a 1-second smoke block at
    # 200 req/s is sustained depends on how busy the machine is, so either shape is right.
    assert len(ladder) >= 2 or ladder[0]["verdict"] != "sustained"
    assert overhead["requests"]["stop_reason"]
    streams = overhead["streams"]
    for path in ("baseline", "picker"):
        delay = streams[path]["chunk_delay_ms"]
        assert delay["n"] > 0 and _finite(delay["p50"]) and _finite(delay["mean"])
        assert _positive(streams[path]["inter_arrival_ms"]["p50"])
    assert all(_finite(v) for v in streams["added_per_chunk_ms"].values())
    assert streams["incomplete_streams"] == 0


def test_drift_numbers_are_sane(quick: tuple[Path, dict[str, Any], str]) -> None:
    drift = quick[1]["drift"]
    gateway, engine = drift["gateway"], drift["engine"]
    assert gateway["bound"] == 2 * max(1 * 512, 2 * 2048)
    assert gateway["window_s"] is not None
    assert _finite(gateway["backlogged_drift"]) and gateway["backlogged_drift"] >= 0
    assert _finite(gateway["drift_over_bound"]) and gateway["drift_over_bound"] >= 0
    assert all(_positive(v) for v in gateway["services"].values())
    for policy in ("vtc", "fcfs"):
        assert engine[policy]["bound"] == gateway["bound"]
        assert _finite(engine[policy]["drift_over_bound"])
    # The simulator is deterministic: its VTC run stays within the bound.
    assert engine["vtc"]["backlogged_drift"] <= engine["vtc"]["bound"]
