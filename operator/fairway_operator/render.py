"""TenantPolicies of one pool, plus the base config, into the picker's config (pure: no API).

``render(base, policies, secrets)`` returns the picker config (a dict, validated with the picker's
own ``load_config``) and one ``Verdict`` per policy: applied, or refused with a reason and a
message naming the field. One bad policy never breaks the others; it is left out.

How a policy becomes config:

- one ``tenants`` entry per tenant id in ``spec.tenants``, each carrying the policy's ``weight``,
  ``lane``, ``allowedLanes``, ``budgets``, ``overBudget`` and ``limits`` (same camelCase keys);
- with ``spec.apiKeySecretRef``, every data value of that Secret (base64, as Kubernetes stores
  it; surrounding whitespace such as a trailing newline is dropped) is an API key. The config
  gets only its SHA-256, added to the base config's keys (``tenancy.apiKeys: [{sha256, tenant}]``).
  A key names one tenant, so **with several tenants in one policy, each key maps to the policy's
  first tenant** (give each tenant its own policy and Secret to tell them apart).

How requests name their tenant is the platform admin's choice, made in the base config
(``tenancy.mode``), never a policy's: in API-key mode every request without a known key gets
401, so one namespace's policy must not be able to switch the pool and lock out every tenant
the gateway's header names.

- ``tenancy.mode: header`` (the default): a policy with ``apiKeySecretRef`` is refused
  (``ApiKeysNotEnabled``); the other policies apply.
- ``tenancy.mode: apiKey``: the policies' keys are added. A policy without ``apiKeySecretRef``
  none of whose tenants has a key (in the base config or an applied policy) is refused
  (``TenantsUnidentifiable``: all its tenants' requests would get 401); one for tenants the base
  config's keys name applies (it sets their weight, lanes, budgets). The base config may hold no
  key of its own, leaving the keys to policies; with no key at all nothing is written and every
  policy is refused with ``InvalidBaseConfig``.

Policies are taken oldest first (``creationTimestamp``, then name). A tenant id or API key
claimed by an older applied policy stays with it; the younger policy is refused whole.

A policy annotated ``fairway.dev/dry-run: "true"`` is left out of ``render`` (the caller
separates them with ``is_dry_run``): ``dry_run`` gives the candidate config it asks about.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from picker.config.schema import load_config
from picker.config.strict import safe_load
from picker.errors import ConfigError
from picker.identity import hash_api_key

TENANT_KEYS = ("weight", "lane", "allowedLanes", "budgets", "overBudget", "limits")
"""Spec fields copied into each tenant entry as they are."""

APPLIED = "Applied"
INVALID_BASE_CONFIG = "InvalidBaseConfig"
INVALID_POLICY = "InvalidPolicy"
UNKNOWN_LANE = "UnknownLane"
DUPLICATE_TENANT = "DuplicateTenant"
DUPLICATE_API_KEY = "DuplicateApiKey"
SECRET_NOT_FOUND = "SecretNotFound"
INVALID_SECRET = "InvalidSecret"
API_KEYS_NOT_ENABLED = "ApiKeysNotEnabled"
TENANTS_UNIDENTIFIABLE = "TenantsUnidentifiable"
DRY_RUN = "DryRun"

DRY_RUN_ANNOTATION = "fairway.dev/dry-run"
"""A policy annotated ``"true"`` is never rendered into the picker's config: the operator
replays the picker's recent traffic under the config with it applied and writes the prediction
into its status (``fairway_operator.whatif``)."""

_TENANT_PATH = re.compile(r"^tenants\[(\d+)\](.*)$")


@dataclass(frozen=True)
class Verdict:
    """What became of one policy: ``Ready`` with a reason and a message."""

    name: str
    ready: bool
    reason: str
    message: str
    generation: int | None = None
    """``metadata.generation`` of the policy this verdict is about (its ``observedGeneration``)."""
    tenants: tuple[str, ...] = ()
    """The tenant ids the policy put in the config (empty when refused)."""


@dataclass(frozen=True)
class _Contribution:
    name: str
    entries: list[dict]
    keys: list[dict]
    generation: int | None


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def pool_of(policy: Mapping[str, Any] | None) -> str | None:
    """``spec.poolRef.name`` of a policy, or None."""
    if not isinstance(policy, Mapping):
        return None
    spec = policy.get("spec")
    ref = spec.get("poolRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None


def select_policies(items: Iterable[Mapping[str, Any]], pool: str) -> list[dict]:
    """The policies of ``pool`` that are not being deleted, oldest first."""
    chosen = [dict(p) for p in items
              if pool_of(p) == pool and not p.get("metadata", {}).get("deletionTimestamp")]
    return sorted(chosen, key=_age)


def is_dry_run(policy: Mapping[str, Any]) -> bool:
    """The policy carries ``fairway.dev/dry-run: "true"`` (any case; other values: no)."""
    annotations = (policy.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(DRY_RUN_ANNOTATION) if isinstance(annotations, Mapping) else None
    return isinstance(value, str) and value.strip().lower() == "true"


def dry_run(config: Mapping[str, Any] | None, base: Any, policy: Mapping[str, Any],
            secrets: Mapping[str, Mapping[str, str] | None] | None = None,
            ) -> tuple[dict | None, Verdict]:
    """The candidate config a dry-run ``policy`` asks about, and its verdict.

    The candidate is the live ``config`` (what ``render`` wrote, None when nothing could be)
    with the policy applied as ``kubectl apply`` would apply it: each of its tenants' entries
    replaces that tenant's entry (a dry run of a new weight for a tenant another policy holds is
    the usual question) or is added, and its API keys are added. Its verdict is ``DryRun``
    (Ready=False: it is not in the picker's config) with the tenants, or a refusal as a live
    policy would get one, with no candidate.
    """
    name, generation = _name(policy), _generation(policy)
    if config is None:
        return None, Verdict(name, False, INVALID_BASE_CONFIG,
                             "the base config is refused, so there is no config to compare "
                             "with (see the pool's other policies)", generation)
    try:
        contribution = _contribution(policy, secrets or {}, _api_key_mode(base))
    except _Refused as refused:
        return None, Verdict(name, False, refused.reason, refused.message, generation)
    candidate = copy.deepcopy(dict(config))
    tenants = [entry for entry in candidate.get("tenants") or () if isinstance(entry, dict)]
    for entry in contribution.entries:
        index = next((i for i, t in enumerate(tenants) if t.get("id") == entry["id"]), None)
        if index is None:
            tenants.append(copy.deepcopy(entry))
        else:
            tenants[index] = copy.deepcopy(entry)
    candidate["tenants"] = tenants
    if contribution.keys:
        tenancy = dict(candidate.get("tenancy") or {})
        tenancy["apiKeys"] = [*(tenancy.get("apiKeys") or ()), *copy.deepcopy(contribution.keys)]
        candidate["tenancy"] = tenancy
    try:
        load_config(candidate)
    except ConfigError as exc:
        return None, Verdict(name, False, INVALID_POLICY,
                             f"the picker would refuse the config with this policy: {exc}",
                             generation)
    ids = tuple(e["id"] for e in contribution.entries)
    return candidate, Verdict(
        name, False, DRY_RUN,
        f"a dry run ({DRY_RUN_ANNOTATION}): tenant(s) {', '.join(ids)} are not changed in the "
        "picker config; status.whatIf predicts what each tenant would get", generation, ids)


def capacity_profile(config: Mapping[str, Any]) -> str:
    """The ``capacity.profile`` in force under ``config`` (a config ``render`` wrote): each
    TenantPolicy's ``status.capacityProfile``. The base config chooses it, never a policy: it
    trades the whole pool's tokens for light tenants' latency (README, "What isolation costs")."""
    return load_config(dict(config)).capacity.profile


def secret_names(policies: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names of the Secrets the policies' ``apiKeySecretRef`` point at."""
    names = set()
    for policy in policies:
        name = _secret_ref(policy.get("spec"))
        if name:
            names.add(name)
    return names


def parse_base(data: Mapping[str, str] | None, key: str, configmap: str) -> dict:
    """The base config from a ConfigMap's ``data`` (None: no such ConfigMap).

    Raises ConfigError (path ``""``) when it is missing or not a YAML mapping; its content is
    checked by ``render``.
    """
    if data is None:
        raise ConfigError("", f"ConfigMap {configmap} not found")
    if key not in data:
        raise ConfigError("", f"ConfigMap {configmap} has no key {key}")
    try:
        base = safe_load(data[key])  # a key written twice is refused, as in a config file
    except yaml.YAMLError as exc:
        raise ConfigError("", f"ConfigMap {configmap} key {key} is not valid YAML: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} (ConfigMap {configmap} key {key})") from exc
    if base is None:
        base = {}
    if not isinstance(base, dict):
        raise ConfigError("", f"ConfigMap {configmap} key {key} must hold a mapping, "
                              f"not {type(base).__name__}")
    return base


def refuse_all(policies: Iterable[Mapping[str, Any]], reason: str,
               message: str) -> dict[str, Verdict]:
    """The same refusal for every policy (e.g. the base config is bad)."""
    return {_name(p): Verdict(_name(p), False, reason, message, _generation(p))
            for p in policies}


def render(base: Any, policies: Iterable[Mapping[str, Any]],
           secrets: Mapping[str, Mapping[str, str] | None] | None = None,
           ) -> tuple[dict | None, dict[str, Verdict]]:
    """The picker config for ``base`` plus ``policies``, and a verdict per policy (by name).

    ``secrets`` maps a Secret's name to its ``data`` (base64 values) or None when it does not
    exist. The config is None when the base config itself is bad: then every policy is refused
    with ``InvalidBaseConfig`` and nothing should be written.
    """
    policies = sorted((dict(p) for p in policies), key=_age)
    secrets = secrets or {}
    try:
        keys_required_later = _check_base(base)
    except ConfigError as exc:
        return None, refuse_all(policies, INVALID_BASE_CONFIG, f"base config: {exc}")

    verdicts: dict[str, Verdict] = {}
    accepted: list[_Contribution] = []
    tenant_owner: dict[str, str] = {}
    key_owner: dict[str, str] = {k["sha256"]: "the base config" for k in _base_keys(base)}
    keyed = {k["tenant"] for k in _base_keys(base)}
    api_key_mode = _api_key_mode(base)
    for policy in policies:
        name = _name(policy)
        try:
            contribution = _contribution(policy, secrets, api_key_mode)
            _check_alone(base, contribution, keys_required_later)
            _check_claims(contribution, tenant_owner, key_owner)
            if api_key_mode:
                _check_identifiable(contribution, keyed)
        except _Refused as refused:
            verdicts[name] = Verdict(name, False, refused.reason, refused.message,
                                     _generation(policy))
            continue
        accepted.append(contribution)
        for entry in contribution.entries:
            tenant_owner[entry["id"]] = name
        for key in contribution.keys:
            key_owner[key["sha256"]] = name
            keyed.add(key["tenant"])

    config = _assemble(base, accepted)
    try:
        load_config(config)
    except ConfigError as exc:
        if exc.path.startswith("tenancy.apiKeys") and not any(c.keys for c in accepted):
            message = f"base config: {exc} (and no applied TenantPolicy brings an API key)"
            return None, refuse_all(policies, INVALID_BASE_CONFIG, message)
        # Each policy passed on its own, yet together they fail: add them one at a time.
        config, accepted = _accept_one_by_one(base, accepted, verdicts)

    for contribution in accepted:
        tenants = tuple(e["id"] for e in contribution.entries)
        keys = f" and {len(contribution.keys)} API key(s)" if contribution.keys else ""
        verdicts[contribution.name] = Verdict(
            contribution.name, True, APPLIED,
            f"tenant(s) {', '.join(tenants)}{keys} are in the picker config",
            contribution.generation, tenants)
    return config, {p: verdicts[p] for p in (_name(x) for x in policies)}


def _accept_one_by_one(base: dict, candidates: list[_Contribution],
                       verdicts: dict[str, Verdict]) -> tuple[dict, list[_Contribution]]:
    accepted: list[_Contribution] = []
    for contribution in candidates:
        try:
            load_config(_assemble(base, [*accepted, contribution]))
        except ConfigError as exc:
            verdicts[contribution.name] = Verdict(
                contribution.name, False, INVALID_POLICY,
                f"conflicts with older policies: {exc}", contribution.generation)
            continue
        accepted.append(contribution)
    return _assemble(base, accepted), accepted


def check_base(base: Any) -> None:
    """ConfigError unless ``base`` is usable as a base config (``render`` checks it too)."""
    _check_base(base)


def _check_base(base: Any) -> bool:
    """ConfigError unless ``base`` is a usable base config; True when it asks for API-key mode
    without keys of its own (then some policy must bring one)."""
    if not isinstance(base, dict):
        raise ConfigError("", f"must be a mapping, not {type(base).__name__}")
    if base.get("tenants"):
        raise ConfigError("tenants", "must be empty in the base config: tenants come from "
                                     "TenantPolicies")
    probe = copy.deepcopy(base)
    probe["tenants"] = []
    try:
        load_config(probe)
    except ConfigError as exc:
        if exc.path != "tenancy.apiKeys":
            raise
        load_config(_header_mode(probe))  # anything else wrong?
        return True
    return False


def _api_key_mode(base: dict) -> bool:
    """Whether the base config identifies tenants by API key (only it decides)."""
    tenancy = base.get("tenancy")
    return isinstance(tenancy, dict) and tenancy.get("mode") == "apiKey"


def _header_mode(config: dict) -> dict:
    probe = copy.deepcopy(config)
    tenancy = probe.get("tenancy")
    if isinstance(tenancy, dict):
        tenancy["mode"] = "header"
    return probe


def _base_keys(base: dict) -> list[dict]:
    tenancy = base.get("tenancy") or {}
    keys = tenancy.get("apiKeys") if isinstance(tenancy, dict) else None
    return [k for k in keys or () if isinstance(k, dict) and isinstance(k.get("sha256"), str)]


def _contribution(policy: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str] | None],
                  api_key_mode: bool) -> _Contribution:
    spec = policy.get("spec")
    if not isinstance(spec, Mapping):
        raise _Refused(INVALID_POLICY, "spec: must be a mapping")
    tenants = spec.get("tenants")
    if not isinstance(tenants, list) or not tenants:
        raise _Refused(INVALID_POLICY, "spec.tenants: must list at least one tenant id")
    for i, tenant in enumerate(tenants):
        if not isinstance(tenant, str) or not tenant:
            raise _Refused(INVALID_POLICY,
                           f"spec.tenants[{i}]: must be a non-empty string, got {tenant!r}")
    rules = {key: copy.deepcopy(spec[key]) for key in TENANT_KEYS if spec.get(key) is not None}
    entries = [{"id": tenant, **copy.deepcopy(rules)} for tenant in tenants]
    keys = []
    secret = _secret_ref(spec)
    if "apiKeySecretRef" in spec and not secret:
        raise _Refused(INVALID_POLICY, "spec.apiKeySecretRef.name: must name a Secret")
    if secret and not api_key_mode:
        raise _Refused(API_KEYS_NOT_ENABLED,
                       "spec.apiKeySecretRef: this pool does not use API keys: its base config "
                       "identifies tenants by the gateway's header (tenancy.mode: header). To "
                       "use API keys, the platform admin sets tenancy.mode: apiKey in the base "
                       "config (then every tenant needs a key); or remove apiKeySecretRef")
    if secret:
        hashes = _key_hashes(secret, secrets.get(secret))
        keys = [{"sha256": digest, "tenant": tenants[0]} for digest in hashes]
    return _Contribution(_name(policy), entries, keys, _generation(policy))


