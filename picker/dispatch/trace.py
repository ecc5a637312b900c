"""The picker's view of its endpoints over time, for the efficiency benchmark (``--trace FILE``).

It answers: *what did the picker believe about each endpoint, and why did it hold its queue,
at each moment?* Off by default (``picker serve`` without ``--trace``): nothing is recorded and
the request path only tests ``Dispatcher.trace is None``. On, a background task writes one JSON
line every ``interval`` seconds (the picker's monotonic clock, the same as a simulated server's
step trace on the same host): the queue's length, the head request's prompt, and per endpoint
the picker's own count (tokens and requests in flight, projected tokens, outstanding prefill),
the occupancy it judges room by, the scraped waiting queue and KV use with their age, why
``has_room`` says no to the head (``picker.core.holds``), and how many requests it has sent
there and seen end so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

from picker.core.gate import Gate, Passage
from picker.core.holds import hold_reason
from picker.core.selection import occupancy, waiting

INTERVAL = 0.005
"""Seconds between two lines: half a 10 ms engine step."""


class Viewed(Protocol):
    """What the trace reads of ``picker.dispatch.Dispatcher`` (a protocol: the dispatcher
    imports this module)."""

    gate: Gate
    clock: Callable[[], float]


class PickerTrace:
    """Writes the dispatcher's view to ``path`` while ``run`` runs (a ``picker.server`` runner)."""

    def __init__(self, dispatcher: Viewed, path: Path, interval: float = INTERVAL) -> None:
        self.dispatcher, self.path, self.interval = dispatcher, path, interval
        self.sent: dict[str, int] = {}
        self.ended: dict[str, int] = {}
        self.events: list[str] = []
        """Dispatches and settlements since the last line, each a JSON line of its own with
        its exact time (``ev`` ``d`` or ``s``, ``a`` the endpoint)."""

    def dispatched(self, ticket: Passage, now: float) -> None:
        if ticket.endpoint is not None:
            address = ticket.endpoint.address
            self.sent[address] = self.sent.get(address, 0) + 1
            self.events.append(f'{{"ev":"d","t":{now:.5f},"a":"{address}"}}\n')

    def settled(self, ticket: Passage, now: float) -> None:
        if ticket.endpoint is not None:
            address = ticket.endpoint.address
            self.ended[address] = self.ended.get(address, 0) + 1
            self.events.append(f'{{"ev":"s","t":{now:.5f},"a":"{address}"}}\n')

    def line(self) -> dict[str, Any]:
        """The view now, as one trace line."""
        dispatcher = self.dispatcher
        gate, now = dispatcher.gate, dispatcher.clock()
        rules = gate.rules.capacity
        head = gate.scheduler.peek(now) if gate.scheduler.queued() else None
        prompt = head.prompt_tokens if head is not None else 0
        endpoints = []
        for e in gate.endpoints.values():
            endpoints.append({
                "a": e.address, "it": e.inflight_tokens, "ir": e.inflight_requests,
                "pj": e.projected_tokens, "pf": e.prefill_tokens,
                "occ": round(occupancy(e, now, rules)), "w": waiting(e, now, rules),
                "sw": e.waiting, "kv": e.kv_usage,
                "age": None if e.scraped_at is None else round(now - e.scraped_at, 4),
                "cs": e.completed_since_scrape, "bud": e.budget(rules.fallback_budget),
                "why": hold_reason(e, now, rules, prompt) if head is not None else None,
                "d": self.sent.get(e.address, 0), "s": self.ended.get(e.address, 0)})
        return {"t": round(now, 5), "q": gate.queued_total(), "head": prompt or None,
                "maxw": rules.max_waiting, "eps": endpoints}

    async def run(self, stop: asyncio.Event) -> None:
        out: TextIO
        with self.path.open("w", encoding="utf-8") as out:
            flushed = 0.0
            while not stop.is_set():
                out.write(json.dumps(self.line(), separators=(",", ":")) + "\n")
                events, self.events = self.events, []
                out.writelines(events)
                now = self.dispatcher.clock()
                if now - flushed > 0.5:  # a picker killed at the end loses half a second at most
                    out.flush()
                    flushed = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
