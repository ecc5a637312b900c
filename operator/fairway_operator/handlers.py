"""The kopf handlers: thin triggers of the whole-pool reconcile, and the live-figures timer.

- TenantPolicy of the pool created, changed, resumed or deleted (also: moved to another pool):
  reconcile now; Kubernetes API trouble → ``kopf.TemporaryError`` with backoff, a request the
  API refuses as such → ``kopf.PermanentError``. A policy that cannot apply is not an error of
  the handler: it gets ``Ready=False`` and is not retried.
- The base or the output ConfigMap changed, or a Secret a policy of the pool references:
  reconcile in the background, retried with backoff (kopf does not retry event handlers).
- Every ``status_interval`` (with an admin address): each applied policy's status gets the
  picker's live figures; an unreachable picker → ``kopf.TemporaryError`` (old figures kept).

Everything is registered on a fresh ``kopf.OperatorRegistry``, so an operator can be built
more than once in a process (tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from fairway_operator.figures import AdminClient, PickerUnreachable, figures
from fairway_operator.kube import GROUP, PLURAL, VERSION, ApiError, Kube, PermanentApiError
from fairway_operator.reconcile import READY, Reconciler
from fairway_operator.render import pool_of
from fairway_operator.settings import Settings

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
    ks.posting.level = logging.WARNING  # refusals become Kubernetes Events on the policy
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

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await reconciler.close()
        if admin is not None:
            await admin.close()
        kube.close()

    async def reconcile_pool(namespace: str, name: str, retry: int,
                             logger: logging.Logger, deleting: bool = False) -> None:
        try:
            verdicts = await reconciler.reconcile(namespace)
        except PermanentApiError as exc:
            raise kopf.PermanentError(str(exc)) from None
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=backoff(retry)) from None
        verdict = verdicts.get(name)
        if deleting or verdict is None:
            logger.info(f"Not in pool {settings.pool}'s picker config (any more).")
        elif verdict.ready:
            logger.info(f"Applied: {verdict.message}.")
        else:
            logger.warning(f"Not applied ({verdict.reason}): {verdict.message}")

    @kopf.on.resume(*policy, id="policy", when=ours_now, registry=registry)
    @kopf.on.create(*policy, id="policy", when=ours_now, registry=registry)
    @kopf.on.update(*policy, id="policy", when=ours_before_or_now, registry=registry)
    async def policy_changed(namespace: str, name: str, retry: int, logger: logging.Logger,
                             **_: Any) -> None:
        await reconcile_pool(namespace, name, retry, logger)

    @kopf.on.delete(*policy, id="policy-deleted", when=ours_now, registry=registry)
    async def policy_deleted(namespace: str, name: str, retry: int, logger: logging.Logger,
                             **_: Any) -> None:
        await reconcile_pool(namespace, name, retry, logger, deleting=True)

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

    if admin is not None:
        @kopf.timer(*policy, id="live-figures", interval=settings.status_interval,
                    when=ours_now, registry=registry)
        async def live_figures(spec: Mapping[str, Any], status: Mapping[str, Any],
                               patch: kopf.Patch, retry: int, **_: Any) -> None:
            if not _ready(status):
                return
            tenants = [t for t in spec.get("tenants") or () if isinstance(t, str)]
            try:
                snapshot = await admin.snapshot()
            except PickerUnreachable as exc:
                delay = backoff(retry, settings.status_interval,
                                max(MAX_BACKOFF, settings.status_interval))
                raise kopf.TemporaryError(f"picker admin API unreachable, status figures "
                                          f"kept: {exc}", delay=delay) from None
            for key, value in figures(snapshot, tenants).items():
                patch.status[key] = value

    return registry


def _ready(status: Mapping[str, Any]) -> bool:
    return any(isinstance(c, Mapping) and c.get("type") == READY and c.get("status") == "True"
               for c in status.get("conditions") or ())
