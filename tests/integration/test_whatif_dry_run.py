"""A what-if against a running picker (issue 29 point 4): real Envoy, the picker as a process
(``picker.stack.launcher.Stack``) and a simulated vLLM server serve two tenants; then

- the picker's admin API answers the requests it served (``RecentRequests``);
- ``python -m picker.ctl whatif`` replays them under a candidate TenantPolicy from outside, and
  says when the window is too short;
- the operator (in-process, kopf against kmock's Kubernetes emulator, as in test_operator.py)
  answers a dry-run TenantPolicy into its status from the same picker, and keeps it out of the
  picker's config.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.stack.launcher import Stack
from tests.integration.test_admin_api import _post, _settled
from tests.integration.test_operator import (  # noqa: F401 (cluster: a fixture)
    NS,
    POOL,
    Cluster,
    assert_valid_policy,
    cluster,
    eventually,
    running_operator,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SENT = {"alice": 12, "bob": 8}
RELAXED = ["--min-requests", "10", "--min-seconds", "0"]
"""A few seconds of test traffic is below the default bounds (50 requests over 60 s)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {"tenants": [{"id": "alice"}, {"id": "bob"}]}
    with Stack(tmp_path_factory.mktemp("whatif"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "2"], picker_config=config) as running:
        # Interleaved, one at a time: alice 12 and bob 8 requests over a few seconds.
        order = sorted((i / count, tenant) for tenant, count in SENT.items()
                       for i in range(count))
        for _, tenant in order:
            assert _post(running, tenant) == 200
        _settled(running, sum(SENT.values()))
        yield running


def _files(tmp_path: Path) -> tuple[Path, Path]:
    baseline = tmp_path / "current.yaml"
    baseline.write_text(yaml.safe_dump({"tenants": [{"id": "alice"}, {"id": "bob"}]}))
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text(yaml.safe_dump({
        "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
        "metadata": {"name": "alice-more"},
        "spec": {"poolRef": {"name": POOL}, "tenants": ["alice"], "weight": 3}}))
    return baseline, candidate


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker.ctl", "whatif", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_admin_api_answers_the_requests_served(stack: Stack) -> None:
    with grpc.insecure_channel(stack.admin_address) as channel:
        answer = admin_pb2_grpc.AdminStub(channel).RecentRequests(
            admin_pb2.RecentRequestsRequest(since_seconds=600), timeout=15)
    by_tenant: dict[str, int] = {}
    for record in answer.records:
        by_tenant[record.tenant_id] = by_tenant.get(record.tenant_id, 0) + 1
    assert by_tenant == SENT
    record = answer.records[0]
    assert record.outcome == "ok" and record.endpoint and record.max_tokens == 8
    assert record.completion_tokens == 8 and record.prompt_tokens > 0
    assert 0 < record.timestamp - record.arrived_at < 15
    assert record.HasField("ttft_ms") and record.e2e_ms >= record.ttft_ms
    assert answer.held == sum(SENT.values()) and answer.capacity == 20_000


def test_ctl_whatif_replays_the_pickers_window_under_a_candidate(stack: Stack,
                                                                 tmp_path: Path) -> None:
    baseline, candidate = _files(tmp_path)
    done = _ctl("-f", str(candidate), "--baseline", str(baseline), "--admin",
                stack.admin_address, "--json", *RELAXED)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["verdict"] == "Predicted" and answer["window"]["requests"] == 20
    tenants = {t["tenant"]: t for t in answer["tenants"]}
    assert answer["tenants"][0]["tenant"] == "alice"  # the policy's first
    assert set(tenants) == {"alice", "bob"}
    for row in tenants.values():  # a light load: everyone is served under both
        assert row["refused_429"] == [0, 0] and row["requests"] == SENT[row["tenant"]]
        assert sum(row["share"]) > 0
    assert answer["picker"]["held"] == 20
    # The table a person reads.
    done = _ctl("-f", str(candidate), "--baseline", str(baseline), "--admin",
                stack.admin_address, *RELAXED)
    assert done.returncode == 0 and "alice" in done.stdout and "→" in done.stdout


def test_ctl_whatif_says_when_the_window_is_too_short(stack: Stack, tmp_path: Path) -> None:
    baseline, candidate = _files(tmp_path)
    done = _ctl("-f", str(candidate), "--baseline", str(baseline), "--admin",
                stack.admin_address)
    assert done.returncode == 3
    assert "hold 20 request(s)" in done.stdout and "at least 50" in done.stdout


def test_ctl_whatif_names_an_unreachable_picker_and_a_refused_candidate(
        tmp_path: Path) -> None:
    baseline, candidate = _files(tmp_path)
    done = _ctl("-f", str(candidate), "--baseline", str(baseline), "--admin", "127.0.0.1:9",
                "--timeout", "5")
    assert done.returncode == 1 and "127.0.0.1:9" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(candidate.read_text().replace("weight: 3", "lane: gold"))
    done = _ctl("-f", str(bad), "--baseline", str(baseline), "--admin", "127.0.0.1:9")
    assert done.returncode == 2 and "gold" in done.stderr


async def test_the_operator_answers_a_dry_run_policy_from_the_picker(
        stack: Stack, cluster: Cluster) -> None:  # noqa: F811
    await cluster.create_policy("team", ["alice", "bob"], weight=1)
    await cluster._send("POST", f"/apis/fairway.dev/v1alpha1/namespaces/{NS}/tenantpolicies", {
        "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
        "metadata": {"name": "alice-more", "namespace": NS,
                     "annotations": {"fairway.dev/dry-run": "true"}},
        "spec": {"poolRef": {"name": POOL}, "tenants": ["alice"], "weight": 3}})
    async with running_operator(cluster, admin_address=stack.admin_address, status_interval=0.2,
                                whatif_min_requests=10, whatif_min_seconds=0.0):
        def answered() -> dict:
            status = cluster.policy("alice-more")["status"]
            condition = next((c for c in status["conditions"] if c["type"] == "WhatIf"), None)
            assert condition is not None and condition["reason"] == "Predicted", status
            return status

        status = await eventually(answered, timeout=30)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "DryRun")
        what_if = status["whatIf"]
        assert what_if["window"]["requests"] == 20 and what_if["observedGeneration"] == 1
        rows = {row["tenant"]: row for row in what_if["tenants"]}
        assert what_if["tenants"][0]["tenant"] == "alice" and set(rows) == {"alice", "bob"}
        assert rows["alice"]["refused429"] == "0 → 0" and "→" in rows["alice"]["share"]
        assert_valid_policy(cluster.policy("alice-more"))
        # The live config has the applied policy's weight, never the dry run's.
        config = cluster.picker_config()
        assert config is not None
        assert {t["id"]: t.get("weight") for t in config["tenants"]} == {"alice": 1, "bob": 1}
        assert "share" not in status  # a dry run gets no live figures
