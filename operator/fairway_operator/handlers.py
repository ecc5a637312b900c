"""The kopf handlers: thin triggers of the whole-pool reconcile, and the live-figures loop.

- TenantPolicy of the pool created, changed or resumed (also: moved to another pool): reconcile
  now; Kubernetes API trouble → ``kopf.TemporaryError`` with backoff, a request the API refuses
  as such → ``kopf.PermanentError``. A policy that cannot apply is not an error of the handler:
  it gets ``Ready=False`` (and an Event) and is not retried.
- TenantPolicy of the pool deleted, the base or the output ConfigMap changed, or a Secret a
  policy of the pool references: reconcile in the background, retried with backoff (kopf does
  not retry event handlers).
- Every ``status_interval`` (with an admin address), one loop for the whole operator: each
  applied policy's status gets the picker's live figures. Another answers dry-run policies
  (``fairway.dev/dry-run: "true"``) with a replay of the picker's recent requests
  (``fairway_operator.whatif``). An unreachable picker is logged once
  (and once more when it answers again); the old figures stay.

No handler needs a finalizer: the output is rendered from what exists, so a deletion is seen as
it happens (a watch event), and one missed while the operator was down is made good by the
reconcile at its next start. So a policy never waits for the operator to be deleted, and
uninstalling the operator before the policies leaves nothing stuck terminating. Policies that
carry the finalizer of an older operator (``pool.fairway.dev/<pool>``) lose it at the next
start.

Everything is registered on a fresh ``kopf.OperatorRegistry``, so an operator can be built
more than once in a process (tests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from fairway_operator.figures import AdminClient, PickerUnreachable, figures
from fairway_operator.kube import GROUP, PLURAL, VERSION, ApiError, Kube, PermanentApiError
from fairway_operator.reconcile import Reconciler
from fairway_operator.render import DRY_RUN, pool_of
from fairway_operator.settings import Settings
from fairway_operator.whatif import run_dry_runs

log = logging.getLogger("fairway_operator")

MAX_BACKOFF = 60.0


def backoff(retry: int, first: float = 1.0, limit: float = MAX_BACKOFF) -> float:
    """Seconds before retry number ``retry`` (0, 1, …): doubling from ``first`` up to
    ``limit``."""
    return min(first * 2 ** min(retry, 30), limit)


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    """kopf's settings for this pool. Finalizer and annotations are named after the pool, so
    operators of several pools in one namespace do not take each other's marks."""
    ks = kopf.OperatorSettings()
    prefix = f"{settings.pool}.pool.fairway.dev"
    ks.persistence.finalizer = f"pool.fairway.dev/{settings.pool}"
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration")
    # Watching given namespaces needs no cluster-wide list of CRDs or namespaces, which the
    # chart's namespaced Role does not grant (kopf would log 403s and start late).
    ks.scanning.disabled = bool(settings.namespaces)
    ks.networking.request_timeout = max(settings.kube_timeout * 3, 30.0)
    return ks


