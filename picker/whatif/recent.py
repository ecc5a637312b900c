"""A what-if over the picker's recent requests: the operator's dry-run TenantPolicy and
``python -m picker.ctl whatif``.

It answers, without touching the live picker: *had the candidate config served the last N
minutes of this picker's traffic, what would each tenant have got beside what the current
config gives it?* The records come from the admin API's ``RecentRequests`` (the metering log's
fields, held in the picker's memory); they are replayed as ``python -m picker.whatif`` replays a
log (``picker.whatif.replay``), under the baseline and the candidate, on the pool the records
show. The replay runs in the caller's process (the operator's or the workstation's), never in
the picker's: it is CPU-bound pure Python, which in the picker would hold the interpreter
against the ext_proc stream serving live requests.

Bounded: the last ``Bounds.minutes`` of traffic, at most ``Bounds.max_records`` records (the
latest), and ``Bounds.timeout_s`` of replay time for both configs together (TimeoutError). A
window with fewer than ``Bounds.min_records`` usable requests, or spanning less than
``Bounds.min_span_s``, gives no prediction (``WINDOW_TOO_SHORT``): its shares would be noise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from picker.config.schema import PickerConfig
from picker.whatif.__main__ import pool_spec, scan_figures
from picker.whatif.log import Skips, read_arrivals
from picker.whatif.replay import Quantiles, ReplayResult, replay

PREDICTED = "Predicted"
WINDOW_TOO_SHORT = "WindowTooShort"

REPLAY_FIELDS = ("tenant_id", "model", "priority_lane", "lane_asked", "arrived_at", "timestamp",
                 "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "max_tokens",
                 "stream", "outcome", "endpoint", "queue_ms", "ttft_ms", "e2e_ms", "demoted")
"""The admin API's ``RequestRecord`` fields, named as the metering log names them."""
_OPTIONAL = frozenset(("max_tokens", "ttft_ms"))
_EMPTY_IS_NONE = frozenset(("lane_asked", "endpoint", "model"))


@dataclass(frozen=True)
class Bounds:
    """How much a what-if may read and spend."""

    minutes: float = 15.0
    """Replay the requests that arrived in the last this many minutes."""
    max_records: int = 20_000
    """At most this many records (the latest)."""
    timeout_s: float = 120.0
    """Seconds of replay (both configs) before giving up. 20,000 records over 15 minutes on 2
    endpoints (10 ms steps) took 38-40 s of CPU on the shared 2-core machine
    (``python -m bench.whatif_window``)."""
    min_records: int = 50
    """Fewer usable requests than this: no prediction."""
    min_span_s: float = 60.0
    """Arrivals spanning less than this: no prediction."""

    def __post_init__(self) -> None:
        if not (self.minutes > 0 and self.timeout_s > 0 and self.min_span_s >= 0):
            raise ValueError("minutes and timeout must be above 0, min_span_s at least 0")
        if self.max_records < 1 or self.min_records < 1:
            raise ValueError("max_records and min_records must be at least 1")


def record_of(message: Any) -> dict[str, Any]:
    """A ``fairway.v1.RequestRecord`` as the metering log's JSON object (duck-typed: this
    package does not import the admin stubs). Absent optional fields and empty strings that mean
    "none" become None, as the log writes them."""
    out: dict[str, Any] = {}
    for name in REPLAY_FIELDS:
        if name in _OPTIONAL and not message.HasField(name):
            out[name] = None
            continue
        value = getattr(message, name)
        out[name] = None if name in _EMPTY_IS_NONE and value == "" else value
    return out


@dataclass
class TenantRow:
    """One tenant's prediction: baseline beside candidate (summed over its lanes)."""

    tenant: str
    share: tuple[float, float]
    ttft_p95_s: tuple[float | None, float | None]
    refused_429: tuple[int, int]
    requests: int


@dataclass
class Prediction:
    """The what-if's answer: ``verdict`` is ``PREDICTED`` or ``WINDOW_TOO_SHORT``."""

    verdict: str
    message: str
    window: dict[str, Any] = field(default_factory=dict)
    """``from``/``to`` (unix seconds of the first and last arrival replayed), ``seconds``,
    ``requests`` replayed, ``skipped``, ``askedSeconds`` and whether the answer was cut
    (``truncated``: more records matched than the cap)."""
    pool: list[str] = field(default_factory=list)
    """Where each figure of the replayed pool came from."""
    rows: list[TenantRow] = field(default_factory=list)
    baseline: ReplayResult | None = None
    candidate: ReplayResult | None = None


