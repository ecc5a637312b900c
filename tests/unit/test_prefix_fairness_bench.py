"""The arithmetic of the prefix benchmarks' fairness measures (``bench/prefix_fairness.py``,
``bench/prefix_sessions.py``, ``bench/prefix.py``): when tenants count as backlogged, what service
falls within those seconds, and how each benchmark's section of ``prefix.md`` is kept."""

from __future__ import annotations

import pytest

from bench.prefix import sections, splice
from bench.prefix_fairness import (
    all_backlogged,
    computed_service,
    intersect,
    length,
    waiting_spans,
)
from bench.prefix_sessions import END, START, backlogged_fraction
from picker.sim.pool import PoolRecord


def record(tenant: str, arrival: float, dispatched: float | None, end: float | None = None, *,
           prompt: int = 10, cached: int = 0, output: int = 0,
           first_token: float | None = None) -> PoolRecord:
    r = PoolRecord(tenant, "open", arrival, prompt, output, True)
    r.dispatched_s, r.end_s, r.first_token_s = dispatched, end, first_token
    r.cached_tokens, r.completion_tokens = cached, output
    return r


def test_a_tenant_is_backlogged_over_the_union_of_its_waits() -> None:
    # waits 0-2 and 1-3 overlap (3 s), 5-6 (1 s), one never dispatched from 8 to the end (2 s);
    # one dispatched as it arrived waited no time
    records = [record("t", 0, 2), record("t", 1, 3), record("t", 5, 6), record("t", 8, None),
               record("t", 4, 4)]
    assert waiting_spans(records, 0.0, 10.0) == [(0, 3), (5, 6), (8, 10.0)]
    assert backlogged_fraction(records, (0.0, 10.0)) == pytest.approx(0.6)


def test_all_backlogged_is_where_every_tenant_waits_at_once() -> None:
    records = [record("a", 0, 4), record("a", 6, 9), record("b", 2, 7)]
    assert intersect([(0, 4), (6, 9)], [(2, 7)]) == [(2, 4), (6, 7)]
    spans = all_backlogged(records, ["a", "b"], 0.0, 10.0)
    assert spans == [(2, 4), (6, 7)] and length(spans) == 3
    assert all_backlogged(records, ["a", "b", "c"], 0.0, 10.0) == []  # c never waited


def test_service_counts_a_prompt_at_dispatch_and_output_evenly_within_the_spans() -> None:
    # 1,000-token prompt, 600 cached, dispatched at 1 s; 100 output tokens from 2 s to 12 s
    r = record("a", 0, 1, 12, prompt=1000, cached=600, output=100, first_token=2)
    assert computed_service([r], [(0, 5)]) == {"a": pytest.approx(400 + 2 * 100 * 3 / 10)}
    assert computed_service([r], [(0, 5)], cached_weight=1.0) == {
        "a": pytest.approx(1000 + 60)}
    assert computed_service([r], [(5, 7), (10, 20)]) == {"a": pytest.approx(2 * 100 * 4 / 10)}
    # never dispatched: nothing served
    assert computed_service([record("b", 0, None, 3)], [(0, 10)]) == {}


def test_each_benchmark_rewrites_its_own_section_of_prefix_md_and_keeps_the_others() -> None:
    page = "# prefix\n\nrows\n\n<!-- bench.peer: x -->\npeer\n<!-- /bench.peer -->\n"
    once = splice(page, "## programs and sessions\n\nold\n", START, END)
    twice = splice(once, "## programs and sessions\n\nnew\n", START, END)
    assert twice.count(START) == 1 and twice.count(END) == 1
    assert "new" in twice and "old" not in twice and "<!-- /bench.peer -->" in twice
    kept = sections(twice)
    assert [k.splitlines()[0] for k in kept] == ["<!-- bench.peer: x -->", START]
    assert kept[1].endswith(END) and "new" in kept[1]
