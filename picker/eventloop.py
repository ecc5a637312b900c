"""Which event loop runs a picker process, and how a process starts one.

uvloop (libuv's loop, written in Cython) by default: the picker's CPU goes mostly to waking up
for gRPC messages, not to its own code (``bench/results/profile.md``), and uvloop wakes up for
less. ``asyncio`` is the standard library's loop, for a platform without uvloop's wheels or to
compare the two; the picker behaves the same on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

EVENT_LOOPS = ("uvloop", "asyncio")
DEFAULT_EVENT_LOOP = "uvloop"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], event_loop: str = DEFAULT_EVENT_LOOP) -> T:
    """Run ``main`` to completion on a new loop of the kind ``event_loop`` names."""
    if event_loop == "uvloop":
        import uvloop  # only here: a process that asks for asyncio's loop never loads it

        return uvloop.run(main)
    if event_loop != "asyncio":
        main.close()
        raise ValueError(f"event loop {event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
    return asyncio.run(main)
