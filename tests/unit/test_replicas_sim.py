"""The pool simulator with active-active pickers (``picker.sim.pool.Sharing``): three gates over
the same engines, sharing state through ``StoreModel`` with a sync interval and a round trip.
Tenants weighted 1:2:3 whose requests reach the pickers unevenly get their weights' shares, and
the pickers' grants never sum above the pool."""

from __future__ import annotations

import pytest

from picker.sim.pool import PoolSpec, Sharing, simulate
from picker.sim.traffic import load_traffic
from tests.unit.test_pool_sim import _config, _mine, _output_between

POOL = PoolSpec(endpoints=3, kv_budget_tokens=2048, step_s=0.005)
ARRIVAL = {"a": (0.8, 0.2, 0.0), "b": (0.0, 0.5, 0.5), "c": (0.1, 0.0, 0.9)}


def _traffic(duration: float = 30.0) -> object:
    shape = {"api": "completions", "stream_fraction": 0.0, "prompt_tokens": [64, 64],
             "output_tokens": [64, 64]}
    return load_traffic({"duration_s": duration, "seed": 4, "tenants": [
        {"name": t, "backlog": 60, **shape} for t in ("a", "b", "c")]})


@pytest.mark.parametrize("sharing", [None, Sharing(pickers=3, arrival=ARRIVAL)],
                         ids=["one picker", "three pickers"])
def test_weighted_shares_hold_whichever_picker_requests_reach(sharing: Sharing | None) -> None:
    traffic = _traffic()
    run = simulate(_config({"a": 1, "b": 2, "c": 3}), traffic, POOL,  # type: ignore[arg-type]
                   sharing=sharing)
    t1, t2 = 5.0, 29.0
    served = {t: _output_between(_mine(run, t), t1, t2) for t in ("a", "b", "c")}
    total = sum(served.values())
    for tenant, weight in (("a", 1), ("b", 2), ("c", 3)):
        assert served[tenant] / total == pytest.approx(weight / 6, rel=0.05), served
    if sharing is not None:
        assert run.sharing is not None
        assert run.sharing.grants_max <= 1.0 + 1e-9
        assert max(run.sharing.view_age_s) <= sharing.sync_interval_s + sharing.latency_s + 0.01
