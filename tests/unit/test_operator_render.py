"""The operator's pure parts: TenantPolicies + base config → picker config and verdicts, the
Ready condition it records, and the live figures it copies from the admin API."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest
import yaml

from fairway_operator import render
from fairway_operator.__main__ import parse_args
from fairway_operator.figures import figures
from fairway_operator.handlers import backoff
from fairway_operator.kube import PermanentApiError, TransientApiError, classify
from fairway_operator.reconcile import status_patch
from fairway_operator.render import Verdict
from fairway_operator.settings import Settings
from picker.admin.v1 import admin_pb2
from picker.config.schema import load_config
from picker.identity import hash_api_key

BASE = {
    "lanes": [{"name": "online", "enginePriority": 0},
              {"name": "batch", "minShare": 0.2, "enginePriority": 10}],
    "queue": {"maxQueued": 1000, "maxWait": "60s"},
    "tenantDefaults": {"budgets": {"burst": {"tokens": 200000, "per": "60s"}},
                       "overBudget": {"action": "reject"}},
}
KEY_BASE = {**BASE, "tenancy": {"mode": "apiKey"}}
"""A base config in API-key mode with no key of its own: the policies bring them."""
KEY_A = "sk-acme-3c9a1e2b4d6f8a0c1e3b5d7f9a1c3e5b"
KEY_B = "sk-acme-second-0a2c4e6f8b1d3f5a7c9e1b3d"


def policy(name: str, tenants: list[str], *, created: str = "2025-01-01T00:00:00Z",
           generation: int = 1, pool: str = "llm-pool", **spec: object) -> dict:
    return {
        "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
        "metadata": {"name": name, "namespace": "inference", "generation": generation,
                     "creationTimestamp": created},
        "spec": {"poolRef": {"name": pool}, "tenants": tenants, **spec},
    }


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_good_policies_render_a_config_the_picker_accepts() -> None:
    policies = [
        policy("team-a", ["alice", "ann"], weight=2, lane="online", allowedLanes=["batch"],
               budgets={"burst": {"tokens": 50000, "per": "60s"}},
               overBudget={"action": "demote", "lane": "batch"},
               limits={"maxQueued": 100, "maxConcurrent": 16, "maxOutputTokens": 4096,
                       "outputLimit": "clamp"}),
        policy("nightly", ["etl"], created="2025-01-02T00:00:00Z", lane="batch"),
    ]
    config, verdicts = render.render(BASE, policies)

    loaded = load_config(config)
    assert [t.id for t in loaded.tenants] == ["alice", "ann", "etl"]
    alice = loaded.tenant("alice")
    assert alice.weight == 2 and alice.lane == "online" and alice.allowed_lanes == ("batch",)
    assert alice.budgets.burst.tokens == 50000 and alice.budgets.burst.per == 60.0
    assert alice.over_budget.action == "demote" and alice.over_budget.lane == "batch"
    assert alice.limits.max_concurrent == 16 and alice.limits.output_limit == "clamp"
    assert loaded.tenant("ann").weight == 2  # the weight is per tenant, not shared
    assert loaded.tenant("etl").lane == "batch" and loaded.tenant("etl").weight == 1.0
    assert loaded.tenancy.mode == "header"
    assert [lane.name for lane in loaded.lanes] == ["online", "batch"]  # base kept
    assert {n: (v.ready, v.reason) for n, v in verdicts.items()} == {
        "team-a": (True, "Applied"), "nightly": (True, "Applied")}
    assert verdicts["team-a"].tenants == ("alice", "ann")
    assert verdicts["team-a"].generation == 1
    assert "tenants" not in BASE  # the base is not modified

    text = render.dump(config, "llm-pool")
    assert text.startswith("#") and load_config(yaml.safe_load(text)) == loaded
    assert render.dump(config, "llm-pool") == text  # stable: equal configs, equal text


def test_a_policy_s_budget_reserve_rule_reaches_the_config() -> None:
    policies = [policy("lenient", ["lena"], budgets={"burst": {"tokens": 5000, "per": "60s"},
                                                      "reserve": "expected"}),
                policy("plain", ["paul"], created="2025-01-02T00:00:00Z",
                       budgets={"burst": {"tokens": 5000, "per": "60s"}})]
    config, verdicts = render.render(BASE, policies)
    loaded = load_config(config)
    assert all(v.ready for v in verdicts.values())
    assert loaded.tenant("lena").budgets.reserve == "expected"
    assert loaded.tenant("paul").budgets.reserve == "worstCase"  # the default
    _, refused = render.render(BASE, [policy("odd", ["olga"], budgets={"reserve": "never"})])
    assert not refused["odd"].ready


def test_unknown_lane_excludes_that_policy_and_keeps_the_others() -> None:
    policies = [policy("good", ["alice"], lane="online"),
                policy("typo", ["bob"], lane="gold", created="2025-01-02T00:00:00Z"),
                policy("demote-typo", ["carol"], overBudget={"action": "demote", "lane": "slow"}),
                policy("also-good", ["dave"], created="2025-01-03T00:00:00Z")]
    config, verdicts = render.render(BASE, policies)

    assert [t["id"] for t in config["tenants"]] == ["alice", "dave"]
    load_config(config)
    typo = verdicts["typo"]
    assert not typo.ready and typo.reason == "UnknownLane"
    assert "spec.lane" in typo.message and "gold" in typo.message
    assert "tenants[0].lane" in typo.message  # the picker config's path, too
    assert "online, batch" in typo.message
    assert verdicts["demote-typo"].reason == "UnknownLane"
    assert "spec.overBudget.lane" in verdicts["demote-typo"].message
    assert verdicts["good"].ready and verdicts["also-good"].ready


def test_a_policy_demoting_into_a_higher_lane_is_refused() -> None:
    policies = [policy("upward", ["bob"], lane="batch",
                       overBudget={"action": "demote", "lane": "online"}),
                policy("nowhere", ["carol"], overBudget={"action": "demote", "lane": "online"}),
                policy("downward", ["alice"], created="2025-01-02T00:00:00Z", lane="online",
                       overBudget={"action": "demote", "lane": "batch"})]
    config, verdicts = render.render(BASE, policies)

    upward = verdicts["upward"]
    assert not upward.ready and upward.reason == "InvalidPolicy"
    assert upward.message == (
        "spec.overBudget.lane: 'online' is above the tenant's lane 'batch'; demotion moves a "
        "request past its budget to a lower lane (lanes, highest priority first: online, batch) "
        "(picker config path tenants[0].overBudget.lane)")
    # Without a lane of its own a tenant is in the first lane: demoting into it does nothing
    # (the CRD's CEL rule cannot see this: it does not know the pool's lanes).
    nowhere = verdicts["nowhere"]
    assert nowhere.reason == "InvalidPolicy"
    assert nowhere.message.startswith(
        "spec.overBudget.lane: 'online' is the tenant's lane (the first lane, as it names none): "
        "demoting into it changes nothing")
    assert verdicts["downward"].ready
    assert [t["id"] for t in config["tenants"]] == ["alice"]


@pytest.mark.parametrize(("spec", "path"), [
    ({"budgets": {"burst": {"tokens": 0, "per": "60s"}}}, "spec.budgets.burst.tokens"),
    ({"budgets": {"burst": {"tokens": 10, "per": "soon"}}}, "spec.budgets.burst.per"),
    ({"budgets": {"sustained": {"tokens": 10}}}, "spec.budgets.sustained.per"),
    ({"weight": 0}, "spec.weight"),
    ({"overBudget": {"action": "demote"}}, "spec.overBudget.lane"),
    ({"limits": {"outputLimit": "truncate"}}, "spec.limits.outputLimit"),
])
def test_invalid_policy_is_refused_naming_the_field(spec: dict, path: str) -> None:
    config, verdicts = render.render(BASE, [policy("bad", ["bob"], **spec),
                                            policy("fine", ["alice"])])
    bad = verdicts["bad"]
    assert not bad.ready and bad.reason == "InvalidPolicy"
    assert bad.message.startswith(path + ":"), bad.message
    assert [t["id"] for t in config["tenants"]] == ["alice"]


def test_empty_or_repeated_tenants_are_refused() -> None:
    _, verdicts = render.render(BASE, [policy("empty", []), policy("twice", ["a", "a"])])
    assert verdicts["empty"].reason == "InvalidPolicy"
    assert "spec.tenants" in verdicts["empty"].message
    assert verdicts["twice"].reason == "InvalidPolicy"
    assert verdicts["twice"].message.startswith("spec.tenants[1]: duplicate tenant 'a'")


def test_duplicate_tenant_goes_to_the_older_policy() -> None:
    older = policy("zeta", ["alice", "shared"], created="2025-01-01T00:00:00Z", weight=3)
    younger = policy("alpha", ["shared", "bob"], created="2025-02-01T00:00:00Z")
    config, verdicts = render.render(BASE, [younger, older])  # input order does not matter

    assert [t["id"] for t in config["tenants"]] == ["alice", "shared"]
    assert config["tenants"][1]["weight"] == 3
    assert verdicts["zeta"].ready
    refused = verdicts["alpha"]
    assert not refused.ready and refused.reason == "DuplicateTenant"
    assert "'shared'" in refused.message and "zeta" in refused.message
    assert list(verdicts) == ["zeta", "alpha"]  # oldest first

    # Same age: the name decides.
    _, verdicts = render.render(BASE, [policy("b", ["x"]), policy("a", ["x"])])
    assert verdicts["a"].ready and verdicts["b"].reason == "DuplicateTenant"


def test_a_refused_policy_claims_no_tenant() -> None:
    broken_older = policy("old", ["alice"], lane="gold", created="2025-01-01T00:00:00Z")
    newer = policy("new", ["alice"], created="2025-02-01T00:00:00Z")
    config, verdicts = render.render(BASE, [broken_older, newer])
    assert verdicts["old"].reason == "UnknownLane" and verdicts["new"].ready
    assert [t["id"] for t in config["tenants"]] == ["alice"]


def test_api_keys_are_hashed_and_never_in_clear() -> None:
    policies = [policy("acme", ["partner-acme", "acme-staff"], apiKeySecretRef={"name": "keys"})]
    secrets = {"keys": {"primary": b64(KEY_A + "\n"), "secondary": b64(KEY_B)}}
    config, verdicts = render.render(KEY_BASE, policies, secrets)

    loaded = load_config(config)
    assert loaded.tenancy.mode == "apiKey"
    assert {(k.sha256, k.tenant) for k in loaded.tenancy.api_keys} == {
        (hash_api_key(KEY_A), "partner-acme"),  # trailing newline dropped
        (hash_api_key(KEY_B), "partner-acme"),  # several tenants: the first one
    }
    text = render.dump(config, "llm-pool")
    for key in (KEY_A, KEY_B):
        assert key not in text and b64(key) not in text
        assert all(key not in v.message for v in verdicts.values())
    assert verdicts["acme"].ready and "2 API key(s)" in verdicts["acme"].message


def test_secret_problems_refuse_only_that_policy() -> None:
    static = {"sha256": hash_api_key("sk-d-key"), "tenant": "d"}
    base = {**BASE, "tenancy": {"mode": "apiKey", "apiKeys": [static]}}
    policies = [policy("missing", ["a"], apiKeySecretRef={"name": "nope"}),
                policy("empty", ["b"], apiKeySecretRef={"name": "empty"}),
                policy("garbled", ["c"], apiKeySecretRef={"name": "garbled"}),
                policy("plain", ["d"], created="2025-01-02T00:00:00Z")]
    secrets = {"nope": None, "empty": {}, "garbled": {"k": "***not base64***"}}
    config, verdicts = render.render(base, policies, secrets)

    assert verdicts["missing"].reason == "SecretNotFound" and "nope" in verdicts["missing"].message
    assert verdicts["empty"].reason == "InvalidSecret"
    assert verdicts["garbled"].reason == "InvalidSecret" and "'k'" in verdicts["garbled"].message
    assert verdicts["plain"].ready
    assert [t["id"] for t in config["tenants"]] == ["d"]
    assert config["tenancy"]["apiKeys"] == [static]  # no key of the policies came through


def test_a_key_shared_by_two_policies_stays_with_the_older() -> None:
    policies = [policy("first", ["a"], apiKeySecretRef={"name": "s1"}),
                policy("second", ["b"], apiKeySecretRef={"name": "s2"},
                       created="2025-01-02T00:00:00Z")]
    secrets = {"s1": {"k": b64(KEY_A)}, "s2": {"k": b64(KEY_A), "other": b64(KEY_B)}}
    config, verdicts = render.render(KEY_BASE, policies, secrets)
    assert verdicts["first"].ready
    assert verdicts["second"].reason == "DuplicateApiKey"
    assert "first" in verdicts["second"].message
    assert KEY_A not in verdicts["second"].message
    assert [k["tenant"] for k in config["tenancy"]["apiKeys"]] == ["a"]


def test_base_keys_are_kept_and_api_key_mode_may_wait_for_policy_keys() -> None:
    config, verdicts = render.render(KEY_BASE, [policy("acme", ["acme"],
                                                       apiKeySecretRef={"name": "s"})],
                                     {"s": {"k": b64(KEY_A)}})
    assert verdicts["acme"].ready and load_config(config).tenancy.mode == "apiKey"

    # No key anywhere: the picker would refuse the config, so nothing is written.
    config, verdicts = render.render(KEY_BASE, [policy("plain", ["a"])])
    assert config is None
    assert verdicts["plain"].reason == "InvalidBaseConfig"
    assert "apiKeys" in verdicts["plain"].message

    static = {"sha256": hash_api_key("sk-admin-key"), "tenant": "ops"}
    base = {**BASE, "tenancy": {"mode": "apiKey", "apiKeys": [static]}}
    config, verdicts = render.render(base, [policy("acme", ["acme"],
                                                   apiKeySecretRef={"name": "s"})],
                                     {"s": {"k": b64(KEY_A)}})
    assert [k.tenant for k in load_config(config).tenancy.api_keys] == ["ops", "acme"]


def test_a_header_base_refuses_a_policy_with_api_keys_and_applies_the_others() -> None:
    policies = [policy("acme", ["partner-acme"], apiKeySecretRef={"name": "keys"}),
                policy("team-a", ["alice"], created="2025-01-02T00:00:00Z"),
                policy("team-b", ["bob"], created="2025-01-03T00:00:00Z")]
    config, verdicts = render.render(BASE, policies, {"keys": {"k": b64(KEY_A)}})

    acme = verdicts["acme"]
    assert not acme.ready and acme.reason == "ApiKeysNotEnabled"
    assert acme.message == (
        "spec.apiKeySecretRef: this pool does not use API keys: its base config identifies "
        "tenants by the gateway's header (tenancy.mode: header). To use API keys, the platform "
        "admin sets tenancy.mode: apiKey in the base config (then every tenant needs a key); or "
        "remove apiKeySecretRef")
    assert verdicts["team-a"].ready and verdicts["team-b"].ready
    loaded = load_config(config)
    assert loaded.tenancy.mode == "header" and loaded.tenancy.api_keys == ()  # nobody locked out
    assert [t.id for t in loaded.tenants] == ["alice", "bob"]


def test_an_api_key_base_refuses_a_keyless_policy_whose_tenants_have_no_key() -> None:
    policies = [policy("acme", ["partner-acme"], apiKeySecretRef={"name": "keys"}),
                policy("walk-ins", ["alice", "ann"], created="2025-01-02T00:00:00Z")]
    config, verdicts = render.render(KEY_BASE, policies, {"keys": {"k": b64(KEY_A)}})

    refused = verdicts["walk-ins"]
    assert not refused.ready and refused.reason == "TenantsUnidentifiable"
    assert refused.message == (
        "spec.apiKeySecretRef: not set, and the pool identifies tenants by API key "
        "(tenancy.mode: apiKey in the base config): no key names its tenant(s) alice, ann, so "
        "their requests would get 401. Add spec.apiKeySecretRef, or keys for them in the base "
        "config's tenancy.apiKeys")
    assert verdicts["acme"].ready
    assert [t["id"] for t in config["tenants"]] == ["partner-acme"]


def test_an_api_key_base_applies_a_keyless_policy_for_a_tenant_its_keys_name() -> None:
    static = {"sha256": hash_api_key("sk-ops-key"), "tenant": "ops"}
    base = {**BASE, "tenancy": {"mode": "apiKey", "apiKeys": [static]}}
    config, verdicts = render.render(base, [
        policy("ops", ["ops"], weight=4, lane="online"),
        policy("stranger", ["nobody"], created="2025-01-02T00:00:00Z")])

    assert verdicts["ops"].ready and verdicts["ops"].reason == "Applied"
    assert verdicts["stranger"].reason == "TenantsUnidentifiable"  # the key makes the difference
    loaded = load_config(config)
    assert loaded.tenant("ops").weight == 4  # the policy sets the weight of the base's tenant
    assert [(k.sha256, k.tenant) for k in loaded.tenancy.api_keys] == [(static["sha256"], "ops")]


def test_an_api_key_base_applies_a_policy_with_keys() -> None:
    static = {"sha256": hash_api_key("sk-ops-key"), "tenant": "ops"}
    base = {**BASE, "tenancy": {"mode": "apiKey", "apiKeys": [static]}}
    config, verdicts = render.render(base, [
        policy("acme", ["partner-acme"], apiKeySecretRef={"name": "keys"}),
        policy("ops", ["ops"], created="2025-01-02T00:00:00Z")], {"keys": {"k": b64(KEY_A)}})

    assert verdicts["acme"].ready and "1 API key(s)" in verdicts["acme"].message
    assert verdicts["ops"].ready
    loaded = load_config(config)
    assert loaded.tenancy.mode == "apiKey"
    assert [k.tenant for k in loaded.tenancy.api_keys] == ["ops", "partner-acme"]


@pytest.mark.parametrize("base", [
    {"lanes": []},
    {"lanes": [{"name": "online"}], "queue": {"maxQueued": 0}},
    {"lanez": [{"name": "online"}]},
    {**BASE, "tenants": [{"id": "sneaky"}]},
    {**BASE, "tenantDefaults": {"overBudget": {"action": "demote", "lane": "online"}}},
    ["not", "a", "mapping"],
])
def test_bad_base_refuses_every_policy_and_renders_nothing(base: object) -> None:
    config, verdicts = render.render(base, [policy("a", ["alice"]), policy("b", ["bob"])])
    assert config is None
    assert {v.reason for v in verdicts.values()} == {"InvalidBaseConfig"}
    assert all(not v.ready and v.message.startswith("base config") for v in verdicts.values())


def test_parse_base_from_the_configmap() -> None:
    assert render.parse_base({"base.yaml": "lanes: [{name: a}]"}, "base.yaml", "fb") == {
        "lanes": [{"name": "a"}]}
    assert render.parse_base({"base.yaml": ""}, "base.yaml", "fb") == {}
    for data, words in [(None, "not found"), ({}, "no key base.yaml"),
                        ({"base.yaml": "a: [1"}, "not valid YAML"),
                        ({"base.yaml": "- 1"}, "must hold a mapping")]:
        with pytest.raises(render.ConfigError, match=words):
            render.parse_base(data, "base.yaml", "fb")


def test_select_policies_takes_the_pool_and_skips_deleting_ones() -> None:
    deleting = policy("going", ["x"])
    deleting["metadata"]["deletionTimestamp"] = "2025-03-01T00:00:00Z"
    items = [policy("b", ["b"], created="2025-01-02T00:00:00Z"), policy("a", ["a"]),
             policy("other", ["o"], pool="other-pool"), deleting]
    assert [p["metadata"]["name"] for p in render.select_policies(items, "llm-pool")] == [
        "a", "b"]
    assert render.secret_names([policy("k", ["k"], apiKeySecretRef={"name": "s"}),
                                policy("n", ["n"])]) == {"s"}


def test_status_patch_records_the_verdict_once() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    ok = Verdict("p", True, "Applied", "tenant(s) a are in the picker config", 3)
    change = status_patch({}, ok, t0)
    assert change == {"observedGeneration": 3, "conditions": [{
        "type": "Ready", "status": "True", "reason": "Applied",
        "message": "tenant(s) a are in the picker config", "observedGeneration": 3,
        "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
    assert status_patch(change, ok) is None  # nothing new: no write

    newer = Verdict("p", True, "Applied", "tenant(s) a are in the picker config", 4)
    moved = status_patch(change, newer, datetime(2025, 2, 1, tzinfo=UTC))
    assert moved["observedGeneration"] == 4
    assert moved["conditions"][0]["lastTransitionTime"] == "2025-01-01T00:00:00Z"  # no flip

    bad = Verdict("p", False, "UnknownLane", "spec.lane: unknown lane 'x'", 5)
    flipped = status_patch({**change, "share": 0.5}, bad, datetime(2025, 3, 1, tzinfo=UTC))
    assert flipped["conditions"][0]["status"] == "False"
    assert flipped["conditions"][0]["lastTransitionTime"] == "2025-03-01T00:00:00Z"


def test_the_pools_capacity_profile_comes_from_the_base_config() -> None:
    config, verdicts = render.render(BASE, [policy("a", ["a"])])
    assert config is not None and verdicts["a"].ready
    assert render.capacity_profile(config) == "throughput"
    isolation = {**BASE, "capacity": {"profile": "isolation", "maxPrefillTokens": 8192}}
    config, verdicts = render.render(isolation, [policy("a", ["a"])])
    assert config is not None and verdicts["a"].ready
    assert config["capacity"] == {"profile": "isolation", "maxPrefillTokens": 8192}
    assert render.capacity_profile(config) == "isolation"


def test_status_patch_says_which_capacity_profile_is_in_force() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    ok = Verdict("p", True, "Applied", "tenant(s) a are in the picker config", 3)
    change = status_patch({}, ok, t0, profile="isolation")
    assert change is not None and change["capacityProfile"] == "isolation"
    assert change["conditions"][0]["reason"] == "Applied"
    assert status_patch(change, ok, profile="isolation") is None  # nothing new: no write
    # The base config switched the pool back: only the profile is written.
    assert status_patch(change, ok, profile="throughput") == {"capacityProfile": "throughput"}
    # No config written (a bad base config): the status keeps what it said.
    assert status_patch(change, ok) is None


def test_figures_sum_the_policys_tenants() -> None:
    def state(tenant: str, share: float, queued: int, running: int,
              budgets: tuple = ()) -> admin_pb2.TenantState:
        return admin_pb2.TenantState(
            tenant=tenant, service_share=share, queued_requests=queued,
            running_requests=running,
            budgets=[admin_pb2.BudgetWindow(window=w, remaining_tokens=r, capacity_tokens=c)
                     for w, r, c in budgets])

    snapshot = admin_pb2.ListTenantsResponse(taken_at_unix=1735689600.5, tenants=[
        state("a", 0.25, 2, 1, (("burst", 1200.0, 5000), ("sustained", -30.5, 10**6))),
        state("b", 0.125, 1, 3),
        state("stranger", 0.5, 9, 9),
    ])
    assert figures(snapshot, ["a", "b", "missing"]) == {
        "share": 0.375, "queuedRequests": 3, "runningRequests": 4,
        "budgetRemaining": {"burst": 1200, "sustained": -30.5},
        "lastUpdated": "2025-01-01T00:00:00Z",
    }
    assert figures(snapshot, ["b"])["budgetRemaining"] is None


def test_api_errors_are_sorted_into_retry_or_not() -> None:
    for status in (500, 503, 504, 429, 409, 403, None):
        assert isinstance(classify("x", status, "r"), TransientApiError), status
    for status in (400, 415, 422):
        assert isinstance(classify("x", status, "r"), PermanentApiError), status
    assert [backoff(r) for r in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


def test_settings_come_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIRWAY_POOL", "llm-pool")
    monkeypatch.setenv("FAIRWAY_NAMESPACES", "inference,batch")
    monkeypatch.setenv("FAIRWAY_ADMIN_ADDRESS", "picker-admin:9003")
    settings, _ = parse_args(["--status-interval", "30s", "--output-configmap", "cfg"])
    assert settings == Settings(pool="llm-pool", namespaces=("inference", "batch"),
                                admin_address="picker-admin:9003", status_interval=30.0,
                                output_configmap="cfg")
    assert settings.base_configmap == "fairway-base" and settings.output_key == "picker.yaml"

    monkeypatch.delenv("FAIRWAY_NAMESPACES")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    settings, _ = parse_args(["--pool", "p", "--all-namespaces"])
    assert settings.namespaces == () and settings.admin_address == "picker-admin:9003"
    with pytest.raises(SystemExit):
        parse_args(["--pool", "p"])  # no namespace and not --all-namespaces
    with pytest.raises(SystemExit):
        parse_args(["--pool", "p", "-A", "--status-interval", "soon"])
