"""The CLI reads the log once (issue 29's day-in-2-minutes goal): one decoding pass scans the
pool's figures and spools the arrivals every config replays. It must give what the two passes it
replaced gave, bad lines and all."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

import picker.whatif.log as log_module
from picker.whatif.__main__ import read_log, scan_figures
from picker.whatif.log import Arrival, Skips, Spool, decode, quiet_gc, read_arrivals
from tests.unit.test_whatif_log import T0, record, write


def _messy_log(tmp_path: Path) -> Path:
    """Finish order with a long request, a corrupt line, a bad field, a record out of order
    beyond a 30 s window, an older record without the replay fields, one never served, a
    line json takes and orjson refuses, and a truncated last line."""
    lines = [record(float(t), tenant="ab"[t % 2], endpoint=f"10.0.0.{t % 3}:8000")
             for t in range(0, 200, 5)]
    lines.insert(3, record(1.0, e2e_s=40.0, tenant="c"))  # finishes late: reordered
    lines.insert(7, "\x00\x01garbage")
    lines.insert(9, record(33.0, prompt_tokens="many"))
    lines.insert(30, record(20.0))  # 100 s late: beyond the window
    old = json.loads(record(120.5, e2e_s=2.0))
    for name in ("arrived_at", "max_tokens", "stream", "lane_asked"):
        del old[name]
    lines.insert(31, json.dumps(old))
    lines.insert(33, record(121.0, endpoint=None, outcome="queue_timeout", prompt_tokens=0,
                            completion_tokens=0))
    lines.insert(35, record(122.0).replace('"cost":140.0', '"cost":NaN'))
    lines.append(record(300.0)[:40])
    return write(tmp_path, lines, end="")


@pytest.mark.parametrize("window", [{}, {"since": T0 + 10.0, "until": T0 + 150.0}])
def test_one_pass_gives_what_the_scan_and_the_replays_read_gave(
        tmp_path: Path, window: dict[str, float]) -> None:
    path = _messy_log(tmp_path)
    options: dict[str, Any] = {"reorder_window_s": 30.0, **window}
    alone = Skips()
    expected = list(read_arrivals(path, alone, **options))
    figures_then = scan_figures(path, **options)
    reported: list[str] = []
    skips = Skips()
    figures, spool = read_log(path, skips, report=reported.append, **options)
    with spool:
        assert list(spool) == expected
        assert list(spool) == expected  # every config reads it again from the first
        rows = list(spool.rows())  # the fast replay's reading: plain tuples, same fields
        assert rows == [tuple(a) for a in expected] and all(type(r) is tuple for r in rows)
        assert spool.first == expected[0] and spool.count == len(expected)
    assert skips == alone and reported == alone.messages
    assert (skips.not_json, skips.bad_field, skips.out_of_order) == (2, 1, 1)
    assert skips.prompt_guessed == 1 and skips.inferred == 1
    assert any(m.startswith("line 31: arrived at ") for m in skips.messages)
    assert figures.endpoints == figures_then.endpoints == 3
    assert (figures.step_s, figures.step_samples, figures.kv_budget_tokens, figures.saturated,
            figures.outputs) == (figures_then.step_s, figures_then.step_samples,
                                 figures_then.kv_budget_tokens, figures_then.saturated,
                                 figures_then.outputs)
    assert figures.recorded.as_dict() == figures_then.recorded.as_dict()
    assert figures.recorded.ticks == figures_then.recorded.ticks


def test_lines_orjson_refuses_read_as_json_reads_them() -> None:
    assert decode(b'{"a": 1.5, "b": [null, true]}') == {"a": 1.5, "b": [None, True]}
    big = 2 ** 70
    assert decode(b'{"n": %d}' % big) == {"n": big}
    nan = decode(b'{"x": NaN}')["x"]
    assert nan != nan
    assert decode(b'"\\ud800"') == "\ud800"  # a lone surrogate
    assert decode('{"t": "é"}'.encode("utf-16")) == {"t": "é"}
    for corrupt in (b"\x00\x01garbage", b'{"a": 1 "b": 2}', b'{"a": 1', b"\xff{}"):
        with pytest.raises(ValueError) as ours:
            decode(corrupt)
        with pytest.raises(ValueError) as theirs:
            json.loads(corrupt)
        assert str(ours.value) == str(theirs.value)  # the message the skip reports


def test_a_record_with_a_non_finite_number_is_a_bad_field_not_corrupt(tmp_path: Path) -> None:
    path = write(tmp_path, [record(0.0).replace('"arrived_at":', '"arrived_at":NaN,"x":')])
    skips = Skips()
    assert list(read_arrivals(path, skips)) == []
    assert skips.bad_field == 1 and skips.not_json == 0
    assert skips.messages == ["line 1: field arrived_at: must be a finite number, got nan; "
                              "skipped"]


def test_the_spool_reads_back_across_chunks_twice_and_side_by_side(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_module, "SPOOL_CHUNK", 7)
    arrivals = [Arrival(line=i, arrived=T0 + i / 3, tenant=f"t{i % 4}", model="m",
                        lane_asked="batch" if i % 5 == 0 else None, prompt_tokens=i,
                        output_tokens=None if i % 6 == 0 else i * 2,
                        max_tokens=None if i % 2 else 64, stream=bool(i % 3), finished=T0 + i)
                for i in range(1, 51)]
    with Spool() as spool:
        assert list(spool) == [] and spool.first is None
        for arrival in arrivals:
            spool.append(arrival)
        assert list(spool) == arrivals
        one, two = iter(spool), iter(spool)
        pairs = list(zip(one, two, strict=True))
        assert [a for a, _ in pairs] == [b for _, b in pairs] == arrivals
        read = next(iter(spool))
        assert isinstance(read, Arrival) and read.tenant == "t1" and read.output_tokens == 2
        assert spool.count == 50


def test_the_spool_holds_one_chunk_in_memory() -> None:
    with Spool() as spool:
        for i in range(3 * log_module.SPOOL_CHUNK + 5):
            spool.append(Arrival(i, float(i), "a", "m", None, 1, 1, None, True, float(i)))
            assert len(spool._chunk) <= log_module.SPOOL_CHUNK
        assert len(spool._chunk) == 5
        assert sum(1 for _ in spool) == spool.count == 3 * log_module.SPOOL_CHUNK + 5


def test_quiet_gc_restores_the_collector_as_it_found_it() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with quiet_gc():
        assert gc.get_threshold()[0] == log_module.GC_YOUNG_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() > frozen
        assert gc.isenabled()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen
