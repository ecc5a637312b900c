"""How much weighted service did each tenant get over the last window (say, the last minute)?

The scheduler keeps only cumulative totals per tenant since the picker started. ``ServiceWindow``
samples those totals at most once per ``interval`` and keeps, per sample, what each tenant gained
since the previous one; a tenant's service over the window is the sum of its gains in the samples
still inside the window plus what it gained since the last sample.

Memory stays bounded whatever tenant ids clients send: a sample holds only the tenants that
gained service in its interval (none: the sample is not kept), and samples older than the window
are dropped, so the history holds at most ``window / interval`` samples of tenants served within
the window. The one full map kept is the previous totals, needed to take differences; it has the
same keys as the scheduler's own totals, so it adds no tenants the picker does not already hold.

Service is attributed to the time of the sample that first saw it: sampling every second (the
admin server's background task) makes the window accurate to about a second. Time is passed in
(monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

DEFAULT_WINDOW = 60.0
"""Seconds of the window ``service_share`` and ``window_service`` are computed over."""
DEFAULT_INTERVAL = 1.0
"""Seconds between kept samples, at least."""


class ServiceWindow:
    """Per-tenant service over a sliding window, from samples of cumulative totals."""

    def __init__(self, window: float = DEFAULT_WINDOW, interval: float = DEFAULT_INTERVAL) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, not {window!r}")
        if not 0 < interval <= window:
            raise ValueError(f"interval must be in (0, window], not {interval!r}")
        self.window = float(window)
        self.interval = float(interval)
        self._samples: deque[tuple[float, dict[str, float]]] = deque()
        """(time, {tenant: gain since the previous sample}), oldest first; gains are non-zero."""
        self._totals: dict[str, float] = {}
        """The cumulative totals at the last sample."""
        self._sampled_at: float | None = None

    @property
    def samples(self) -> int:
        """Samples held (bounded by ``window / interval``)."""
        return len(self._samples)

    @property
    def tenants_held(self) -> int:
        """Distinct tenants in the history (only those with service within the window)."""
        return len({tenant for _, gains in self._samples for tenant in gains})

    def observe(self, now: float, totals: Mapping[str, float]) -> None:
        """Take a sample of ``totals`` unless the last one is less than ``interval`` old.

        The first call only sets the baseline: service before it is not in any window, because
        when it happened is unknown.
        """
        if self._sampled_at is not None and now - self._sampled_at < self.interval:
            return
        if self._sampled_at is not None:
            gains = self._gains(totals)
            if gains:
                self._samples.append((now, gains))
        self._totals = dict(totals)
        self._sampled_at = now
        self._expire(now)

    def service(self, now: float, totals: Mapping[str, float]) -> dict[str, float]:
        """Each tenant's service over ``(now - window, now]``, for tenants with some (> 0).

        Samples first (when due), so callers need no background task for correct figures; a task
        calling ``observe`` every ``interval`` only sharpens when service is counted as happening.
        """
        self.observe(now, totals)
        self._expire(now)
        out: dict[str, float] = {}
        for _, gains in self._samples:
            for tenant, gain in gains.items():
                out[tenant] = out.get(tenant, 0.0) + gain
        for tenant, gain in self._gains(totals).items():
            out[tenant] = out.get(tenant, 0.0) + gain
        # A settlement can lower a total (an estimate was too high): net service below zero over
        # the window means none was delivered in it.
        return {tenant: value for tenant, value in out.items() if value > 0}

    def _gains(self, totals: Mapping[str, float]) -> dict[str, float]:
        previous = self._totals
        return {tenant: value - previous.get(tenant, 0.0) for tenant, value in totals.items()
                if value != previous.get(tenant, 0.0)}

    def _expire(self, now: float) -> None:
        start = now - self.window
        while self._samples and self._samples[0][0] <= start:
            self._samples.popleft()