def _key_hashes(secret: str, data: Mapping[str, str] | None) -> list[str]:
    """SHA-256 of each key in the Secret's data, in the order of the data keys, deduplicated.

    Messages never quote a key, only the data key it is stored under.
    """
    if data is None:
        raise _Refused(SECRET_NOT_FOUND,
                       f"spec.apiKeySecretRef: Secret {secret} not found in this namespace")
    if not data:
        raise _Refused(INVALID_SECRET, f"spec.apiKeySecretRef: Secret {secret} has no data "
                                       f"(each data value must be an API key)")
    hashes: list[str] = []
    for item in sorted(data):
        try:
            key = base64.b64decode(data[item], validate=True).decode("utf-8").strip()
        except (binascii.Error, ValueError, TypeError):
            raise _Refused(INVALID_SECRET, f"spec.apiKeySecretRef: Secret {secret}, data key "
                                           f"{item!r}: not base64 of UTF-8 text") from None
        if not key or any(c.isspace() for c in key):
            raise _Refused(INVALID_SECRET, f"spec.apiKeySecretRef: Secret {secret}, data key "
                                           f"{item!r}: an API key must be non-empty and "
                                           f"contain no whitespace")
        digest = hash_api_key(key)
        if digest not in hashes:
            hashes.append(digest)
    return hashes


