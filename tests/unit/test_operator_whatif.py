"""The operator's dry runs, pure parts (issue 29 point 4): which policies are dry runs, the
candidate config one asks about, and the WhatIf condition and ``status.whatIf`` table it gets."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import openapi_schema_validator
import pytest
import yaml

from fairway_operator import render
from fairway_operator.__main__ import parse_args
from fairway_operator.whatif import MAX_ROWS, WHAT_IF, DryRun, rows, status_patch
from picker.config.schema import load_config
from picker.whatif.recent import PREDICTED, WINDOW_TOO_SHORT, Prediction, TenantRow
from tests.unit.test_operator_render import BASE, policy

NOW = datetime(2026, 12, 3, 14, 0, 0, tzinfo=UTC)
CRD = Path(__file__).resolve().parents[2] / "manifests/crd/fairway.dev_tenantpolicies.yaml"


def assert_valid_policy(obj: dict) -> None:
    """The object (status included) fits the CRD's schema, as a real API server would demand."""
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    openapi_schema_validator.validate(obj, schema, cls=openapi_schema_validator.OAS30Validator)


def dry(p: dict, value: str = "true") -> dict:
    p["metadata"]["annotations"] = {render.DRY_RUN_ANNOTATION: value}
    return p


@pytest.mark.parametrize(("value", "expected"), [
    ("true", True), ("True", True), (" TRUE ", True), ("false", False), ("yes", False),
    ("", False)])
def test_only_the_annotation_true_makes_a_dry_run(value: str, expected: bool) -> None:
    assert render.is_dry_run(dry(policy("p", ["a"]), value)) is expected
    assert not render.is_dry_run(policy("p", ["a"]))
    assert not render.is_dry_run({"metadata": {"annotations": None}})


def test_a_dry_run_replaces_its_tenants_entries_in_the_live_config_and_adds_new_ones() -> None:
    live, _ = render.render(BASE, [policy("team-a", ["alice", "ann"], weight=1),
                                   policy("other", ["bob"], created="2025-01-02T00:00:00Z")])
    assert live is not None
    proposal = dry(policy("more-for-alice", ["alice", "carol"], weight=3, lane="online",
                          created="2025-01-03T00:00:00Z", generation=4))
    candidate, verdict = render.dry_run(live, BASE, proposal)
    assert candidate is not None
    assert candidate["tenants"] == [{"id": "alice", "weight": 3, "lane": "online"},
                                    {"id": "ann", "weight": 1}, {"id": "bob"},
                                    {"id": "carol", "weight": 3, "lane": "online"}]
    load_config(candidate)
    # Not ready (never in the picker's config), and says where the answer is.
    assert (verdict.ready, verdict.reason, verdict.generation) == (False, render.DRY_RUN, 4)
    assert verdict.tenants == ("alice", "carol") and "status.whatIf" in verdict.message
    assert [t["id"] for t in live["tenants"]] == ["alice", "ann", "bob"]  # live untouched


def test_a_dry_run_the_picker_would_refuse_gets_no_candidate() -> None:
    live, _ = render.render(BASE, [])
    candidate, verdict = render.dry_run(live, BASE, dry(policy("typo", ["a"], lane="gold")))
    assert candidate is None and verdict.reason == render.INVALID_POLICY
    assert "lane" in verdict.message and "gold" in verdict.message
    candidate, verdict = render.dry_run(None, BASE, dry(policy("p", ["a"])))
    assert candidate is None and verdict.reason == render.INVALID_BASE_CONFIG


def _dry_run() -> DryRun:
    return DryRun("inference", "more-for-alice", 4, ("alice",), {"tenants": []}, {"tenants": []})


def _prediction(verdict: str = PREDICTED, tenants: int = 2) -> Prediction:
    rows_ = [TenantRow("alice", (0.5, 0.75), (0.12, 0.08), (0, 0), 300),
             TenantRow("bob", (0.5, 0.25), (0.12, None), (0, 12), 300)]
    rows_ += [TenantRow(f"t{i}", (0.0, 0.0), (None, None), (0, 0), 1) for i in range(tenants - 2)]
    window = {"from": NOW.timestamp() - 900, "to": NOW.timestamp() - 1, "seconds": 899,
              "requests": 600, "skipped": 2, "askedSeconds": 900, "truncated": False}
    return Prediction(verdict, "replayed 600 requests over the last 15.0 min (asked: 15)",
                      window, ["endpoints 2 (served requests in the log)"],
                      rows_ if verdict == PREDICTED else [])


