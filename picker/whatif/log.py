"""A metering log read as arrivals: which requests came, when, and what each asked for.

It answers: *what traffic does this log hold, in arrival order, and what in it cannot be used?*
The picker writes one JSON line per finished request (``picker.metering``), in the order they
finish; a replay needs them in the order they arrived. ``read_arrivals`` streams the file once and
keeps only a reorder window in memory: a record is released once a record finishing
``reorder_window_s`` later has been read (no request still to come can have arrived before it).

Each line that cannot be used is skipped and reported once, naming its line and field (``Skips``):
not JSON (a truncated or corrupt line), a field missing or of the wrong type, arrived before
records already replayed (out of order by more than the window), or outside ``--since``/``--until``
(counted, not reported). Records written before the replay fields (``arrived_at``, ``max_tokens``,
``stream``, ``lane_asked``) still load: the arrival is their finish less ``e2e_ms``, the rest
unknown (``Skips.inferred`` counts them). A request that never reached an engine (it timed out
in the queue, or was cancelled there) is metered with ``prompt_tokens`` 0: nothing was charged.
Its prompt is taken as the mean prompt of its tenant's served requests read so far (else of all
tenants', else 1), since under another config it may be served (``Skips.prompt_guessed``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import marshal
import math
import operator
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NamedTuple

try:
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is a dependency; json gives the same records
    _loads = json.loads  # type: ignore[assignment]  # takes str and bytes alike, as orjson's

REPORTED_PER_KIND = 5
"""Messages printed for each kind of problem; the rest are counted."""


class Arrival(NamedTuple):
    """One request of the log, as a replay sends it again (a named tuple: a day's log makes
    millions, and a tuple is built and read back from the spool several times faster than a
    frozen dataclass)."""

    line: int
    """Its line in the log (1-based): messages about it name it."""
    arrived: float
    """Unix seconds."""
    tenant: str
    model: str
    lane_asked: str | None
    """The lane it asked for; None: its tenant's (and in older records, which lack it)."""
    prompt_tokens: int
    output_tokens: int | None
    """What the engine produced for it (``completion_tokens``), which the replay's engine
    produces again; None when it never reached an engine (the run's default is used)."""
    max_tokens: int | None
    """The output limit the body asked for, which admission reserves for; None: none or
    unknown."""
    stream: bool
    finished: float
    """Unix seconds when it finished (``timestamp``): the log's own order."""


