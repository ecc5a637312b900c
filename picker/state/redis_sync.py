"""How does this picker's view of tenants' counters and budgets come to include every replica's
charges, and outlive the process?

Every ``state.syncInterval`` one Lua script runs on Redis, atomically: it applies the changes
this picker made since the last exchange (``picker.core.shared.take_changes``), and returns every
counter and every bucket that is not full, which become the picker's view
(``apply_view``). Like envoyproxy/ratelimit, the request path never waits on Redis: decisions
are made on the local view, and Redis is one round trip per interval whatever the request rate.

Keys (one hash tag, so a Redis Cluster keeps them on one shard; ``P`` is ``redis.keyPrefix``)::

    {P}:counters       hash  "lane\\x1ftenant"  -> counter
    {P}:budgets        hash  "tenant\\x1fwindow" -> "level stamp capacity rate" (Redis's clock);
                       a full bucket is deleted (absent means full)
    {P}:epoch          a random id set by the first exchange after the store was empty
    {P}:estimates      hash  "kind\\x1ftenant\\x1fmodel" -> "value stamp" (dropped after the
                       estimates' ttl)
    {P}:applied:<id>   the last batch number applied for replica <id> (expires after an hour)
    {P}:leases         hash  replica -> "may-hold grant stamp": each replica's lease (dropped once
                       silent for maxStaleness)
    {P}:demands        hash  replica -> its demand per lane and tenant, and its queue's floors

**Exactly once.** A batch of changes is numbered; the script applies a batch only if its number
is above the one recorded for the replica, so a batch re-sent after a timeout (Redis may have
applied it before the reply was lost) is not charged twice. A failed batch is re-sent unchanged
until it goes through; changes made meanwhile wait for the next batch.

**Redis unavailable.** Until ``maxStaleness`` has passed nothing changes for requests. After it,
``failSoft`` decides on the local view alone and ``failClosed`` refuses new requests (503); both
set ``fairway_state_backend_up`` to 0. When Redis answers again the pending batch goes through
and the view is refreshed: the changes of the outage are sent once.

**Budgets beside other replicas.** A tenant with budgets has each request reserved in Redis
first (``reserve``, one atomic script: all of the tenant's budgets or none), so replicas cannot
overrun a budget together, by more than what estimates fell short (as one picker alone); the
local admission takes the store's word (``Admission.judged_in_store``,
``Gate.admit(prereserved=)``). That is one round trip per such request, and none for tenants
without budgets or for a picker alone. If the store does not answer, the picker judges on its
own view, spending at most its part between exchanges (``Admission.replicas``).

**Restart of a picker.** Before the picker serves, ``load`` reads the view: counters and
budget levels are those of the last exchange of the process that ran before (at most one
interval old).

**Restart of Redis.** With persistence (AOF) nothing is lost. Without it Redis comes back
empty; the epoch tells each picker so, and each sends its whole view (every counter and bucket,
each with its own value, which the store takes where it holds nothing yet): the view survives
as long as one picker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from picker.config.schema import State
from picker.core.shared import SEPARATOR, Changes, Replica, StoreReply
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics

log = logging.getLogger(__name__)

APPLIED_TTL_SECONDS = 3600
"""How long Redis remembers a replica's last batch number (a replica that has been silent
longer has restarted under a new id)."""
STATE_TTL_SECONDS = 7 * 24 * 3600
"""Counters and buckets untouched by every replica this long are dropped (a pool gone)."""

SYNC_SCRIPT = """
-- KEYS: counters, budgets, epoch, estimates, applied marker of this replica, leases, demands.
-- ARGV: batch number, marker ttl, state ttl, epoch to create if there is none, estimate ttl,
--       n counters, n x (field, change, own value, lift floor or '', charged since the lift),
--       n budgets, n x (field, change, own level, capacity, rate),
--       n estimates, n x (field, value),
--       replica, target lease, fraction held, lease expiry (s), demand (opaque text).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', KEYS[3], epoch)
end
redis.call('EXPIRE', KEYS[3], ARGV[3])
local batch = tonumber(ARGV[1])
local fresh = batch > tonumber(redis.call('GET', KEYS[5]) or '0')
local function refilled(stored)
  local level, stamp, cap, rate = string.match(stored, '(%S+) (%S+) (%S+) (%S+)')
  level, stamp, cap, rate = tonumber(level), tonumber(stamp), tonumber(cap), tonumber(rate)
  if now > stamp and level < cap then level = math.min(cap, level + rate * (now - stamp)) end
  return level, cap
