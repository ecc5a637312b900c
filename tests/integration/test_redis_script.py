"""The shared state's Lua script on a real ``redis-server`` against ``StoreModel``, its rules in
Python (what the unit tests and the multi-picker simulator use): random exchanges of three
replicas (charges, lifts, new counters, budget changes, estimates, leases, batches re-sent) leave
both with the same counters, levels, estimates and grants."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from picker.core.shared import BudgetChange, Changes, CounterChange, Learned, StoreModel
from picker.stack.redis import RedisServer
from picker.state.redis_sync import SYNC_SCRIPT, _batch_args, _encode_peer, _estimates, _pairs

pytestmark = pytest.mark.integration

KEYS = ["{t}:counters", "{t}:budgets", "{t}:epoch", "{t}:estimates", "{t}:applied:{r}",
        "{t}:leases", "{t}:demands"]
RATE = 1e-9
"""Tokens a second: refill is negligible, as the script reads Redis's clock and the model ours."""


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    with RedisServer(tmp_path / "redis") as server:
        connection = redis.Redis(port=server.port, decode_responses=True)
        yield connection
        connection.close()


def _changes(rng: random.Random) -> Changes:
    tenants, lanes = ["a", "b", "c", "d"], ["online", "batch"]
    counters = []
    for _ in range(rng.randint(0, 4)):
        lifted = rng.random() < 0.3
        counters.append(CounterChange(
            rng.choice(lanes), rng.choice(tenants), rng.choice([-50.0, 0.0, 10.0, 125.5]),
            rng.uniform(0, 5000), rng.uniform(0, 5000) if lifted else None,
            rng.uniform(0, 100) if lifted else 0.0))
    budgets = [BudgetChange(rng.choice(tenants), rng.choice(["burst", "sustained"]),
                            rng.choice([-400.0, -30.0, 25.0]), rng.uniform(-100, 1000), 1000,
                            RATE) for _ in range(rng.randint(0, 3))]
    learned = [Learned(rng.choice(["output", "stream"]), rng.choice(tenants), "",
                       rng.uniform(1, 500)) for _ in range(rng.randint(0, 2))]
    return Changes(tuple(counters), tuple(budgets), tuple(learned))


def test_the_script_keeps_the_model_s_rules(client: redis.Redis) -> None:
    script = client.register_script(SYNC_SCRIPT)
    model = StoreModel(lease_expiry=3600.0)
    rng = random.Random(5)
    batches = {"r1": 0, "r2": 0, "r3": 0}
    for step in range(300):
        replica = rng.choice(list(batches))
        resend = batches[replica] > 0 and rng.random() < 0.15  # a lost reply: the same batch
        if not resend:
            batches[replica] += 1
        changes = _changes(random.Random(f"{replica}-{batches[replica]}"))
        target, held = rng.uniform(0, 1), rng.uniform(0, 0.5)
        demand = {("online", rng.choice("abcd")): float(rng.randint(1, 900))}
        args = [*_batch_args(batches[replica], "epoch", 3600.0, changes),
                replica, repr(target), repr(held), "3600", _encode_peer(demand, {"online": 7.0})]
        keys = [key.replace("{r}", replica) for key in KEYS]
        counters, levels, _, learned, grant, _ = script(keys=keys, args=args)
        want = model.exchange(replica, batches[replica], changes, float(step), target=target,
                              held=held, demand=demand, floors={"online": 7.0})
        assert _pairs(counters) == pytest.approx(want.counters), step
        assert _pairs(levels) == pytest.approx(want.levels, abs=1e-3), step
        assert {k: v for k, (v, _) in _estimates(learned).items()} == pytest.approx(
            {k: v for k, (v, _) in want.learned.items()}), step
        assert float(grant) == pytest.approx(want.grant), step
