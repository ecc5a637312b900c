"""How many lines may a flood of like events write to the log? A fixed number per interval.

A client refused at ~650 requests/s must not write ~650 log lines a second: every refusal is
counted in a metric; the log gets the first few of each interval and then one line saying how
many it left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

LINES_PER_INTERVAL = 10
INTERVAL = 60.0
"""Seconds: at most ``LINES_PER_INTERVAL`` lines (plus one summary line) in each."""


class LogBudget:
    """At most ``lines`` log lines per ``interval`` seconds of ``clock``; the events left out are
    counted and reported with the next line written."""

    __slots__ = ("_clock", "_interval", "_left", "_lines", "_logger", "_omitted", "_since", "what")

    def __init__(self, logger: logging.Logger, what: str, clock: Callable[[], float],
                 lines: int = LINES_PER_INTERVAL, interval: float = INTERVAL) -> None:
        self._logger, self.what, self._clock = logger, what, clock
        self._lines, self._interval = lines, interval
        self._since = -float("inf")
        self._left = 0
        self._omitted = 0

    def log(self, level: int, message: str, *args: object) -> bool:
        """Log ``message % args`` if the interval's budget allows; True when it was written."""
        now = self._clock()
        if now - self._since >= self._interval:
            if self._omitted:
                self._logger.log(level, "%d %s not logged in the last %gs", self._omitted,
                                 self.what, self._interval)
            self._since, self._left, self._omitted = now, self._lines, 0
        if self._left <= 0:
            self._omitted += 1
            return False
        self._left -= 1
        self._logger.log(level, message, *args)
        return True
