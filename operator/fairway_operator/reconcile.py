"""Reconciling one pool in one namespace: read everything, render, write what changed.

The output is a function of what exists now (the pool's policies, the base ConfigMap, the
referenced Secrets), so every trigger runs the same whole-pool reconcile. Reconciles of a
namespace run one at a time; a caller that arrives while one runs is served by the next run,
which starts after its request (so bursts of events cost two runs, not one per event).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from fairway_operator import render
from fairway_operator.kube import ApiError, Kube, PermanentApiError
from fairway_operator.settings import Settings
from fairway_operator.whatif import DryRun
from picker.errors import ConfigError

log = logging.getLogger("fairway_operator")

READY = "Ready"
MAX_MESSAGE = 4096
"""Longest condition message written (the API allows 32768)."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "fairway-operator"}


class Reconciler:
    """Renders the pool of ``settings`` into the output ConfigMap of each namespace."""

    def __init__(self, settings: Settings, kube: Kube) -> None:
        self.settings = settings
        self.kube = kube
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._wanted: defaultdict[str, int] = defaultdict(int)
        self._done: defaultdict[str, int] = defaultdict(int)
        self._retries: dict[str, asyncio.Task[None]] = {}
        self._verdicts: dict[str, dict[str, render.Verdict]] = {}
        self._dry_runs: dict[str, dict[str, DryRun]] = {}

    async def reconcile(self, namespace: str) -> dict[str, render.Verdict]:
        """Reconcile ``namespace`` now (or join a run that starts after this call).

        Returns the verdicts of the run that covered this call, by policy name. Raises
        ``kube.ApiError`` when the API fails.
        """
        self._wanted[namespace] += 1
        ticket = self._wanted[namespace]
        async with self._locks[namespace]:
            if self._done[namespace] < ticket:
                covered = self._wanted[namespace]
                self._verdicts[namespace] = await self._reconcile_once(namespace)
                self._done[namespace] = max(self._done[namespace], covered)
            return self._verdicts[namespace]

    def applied(self) -> list[tuple[str, render.Verdict]]:
        """``(namespace, verdict)`` of every policy that the latest reconcile of its namespace
        put in the picker config."""
        return [(namespace, verdict) for namespace, verdicts in self._verdicts.items()
                for verdict in verdicts.values() if verdict.ready]

    def lock(self, namespace: str) -> asyncio.Lock:
        """Held while ``namespace`` is reconciled: another writer of the policies' conditions
        (the dry-run answers) holds it too, so neither overwrites the other's condition with a
        list read before it was written."""
        return self._locks[namespace]

    def dry_runs(self) -> list[DryRun]:
        """The dry-run policies of the latest reconcile of each namespace that have a candidate
        config to replay (refused ones have none)."""
        return [dry for runs in self._dry_runs.values() for dry in runs.values()]

    def request(self, namespace: str) -> None:
        """Reconcile ``namespace`` in the background, retrying with backoff until it succeeds
        (for triggers whose handlers kopf does not retry: ConfigMap and Secret events)."""
        self._wanted[namespace] += 1
        task = self._retries.get(namespace)
        if task is None or task.done():
            self._retries[namespace] = asyncio.create_task(self._retry(namespace),
                                                           name=f"reconcile {namespace}")

    async def _retry(self, namespace: str) -> None:
        delay = 1.0
        while self._done[namespace] < self._wanted[namespace]:
            try:
                await self.reconcile(namespace)
            except PermanentApiError as exc:
                log.error("Reconciling %s failed for good: %s", namespace, exc)
                return
            except ApiError as exc:
                log.warning("Reconciling %s failed, retrying in %.0f s: %s",
                            namespace, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def close(self) -> None:
        tasks = [t for t in self._retries.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _reconcile_once(self, namespace: str) -> dict[str, render.Verdict]:
        s = self.settings
        problem = "base config: tenancy.apiKeys: apiKey mode needs at least one key"
        chosen = render.select_policies(await self.kube.list_policies(namespace), s.pool)
        # Dry runs are never rendered into the picker's config: each is answered beside it.
        policies = [p for p in chosen if not render.is_dry_run(p)]
        dry_policies = [p for p in chosen if render.is_dry_run(p)]
        secrets: dict[str, Mapping[str, str] | None] = {}
        base: Any = None
        base_cm = await self.kube.get_configmap(namespace, s.base_configmap)
        try:
            data = (base_cm.get("data") or {}) if base_cm is not None else None
            base = render.parse_base(data, s.base_key, s.base_configmap)
            render.check_base(base)
        except ConfigError as exc:
            problem = f"base config: {exc}"
            config, verdicts = None, render.refuse_all(policies, render.INVALID_BASE_CONFIG,
                                                       problem)
        else:
            for name in sorted(render.secret_names(chosen)):
                secret = await self.kube.get_secret(namespace, name)
                secrets[name] = None if secret is None else _secret_data(secret)
            config, verdicts = render.render(base, policies, secrets)

        if config is None:
            if policies or base_cm is not None:  # else: a namespace without this pool
                problem = next(iter(verdicts.values())).message if verdicts else problem
                log.warning("%s: the picker config is left as it is: %s", namespace, problem)
        else:
            await self._write_output(namespace, render.dump(config, s.pool), base_cm)
        runs: dict[str, DryRun] = {}
        for policy in dry_policies:
            candidate, verdict = render.dry_run(config, base, policy, secrets)
            verdicts[verdict.name] = verdict
            if candidate is not None and config is not None:
                runs[verdict.name] = DryRun(namespace, verdict.name, verdict.generation,
                                            verdict.tenants, config, candidate)
        self._dry_runs[namespace] = runs
        # The pool's profile goes on every policy's status, dry runs' too: it is in force for
        # their tenants. None (no config written): the picker keeps its last, left as said.
        profile = None if config is None else render.capacity_profile(config)
        for policy in chosen:
            verdict = verdicts[policy["metadata"]["name"]]
            status = policy.get("status") or {}
            change = status_patch(status, verdict, profile=profile)
            if change is not None:
                await self.kube.patch_policy_status(namespace, verdict.name, change)
            if verdict_changed(status, verdict):
                await self._post_event(namespace, policy, verdict)
        return verdicts

    async def _post_event(self, namespace: str, policy: Mapping[str, Any],
                          verdict: render.Verdict) -> None:
        # An Event is what `kubectl describe` and dashboards show; losing one loses nothing the
        # status does not also say, so a refused Event is logged, never retried.
        kind = "Normal" if verdict.ready else "Warning"
        try:
            await self.kube.post_event(namespace, policy, kind, verdict.reason, verdict.message)
        except ApiError as exc:
            log.warning("%s/%s: Event not posted: %s", namespace, verdict.name, exc)

    async def _write_output(self, namespace: str, text: str,
                            base_cm: Mapping[str, Any] | None) -> None:
        s = self.settings
        current = await self.kube.get_configmap(namespace, s.output_configmap)
        # Owned by the base ConfigMap (the chart's): uninstalling the release deletes the base,
        # and the garbage collector the rendered config with it.
        owners = _owner_of(base_cm)
        if current is None:
            metadata: dict[str, Any] = {"name": s.output_configmap, "namespace": namespace,
                                        "labels": {**MANAGED_BY, "fairway.dev/pool": s.pool}}
            if owners:
                metadata["ownerReferences"] = owners
            await self.kube.create_configmap(namespace, {
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                "data": {s.output_key: text}})
            log.info("%s/%s: created with the picker config", namespace, s.output_configmap)
            return
        patch: dict[str, Any] = {}
        if (current.get("data") or {}).get(s.output_key) != text:
            patch["data"] = {s.output_key: text}
        if owners and not (current.get("metadata") or {}).get("ownerReferences"):
            patch["metadata"] = {"ownerReferences": owners}
        if patch:
            await self.kube.patch_configmap(namespace, s.output_configmap, patch)
            log.info("%s/%s: picker config updated", namespace, s.output_configmap)


def _owner_of(configmap: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    meta = (configmap or {}).get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        return []
    return [{"apiVersion": "v1", "kind": "ConfigMap", "name": meta["name"], "uid": meta["uid"]}]


def _secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    data = dict(secret.get("data") or {})
    # Kubernetes turns stringData into data on write; honour it where it was not (tests, mocks).
    for key, value in (secret.get("stringData") or {}).items():
        data.setdefault(key, base64.b64encode(str(value).encode()).decode())
    return data


def verdict_changed(status: Mapping[str, Any], verdict: render.Verdict) -> bool:
    """True when ``verdict`` says something the policy's Ready condition does not say yet
    (status, reason or message): an Event is posted then, not at every reconcile."""
    old = _ready_condition(status)
    return old is None or (old.get("status"), old.get("reason"), old.get("message")) != (
        "True" if verdict.ready else "False", verdict.reason, verdict.message[:MAX_MESSAGE])


def _ready_condition(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or ()
                 if isinstance(c, Mapping) and c.get("type") == READY), None)


def status_patch(status: Mapping[str, Any], verdict: render.Verdict,
                 now: datetime | None = None, *, profile: str | None = None) -> dict | None:
    """The status change that records ``verdict`` (its Ready condition and
    ``observedGeneration``) and the pool's ``capacityProfile`` (when ``profile`` is known), or
    None when the status already says so.

    ``lastTransitionTime`` moves only when the condition's status flips."""
    change = _verdict_patch(status, verdict, now)
    if profile is not None and status.get("capacityProfile") != profile:
        change = {**(change or {}), "capacityProfile": profile}
    return change


def _verdict_patch(status: Mapping[str, Any], verdict: render.Verdict,
                   now: datetime | None) -> dict | None:
    conditions = [c for c in status.get("conditions") or () if isinstance(c, Mapping)]
    old = _ready_condition(status)
    flag = "True" if verdict.ready else "False"
    wanted: dict[str, object] = {"type": READY, "status": flag, "reason": verdict.reason,
              "message": verdict.message[:MAX_MESSAGE]}
    if verdict.generation is not None:
        wanted["observedGeneration"] = verdict.generation
    same = old is not None and all(old.get(k) == v for k, v in wanted.items())
    if same and (verdict.generation is None
                 or status.get("observedGeneration") == verdict.generation):
        return None
    if old is not None and old.get("status") == flag and old.get("lastTransitionTime"):
        wanted["lastTransitionTime"] = old["lastTransitionTime"]
    else:
        when = now or datetime.now(UTC)
        wanted["lastTransitionTime"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    others = [dict(c) for c in conditions if c.get("type") != READY]
    change: dict[str, Any] = {"conditions": [*others, wanted]}
    if verdict.generation is not None:
        change["observedGeneration"] = verdict.generation
    return change
