"""What did each finished request cost, and whom? One JSON record per request, for billing.

Every request the picker admits becomes, once finished (served, cancelled, timed out in the
queue, failed), one ``MeteringRecord``, written by a ``MeteringSink`` as one compact JSON object
per line (JSON Lines) to stdout or a file, ready for a log shipper or ``jq``. Fields appear in
the dataclass's order. A request refused before the queue (401, 404, 405, 429, ...) costs
nothing and is not metered: it is counted in ``fairway_rejections_total``.

Writing runs on the picker's event loop, so it is cheap: one ``write`` and a flush per line, no
fsync. A sink never raises on a failed write (a closed or broken stdout, a full disk): it counts
the failure in ``failures`` and logs the first one, since metering must not take requests down.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any, Protocol

from picker.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeteringRecord:
    """One finished request: who, what, how long, how many tokens and what it was charged."""

    request_id: str
    timestamp: float
    """When the request finished, unix seconds."""
    tenant_id: str
    model: str | None
    """The requested model; None when the request was refused before naming one."""
    priority_lane: str
    outcome: str
    """``"ok"``, or why not: ``"cancelled"`` or an error's ``metric_label`` (``"queue_full"``)."""
    finish_reason: str
    """``"stop"``, ``"length"`` (engine's), or ``"cancelled"``, ``"timeout"``, ``"error"``."""
    endpoint: str | None
    """The endpoint that served it; None if it was never dispatched."""
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens the engine served from its prefix cache."""
    estimated: bool
    """True when the picker counted or estimated the tokens; False when the engine reported them."""
    cost: float
    """Weighted service charged to the tenant (the scheduler's counter units)."""
    demoted: bool
    """The request ran in a lower lane than it asked for (e.g. its tenant was over budget)."""
    queue_ms: float
    """Time held in the picker's queue."""
    ttft_ms: float | None
    """Time to first token from arrival; None if no token was produced."""
    e2e_ms: float
    """Arrival to finish."""
    # What a replay needs (``python -m picker.whatif``). Added after the fields above, with
    # defaults, so records written before them still load and readers of the others see no change.
    arrived_at: float | None = None
    """When the request reached the picker, unix seconds (``timestamp`` less ``e2e_ms``: the
    log is in finish order, a replay needs arrival order). None in older records."""
    max_tokens: int | None = None
    """The output limit the body asked for (``max_tokens`` or its API's equivalent; 0 for
    embeddings); None when it set none (or in older records)."""
    stream: bool | None = None
    """The client asked for a streamed response; None in older records."""
    lane_asked: str | None = None
    """The lane the request asked for (``x-fairway-lane``); None: its tenant's lane, as
    ``priority_lane`` names it unless ``demoted``."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict, in field order (cheaper than ``dataclasses.asdict``)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def to_json(self) -> str:
        """One compact JSON object, no newline; a non-finite number becomes ``null``."""
        data = self.as_dict()
        try:
            return json.dumps(data, separators=(",", ":"), allow_nan=False)
        except ValueError:
            # NaN and infinity are not JSON; consumers would reject the whole line.
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                     for k, v in data.items()}
            return json.dumps(clean, separators=(",", ":"), allow_nan=False)


_FIELD_NAMES = tuple(f.name for f in fields(MeteringRecord))


class MeteringSink(Protocol):
    """Where metering records go."""

    @property
    def enabled(self) -> bool:
        """False when records are dropped (callers may skip building them)."""
        ...

    def write(self, record: MeteringRecord) -> None:
        """Emit one record; never raises."""
        ...

    def close(self) -> None:
        """Release the destination; later writes are counted as failures."""
        ...


_STDOUT = ("stdout", "-")
_DISABLED = ("none", "")


class JsonLinesSink:
    """Writes each record as one JSON line to stdout, a file (appended to), or nowhere.

    ``target`` is ``"stdout"`` or ``"-"``, ``"none"`` or ``""`` (disabled), a file path, or an open
    text stream (which ``close`` leaves open: the caller owns it). A file path's directory must
    exist; otherwise, or when the file cannot be opened, ``ConfigError`` says why.
    """

    def __init__(self, target: str | IO[str]) -> None:
        self.failures = 0
        """Records lost because a write failed."""
        self.written = 0
        """Records written."""
        self._closed = False
        self._owned: IO[str] | None = None
        self._stream: IO[str] | None = None
        self._use_stdout = False
        if not isinstance(target, str):
            self.target = getattr(target, "name", repr(target))
            self._stream = target
            return
        self.target = target
        name = target.strip()
        if name.lower() in _DISABLED:
            return
        if name.lower() in _STDOUT:
            # Looked up at each write, so a replaced sys.stdout (tests, daemons) is honoured.
            self._use_stdout = True
            return
        path = Path(name)
        if not path.parent.is_dir():
            raise ConfigError("", f"metering target {name}: directory {path.parent} does not exist")
        try:
            # Line-buffered: each record reaches the OS as it is written, without an fsync.
            self._owned = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise ConfigError("", f"metering target {name}: cannot open: {exc.strerror}") from exc
        self._stream = self._owned

    @property
    def enabled(self) -> bool:
        """False for a disabled target: records are dropped without counting."""
        return self._use_stdout or self._stream is not None

    def write(self, record: MeteringRecord) -> None:
        """Append ``record`` as one JSON line; on failure count it in ``failures``, never raise."""
        if not self.enabled:
            return
        try:
            if self._closed:
                raise ValueError("sink is closed")
            line = record.to_json() + "\n"
            stream = sys.stdout if self._use_stdout else self._stream
            if stream is None:  # sys.stdout can be None (pythonw, detached daemons)
                raise ValueError("stdout is not available")
            stream.write(line)
            stream.flush()
        except (OSError, ValueError, TypeError) as exc:
            # OSError: broken pipe, full disk; ValueError: closed stream; TypeError: a field of a
            # type JSON cannot hold. Metering must never fail the request it describes.
            self.failures += 1
            if self.failures == 1:
                log.warning("metering: cannot write to %s: %s (counting further failures)",
                            self.target, exc)
            return
        self.written += 1

    def close(self) -> None:
        """Close the file this sink opened (stdout and caller-owned streams stay open)."""
        self._closed = True
        if self._owned is not None:
            try:
                self._owned.close()
            except OSError as exc:
                log.warning("metering: closing %s: %s", self.target, exc)
            self._owned = None


class RecentRecords:
    """The last ``capacity`` records, oldest first, in memory: the traffic a what-if replays
    (the admin API's ``RecentRequests``). Kept whether or not a metering log is written.

    Appending keeps the record the dispatcher already built (no copy, no parse); the ring
    forgets the oldest once full, so memory is bounded by ``capacity`` records (about 560 bytes
    each, measured with tracemalloc: 11 MB for 20,000)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity!r}")
        self.capacity = capacity
        self.records: deque[MeteringRecord] = deque(maxlen=capacity)

    def add(self, record: MeteringRecord) -> None:
        self.records.append(record)

    def oldest_arrival(self) -> float | None:
        """The earliest arrival among the records held (None: none held)."""
        arrivals = (r.arrived_at if r.arrived_at is not None else r.timestamp - r.e2e_ms / 1000
                    for r in self.records)
        return min(arrivals, default=None)

    def since(self, arrived_from: float, limit: int) -> tuple[list[MeteringRecord], bool]:
        """Records that arrived at ``arrived_from`` (unix seconds) or later, oldest first by
        finish; at most ``limit``, the latest to finish, and whether more matched."""
        found: list[MeteringRecord] = []
        truncated = False
        for record in reversed(self.records):
            if record.timestamp < arrived_from:
                break  # it and every older record finished, so arrived, before the window
            arrived = record.arrived_at if record.arrived_at is not None else \
                record.timestamp - record.e2e_ms / 1000
            if arrived < arrived_from:
                continue
            if len(found) == limit:
                truncated = True
                break
            found.append(record)
        found.reverse()
        return found, truncated


def open_sink(target: str) -> MeteringSink:
    """The sink for a configured ``target``: ``"stdout"``/``"-"``, ``"none"``/``""``, or a path."""
    return JsonLinesSink(target)
