"""Fairness measures over a simulation record: drift, the VTC bound, shares."""

from __future__ import annotations

from collections.abc import Iterable

from picker.sim.engine import SimResult
from picker.sim.scenario import Scenario


def vtc_bound(scenario: Scenario, result: SimResult | None = None) -> float:
    """``2·max(w_p·L_input, w_q·M)``: VTC's bound on the service gap of two backlogged tenants.

    ``M`` is the most tokens a running batch holds. The engine (like seed 000's loop) checks the
    KV budget only when it admits a prompt, so a batch of short prompts with long outputs can
    outgrow ``kv_budget_tokens`` while decoding; given the run's ``result``, M is the larger of the
    budget and the batch's actual peak, which is what the theorem's premise is about. With a
    context-aware cost an output token can cost up to ``w_q + β·M``. Drift is measured on service
    divided by weight, so a tenant weighing less than 1 widens the bound by that factor.
    """
    cost = scenario.cost
    batch = scenario.kv_budget_tokens
    if result is not None:
        batch = max(batch, result.peak_batch_tokens)
    longest_prompt = max(t.prompt_tokens[1] for t in scenario.tenants)
    decode = cost.decode_weight + cost.context_beta * batch
    lightest = min(1.0, *(t.weight for t in scenario.tenants))
    return 2 * max(cost.prefill_weight * longest_prompt, decode * batch) / lightest


def _normalized_gap(result: SimResult, a: int, b: int, row: list[float]) -> float:
    return row[a] / result.weights[a] - row[b] / result.weights[b]


def max_drift(result: SimResult, a: str, b: str) -> float:
    """``max_t |W_a(0,t)/w_a - W_b(0,t)/w_b|`` over the whole run (seed 000's drift)."""
    i, j = result.tenants.index(a), result.tenants.index(b)
    return max((abs(_normalized_gap(result, i, j, row)) for row in result.service), default=0.0)


def backlogged_drift(result: SimResult, a: str, b: str) -> float:
    """The largest ``|W_a(t1,t2)/w_a - W_b(t1,t2)/w_b|`` over intervals where both stay backlogged.

    Within one run of steps where both are backlogged, the worst interval's gap is the range
    (max - min) of the cumulative normalized gap.
    """
    i, j = result.tenants.index(a), result.tenants.index(b)
    return widest_swing(_normalized_gap(result, i, j, row) if flags[i] and flags[j] else None
                        for row, flags in zip(result.service, result.backlogged, strict=True))


def widest_swing(gaps: Iterable[float | None]) -> float:
    """The largest max − min of a cumulative gap within runs of steps where it is defined.

    ``None`` ends a run (a tenant was not backlogged). Within one run, the worst interval's
    service difference is the range of the cumulative difference.
    """
    worst = 0.0
    low = high = None
    for gap in gaps:
        if gap is None:
            low = high = None
            continue
        low = gap if low is None else min(low, gap)
        high = gap if high is None else max(high, gap)
        worst = max(worst, high - low)
    return worst


def service_between(result: SimResult, tenant: str, start: int, end: int) -> float:
    """Weighted service ``tenant`` received in steps ``start`` … ``end - 1``."""
    i = result.tenants.index(tenant)
    before = result.service[start - 1][i] if start > 0 else 0.0
    return result.service[end - 1][i] - before


def shares(result: SimResult, start: int = 0, end: int | None = None) -> dict[str, float]:
    """Each tenant's fraction of all weighted service delivered in ``[start, end)``."""
    end = result.steps if end is None else end
    got = {t: service_between(result, t, start, end) for t in result.tenants}
    total = sum(got.values())
    return {t: (v / total if total else 0.0) for t, v in got.items()}
