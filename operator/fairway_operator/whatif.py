"""Dry-run TenantPolicies: what would each tenant get if this policy were applied?

A policy annotated ``fairway.dev/dry-run: "true"`` is never rendered into the picker's config
(``render.dry_run`` gives the candidate config it asks about, beside the live one). Every
``status_interval`` this module's loop takes each dry run that has no answer for its current
spec and config yet (or whose answer is older than ``whatif_interval``), reads the picker's
recent requests from its admin API (``RecentRequests``: a read, as every admin call), replays
them under the live config and the candidate (``picker.whatif.recent``), and writes into the
policy's status a ``WhatIf`` condition and ``status.whatIf``: the window replayed and one row
per tenant, share, TTFT p95 and 429s, baseline → candidate.

Why the replay runs here and not in the picker behind an admin RPC: it is CPU-bound pure Python
for up to ``whatif_timeout`` seconds, and in the picker it would hold the interpreter against
the ext_proc streams serving live requests, the one thing a dry run must not touch. The picker
only serves the records (bounded: ``picker.admin.service.RECENT_REQUESTS``); the operator already
holds both configs. The replay runs in a worker thread, so kopf's handlers and the live-figures
loop keep their event loop (they share the interpreter with it, and slow down at worst).

Bounds: the last ``whatif_minutes`` of traffic, at most ``whatif_max_records`` requests (the
latest), ``whatif_timeout`` seconds of replay, one dry run at a time. A window with fewer than
``whatif_min_requests`` requests or spanning less than ``whatif_min_seconds`` says so in the
condition (``WindowTooShort``) instead of predicting.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fairway_operator.figures import AdminClient, PickerUnreachable, rfc3339
from fairway_operator.kube import ApiError, Kube
from fairway_operator.settings import Settings
from picker.config.schema import PickerConfig, load_config
from picker.errors import ConfigError
from picker.whatif.recent import (
    PREDICTED,
    Bounds,
    Prediction,
    arrow,
    milliseconds,
    percent,
    predict,
    record_of,
)

log = logging.getLogger("fairway_operator")

WHAT_IF = "WhatIf"
"""The condition a dry-run policy's answer is in."""
PICKER_UNREACHABLE = "PickerUnreachable"
NO_ADMIN_API = "NoAdminApi"
TIMED_OUT = "TimedOut"
MAX_ROWS = 20
"""Tenants in ``status.whatIf.tenants`` at most: the policy's first, then the busiest."""
MAX_MESSAGE = 4096