def _check_alone(base: dict, contribution: _Contribution, keys_required_later: bool) -> None:
    """Refuse the policy if base + this policy alone is not a valid picker config."""
    probe = copy.deepcopy(base)
    probe["tenants"] = contribution.entries
    if keys_required_later:
        probe = _header_mode(probe)  # the keys may come from other policies
    try:
        load_config(probe)
    except ConfigError as exc:
        spec_path = _spec_path(exc.path)
        reason = UNKNOWN_LANE if exc.message.startswith("unknown lane") else INVALID_POLICY
        where = f" (picker config path {exc.path})" if exc.path != spec_path else ""
        raise _Refused(reason, f"{spec_path}: {exc.message}{where}") from None


def _check_identifiable(contribution: _Contribution, keyed: set[str]) -> None:
    """In API-key mode a request without a known key gets 401: refuse a policy that brings no
    key and none of whose tenants has one. ``keyed``: the tenants named by the base config's
    keys and older applied policies' (a younger policy's keys name its own tenant, which this
    policy cannot share)."""
    tenants = [entry["id"] for entry in contribution.entries]
    if contribution.keys or any(tenant in keyed for tenant in tenants):
        return
    raise _Refused(TENANTS_UNIDENTIFIABLE,
                   "spec.apiKeySecretRef: not set, and the pool identifies tenants by API key "
                   "(tenancy.mode: apiKey in the base config): no key names its tenant(s) "
                   f"{', '.join(tenants)}, so their requests would get 401. Add "
                   "spec.apiKeySecretRef, or keys for them in the base config's tenancy.apiKeys")


