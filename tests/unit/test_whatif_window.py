"""The reorder window (``picker.whatif.log.read_arrival_chunks``) releases in batches what a heap
released record by record: the same arrivals in the same order, the same records judged out of
order, with the same messages (issue 29's day-in-2-minutes goal: a heap cost a microsecond a
record)."""

from __future__ import annotations

import heapq
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import picker.whatif.log as log_module
from picker.whatif.log import Arrival, Skips, _iso, parse_record, read_arrivals
from tests.unit.test_whatif_log import T0, record, write


def heap_window(path: Path, skips: Skips, *, reorder_window_s: float,
                since: float | None = None, until: float | None = None) -> list[Arrival]:
    """The window as a heap released it at every record (what ``read_arrivals`` did before),
    for logs of good records."""
    pending: list[tuple[float, int, Arrival]] = []
    latest_finish = released = -math.inf
    out = []
    means: dict[str, list[int]] = {}
    total = [0, 0]
    for number, raw in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
        skips.lines += 1
        if not raw.strip():
            continue
        arrival, _ = parse_record(number, log_module.decode(raw))
        arrived = arrival.arrived
        latest_finish = max(latest_finish, arrival.finished)
        if arrived < released:
            skips.note("out_of_order",
                       f"line {number}: arrived at {_iso(arrived)}, "
                       f"{released - arrived:.1f}s before a request already replayed "
                       f"(the reorder window is {reorder_window_s:g}s: --reorder-window); "
                       "skipped")
            continue
        if (since is not None and arrived < since) or (until is not None and arrived >= until):
            skips.outside_window += 1
            continue
        if arrival.output_tokens is None and arrival.prompt_tokens == 0:
            seen_total, seen = means.get(arrival.tenant) or total
            arrival = arrival._replace(
                prompt_tokens=max(1, round(seen_total / seen)) if seen else 1)
            skips.prompt_guessed += 1
        elif arrival.prompt_tokens:
            total[0] += arrival.prompt_tokens
            total[1] += 1
            sums = means.setdefault(arrival.tenant, [0, 0])
            sums[0] += arrival.prompt_tokens
            sums[1] += 1
        heapq.heappush(pending, (arrived, number, arrival))
        while pending and pending[0][0] <= latest_finish - reorder_window_s:
            released = pending[0][0]
            out.append(heapq.heappop(pending)[2])
    out.extend(heapq.heappop(pending)[2] for _ in range(len(pending)))
    skips.used = len(out)
    return out


def _log(rng: random.Random, count: int) -> list[str]:
    """Records in about finish order, some very late, some tied, some never served."""
    lines = []
    for _ in range(count):
        arrived = float(rng.randint(0, 4 * count)) / 4  # ties are common
        e2e = rng.choice((0.5, 1.0, 3.0, 8.0, 40.0))  # some outlast a 10 s window
        changes: dict[str, Any] = {}
        if rng.random() < 0.1:
            changes = {"endpoint": None, "outcome": "queue_timeout", "prompt_tokens": 0,
                       "completion_tokens": 0}
        elif rng.random() < 0.5:
            changes = {"prompt_tokens": rng.randint(1, 500)}
        lines.append((arrived + e2e + rng.random() * 5, record(
            arrived, e2e_s=e2e, tenant=rng.choice("abc"), **changes)))
    lines.sort(key=lambda pair: pair[0])  # finish order, roughly: the jitter reorders
    return [line for _, line in lines]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), every=st.sampled_from((1, 2, 3, 7, 50)),
       window=st.sampled_from((0.0, 2.0, 10.0, 30.0)), count=st.integers(0, 120),
       bounds=st.sampled_from(((None, None), (20.0, None), (10.0, 60.0))))
def test_the_window_releases_what_a_heap_released(
        tmp_path_factory: pytest.TempPathFactory, seed: int, every: int, window: float,
        count: int, bounds: tuple[float | None, float | None]) -> None:
    path = write(tmp_path_factory.mktemp("log"), _log(random.Random(seed), count))
    since, until = (None if b is None else T0 + b for b in bounds)
    expected_skips = Skips()
    expected = heap_window(path, expected_skips, reorder_window_s=window, since=since,
                           until=until)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(log_module, "RELEASE_EVERY", every)
        skips = Skips()
        got = list(read_arrivals(path, skips, reorder_window_s=window, since=since,
                                 until=until))
    assert [(a.line, a.arrived, a.prompt_tokens) for a in got] == [
        (a.line, a.arrived, a.prompt_tokens) for a in expected]
    assert skips.as_dict() == expected_skips.as_dict()
    assert skips.messages == expected_skips.messages


def test_many_late_records_are_judged_without_sorting_the_window_for_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the messages listed, a record certainly out of order does not cut the window.
    lines = [record(float(t)) for t in range(200)]
    lines += [record(float(t), e2e_s=300.0) for t in range(100)]  # all far behind
    sorts = []
    release = list.sort

    class Counted(list):  # type: ignore[type-arg]
        def sort(self, **kwargs: Any) -> None:
            sorts.append(len(self))
            release(self, **kwargs)

    monkeypatch.setattr(log_module, "RELEASE_EVERY", 10**6)
    monkeypatch.setattr(log_module, "_new_window", Counted)
    skips = Skips()
    got = list(read_arrivals(write(tmp_path, lines), skips, reorder_window_s=10.0))
    assert skips.out_of_order == 100 and len(got) == 200
    assert len(sorts) <= log_module.REPORTED_PER_KIND + 2
