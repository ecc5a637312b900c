"""``python -m picker.whatif`` (issue 29 points 1 and 5): baseline beside candidates, JSON and a
PNG; configs loaded as the picker loads them, a refused one named with its file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from picker.errors import ConfigError
from picker.whatif.__main__ import TENANT_POLICY_KEYS, apply_policies, load_config_file, main
from tests.unit.test_whatif_log import record, write

BASE = """\
capacity: {kvBudgetTokens: 4096}
tenants:
  - {id: a}
  - {id: b}
"""
CANDIDATE = """\
capacity: {kvBudgetTokens: 4096}
tenants:
  - id: a
    budgets: {burst: {tokens: 1500, per: 1h}}
  - {id: b}
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    lines = [record(i * 0.2, e2e_s=0.5, tenant="ab"[i % 2], prompt_tokens=100,
                    completion_tokens=50, max_tokens=50, ttft_ms=20.0) for i in range(40)]
    out = {"log": write(tmp_path, lines)}
    for name, text in (("base", BASE), ("candidate", CANDIDATE)):
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text, encoding="utf-8")
    return out


def test_json_puts_each_candidate_beside_the_baseline(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(files["log"]), "--baseline", str(files["base"]), "--candidate",
                 str(files["candidate"]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["log"]["used"] == 40 and out["log"]["skipped"] == 0
    assert out["pool"]["endpoints"] == 1  # the log's one endpoint
    assert out["pool"]["kv_budget_tokens"] == 4096
    # Time per output token: (500 - 20) ms over 49 tokens.
    assert out["pool"]["step_s"] == pytest.approx(0.48 / 49, rel=0.01)
    base = {row["tenant"]: row for row in out["baseline"]["tenants"]}
    (candidate,) = out["candidates"]
    cand = {row["tenant"]: row for row in candidate["tenants"]}
    assert base["a"]["refused_429"] == 0 and base["a"]["ok"] == 20
    assert cand["a"]["ok"] == 10 and cand["a"]["refused_429"] == 10  # 1500 / 150 a request
    # a's 11th request, at 20 × 0.2 s (arrivals land on the replay's steps of ~10 ms).
    assert cand["a"]["budget_out_s"] == pytest.approx(4.0, abs=0.01)
    assert cand["b"]["share"] > base["b"]["share"]
    for row in (base["a"], cand["b"]):
        assert row["ttft_s"]["p95"] is not None and row["queue_wait_s"]["p50"] is not None
    assert candidate["pool"]["tokens_per_s"] > 0 and 0 < candidate["pool"]["utilisation"] <= 1
    # What the log itself measured, summed as a replay is, for setting beside the baseline's.
    recorded = {row["tenant"]: row for row in out["recorded"]["tenants"]}
    assert recorded["a"]["ok"] == 20 and recorded["a"]["share"] == pytest.approx(0.5)
    assert recorded["a"]["ttft_s"]["p50"] == pytest.approx(0.020, rel=0.01)
    assert recorded["a"]["queue_wait_s"]["p95"] == 0.0


def test_the_table_and_the_plot(files: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "whatif.png"
    code = main([str(files["log"]), "--baseline", str(files["base"]), "--candidate",
                 str(files["candidate"]), "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("replayed 40 of 40 lines\npool: endpoints 1 (served requests in "
                          "the log)")
    assert "as recorded | the baseline's replay  (each column: as recorded, then the " \
        "baseline's replay)" in out
    assert f"baseline | {files['candidate']}  (each column: baseline, then " in out
    row = [line for line in out.splitlines() if line.startswith("a ")][-1]
    assert "|      0     10 |" in row  # 429s: none under the baseline, 10 under the candidate
    assert "pool: output tokens/s" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_refused_candidate_is_named_and_the_others_still_run(
        files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {id: a, weight: -2}\n", encoding="utf-8")
    code = main([str(files["log"]), "--baseline", str(files["base"]), "--candidate", str(bad),
                 "--candidate", str(files["candidate"]), "--json"])
    captured = capsys.readouterr()
    assert code == 1
    assert f"whatif: candidate {bad} is refused, not replayed: tenants[0].weight: " \
        in captured.err
    assert str(bad) in captured.err.splitlines()[0].rsplit("(", 1)[-1]
    out = json.loads(captured.out)
    assert [c["config"] for c in out["candidates"]] == [str(files["candidate"])]
    assert out["refused_configs"] == 1


def test_a_refused_baseline_stops_the_replay(files: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {id: a, wieght: 2}\n", encoding="utf-8")
    assert main([str(files["log"]), "--baseline", str(bad), "--candidate",
                 str(files["candidate"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("whatif: the baseline config is refused: tenants[0].wieght: ")


def test_bad_lines_are_reported_on_stderr_and_counted(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    log = files["log"]
    lines = log.read_text().splitlines()
    lines[2] = lines[2][:30]
    lines[5] = lines[5].replace('"prompt_tokens":100', '"prompt_tokens":"many"')
    log.write_text("\n".join(lines) + "\n")
    code = main([str(log), "--baseline", str(files["base"]), "--candidate",
                 str(files["candidate"])])
    captured = capsys.readouterr()
    assert code == 0
    assert "line 3: not a JSON record" in captured.err
    assert "line 6: field prompt_tokens: must be a whole number >= 0, got 'many'; skipped" \
        in captured.err
    assert captured.out.startswith("replayed 38 of 40 lines; skipped 2: 1 not JSON (truncated "
                                   "or corrupt), 1 with a missing or bad field\n")


def test_a_log_with_nothing_usable_says_so(tmp_path: Path, files: dict[str, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    log = write(tmp_path, ["{", "not json"])
    assert main([str(log), "--baseline", str(files["base"]), "--candidate",
                 str(files["candidate"])]) == 2
    err = capsys.readouterr().err
    assert f"whatif: {log}: no usable record in the log (replayed 0 of 2 lines; skipped 2" in err


def test_a_configmap_as_the_operator_renders_it_is_a_config(tmp_path: Path) -> None:
    configmap = tmp_path / "cm.yaml"
    configmap.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: fairway}\n"
        "data:\n  picker.yaml: |\n" + "".join(f"    {line}\n" for line in BASE.splitlines()),
        encoding="utf-8")
    config = load_config_file(configmap)
    assert [t.id for t in config.tenants] == ["a", "b"]
    empty = tmp_path / "empty-cm.yaml"
    empty.write_text("kind: ConfigMap\ndata: {other: x}\n", encoding="utf-8")
    with pytest.raises(Exception, match=r"data: the ConfigMap has no 'picker.yaml' key \(.*\)"):
        load_config_file(empty)


POLICY = """\
apiVersion: fairway.dev/v1alpha1
kind: TenantPolicy
metadata: {name: team-a, namespace: inference}
spec:
  poolRef: {name: llm-pool}
  tenants: [a]
  budgets: {burst: {tokens: 1500, per: 1h}}
"""


def test_a_tenant_policy_as_kubectl_applies_it_is_a_candidate(
        files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "team-a.yaml"
    policy.write_text(POLICY, encoding="utf-8")
    code = main([str(files["log"]), "--baseline", str(files["base"]), "--candidate",
                 str(policy), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    cand = {row["tenant"]: row for row in out["candidates"][0]["tenants"]}
    # The same as the config with a's budget: a refused past it, b untouched.
    assert cand["a"]["ok"] == 10 and cand["a"]["refused_429"] == 10
    assert cand["b"]["refused_429"] == 0 and cand["b"]["ok"] == 20


def test_a_policy_replaces_its_tenants_entries_and_adds_new_ones() -> None:
    base = {"capacity": {"kvBudgetTokens": 4096},
            "tenants": [{"id": "a", "weight": 5, "lane": "x"}, {"id": "b", "weight": 2}]}
    policy = {"kind": "TenantPolicy", "spec": {"tenants": ["a", "c"], "weight": 3,
                                               "poolRef": {"name": "p"}}}
    merged = apply_policies(base, [policy])
    # As the operator renders it: the entry is the policy's rules only (a's lane is gone).
    assert merged["tenants"] == [{"id": "a", "weight": 3}, {"id": "b", "weight": 2},
                                 {"id": "c", "weight": 3}]
    assert base["tenants"][0] == {"id": "a", "weight": 5, "lane": "x"}  # base unchanged
    with pytest.raises(ConfigError, match=r"spec\.tenants: must list at least one tenant id"):
        apply_policies(base, [{"kind": "TenantPolicy", "spec": {"weight": 2}}])


def test_a_bad_policy_candidate_is_refused_naming_the_file(
        files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "bad-policy.yaml"
    policy.write_text(POLICY.replace("tokens: 1500", "tokens: -5"), encoding="utf-8")
    code = main([str(files["log"]), "--baseline", str(files["base"]), "--candidate",
                 str(policy)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"candidate {policy} is refused, not replayed: tenants[0].budgets.burst.tokens: " \
        in err and f"({policy})" in err


def test_the_policy_keys_are_the_operators() -> None:
    from fairway_operator.render import TENANT_KEYS

    assert TENANT_POLICY_KEYS == TENANT_KEYS


@pytest.mark.parametrize(("option", "message"), [
    (["--step-ms", "0"], "--step-ms must be above 0"),
    (["--endpoints", "0"], "--endpoints must be at least 1"),
    (["--since", "last tuesday"], "neither unix seconds nor an ISO 8601 time"),
])
def test_bad_options_are_refused_before_any_replay(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], option: list[str],
        message: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([str(files["log"]), "--baseline", str(files["base"]), "--candidate",
              str(files["candidate"]), *option])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
