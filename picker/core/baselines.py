"""Baseline policies behind the same interface as VTC, for comparison.

``fcfs`` is what an engine does on its own; ``rpm`` is what API gateways do today (each tenant gets
at most N dispatches per fixed window, FCFS among those still under their limit). Both keep counters
of normalized service so that metrics read the same for every policy.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from picker.core.request import Request


class _ServiceCounters:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}

    def charge(self, tenant: str, normalized: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + normalized

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)


class FirstComeFirstServed(_ServiceCounters):
    """Oldest queued request first, whoever sent it."""

    name = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self._queue: OrderedDict[int, Request] = OrderedDict()

    def enqueue(self, request: Request, now: float) -> None:
        self._queue[request.seq] = request

    def peek(self, now: float) -> Request | None:
        return next(iter(self._queue.values()), None)

    def pop(self, request: Request, now: float) -> None:
        del self._queue[request.seq]

    def remove(self, request: Request) -> None:
        del self._queue[request.seq]

    def take_alone(self, request: Request) -> None:
        """``enqueue`` then ``pop`` while nothing is queued: nothing to keep."""
        if self._queue:
            raise ValueError("take_alone: requests are queued in this lane")

    def queued(self) -> int:
        return len(self._queue)


class RequestsPerWindow(_ServiceCounters):
    """At most ``limit`` dispatches per tenant in each fixed window of ``window`` time units.

    Not work-conserving by design: when every queued tenant is over its limit, ``peek`` returns None
    and capacity idles until the next window. Picking scans the tenants with queued requests
    (O(n)); this is a baseline for experiments, not a production path.
    """

    name = "rpm"

    def __init__(self, limit: float = float("inf"), window: float = 2000.0) -> None:
        super().__init__()
        if limit < 0 or window <= 0:
            raise ValueError("rpm needs limit >= 0 and window > 0")
        self.limit = limit
        self.window = window
        self._queues: dict[str, deque[Request]] = {}
        self._window_index = -1
        self._dispatched: dict[str, int] = {}
        self._queued = 0

    def enqueue(self, request: Request, now: float) -> None:
        self._queues.setdefault(request.tenant, deque()).append(request)
        self._queued += 1

    def peek(self, now: float) -> Request | None:
        self._roll(now)
        best: Request | None = None
        for tenant, queue in self._queues.items():
            if queue and self._dispatched.get(tenant, 0) < self.limit:
                head = queue[0]
                if best is None or head.seq < best.seq:
                    best = head
        return best

    def pop(self, request: Request, now: float) -> None:
        self._roll(now)
        self.remove(request)
        self._dispatched[request.tenant] = self._dispatched.get(request.tenant, 0) + 1

    def remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        self._queued -= 1

    def queued(self) -> int:
        return self._queued

    def _roll(self, now: float) -> None:
        index = int(now // self.window)
        if index != self._window_index:
            self._window_index = index
            self._dispatched.clear()