def _tenant_sums(result: ReplayResult) -> dict[str, tuple[int, Quantiles, int, int]]:
    """Per tenant: tokens served, TTFTs (the lanes' bins merged), 429s, requests."""
    out: dict[str, tuple[int, Quantiles, int, int]] = {}
    for (tenant, _), stats in result.lanes.items():
        tokens, ttft, refused, sent = out.get(tenant, (0, Quantiles(), 0, 0))
        for key, n in stats.ttft.bins.items():
            ttft.bins[key] = ttft.bins.get(key, 0) + n
        ttft.zeros += stats.ttft.zeros
        ttft.count += stats.ttft.count
        out[tenant] = (tokens + stats.tokens, ttft, refused + stats.status_count(429),
                       sent + stats.sent)
    return out


def tenant_rows(baseline: ReplayResult, candidate: ReplayResult,
                first: Sequence[str] = ()) -> list[TenantRow]:
    """One row per tenant of either replay: ``first`` (a policy's tenants) in their order, then
    the others by baseline share, largest first."""
    base, cand = _tenant_sums(baseline), _tenant_sums(candidate)
    base_total = sum(v[0] for v in base.values()) or 1
    cand_total = sum(v[0] for v in cand.values()) or 1
    empty = (0, Quantiles(), 0, 0)
    rows = []
    for tenant in set(base) | set(cand):
        b, c = base.get(tenant, empty), cand.get(tenant, empty)
        rows.append(TenantRow(tenant, (b[0] / base_total, c[0] / cand_total),
                              (b[1].quantile(0.95), c[1].quantile(0.95)), (b[2], c[2]),
                              max(b[3], c[3])))
    order = {t: i for i, t in enumerate(dict.fromkeys(first))}
    rows.sort(key=lambda r: (order.get(r.tenant, len(order)), -r.share[0], r.tenant))
    return rows


def predict(records: Iterable[dict[str, Any]], baseline: PickerConfig,
            candidate: PickerConfig, *, bounds: Bounds, now: float,
            expired: Callable[[], bool] | None = None, truncated: bool = False,
            first: Sequence[str] = ()) -> Prediction:
    """Replay ``records`` (metering-log dicts, as ``record_of`` gives them) that arrived in the
    last ``bounds.minutes`` before ``now`` (unix seconds) under ``baseline`` and ``candidate``.
    ``first``: tenants listed first (the policy's). Raises TimeoutError once ``expired()``."""
    asked = bounds.minutes * 60
    since = now - asked
    kept = [r for r in records
            if isinstance(r.get("arrived_at"), (int, float)) and r["arrived_at"] >= since]
    cut = truncated or len(kept) > bounds.max_records
    kept = kept[-bounds.max_records:]
    lines = [json.dumps(r, allow_nan=False).encode() + b"\n" for r in kept]
    arrivals_at = [r["arrived_at"] for r in kept]
    start = min(arrivals_at, default=now)
    span = (max(arrivals_at) - start) if arrivals_at else 0.0
    window = {"from": start, "to": start + span, "seconds": span, "requests": len(kept),
              "skipped": 0, "askedSeconds": asked, "truncated": cut}
    if len(kept) < bounds.min_records or span < bounds.min_span_s:
        return Prediction(
            WINDOW_TOO_SHORT,
            f"the picker's recent requests hold {len(kept):,} request(s) over {span:,.0f} s of "
            f"the last {bounds.minutes:g} min; a prediction needs at least "
            f"{bounds.min_records:,} over {bounds.min_span_s:,.0f} s (send traffic, or wait)",
            window)
    figures = scan_figures(lines, since=since)
    options = SimpleNamespace(endpoints=None, kv_budget_tokens=None, step_ms=None,
                              engine_policy="fcfs", prefill_ms_per_1k_tokens=0.0)
    spec, notes = pool_spec(options, figures, baseline)  # type: ignore[arg-type]
    skips = Skips()
    base = replay(baseline, spec, read_arrivals(lines, skips, since=since), start=start,
                  expired=expired)
    cand = replay(candidate, spec, read_arrivals(lines, Skips(), since=since), start=start,
                  expired=expired)
    window["requests"], window["skipped"] = skips.used, skips.skipped
    rows = tenant_rows(base, cand, first)
    minutes = span / 60
    message = (f"replayed {skips.used:,} requests over the last {minutes:,.1f} min "
               f"(asked: {bounds.minutes:g})")
    if cut:
        message += f", the latest {bounds.max_records:,} only"
    if skips.skipped:
        message += f"; skipped {skips.skipped:,} unusable"
    return Prediction(PREDICTED, message, window, notes, rows, base, cand)


def percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def milliseconds(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 1000:,.0f} ms"


def arrow(before: str, after: str) -> str:
    """``before → after``: how a status cell and the ctl's table read a change."""
    return f"{before} → {after}"

