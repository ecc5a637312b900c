"""Metering: one JSON line per finished request, to stdout, a file or nowhere; never raising."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from pathlib import Path

import pytest

from picker.errors import ConfigError
from picker.metering import JsonLinesSink, MeteringRecord, MeteringSink, open_sink


def record(**changes: object) -> MeteringRecord:
    base = MeteringRecord(
        request_id="req-1",
        timestamp=1_700_000_000.25,
        tenant_id="alice",
        model="llama-3-8b",
        priority_lane="interactive",
        outcome="ok",
        finish_reason="stop",
        endpoint="10.0.0.7:8000",
        prompt_tokens=300,
        completion_tokens=42,
        cached_prompt_tokens=128,
        estimated=False,
        cost=384.0,
        demoted=False,
        queue_ms=12.5,
        ttft_ms=80.0,
        e2e_ms=950.0,
    )
    return dataclasses.replace(base, **changes)


def test_record_has_the_required_fields() -> None:
    names = {f.name for f in dataclasses.fields(MeteringRecord)}
    assert names >= {
        "tenant_id", "model", "priority_lane", "prompt_tokens", "completion_tokens",
        "cached_prompt_tokens", "queue_ms", "ttft_ms", "e2e_ms", "finish_reason", "endpoint",
        "cost", "outcome", "request_id", "timestamp", "demoted", "estimated",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        record().cost = 0.0  # type: ignore[misc]


def test_record_round_trips_through_json_with_every_field_in_order() -> None:
    r = record()
    line = r.to_json()
    assert "\n" not in line and ": " not in line and ", " not in line
    data = json.loads(line)
    assert list(data) == [f.name for f in dataclasses.fields(MeteringRecord)]
    assert MeteringRecord(**data) == r


def test_rejected_record_keeps_its_nones() -> None:
    r = record(outcome="queue_full", finish_reason="rejected", endpoint=None, ttft_ms=None,
               model=None, completion_tokens=0, cost=0.0, estimated=True, demoted=True)
    data = json.loads(r.to_json())
    assert data["endpoint"] is None and data["ttft_ms"] is None and data["model"] is None
    assert data["estimated"] is True and data["demoted"] is True
    assert MeteringRecord(**data) == r


def test_non_ascii_and_non_finite_values_stay_valid_json() -> None:
    r = record(tenant_id="équipe-β", cost=float("inf"), queue_ms=float("nan"))
    line = r.to_json()
    assert line.isascii()
    data = json.loads(line)
    assert data["tenant_id"] == "équipe-β"
    assert data["cost"] is None and data["queue_ms"] is None


def test_file_target_appends_one_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "metering.jsonl"
    path.write_text('{"earlier":true}\n', encoding="utf-8")
    sink = JsonLinesSink(str(path))
    sink.write(record(request_id="a"))
    # Line-buffered: the record is in the file before close.
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2
    sink.write(record(request_id="b"))
    sink.close()
    sink = JsonLinesSink(str(path))
    sink.write(record(request_id="c"))
    sink.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == '{"earlier":true}'
    assert [json.loads(line)["request_id"] for line in lines[1:]] == ["a", "b", "c"]
    assert (sink.written, sink.failures) == (1, 0)


def test_file_target_in_a_missing_directory_is_refused_clearly(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "metering.jsonl"
    with pytest.raises(ConfigError, match="does not exist"):
        JsonLinesSink(str(target))
    assert not target.parent.exists()


def test_a_directory_as_file_target_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot open"):
        JsonLinesSink(str(tmp_path))


@pytest.mark.parametrize("target", ["none", "None", ""])
def test_disabled_target_writes_nothing(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    sink = open_sink(target)
    assert not sink.enabled  # type: ignore[attr-defined]
    sink.write(record())
    sink.close()
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []
    assert (sink.written, sink.failures) == (0, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("target", ["stdout", "-"])
def test_stdout_target_writes_json_lines(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    sink = open_sink(target)
    sink.write(record(request_id="a"))
    sink.write(record(request_id="b"))
    sink.close()
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "b"]


def test_closed_stdout_counts_failures_and_does_not_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = io.StringIO()
    broken.close()
    monkeypatch.setattr("sys.stdout", broken)
    sink = JsonLinesSink("stdout")
    with caplog.at_level(logging.WARNING, logger="picker.metering"):
        sink.write(record())
        sink.write(record())
    assert (sink.written, sink.failures) == (0, 2)
    assert len(caplog.records) == 1  # the first failure is logged, the rest only counted


class _BrokenPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_broken_stream_counts_failures_and_does_not_raise() -> None:
    stream = _BrokenPipe()
    sink = JsonLinesSink(stream)
    sink.write(record())
    assert sink.failures == 1
    sink.close()
    assert not stream.closed  # a caller-owned stream stays open


def test_stream_target_writes_and_stays_open() -> None:
    stream = io.StringIO()
    sink = JsonLinesSink(stream)
    sink.write(record())
    sink.close()
    assert not stream.closed
    assert json.loads(stream.getvalue()) == dataclasses.asdict(record())


def test_writes_after_close_are_counted_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JsonLinesSink(str(path))
    sink.write(record())
    sink.close()
    sink.close()  # idempotent
    sink.write(record())
    assert (sink.written, sink.failures) == (1, 1)
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1


def test_unserialisable_field_is_counted_not_raised() -> None:
    stream = io.StringIO()
    sink = JsonLinesSink(stream)
    sink.write(record(endpoint=object()))  # type: ignore[arg-type]
    assert (sink.written, sink.failures) == (0, 1)
    assert stream.getvalue() == ""


def test_open_sink_returns_a_metering_sink(tmp_path: Path) -> None:
    sink: MeteringSink = open_sink(str(tmp_path / "m.jsonl"))
    sink.write(record())
    sink.close()
    assert isinstance(sink, JsonLinesSink)
