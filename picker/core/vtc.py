"""Virtual Token Counter fair queueing within one lane (Sheng et al., OSDI 2024).

Each tenant has a counter of normalized service received. The backlogged tenant with the smallest
counter goes next. A tenant that enqueues while it has nothing queued is *lifted* to the smallest
counter among backlogged tenants (or, with none backlogged, to the counter of the last tenant that
left the queue): idleness buys no credit, and a lift never lowers a counter.

The backlogged tenants sit in a binary heap keyed by (counter, seq of their oldest request), so a
decision costs O(log n) in the number of backlogged tenants. Counters change far more often than
decisions are made (every decoded token charges its tenant), so the heap is re-keyed lazily: a
charge only raises the counter, and an entry whose key has fallen behind is re-keyed when it
reaches the top. That is exact because keys only ever lag *below* the truth: counters grow and a
tenant's oldest request only gets younger. The one exception, a negative settlement, re-pushes the
tenant; superseded entries are dropped by a per-tenant version number (drawn from one counter
per lane, so a tenant forgotten and re-created never reuses an old entry's version).

Within a tenant, requests go oldest first, except that calls of programs in progress
(``Request.resumes``, ``picker.core.sessions``) go before its other requests, the oldest program
first. The counters do not see the order, and the tie-break among equal counters stays the seq of
the tenant's oldest request: only the order inside a tenant's own queue changes.

Idle tenants are forgotten (``forget_idle``) once forgetting cannot change a decision: a tenant
with nothing queued whose counter is at or below the lift floor would be lifted to the floor on
its next enqueue anyway, and a forgotten tenant re-created at 0 is lifted to the same floor. The
floor only rises (tenants enter at or above it and counters only grow), with one exception: a
negative settlement (an estimate was too high) can lower a backlogged tenant's counter, and so
the floor, by at most that estimate's excess. A tenant forgotten just before such a settlement
re-enters that much lower than it would have; the difference is bounded by one estimate and
goes to the forgotten tenant's advantage only in that rare window. ``lcf`` has no lift: there
only counters still at 0 are forgotten.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Collection

from picker.core.request import Request

_HeapEntry = tuple[float, int, str, int]  # (counter, seq of oldest queued request, tenant, version)


class VirtualTokenCounter:
    """VTC: least counter first, with the counter lift on (re)entering the queue."""

    name = "vtc"
    lift = True

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque[Request]] = {}
        self._heap: list[_HeapEntry] = []
        self._version: dict[str, int] = {}
        self._stale: set[str] = set()
        self._backlogged = 0
        self._queued = 0
        self._last_left: str | None = None
        self._resuming: dict[str, int] = {}
        """Per tenant, its queued requests that resume a program (``Request.resumes``): the
        first that many of its queue."""
        self._tick = 0
        self.shared_floor: float | None = None
        """The lowest backlogged counter on other pickers sharing these counters (active-active
        replicas), or None: a tenant backlogged elsewhere is not idle, so a lift here goes no
        higher than that (``picker.core.shared``)."""

    # -- the FairnessPolicy interface --

    def enqueue(self, request: Request, now: float) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self.counters.setdefault(tenant, 0.0)
        if not queue:
            if self.lift:
                self._lift(tenant)
            self._backlogged += 1
            self._stale.add(tenant)
        if request.resumes:
            # A program in progress goes before the tenant's new programs: they are kept at the
            # front of its queue, the oldest program first (then arrival order). The scan is
            # over the tenant's calls in progress queued, one at most per program.
            ahead = self._resuming.get(tenant, 0)
            self._resuming[tenant] = ahead + 1
            at, program = ahead, request.program
            for i, other in enumerate(itertools.islice(queue, ahead)):
                if other.program > program:
                    at = i
                    break
            if at < len(queue):
                queue.insert(at, request)  # its oldest request, the heap key, is unchanged
            else:
                queue.append(request)
        else:
            queue.append(request)
        self._queued += 1

    def peek(self, now: float) -> Request | None:
        top = self._top()
        return None if top is None else self._queues[top[2]][0]

    def peek_besides(self, now: float, tenants: Collection[str]) -> Request | None:
        """The request ``peek`` would choose if ``tenants`` had nothing queued: the next in
        fair order after them, their counters and queues untouched. O(tenants queued): only
        while a head waits (``Gate.pump``, prefix patience)."""
        best: tuple[float, int, str] | None = None
        counters = self.counters
        for tenant, queue in self._queues.items():
            if tenant in tenants or not queue:
                continue
            key = (counters[tenant], self._oldest(tenant, queue), tenant)
            if best is None or key < best:
                best = key
        return None if best is None else self._queues[best[2]][0]

    def pop(self, request: Request, now: float) -> None:
        self._take(request)

    def remove(self, request: Request) -> None:
        self._take(request)

    def take_alone(self, request: Request) -> None:
        """``enqueue`` then ``pop`` of ``request`` while nothing is queued in this lane, in one
        step (``Scheduler.dispatch_alone``): its tenant's counter is lifted to the floor (with
        nothing backlogged, the counter of the last tenant to leave) and it becomes the last
        to leave. What the two calls would leave besides (a heap entry already stale) no
        decision reads."""
        if self._queued:
            raise ValueError("take_alone: requests are queued in this lane")
        tenant = request.tenant
        counters = self.counters
        counter = counters.setdefault(tenant, 0.0)
        last = self._last_left
        if self.lift and last is not None:
            floor = counters[last]
            if self.shared_floor is not None:
                floor = min(floor, self.shared_floor)
            if floor > counter:
                counters[tenant] = floor
        self._last_left = tenant

    def charge(self, tenant: str, normalized: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + normalized
        if normalized < 0 and self._queues.get(tenant):
            self._stale.add(tenant)  # its heap key may now be too high: re-push it

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def set_counter(self, tenant: str, value: float) -> None:
        """Set the tenant's counter (from a store shared with other pickers); it may fall."""
        self.counters[tenant] = value
        if self._queues.get(tenant):
            self._stale.add(tenant)  # its heap key may now be too high: re-push it

    def queued(self) -> int:
        return self._queued

    def renormalise(self, shift: float, ceiling: float) -> None:
        """Lower every counter by ``shift``, and to at most ``ceiling`` after: decisions read
        only counters' order and the lift floor, which all move together, so nothing decided
        changes (but for a tenant still ``ceiling`` ahead of the least served, which stays
        that far ahead) while counters stay far from where a float loses tokens or overflows.
        Heap keys may now be too high: all backlogged tenants are re-pushed."""
        self.counters = {tenant: min(counter - shift, ceiling)
                         for tenant, counter in self.counters.items()}
        self._stale.update(self._queues)

    # -- beyond the interface: what metrics and tests read --

    def min_backlogged_counter(self) -> float | None:
        """The smallest counter among backlogged tenants (the lift floor), or None."""
        top = self._top()
        return None if top is None else top[0]

    def backlogged(self) -> int:
        """How many tenants have at least one queued request."""
        return self._backlogged

    def lift_floor(self) -> float:
        """The counter a tenant entering now would be lifted to (0 with no floor, or no lift)."""
        if not self.lift:
            return 0.0
        floor = self.min_backlogged_counter()
        if floor is None and self._last_left is not None:
            floor = self.counters[self._last_left]
        return 0.0 if floor is None else floor

    def forget_idle(self, keep: Collection[str] = ()) -> list[str]:
        """Forget tenants whose state a fresh tenant would reproduce: nothing queued, a counter
        at or below the lift floor, not the last tenant to leave (its counter *is* the floor) and
        not in ``keep`` (tenants with requests running, which will still be charged). Returns
        them. O(tenants held)."""
        floor = self.lift_floor()
        queues, counters = self._queues, self.counters
        gone = [tenant for tenant, counter in counters.items()
                if counter <= floor and not queues.get(tenant) and tenant != self._last_left
                and tenant not in keep]
        for tenant in gone:
            del counters[tenant]
            queues.pop(tenant, None)
            self._version.pop(tenant, None)
        if len(gone) > len(counters):
            # A dict keeps its largest table after deletions: copy it to give a flood back.
            self.counters, self._queues = dict(counters), dict(queues)
            self._version = dict(self._version)
        return gone

    def tenants(self) -> int:
        """Tenants with state in this lane (memory use)."""
        return len(self.counters)

    # -- internals --

    def _lift(self, tenant: str) -> None:
        floor = self.min_backlogged_counter()
        if floor is None and self._last_left is not None:
            floor = self.counters[self._last_left]
        if floor is not None and self.shared_floor is not None:
            floor = min(floor, self.shared_floor)
        if floor is not None and floor > self.counters[tenant]:
            self.counters[tenant] = floor

    def _take(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if not queue:
            raise KeyError(f"request of tenant {tenant!r} is not queued in this lane")
        if queue[0] is request:
            queue.popleft()
        elif queue[-1] is request:
            queue.pop()  # the newest, sent first from a stale backlog (adaptive LIFO)
        else:
            queue.remove(request)  # a cancellation from the middle: rare, O(tenant's queue)
        self._queued -= 1
        if request.resumes:
            left = self._resuming[tenant] - 1
            if left:
                self._resuming[tenant] = left
            else:
                del self._resuming[tenant]
        if not queue:
            self._backlogged -= 1
            self._last_left = tenant
            self._stale.discard(tenant)
            del self._queues[tenant]  # an empty deque is ~600 bytes: idle tenants keep none

    def _top(self) -> _HeapEntry | None:
        heap, version, queues, counters = self._heap, self._version, self._queues, self.counters
        if self._stale:
            for tenant in self._stale:
                backlog = queues[tenant]
                self._tick += 1
                v = version[tenant] = self._tick
                heapq.heappush(heap, (counters[tenant], self._oldest(tenant, backlog), tenant, v))
            self._stale.clear()
            if len(heap) > 4 * self._backlogged + 64:
                self._compact()
        while heap:
            counter, seq, tenant, v = heap[0]
            queue = queues.get(tenant)
            if version.get(tenant) != v or not queue:
                heapq.heappop(heap)
            elif counter != counters[tenant] or seq != (
                    queue[0].seq if tenant not in self._resuming else self._oldest(tenant, queue)):
                heapq.heapreplace(heap, (counters[tenant], self._oldest(tenant, queue), tenant, v))
            else:
                return heap[0]
        return None

    def _oldest(self, tenant: str, queue: deque[Request]) -> int:
        """The seq of the tenant's oldest queued request (the tie-break among equal counters):
        its head, or with programs in progress first (``Request.resumes``), the oldest of those
        and its first new request. Taking requests only makes it younger."""
        ahead = self._resuming.get(tenant)
        if ahead is None:
            return queue[0].seq
        oldest = min(r.seq for r in itertools.islice(queue, ahead))
        return oldest if ahead >= len(queue) else min(oldest, queue[ahead].seq)

    def _compact(self) -> None:
        version, queues = self._version, self._queues
        self._heap = [e for e in self._heap if version.get(e[2]) == e[3] and queues.get(e[2])]
        heapq.heapify(self._heap)


class LeastCounterFirst(VirtualTokenCounter):
    """The ``lcf`` baseline: VTC without the lift, so idle time banks credit."""

    name = "lcf"
    lift = False