end
local i = 7
for _ = 1, tonumber(ARGV[6]) do
  if fresh then
    local stored = redis.call('HGET', KEYS[1], ARGV[i])
    local value
    if stored then
      value = tonumber(stored) + tonumber(ARGV[i + 1])
      if ARGV[i + 3] ~= '' then
        value = math.max(value, tonumber(ARGV[i + 3]) + tonumber(ARGV[i + 4]))
      end
    else
      value = tonumber(ARGV[i + 2])
    end
    redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', value))
  end
  i = i + 5
end
local budgets = tonumber(ARGV[i])
i = i + 1
for _ = 1, budgets do
  if fresh then
    local cap = tonumber(ARGV[i + 3])
    local level
    local stored = redis.call('HGET', KEYS[2], ARGV[i])
    if stored then
      level = refilled(stored) + tonumber(ARGV[i + 1])
    else
      level = tonumber(ARGV[i + 2])
    end
    -- no floor but MAX_DEBT: a debt is owed in full
    level = math.max(-9007199254740992, math.min(cap, level))
    redis.call('HSET', KEYS[2], ARGV[i], string.format('%.17g %.17g %s %s', level, now,
                                                     ARGV[i + 3], ARGV[i + 4]))
  end
  i = i + 5
end
local estimates = tonumber(ARGV[i])
i = i + 1
for _ = 1, estimates do
  if fresh then
    redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1] .. ' ' .. string.format('%.17g', now))
  end
  i = i + 2