@dataclass(frozen=True)
class DryRun:
    """One dry-run policy's question: its tenants, the live config and the candidate."""

    namespace: str
    name: str
    generation: int | None
    tenants: tuple[str, ...]
    baseline: dict
    candidate: dict

    @property
    def key(self) -> str:
        """Changes when the spec or either config changes: the answer is then stale."""
        text = json.dumps([self.generation, self.baseline, self.candidate], sort_keys=True,
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def bounds_of(settings: Settings) -> Bounds:
    return Bounds(minutes=settings.whatif_minutes, max_records=settings.whatif_max_records,
                  timeout_s=settings.whatif_timeout, min_records=settings.whatif_min_requests,
                  min_span_s=settings.whatif_min_seconds)


def set_condition(status: Mapping[str, Any], kind: str, flag: bool, reason: str, message: str,
                  generation: int | None, now: datetime) -> list[dict]:
    """``status``'s conditions with ``kind`` set; its ``lastTransitionTime`` moves only when
    its status flips, and the other conditions (Ready) are kept as they are."""
    conditions = [dict(c) for c in status.get("conditions") or () if isinstance(c, Mapping)]
    old = next((c for c in conditions if c.get("type") == kind), None)
    value = "True" if flag else "False"
    wanted: dict[str, Any] = {"type": kind, "status": value, "reason": reason,
                              "message": message[:MAX_MESSAGE]}
    if generation is not None:
        wanted["observedGeneration"] = generation
    if old is not None and old.get("status") == value and old.get("lastTransitionTime"):
        wanted["lastTransitionTime"] = old["lastTransitionTime"]
    else:
        wanted["lastTransitionTime"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return [*(c for c in conditions if c.get("type") != kind), wanted]


def status_patch(status: Mapping[str, Any], dry: DryRun, *, prediction: Prediction | None = None,
                 failure: tuple[str, str] | None = None, now: datetime | None = None) -> dict:
    """The status change recording one answer: a ``prediction`` (``Predicted`` or
    ``WindowTooShort``), or a ``failure`` (reason, message) that leaves the last table as it is.

    ``whatIf`` holds ``observedGeneration``, ``lastUpdated``, the ``window`` replayed (``from``,
    ``to``, ``requests``, ``skipped``, ``truncated``), the ``pool`` it was replayed on and
    ``tenants``: rows of ``share``, ``ttftP95`` and ``refused429``, each ``baseline →
    candidate``, the policy's tenants first (at most ``MAX_ROWS``)."""
    when = now or datetime.now(UTC)
    if prediction is None:
        reason, message = failure or (TIMED_OUT, "no answer")
        return {"conditions": set_condition(status, WHAT_IF, False, reason, message,
                                            dry.generation, when)}
    predicted = prediction.verdict == PREDICTED
    window = prediction.window
    what_if: dict[str, Any] = {
        "observedGeneration": dry.generation,
        "lastUpdated": rfc3339(when.timestamp()),
        "window": {
            "from": rfc3339(window["from"]) if window.get("requests") else None,
            "to": rfc3339(window["to"]) if window.get("requests") else None,
            "requests": int(window.get("requests", 0)),
            "skipped": int(window.get("skipped", 0)),
            "truncated": bool(window.get("truncated", False)),
        },
        # A merge patch: None removes a table a longer window gave before.
        "pool": "; ".join(prediction.pool) if predicted else None,
        "tenants": rows(prediction) if predicted else None,
    }
    return {"conditions": set_condition(status, WHAT_IF, predicted, prediction.verdict,
                                        prediction.message, dry.generation, when),
            "whatIf": what_if}


def rows(prediction: Prediction) -> list[dict[str, Any]]:
    """The compact per-tenant table: ``50.0% → 75.0%``, ``120 ms → 80 ms``, ``0 → 3``."""
    return [{"tenant": row.tenant,
             "share": arrow(percent(row.share[0]), percent(row.share[1])),
             "ttftP95": arrow(milliseconds(row.ttft_p95_s[0]), milliseconds(row.ttft_p95_s[1])),
             "refused429": arrow(str(row.refused_429[0]), str(row.refused_429[1])),
             "requests": row.requests}
            for row in prediction.rows[:MAX_ROWS]]


async def answer(dry: DryRun, admin: AdminClient, bounds: Bounds,
                 clock: Callable[[], float] = time.monotonic) -> Prediction:
    """Read the picker's window and replay it (in a worker thread) under both configs.
    Raises PickerUnreachable, TimeoutError, ConfigError."""
    baseline, candidate = _load(dry.baseline), _load(dry.candidate)
    held = await admin.recent_requests(bounds.minutes * 60, bounds.max_records)
    records = [record_of(r) for r in held.records]
    deadline = clock() + bounds.timeout_s
    return await asyncio.to_thread(
        predict, records, baseline, candidate, bounds=bounds, now=held.taken_at_unix,
        truncated=held.truncated, first=dry.tenants, expired=lambda: clock() > deadline)


def _load(data: dict) -> PickerConfig:
    return load_config(data)


async def run_dry_runs(dry_runs: Callable[[], Sequence[DryRun]], admin: AdminClient | None,
                       kube: Kube, settings: Settings,
                       lock: Callable[[str], asyncio.Lock] | None = None) -> None:
    """Every ``status_interval``: answer each dry run whose answer is missing or stale.
    ``lock(namespace)`` is held while a status is read and written (the reconciler's)."""
    answered: dict[tuple[str, str], tuple[str, float]] = {}
    bounds = bounds_of(settings)
    while True:
        for dry in dry_runs():
            done = answered.get((dry.namespace, dry.name))
            now = time.monotonic()
            if done is not None and done[0] == dry.key and \
                    now - done[1] < settings.whatif_interval:
                continue
            prediction: Prediction | None = None
            failure: tuple[str, str] | None = None
            if admin is None:
                failure = (NO_ADMIN_API, "the operator has no --admin-address: it cannot read "
                                         "the picker's recent requests to replay")
            else:
                try:
                    prediction = await answer(dry, admin, bounds)
                except PickerUnreachable as exc:
                    failure = (PICKER_UNREACHABLE, f"the picker's recent requests: {exc}")
                except TimeoutError as exc:
                    failure = (TIMED_OUT, f"{exc} (--whatif-timeout {bounds.timeout_s:g} s; "
                                          "fewer --whatif-minutes replay faster)")
                except ConfigError as exc:  # render.dry_run checked both: not expected
                    failure = ("InvalidPolicy", f"the candidate config: {exc}")
            try:
                if lock is None:
                    await _write(kube, dry, prediction, failure)
                else:
                    async with lock(dry.namespace):
                        await _write(kube, dry, prediction, failure)
            except ApiError as exc:
                log.warning("%s/%s: what-if not written: %s", dry.namespace, dry.name, exc)
                continue
            # A failure or a window too short is tried again at the next round; a prediction
            # stands until the spec or a config changes, or it is whatif_interval old.
            predicted = prediction is not None and prediction.verdict == PREDICTED
            answered[(dry.namespace, dry.name)] = (dry.key if predicted else "",
                                                   time.monotonic())
        await asyncio.sleep(settings.status_interval)


async def _write(kube: Kube, dry: DryRun, prediction: Prediction | None,
                 failure: tuple[str, str] | None) -> None:
    current = next((p for p in await kube.list_policies(dry.namespace)
                    if (p.get("metadata") or {}).get("name") == dry.name), None)
    if current is None:
        return  # deleted meanwhile
    status = current.get("status") or {}
    await kube.patch_policy_status(dry.namespace, dry.name,
                                   status_patch(status, dry, prediction=prediction,
                                                failure=failure))