def build_registry(settings: Settings, kube: Kube, *,
                   login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    """The handlers of an operator for ``settings``, writing through ``kube``; ``login``
    (a ``@kopf.on.login`` handler) defaults to ``kopf.login_via_client`` (in-cluster service
    account, else kubeconfig)."""
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler(settings, kube)
    admin = (AdminClient(settings.admin_address, timeout=settings.admin_timeout,
                         token_file=settings.admin_token_file,
                         max_age=min(1.0, settings.status_interval / 2),
                         reconnect_backoff=max(settings.status_interval, 1.0))
             if settings.admin_address else None)
    policy = (GROUP, VERSION, PLURAL)

    def ours_now(body: Mapping[str, Any], **_: Any) -> bool:
        return pool_of(body) == settings.pool

    def ours_before_or_now(body: Mapping[str, Any], old: Any = None, new: Any = None,
                           **_: Any) -> bool:
        return settings.pool in (pool_of(body), pool_of(old), pool_of(new))

    kopf.on.login(registry=registry)(login or kopf.login_via_client)

    loops: list[asyncio.Task[None]] = []
    if admin is not None:
        @kopf.on.startup(registry=registry)
        async def start_live_figures(**_: Any) -> None:
            loops.append(asyncio.create_task(
                copy_live_figures(reconciler, admin, kube, settings.status_interval),
                name="live-figures"))

    @kopf.on.startup(registry=registry)
    async def start_dry_runs(**_: Any) -> None:
        loops.append(asyncio.create_task(
            run_dry_runs(reconciler.dry_runs, admin, kube, settings, lock=reconciler.lock),
            name="dry-runs"))

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await reconciler.close()
        if admin is not None:
            await admin.close()
        kube.close()

    async def reconcile_pool(namespace: str, name: str, retry: int,
                             logger: logging.Logger) -> None:
        try:
            verdicts = await reconciler.reconcile(namespace)
        except PermanentApiError as exc:
            raise kopf.PermanentError(str(exc)) from None
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=backoff(retry)) from None
        verdict = verdicts.get(name)
        if verdict is None:
            logger.info(f"Not in pool {settings.pool}'s picker config (any more).")
        elif verdict.ready:
            logger.info(f"Applied: {verdict.message}.")
        elif verdict.reason == DRY_RUN:
            logger.info(f"Dry run: {verdict.message}.")
        else:
            logger.warning(f"Not applied ({verdict.reason}): {verdict.message}")

    @kopf.on.resume(*policy, id="policy", when=ours_now, registry=registry)
    @kopf.on.create(*policy, id="policy", when=ours_now, registry=registry)
    @kopf.on.update(*policy, id="policy", when=ours_before_or_now, registry=registry)
    async def policy_changed(namespace: str, name: str, retry: int, logger: logging.Logger,
                             **_: Any) -> None:
        await reconcile_pool(namespace, name, retry, logger)

    def deleted(type: str | None, **kwargs: Any) -> bool:
        return type == "DELETED" and ours_now(**kwargs)

    @kopf.on.event(*policy, id="policy-deleted", when=deleted, registry=registry)
    async def policy_deleted(namespace: str, name: str, logger: logging.Logger,
                             **_: Any) -> None:
        logger.info(f"Deleted: leaves pool {settings.pool}'s picker config.")
        reconciler.request(namespace)

    @kopf.index(*policy, id="secret_refs", when=ours_now, registry=registry)
    def secret_refs(namespace: str, spec: Mapping[str, Any], **_: Any) -> dict | None:
        ref = spec.get("apiKeySecretRef")
        secret = ref.get("name") if isinstance(ref, Mapping) else None
        return {(namespace, secret): True} if isinstance(secret, str) and secret else None

    configmaps = {settings.base_configmap, settings.output_configmap}

    @kopf.on.event("v1", "configmaps", id="configmap",
                   when=lambda name, **_: name in configmaps, registry=registry)
    async def configmap_changed(namespace: str, **_: Any) -> None:
        reconciler.request(namespace)

    def referenced(namespace: str, name: str, secret_refs: kopf.Index, **_: Any) -> bool:
        return (namespace, name) in secret_refs

    @kopf.on.event("v1", "secrets", id="secret", when=referenced, registry=registry)
    async def secret_changed(namespace: str, **_: Any) -> None:
        reconciler.request(namespace)

    return registry


async def copy_live_figures(reconciler: Reconciler, admin: AdminClient, kube: Kube,
                            interval: float) -> None:
    """Every ``interval`` seconds, one admin API snapshot into the status of every applied
    policy. Trouble (the picker or the API unreachable) is logged when it starts and when it
    ends, not at every round: the figures already written stay, with their ``lastUpdated``."""
    trouble: dict[str, str | None] = {"picker": None, "api": None}

    def report(kind: str, problem: str | None) -> None:
        if problem is not None and trouble[kind] is None:
            log.warning("%s; policies keep the figures they have (said once until it ends)",
                        problem)
        elif problem is None and trouble[kind] is not None:
            log.info("live figures flow again (%s)", kind)
        trouble[kind] = problem

    while True:
        try:
            snapshot = await admin.snapshot()
        except PickerUnreachable as exc:
            report("picker", f"picker admin API unreachable: {exc}")
        else:
            report("picker", None)
            problem = None
            for namespace, verdict in reconciler.applied():
                try:
                    await kube.patch_policy_status(namespace, verdict.name,
                                                   figures(snapshot, verdict.tenants))
                except ApiError as exc:
                    problem = f"live figures not written: {exc}"
            report("api", problem)
        await asyncio.sleep(interval)