@dataclass
class Skips:
    """What of the log was not replayed, and why; also what had to be inferred."""

    lines: int = 0
    """Lines read (blank lines included)."""
    used: int = 0
    not_json: int = 0
    bad_field: int = 0
    out_of_order: int = 0
    outside_window: int = 0
    inferred: int = 0
    """Records without the replay fields (written before them): arrival from ``timestamp`` less
    ``e2e_ms``, ``stream`` taken as true, ``max_tokens`` unknown."""
    prompt_guessed: int = 0
    """Requests never served (metered with 0 prompt tokens) given their tenant's mean prompt."""
    messages: list[str] = field(default_factory=list)
    """The first ``REPORTED_PER_KIND`` messages of each kind."""
    _reported: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def skipped(self) -> int:
        return self.not_json + self.bad_field + self.out_of_order

    def note(self, kind: str, message: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        count = self._reported.get(kind, 0)
        if count < REPORTED_PER_KIND:
            self.messages.append(message)
        elif count == REPORTED_PER_KIND:
            self.messages.append(f"(further {kind.replace('_', ' ')} lines are counted, not "
                                 "listed)")
        self._reported[kind] = count + 1

    def will_list(self, kind: str) -> bool:
        """Whether the next problem of ``kind`` gets a message of its own."""
        return self._reported.get(kind, 0) < REPORTED_PER_KIND

    def summary(self) -> str:
        """One sentence: how much was used and how much skipped, by kind."""
        kinds = [(self.not_json, "not JSON (truncated or corrupt)"),
                 (self.bad_field, "with a missing or bad field"),
                 (self.out_of_order, "out of order beyond the reorder window")]
        parts = [f"{n:,} {what}" for n, what in kinds if n]
        text = f"replayed {self.used:,} of {self.lines:,} lines"
        if parts:
            text += f"; skipped {self.skipped:,}: " + ", ".join(parts)
        if self.outside_window:
            text += f"; {self.outside_window:,} outside --since/--until"
        if self.inferred:
            text += (f"; {self.inferred:,} older records without arrival/max_tokens/stream "
                     "(arrival inferred from timestamp - e2e_ms, stream assumed)")
        if self.prompt_guessed:
            text += (f"; {self.prompt_guessed:,} never served, their prompt taken as their "
                     "tenant's mean")
        return text

    def as_dict(self) -> dict[str, int]:
        return {"lines": self.lines, "used": self.used, "skipped": self.skipped,
                "not_json": self.not_json, "bad_field": self.bad_field,
                "out_of_order": self.out_of_order, "outside_window": self.outside_window,
                "inferred": self.inferred, "prompt_guessed": self.prompt_guessed}


MAX_TENANT_MEANS = 100_000
"""Tenants whose mean prompt is kept (memory stays bounded on a log of endless tenant ids)."""


class PromptMeans:
    """Each tenant's mean prompt so far, and all tenants': the prompt of a request the log
    metered at 0 tokens because it never reached an engine."""

    def __init__(self) -> None:
        self.sums: dict[str, list[int]] = {}
        self.total = [0, 0]

    def add(self, tenant: str, prompt: int) -> None:
        self.total[0] += prompt
        self.total[1] += 1
        seen = self.sums.get(tenant)
        if seen is None:
            if len(self.sums) >= MAX_TENANT_MEANS:
                return
            seen = self.sums[tenant] = [0, 0]
        seen[0] += prompt
        seen[1] += 1

    def guess(self, tenant: str) -> int:
        total, count = self.sums.get(tenant) or self.total
        return max(1, round(total / count)) if count else 1


class BadField(ValueError):
    """A record's field is missing or of the wrong type."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"field {name}: {message}")


def _number(data: dict[str, Any], name: str, *, required: bool = True) -> float | None:
    value = data.get(name)
    if value is None:
        if required:
            raise BadField(name, "missing")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadField(name, f"must be a finite number, got {value!r}")
    return float(value)


def _count(data: dict[str, Any], name: str, *, required: bool = True) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise BadField(name, "missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadField(name, f"must be a whole number >= 0, got {value!r}")
    return value


def _text(data: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = data.get(name)
    if value is None:
        if required:
            raise BadField(name, "missing")
        return None
    if not isinstance(value, str) or (required and not value):
        raise BadField(name, f"must be a non-empty string, got {value!r}")
    return value


def _flag(data: dict[str, Any], name: str) -> bool | None:
    value = data.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise BadField(name, f"must be true or false, got {value!r}")


_INF = math.inf

Row = tuple[Any, ...]
"""An ``Arrival``'s fields as a plain tuple, in its order: what the one pass over a day's log
builds, spools and replays (a plain tuple is built, spooled and read back faster than the
named one)."""


_plain_fields = operator.itemgetter(
    "tenant_id", "timestamp", "arrived_at", "prompt_tokens", "completion_tokens", "model",
    "lane_asked", "stream", "max_tokens", "endpoint")
"""The fields ``_plain_record`` reads, in one call instead of ten ``dict.get`` calls (with
``FigureScan.add``'s likewise, 4.5 % of the one pass's instructions)."""


def _plain_record(line_number: int, data: dict[str, Any]) -> Row | None:
    """``parse_record`` of a record as the picker writes it today, in one pass of exact type
    checks (a day's log is millions of them), as a ``Row``; None for anything else, which
    ``parse_record`` then reads field by field to say what is wrong."""
    try:  # the picker writes every field, None or not: one call reads them all
        tenant, finished, arrived, prompt, completion, model, lane, stream, cap, endpoint = \
            _plain_fields(data)
    except KeyError:  # a field missing: None, as ``get`` has it (an older record, say)
        get = data.get
        tenant, finished, arrived = get("tenant_id"), get("timestamp"), get("arrived_at")
        prompt, completion = get("prompt_tokens"), get("completion_tokens")
        model, lane, stream = get("model"), get("lane_asked"), get("stream")
        cap, endpoint = get("max_tokens"), get("endpoint")
    if type(tenant) is not str or not tenant or type(finished) is not float \
            or type(arrived) is not float or not (-_INF < finished < _INF) \
            or not (-_INF < arrived < _INF) or type(prompt) is not int or prompt < 0 \
            or type(completion) is not int or completion < 0 \
            or (model is not None and type(model) is not str) \
            or (lane is not None and type(lane) is not str) \
            or (stream is not None and type(stream) is not bool) \
            or (cap is not None and (type(cap) is not int or cap < 0)):
        return None
    return (line_number, arrived, tenant, model or "", lane, prompt,
            completion if endpoint is not None else None, cap,
            True if stream is None else stream, finished)


def parse_record(line_number: int, data: Any) -> tuple[Arrival, bool]:
    """The arrival a metering record describes, and whether any of it had to be inferred
    (a record written before the replay fields). Raises ``BadField``."""
    if type(data) is dict:
        plain = _plain_record(line_number, data)
        if plain is not None:
            return tuple.__new__(Arrival, plain), False
    if not isinstance(data, dict):
        raise BadField("(record)", f"must be a JSON object, got {type(data).__name__}")
    tenant = _text(data, "tenant_id")
    finished = _number(data, "timestamp")
    arrived = _number(data, "arrived_at", required=False)
    inferred = arrived is None
    if arrived is None:
        e2e_ms = _number(data, "e2e_ms")
        assert e2e_ms is not None and finished is not None
        if e2e_ms < 0:
            raise BadField("e2e_ms", f"must be >= 0, got {e2e_ms!r}")
        arrived = finished - e2e_ms / 1000
    prompt = _count(data, "prompt_tokens")
    completion = _count(data, "completion_tokens")
    # The lane it ran in (``priority_lane``) is the config's decision, made anew by the replay;
    # what it asked for is not (older records: unknown, so its tenant's lane).
    lane_asked = _text(data, "lane_asked", required=False)
    stream = _flag(data, "stream")
    endpoint = data.get("endpoint")
    assert tenant is not None and finished is not None and prompt is not None \
        and completion is not None
    return Arrival(
        line=line_number, arrived=arrived, tenant=tenant,
        model=_text(data, "model", required=False) or "", lane_asked=lane_asked,
        prompt_tokens=prompt, output_tokens=completion if endpoint is not None else None,
        max_tokens=_count(data, "max_tokens", required=False),
        stream=True if stream is None else stream, finished=finished), inferred


def parse_time(text: str) -> float:
    """Unix seconds from ``text``: a number, or ISO 8601 (UTC when no offset is given)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds")


def open_lines(source: Path | Sequence[bytes]
               ) -> contextlib.AbstractContextManager[Iterable[bytes]]:
    """The log's lines: a file opened for reading, or lines already in memory (JSON records
    the admin API's ``RecentRequests`` answered, encoded as the log would hold them)."""
    if isinstance(source, Path):
        return source.open("rb")
    return contextlib.nullcontext(source)


def decode(raw: bytes) -> Any:
    """One line of the log decoded: by orjson (about 1 µs a line against ``json``'s 7), and
    whatever it refuses by ``json`` again, which accepts what orjson does not (``NaN``, integers
    past 64 bits, a lone surrogate, UTF-16) and whose message names what is wrong: the records
    and messages are ``json.loads``'s. Raises ValueError."""
    try:
        return _loads(raw)
    except ValueError:
        return json.loads(raw)


RELEASE_EVERY = 8192
"""Records read between two releases of the reorder window (``read_arrival_chunks``)."""

_new_window = list
"""The reorder window's list (a test counts its sorts)."""
_arrived_of = operator.itemgetter(1)
"""A row's ``arrived``: the reorder window's sort key."""


def read_arrivals(path: Path | Sequence[bytes], skips: Skips, *, reorder_window_s: float = 600.0,
                  since: float | None = None, until: float | None = None,
                  size: int | None = None,
                  report: Callable[[str], None] | None = None,
                  each: Callable[[int, dict[str, Any], Row], None] | None = None
                  ) -> Iterator[Arrival]:
    """The usable records of the log at ``path`` (or lines in memory), in arrival order,
    streamed.

    ``since``/``until`` (unix seconds) keep arrivals in ``[since, until)``. ``size``: read only
    the first ``size`` bytes (a live log grows: every config is replayed on the same lines).
    ``report`` gets each message as it is noted (as well as ``skips.messages``). ``each`` sees
    every record that parses (a ``Row``), in the log's order, as it is read (before the window
    and the order are judged): the CLI's scan of the pool's figures rides on this one decoding
    pass.
    """
    new = tuple.__new__
    for chunk in read_arrival_chunks(path, skips, reorder_window_s=reorder_window_s,
                                     since=since, until=until, size=size, report=report,
                                     each=each):
        for row in chunk:
            yield new(Arrival, row)


def read_arrival_chunks(path: Path | Sequence[bytes], skips: Skips, *,
                        reorder_window_s: float = 600.0, since: float | None = None,
                        until: float | None = None, size: int | None = None,
                        report: Callable[[str], None] | None = None,
                        each: Callable[[int, dict[str, Any], Row], None] | None = None
                        ) -> Iterator[list[Row]]:
    """``read_arrivals``' arrivals as ``Row``s, in lists, as the reorder window releases
    them.

    The window: a record is released once a record finishing ``reorder_window_s`` after its
    arrival has been read (no request still to come can have arrived before it), in the order
    (arrival, line). The records waiting are not a heap but a list, sorted by arrival (stably:
    the line breaks ties) and cut every ``RELEASE_EVERY`` records: a release at the horizon of
    the last record kept is what a heap releasing at every record would have released by then,
    and an arrival is judged out of order against that. Only an arrival before that horizon
    can be (what was released is before it), and only then is the window cut at once, so every
    judgement is the heap's. Memory: the window and ``RELEASE_EVERY`` records."""
    pending: list[Row] = _new_window()
    sums: dict[str, list[int]] = {}
    """Per tenant, [prompt tokens, served requests] (``PromptMeans``, inline)."""
    total_prompt = total_served = 0
    latest_finish = -math.inf
    release_at = -math.inf
    """The horizon as of the last record kept: what is at or before it is released."""
    released = -math.inf
    """The last arrival released: an arrival before it can no longer be replayed."""
    fresh = 0
    """Records kept since the last release."""
    lines = 0

    def note(kind: str, message: str) -> None:
        before = len(skips.messages)
        skips.note(kind, message)
        if report is not None and len(skips.messages) > before:
            report(skips.messages[-1])

    def release(until: float) -> list[Row]:
        """The records waiting that arrived at or before ``until``, in order, taken out."""
        nonlocal released
        pending.sort(key=_arrived_of)
        cut = bisect.bisect_right(pending, until, key=_arrived_of)
        if not cut:
            return []
        out = pending[:cut]
        del pending[:cut]
        released = out[-1][1]
        skips.used += cut
        return out

    plain = _plain_record
    with open_lines(path) as stream:
        read = 0
        for number, raw in enumerate(stream, start=1):
            read += len(raw)
            if size is not None and read > size:
                break
            lines += 1
            if not raw or (raw[0] != 123 and not raw.strip()):  # a record starts with "{"
                continue
            try:
                data = _loads(raw)  # ``decode``, inline: this runs for every line
            except ValueError:
                try:
                    data = json.loads(raw)
                except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
                    ending = "" if raw.endswith(b"\n") else " (the last line, cut short)"
                    note("not_json", f"line {number}: not a JSON record{ending}: {exc}; skipped")
                    continue
            row = plain(number, data) if type(data) is dict else None
            if row is not None:
                inferred = False
            else:
                try:
                    parsed, inferred = parse_record(number, data)
                except BadField as exc:
                    note("bad_field", f"line {number}: {exc}; skipped")
                    continue
                row = tuple(parsed)
            if each is not None:
                each(number, data, row)
            _, arrived, tenant, _, _, prompt, output, _, _, finished = row
            if finished > latest_finish:
                latest_finish = finished
            if arrived < release_at:
                # Before the horizon: released by now, or out of order. Cut the window to
                # know exactly what has been released, unless it is out of order already
                # and its message (which says by how much) is not listed.
                if arrived >= released or skips.will_list("out_of_order"):
                    skips.lines = lines
                    out = release(release_at)
                    fresh = 0
                    if out:
                        yield out
                if arrived < released:
                    note("out_of_order",
                         f"line {number}: arrived at {_iso(arrived)}, "
                         f"{released - arrived:.1f}s before a request already replayed "
                         f"(the reorder window is {reorder_window_s:g}s: --reorder-window); "
                         "skipped")
                    continue
            if (since is not None and arrived < since) or (until is not None and arrived >= until):
                skips.outside_window += 1
                continue
            if inferred:
                skips.inferred += 1
            if output is None and prompt == 0:
                seen_total, seen = sums.get(tenant) or (total_prompt, total_served)
                row = (*row[:5], max(1, round(seen_total / seen)) if seen else 1, *row[6:])
                skips.prompt_guessed += 1
            elif prompt:
                total_prompt += prompt
                total_served += 1
                seen_sums = sums.get(tenant)
                if seen_sums is None and len(sums) < MAX_TENANT_MEANS:
                    seen_sums = sums[tenant] = [0, 0]
                if seen_sums is not None:
                    seen_sums[0] += prompt
                    seen_sums[1] += 1
            pending.append(row)
            release_at = latest_finish - reorder_window_s
            fresh += 1
            if fresh >= RELEASE_EVERY:
                skips.lines = lines
                out = release(release_at)
                fresh = 0
                if out:
                    yield out
    skips.lines = lines
    if pending:
        yield release(math.inf)

SPOOL_CHUNK = 4096
"""Arrivals the spool writes (and reads back) at once."""


class Spool:
    """Arrivals kept on disk, in the order added, to be read back as often as asked: the CLI
    decodes the log once (its scan and the reorder window ride on that pass) and every config
    replays the spooled arrivals, which read back about ten times faster than a line decodes.

    Memory is one chunk of ``SPOOL_CHUNK`` arrivals; the rest is in an unnamed temporary file
    (``marshal``: about 46 bytes an arrival plus its tenant's and model's names, 200 MB for a
    day at 50 requests/s with one-letter names), gone when the spool is closed or collected."""

    def __init__(self) -> None:
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix="fairway-whatif-")  # noqa: SIM115 (closed by close)
        self._chunk: list[Row] = []
        """Plain tuples: marshal takes no named ones."""
        self.count = 0
        self.first: Arrival | None = None

    def append(self, arrival: Arrival) -> None:
        self.extend([tuple(arrival)])

    def extend(self, rows: list[Row]) -> None:
        """Arrivals as ``Row``s (plain tuples, as ``read_arrival_chunks`` gives them), in
        order."""
        if not rows:
            return
        if self.first is None:
            self.first = tuple.__new__(Arrival, rows[0])
        chunk = self._chunk
        chunk.extend(rows)
        self.count += len(rows)
        if len(chunk) >= SPOOL_CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._chunk:
            data = marshal.dumps(self._chunk)
            self._file.write(len(data).to_bytes(8, "little"))
            self._file.write(data)
            self._chunk = []

    def __iter__(self) -> Iterator[Arrival]:
        """The arrivals from the first (the spool stays open for the next reading)."""
        new = tuple.__new__
        for chunk in self.chunks():
            for fields in chunk:
                yield new(Arrival, fields)

    def rows(self) -> Iterator[Row]:
        """The arrivals from the first as plain tuples of ``Arrival``'s fields, in its order:
        nothing is built an arrival (the fast replay reads them so)."""
        for chunk in self.chunks():
            yield from chunk

    def chunks(self) -> Iterator[list[Row]]:
        """The arrivals from the first as lists of ``Row``s, a chunk at a time."""
        self._flush()
        loads, file = marshal.loads, self._file
        position = 0
        end = file.seek(0, 2)
        while position < end:
            file.seek(position)
            size = int.from_bytes(file.read(8), "little")
            chunk = loads(file.read(size))
            position += 8 + size
            yield chunk

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GC_YOUNG_THRESHOLD = 50_000
"""Allocations between two collections of the youngest generation during a replay (Python's
default is 700)."""


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Make the cyclic garbage collector cheap for a long replay, until the block ends: what is
    alive now (modules, configs) is frozen out of its sweeps, and its youngest generation is
    collected every ``GC_YOUNG_THRESHOLD`` allocations instead of 700. A replay makes almost no
    cyclic garbage (a request is freed by reference counting when it ends) but holds tens of
    thousands of live objects (the reorder window, the queue, the pool), which the default
    collector walks again and again: 15 % of the CPU of a 60-minute log's replay. Memory stays
    bounded: the collector still runs, less often. For the fast replay only: the exact one's
    simulator makes cyclic garbage a request, which this lets pile up (peak RSS 200 MB against
    127 on a 10-minute log). On leaving, the thresholds are restored and
    what was frozen here is unfrozen (the CLI runs inside tests' processes too)."""
    thresholds = gc.get_threshold()
    frozen = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if not frozen:
            gc.unfreeze()