end
if fresh then redis.call('SET', KEYS[5], ARGV[1], 'EX', ARGV[2]) end
local levels = {}
local all = redis.call('HGETALL', KEYS[2])
for j = 1, #all, 2 do
  local level, cap = refilled(all[j + 1])
  if level >= cap then
    redis.call('HDEL', KEYS[2], all[j])
  else
    levels[#levels + 1] = all[j]
    levels[#levels + 1] = string.format('%.17g', level)
  end
end
local learned = {}
all = redis.call('HGETALL', KEYS[4])
for j = 1, #all, 2 do
  local value, stamp = string.match(all[j + 1], '(%S+) (%S+)')
  local age = math.max(0, now - tonumber(stamp))
  if age > tonumber(ARGV[5]) then
    redis.call('HDEL', KEYS[4], all[j])
  else
    learned[#learned + 1] = all[j]
    learned[#learned + 1] = value
    learned[#learned + 1] = string.format('%.17g', age)
  end
end
-- The lease: granted out of what the other live replicas may hold (their grant, or what they
-- hold if more: running requests grow), so that the grants never sum above 1.
local replica, target, held, expiry = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]),
                                       tonumber(ARGV[i + 3])
local others, previous = 0, 0
local demands = {}
all = redis.call('HGETALL', KEYS[6])
for j = 1, #all, 2 do
  local ack, granted, stamp = string.match(all[j + 1], '(%S+) (%S+) (%S+)')
  if now - tonumber(stamp) > expiry then
    redis.call('HDEL', KEYS[6], all[j])
    redis.call('HDEL', KEYS[7], all[j])
  elseif all[j] == replica then
    previous = tonumber(granted)
  else
    others = others + tonumber(ack)
    local demand = redis.call('HGET', KEYS[7], all[j])
    if demand then
      demands[#demands + 1] = all[j]
      demands[#demands + 1] = demand
    end
  end
end
local grant = math.max(0, math.min(target, 1 - others))
-- Until this answer reaches the replica it may still fill its previous grant: a lower grant is
-- left to the others only from its next exchange.
redis.call('HSET', KEYS[6], replica, string.format('%.17g %.17g %.17g',
                                                   math.max(grant, held, previous), grant, now))
redis.call('HSET', KEYS[7], replica, ARGV[i + 4])
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[4], KEYS[6], KEYS[7]}) do
  redis.call('EXPIRE', key, ARGV[3])
end
return {redis.call('HGETALL', KEYS[1]), levels, epoch, learned, string.format('%.17g', grant),
        demands}
"""


RESERVE_SCRIPT = """
-- A request's reservation near a tenant's limit, judged here so that replicas cannot overrun
-- it together. KEYS: budgets. ARGV: n, n x (field, tokens, capacity, rate).
-- Returns {1} (reserved from every bucket) or {0, failing field, its level}.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[1])
local levels = {}
for k = 0, n - 1 do
  local at = 2 + 4 * k
  local cap, rate = tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  local level = cap
  local stored = redis.call('HGET', KEYS[1], ARGV[at])
  if stored then
    local l, stamp = string.match(stored, '(%S+) (%S+)')
    level, stamp = tonumber(l), tonumber(stamp)
    if now > stamp and level < cap then level = math.min(cap, level + rate * (now - stamp)) end
  end
  local needed = math.min(tonumber(ARGV[at + 1]), cap)
  if level + 0.000001 < needed then
    return {0, ARGV[at], string.format('%.17g', level)}
  end
  levels[k] = level
end
for k = 0, n - 1 do
  local at = 2 + 4 * k
  local cap = tonumber(ARGV[at + 2])
  local level = math.max(-9007199254740992, levels[k] - tonumber(ARGV[at + 1]))
  redis.call('HSET', KEYS[1], ARGV[at], string.format('%.17g %.17g %s %s', level, now,
                                                      ARGV[at + 2], ARGV[at + 3]))
end
return {1}
"""


def open_redis(state: State) -> aioredis.Redis:
    """A client for ``state.redis``: one attempt per call (the sync loop is the retry), and
    timeouts well inside ``maxStaleness``."""
    settings = state.redis
    password = None
    if settings.password_file:
        password = Path(settings.password_file).read_text().strip()
    timeout = max(0.25, min(1.0, state.max_staleness / 2))
    options: dict[str, Any] = {"password": password, "socket_timeout": timeout,
                               "socket_connect_timeout": timeout,
                               "retry": Retry(NoBackoff(), 0), "decode_responses": True}
    if settings.url.startswith("rediss://") and settings.ca_file:
        options["ssl_ca_certs"] = settings.ca_file
    return aioredis.from_url(settings.url, **options)


def _batch_args(batch: int, epoch: str, estimate_ttl: float,
                changes: Changes) -> list[str | int]:
    args: list[str | int] = [batch, APPLIED_TTL_SECONDS, STATE_TTL_SECONDS, epoch,
                             repr(estimate_ttl), len(changes.counters)]
    for c in changes.counters:
        args += [f"{c.lane}{SEPARATOR}{c.tenant}", repr(c.change), repr(c.value),
                 "" if c.lift_to is None else repr(c.lift_to), repr(c.since_lift)]
    args.append(len(changes.budgets))
    for b in changes.budgets:
        args += [f"{b.tenant}{SEPARATOR}{b.window}", repr(b.change), repr(b.level),
                 b.capacity, repr(b.rate)]
    args.append(len(changes.estimates))
    for e in changes.estimates:
        args += [f"{e.kind}{SEPARATOR}{e.tenant}{SEPARATOR}{e.model}", repr(e.value)]
    return args


def _pairs(flat: list[str]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for j in range(0, len(flat), 2):
        first, _, second = flat[j].partition(SEPARATOR)
        out[(first, second)] = float(flat[j + 1])
    return out


def _estimates(flat: list[str]) -> dict[tuple[str, str, str], tuple[float, float]]:
    out: dict[tuple[str, str, str], tuple[float, float]] = {}
    for j in range(0, len(flat), 3):
        kind, tenant, model = flat[j].split(SEPARATOR, 2)
        out[(kind, tenant, model)] = (float(flat[j + 1]), float(flat[j + 2]))
    return out


def _encode_peer(demand: dict[tuple[str, str], float], floors: dict[str, float]) -> str:
    """What a replica tells its peers: its demand per (lane, tenant) and its fair queue's
    floor per lane."""
    return "\x1e".join(f"{lane}{SEPARATOR}{tenant}{SEPARATOR}{tokens:.0f}"
                        for (lane, tenant), tokens in demand.items()) + "\x1d" + \
        "\x1e".join(f"{lane}{SEPARATOR}{floor!r}" for lane, floor in floors.items())


def _peers(flat: list[str]) -> dict[str, tuple[dict[tuple[str, str], float], dict[str, float]]]:
    out = {}
    for j in range(0, len(flat), 2):
        demand_text, _, floor_text = flat[j + 1].partition("\x1d")
        demand: dict[tuple[str, str], float] = {}
        for entry in demand_text.split("\x1e") if demand_text else ():
            lane, tenant, tokens = entry.split(SEPARATOR)
            demand[(lane, tenant)] = float(tokens)
        floors: dict[str, float] = {}
        for entry in floor_text.split("\x1e") if floor_text else ():
            lane, floor = entry.split(SEPARATOR)
            floors[lane] = float(floor)
        out[flat[j]] = (demand, floors)
    return out


class RedisSync:
    """The exchange loop of one picker (``run``), and its first read (``load``)."""

    def __init__(self, dispatcher: Dispatcher, state: State, metrics: PickerMetrics, *,
                 client: aioredis.Redis | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dispatcher = dispatcher
        self.state = state
        self.metrics = metrics
        self.client = client if client is not None else open_redis(state)
        self.clock = clock
        self.replica = uuid.uuid4().hex
        """This process's id in Redis (a restarted picker is a new replica)."""
        prefix = "{" + state.redis.key_prefix + "}"
        self.keys = [f"{prefix}:counters", f"{prefix}:budgets", f"{prefix}:epoch",
                     f"{prefix}:estimates", f"{prefix}:applied:{self.replica}",
                     f"{prefix}:leases", f"{prefix}:demands"]
        self.sharing = Replica(dispatcher.gate, state.sync_interval)
        """This picker's side of the exchange (``picker.core.shared``)."""
        self.epoch: str | None = None
        """The store's epoch as last seen: a new one means the store lost its state."""
        self._resend_all = False
        self._script = self.client.register_script(SYNC_SCRIPT)
        self._reserve = self.client.register_script(RESERVE_SCRIPT)
        self._batch = 0
        self._pending: list[str | int] | None = None
        """The batch sent and not yet acknowledged: re-sent unchanged until it is."""
        self.last_ok: float | None = None
        """When the last exchange succeeded (``clock``)."""
        self.available = True

    @property
    def lease(self) -> float:
        return self.sharing.lease

    @property
    def peers(self) -> dict[str, tuple[dict[tuple[str, str], float], dict[str, float]]]:
        return self.sharing.peers

    async def exchange(self, releasing: bool = False) -> None:
        """Send this picker's changes (or the batch still pending) and take the view.
        ``releasing``: a stopping picker gives up its lease."""
        sharing = self.sharing
        if self._pending is None:
            changes = sharing.changes(self.clock(), every=self._resend_all)
            self._batch += 1
            self._pending = _batch_args(self._batch, uuid.uuid4().hex,
                                        sharing.gate.estimates.ttl, changes)
            self._resend_all = False
        started = self.clock()
        ask = sharing.lease_request(self.replica, started, releasing=releasing)
        counters, levels, epoch, learned, grant, peers = await self._script(
            keys=self.keys, args=[*self._pending, self.replica, repr(ask.target),
                                  repr(ask.held), repr(self.state.max_staleness),
                                  _encode_peer(ask.demand, ask.floors)])
        self._pending = None
        now = self.clock()
        self.metrics.state_sync_seconds.observe(now - started)
        lost = self.epoch is not None and epoch != self.epoch
        if lost:
            # The store came back empty (restarted without persistence): its view would reset
            # every budget to full. Keep ours and send all of it with the next batch.
            log.warning("shared state store lost its state (new epoch): sending this picker's")
            self._resend_all = True
        self.epoch = epoch
        sharing.receive(StoreReply(_pairs(counters), _pairs(levels), _estimates(learned),
                                   float(grant), _peers(peers)), now, view=not lost)
        self.metrics.state_lease.set(sharing.lease)

    async def reserve(self, tenant: str, tokens: int) -> tuple[bool, str, float] | None:
        """Reserve ``tokens`` from each of the tenant's budgets in Redis, atomically, if every
        one has them: ``(True, "", 0)``; else ``(False, window, its level)`` and nothing is
        reserved. None when Redis does not answer (the picker then judges on its own view)."""
        args: list[str | int] = []
        windows = self.sharing.gate.admission.windows(tenant)
        for window, rule in windows:
            args += [f"{tenant}{SEPARATOR}{window}", tokens, rule.capacity_tokens,
                     repr(rule.rate)]
        try:
            answer = await self._reserve(keys=[self.keys[1]], args=[len(windows), *args])
        except (RedisError, OSError, TimeoutError):
            return None
        if int(answer[0]) == 1:
            return True, "", 0.0
        return False, str(answer[1]).split(SEPARATOR, 1)[1], float(answer[2])

    async def load(self, stop: asyncio.Event) -> bool:
        """The first exchange, before serving: retried until it succeeds or ``maxStaleness``
        has passed (then the picker starts as ``onUnavailable`` says). True when it loaded."""
        deadline = self.clock() + self.state.max_staleness
        while not stop.is_set():
            if await self._try():
                return True
            if self.clock() >= deadline:
                break
            await asyncio.sleep(self.state.sync_interval)
        self._set_available(False)
        return False

    async def run(self, stop: asyncio.Event) -> None:
        """Exchange every ``syncInterval`` until ``stop``; ``flush`` sends what is left."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.state.sync_interval)
            if not stop.is_set():
                await self._try()

    async def flush(self) -> None:
        """The last exchanges of a stopping picker (after its requests drained): the pending
        batch, then the changes since; then the connection is closed."""
        for _ in range(2):
            if not await self._try(releasing=True):
                break
        await self.client.aclose()

    async def _try(self, releasing: bool = False) -> bool:
        try:
            await self.exchange(releasing)
        except (RedisError, OSError, TimeoutError) as error:
            self.metrics.state_syncs.labels("error").inc()
            now = self.clock()
            stale = self.last_ok is None or now - self.last_ok >= self.state.max_staleness
            if stale:
                self.sharing.out_of_touch(now)
                self.metrics.state_lease.set(self.sharing.lease)
            if stale and self.available:
                log.warning("shared state store unreachable for %.1fs (%s: %s): %s",
                            self.state.max_staleness, type(error).__name__, error,
                            "refusing requests" if self.state.on_unavailable == "failClosed"
                            else "deciding on this picker's own view")
                self._set_available(False)
            if self.last_ok is not None:
                self.metrics.state_staleness.set(now - self.last_ok)
            return False
        self.metrics.state_syncs.labels("ok").inc()
        self.last_ok = self.clock()
        self.metrics.state_staleness.set(0.0)
        if not self.available:
            log.warning("shared state store answers again; view refreshed")
        self._set_available(True)
        return True

    def _set_available(self, available: bool) -> None:
        self.available = available
        self.metrics.state_up.set(1 if available else 0)
        self.dispatcher.state_unavailable = (not available
                                             and self.state.on_unavailable == "failClosed")