def _check_claims(contribution: _Contribution, tenant_owner: Mapping[str, str],
                  key_owner: Mapping[str, str]) -> None:
    for entry in contribution.entries:
        owner = tenant_owner.get(entry["id"])
        if owner is not None:
            raise _Refused(DUPLICATE_TENANT,
                           f"spec.tenants: tenant {entry['id']!r} already belongs to the older "
                           f"TenantPolicy {owner}")
    for key in contribution.keys:
        owner = key_owner.get(key["sha256"])
        if owner is not None:
            who = owner if owner == "the base config" else f"the older TenantPolicy {owner}"
            raise _Refused(DUPLICATE_API_KEY,
                           f"spec.apiKeySecretRef: an API key of this Secret (sha256 "
                           f"{key['sha256'][:12]}…) already belongs to {who}")


def _assemble(base: dict, accepted: list[_Contribution]) -> dict:
    config = copy.deepcopy(base)
    config["tenants"] = [entry for c in accepted for entry in copy.deepcopy(c.entries)]
    keys = [k for c in accepted for k in c.keys]
    if keys:  # the base config is in API-key mode: policies' keys are refused otherwise
        tenancy = dict(config["tenancy"])
        tenancy["apiKeys"] = [*_base_keys(base), *copy.deepcopy(keys)]
        config["tenancy"] = tenancy
    return config