def test_a_prediction_becomes_a_condition_and_a_compact_table() -> None:
    ready = {"type": "Ready", "status": "False", "reason": "DryRun", "message": "a dry run",
             "lastTransitionTime": "2026-12-03T13:00:00Z"}
    patch = status_patch({"conditions": [ready]}, _dry_run(), prediction=_prediction(), now=NOW)
    ready_kept, condition = patch["conditions"]
    assert ready_kept == ready  # the reconciler's condition is left as it is
    assert (condition["type"], condition["status"], condition["reason"]) == (
        WHAT_IF, "True", PREDICTED)
    assert condition["observedGeneration"] == 4 and "600 requests" in condition["message"]
    what_if = patch["whatIf"]
    assert what_if["tenants"] == [
        {"tenant": "alice", "share": "50.0% → 75.0%", "ttftP95": "120 ms → 80 ms",
         "refused429": "0 → 0", "requests": 300},
        {"tenant": "bob", "share": "50.0% → 25.0%", "ttftP95": "120 ms → -",
         "refused429": "0 → 12", "requests": 300}]
    assert what_if["window"] == {"from": "2026-12-03T13:45:00Z", "to": "2026-12-03T13:59:59Z",
                                 "requests": 600, "skipped": 2, "truncated": False}
    assert what_if["observedGeneration"] == 4 and what_if["lastUpdated"] == "2026-12-03T14:00:00Z"
    assert what_if["pool"] == "endpoints 2 (served requests in the log)"
    # What a real API server would accept: the CRD's schema.
    body = policy("more-for-alice", ["alice"])
    body["status"] = {**patch}
    assert_valid_policy(body)
    assert len(rows(_prediction(tenants=50))) == MAX_ROWS


def test_a_window_too_short_says_so_and_clears_the_old_table() -> None:
    before = status_patch({}, _dry_run(), prediction=_prediction(), now=NOW)
    later = datetime(2026, 12, 3, 14, 5, tzinfo=UTC)
    short = Prediction(WINDOW_TOO_SHORT, "the picker's recent requests hold 3 request(s) over "
                       "2 s of the last 15 min; a prediction needs at least 50 over 60 s",
                       {"from": 0, "to": 0, "seconds": 2, "requests": 3, "skipped": 0,
                        "askedSeconds": 900, "truncated": False})
    patch = status_patch(before, _dry_run(), prediction=short, now=later)
    (condition,) = patch["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", WINDOW_TOO_SHORT)
    assert "at least 50" in condition["message"]
    assert condition["lastTransitionTime"] == "2026-12-03T14:05:00Z"  # it flipped
    assert patch["whatIf"]["tenants"] is None and patch["whatIf"]["pool"] is None
    assert patch["whatIf"]["window"]["requests"] == 3


def test_a_failure_keeps_the_last_table_and_when_the_condition_last_flipped() -> None:
    short = status_patch({}, _dry_run(), prediction=_prediction(WINDOW_TOO_SHORT), now=NOW)
    later = datetime(2026, 12, 3, 14, 5, tzinfo=UTC)
    patch = status_patch(short, _dry_run(), failure=("PickerUnreachable", "127.0.0.1:1: "
                                                     "UNAVAILABLE"), now=later)
    assert set(patch) == {"conditions"}  # status.whatIf is left as it was
    (condition,) = patch["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "PickerUnreachable")
    assert condition["lastTransitionTime"] == "2026-12-03T14:00:00Z"  # still False since then


def test_the_what_if_bounds_are_flags() -> None:
    settings, _ = parse_args(["--pool", "p", "-n", "ns", "--whatif-minutes", "5",
                              "--whatif-max-records", "1000", "--whatif-timeout", "20",
                              "--whatif-min-requests", "10", "--whatif-min-seconds", "30"])
    assert (settings.whatif_minutes, settings.whatif_max_records, settings.whatif_timeout,
            settings.whatif_min_requests, settings.whatif_min_seconds) == (5, 1000, 20, 10, 30)
    with pytest.raises(SystemExit):
        parse_args(["--pool", "p", "-n", "ns", "--whatif-minutes", "0"])


def test_the_crd_documents_the_annotation() -> None:
    assert render.DRY_RUN_ANNOTATION in CRD.read_text()
