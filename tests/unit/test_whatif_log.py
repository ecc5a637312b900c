"""The metering log read as arrivals (issue 29 points 1 and 5): arrival order from a log in
finish order, streamed; each unusable line named, skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from picker.metering import MeteringRecord
from picker.whatif.log import (
    RELEASE_EVERY,
    REPORTED_PER_KIND,
    Skips,
    parse_time,
    read_arrivals,
)

T0 = 1_764_000_000.0


def record(arrived: float, e2e_s: float = 1.0, tenant: str = "a", **changes: Any) -> str:
    """One metering line as the picker writes it."""
    fields: dict[str, Any] = {
        "request_id": f"r{arrived}", "timestamp": T0 + arrived + e2e_s, "tenant_id": tenant,
        "model": "m", "priority_lane": "default", "outcome": "ok", "finish_reason": "stop",
        "endpoint": "10.0.0.1:8000", "prompt_tokens": 100, "completion_tokens": 20,
        "cached_prompt_tokens": 0, "estimated": False, "cost": 140.0, "demoted": False,
        "queue_ms": 0.0, "ttft_ms": 30.0, "e2e_ms": e2e_s * 1000, "arrived_at": T0 + arrived,
        "max_tokens": 64, "stream": True, "lane_asked": None}
    fields.update(changes)
    return MeteringRecord(**fields).to_json() if set(fields) == set(
        MeteringRecord.__dataclass_fields__) else json.dumps(fields)


def write(tmp_path: Path, lines: list[str], end: str = "\n") -> Path:
    path = tmp_path / "metering.jsonl"
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    return path


def arrivals(path: Path, **options: Any) -> tuple[list[float], Skips]:
    skips = Skips()
    times = [a.arrived - T0 for a in read_arrivals(path, skips, **options)]
    return times, skips


def test_a_log_in_finish_order_comes_back_in_arrival_order(tmp_path: Path) -> None:
    # Finish order: the long request that arrived first finishes last.
    lines = [record(1.0, e2e_s=0.5), record(2.0, e2e_s=0.2), record(0.0, e2e_s=30.0)]
    times, skips = arrivals(write(tmp_path, lines))
    assert times == [0.0, 1.0, 2.0]
    assert (skips.used, skips.skipped, skips.messages) == (3, 0, [])


def test_a_truncated_last_line_and_a_corrupt_one_are_named_skipped_and_counted(
        tmp_path: Path) -> None:
    whole = record(3.0)
    lines = [record(0.0), "\x00\x01garbage", record(1.0), record(2.0), whole[:len(whole) // 2]]
    reported: list[str] = []
    times, skips = arrivals(write(tmp_path, lines, end=""), report=reported.append)
    assert times == [0.0, 1.0, 2.0]
    assert skips.not_json == 2 and skips.used == 3 and skips.lines == 5
    assert reported[0].startswith("line 2: not a JSON record: ")
    assert reported[1].startswith("line 5: not a JSON record (the last line, cut short): ")
    assert "skipped 2: 2 not JSON (truncated or corrupt)" in skips.summary()


@pytest.mark.parametrize(("change", "message"), [
    ({"prompt_tokens": "abc"}, "field prompt_tokens: must be a whole number >= 0, got 'abc'"),
    ({"prompt_tokens": -1}, "field prompt_tokens: must be a whole number >= 0, got -1"),
    ({"tenant_id": None}, "field tenant_id: missing"),
    ({"tenant_id": ""}, "field tenant_id: must be a non-empty string, got ''"),
    ({"timestamp": "yesterday"}, "field timestamp: must be a finite number, got 'yesterday'"),
    ({"stream": "yes"}, "field stream: must be true or false, got 'yes'"),
    ({"arrived_at": None, "e2e_ms": None}, "field e2e_ms: missing"),
])
def test_a_bad_field_is_named_with_its_line(tmp_path: Path, change: dict[str, Any],
                                            message: str) -> None:
    times, skips = arrivals(write(tmp_path, [record(0.0), record(1.0, **change), record(2.0)]))
    assert times == [0.0, 2.0] and skips.bad_field == 1
    assert skips.messages == [f"line 2: {message}; skipped"]


def test_a_line_that_is_not_an_object_is_a_bad_field(tmp_path: Path) -> None:
    _, skips = arrivals(write(tmp_path, ["[1, 2]", record(0.0)]))
    assert skips.messages == ["line 1: field (record): must be a JSON object, got list; skipped"]


def test_out_of_order_beyond_the_window_is_skipped_within_it_is_sorted(tmp_path: Path) -> None:
    # Two logs pasted together: the second starts 100 s before the first one's end.
    first = [record(float(t)) for t in range(0, 200, 10)]
    second = [record(95.0), record(205.0)]
    times, skips = arrivals(write(tmp_path, first + second), reorder_window_s=30.0)
    assert skips.out_of_order == 1 and 95.0 not in times and times[-1] == 205.0
    assert times == sorted(times)
    assert skips.messages[0].startswith("line 21: arrived at 2025-11-24T")
    assert "before a request already replayed (the reorder window is 30s: --reorder-window)" \
        in skips.messages[0]
    # With a window as long as the overlap, nothing is lost.
    times, skips = arrivals(write(tmp_path, first + second), reorder_window_s=200.0)
    assert skips.out_of_order == 0 and 95.0 in times and times == sorted(times)


def test_since_and_until_keep_a_window_of_arrivals(tmp_path: Path) -> None:
    path = write(tmp_path, [record(float(t)) for t in range(10)])
    times, skips = arrivals(path, since=T0 + 3, until=T0 + 6)
    assert times == [3.0, 4.0, 5.0]
    assert skips.outside_window == 7 and skips.skipped == 0
    assert "7 outside --since/--until" in skips.summary()


def test_messages_stop_after_a_few_of_each_kind_but_all_are_counted(tmp_path: Path) -> None:
    lines = ["{broken"] * 50 + [record(0.0)]
    _, skips = arrivals(write(tmp_path, lines))
    assert skips.not_json == 50
    assert len(skips.messages) == REPORTED_PER_KIND + 1
    assert skips.messages[-1] == "(further not json lines are counted, not listed)"


def test_records_written_before_the_replay_fields_are_inferred(tmp_path: Path) -> None:
    old = json.loads(record(5.0, e2e_s=2.0))
    for name in ("arrived_at", "max_tokens", "stream", "lane_asked"):
        del old[name]
    skips = Skips()
    (arrival,) = read_arrivals(write(tmp_path, [json.dumps(old)]), skips)
    assert arrival.arrived == pytest.approx(T0 + 5.0)  # timestamp less e2e_ms
    assert arrival.stream is True and arrival.max_tokens is None
    assert skips.inferred == 1 and "1 older records" in skips.summary()


def test_a_request_that_never_reached_an_engine_has_no_recorded_output(tmp_path: Path) -> None:
    line = record(0.0, endpoint=None, outcome="queue_timeout", completion_tokens=0)
    (arrival,) = read_arrivals(write(tmp_path, [line]), Skips())
    assert arrival.output_tokens is None and arrival.max_tokens == 64


def test_the_log_is_streamed_not_read_whole(tmp_path: Path) -> None:
    path = write(tmp_path, [record(float(t)) for t in range(2 * RELEASE_EVERY)])
    skips = Skips()
    stream = read_arrivals(path, skips, reorder_window_s=10.0)
    next(stream)
    # The first arrivals are out once RELEASE_EVERY records past them have been read (they
    # finished more than 10 s after it): the window and those records are what is held.
    assert skips.lines == RELEASE_EVERY
    assert sum(1 for _ in stream) == 2 * RELEASE_EVERY - 1


def test_times_are_unix_seconds_or_iso_8601() -> None:
    assert parse_time("1764000000.5") == 1764000000.5
    assert parse_time("2025-11-24T16:00:00Z") == 1764000000.0
    assert parse_time("2025-11-24T16:00:00") == 1764000000.0  # no offset: UTC
    assert parse_time("2025-11-24T17:00:00+01:00") == 1764000000.0
    with pytest.raises(ValueError, match="neither unix seconds nor an ISO 8601 time"):
        parse_time("last tuesday")


def test_a_growing_log_is_read_to_the_size_given(tmp_path: Path) -> None:
    path = write(tmp_path, [record(0.0), record(1.0)])
    size = path.stat().st_size
    with path.open("a") as more:  # the picker appends while the replay runs
        more.write(record(2.0) + "\n")
    times, skips = arrivals(path, size=size)
    assert times == [0.0, 1.0] and skips.lines == 2