def _spec_path(path: str) -> str:
    """``tenants[2].budgets.burst.per`` → ``spec.budgets.burst.per``; ``tenants[1].id`` →
    ``spec.tenants[1]``; other paths are left as they are."""
    match = _TENANT_PATH.match(path)
    if not match:
        return path
    rest = match.group(2)
    if rest in ("", ".id"):
        return f"spec.tenants[{match.group(1)}]"
    return "spec" + rest


def _secret_ref(spec: Any) -> str | None:
    ref = spec.get("apiKeySecretRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) and name else None


def _name(policy: Mapping[str, Any]) -> str:
    return str(policy.get("metadata", {}).get("name", ""))


def _generation(policy: Mapping[str, Any]) -> int | None:
    generation = policy.get("metadata", {}).get("generation")
    return generation if isinstance(generation, int) else None


def _age(policy: Mapping[str, Any]) -> tuple[str, str]:
    meta = policy.get("metadata", {})
    # RFC 3339 UTC timestamps sort as text; one without a timestamp counts as the newest.
    return (str(meta.get("creationTimestamp") or "~"), str(meta.get("name", "")))


def dump(config: Mapping[str, Any], pool: str) -> str:
    """The config as the YAML text the output ConfigMap holds (stable for equal configs)."""
    header = (f"# The fairway picker config of pool {pool}: the base config plus the pool's\n"
              f"# TenantPolicies, written by fairway-operator. Do not edit: it is rewritten.\n")
    return header + yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False,
                                   allow_unicode=True)
