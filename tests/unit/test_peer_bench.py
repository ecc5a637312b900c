"""bench.peer's arithmetic: shares, their error, drift, and what the overhead ladder concludes.

The benchmark itself runs upstream's picker (built from Go modules) and is not part of the
suite; these pin what its tables mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.gateway.common import GatewayRun, Sample
from bench.peer import (
    PEERS,
    PREFIX_AFFINITY,
    PREFIX_FLOOR,
    PREFIX_METER,
    PREFIX_PLAIN,
    PREFIX_SHOWN,
    QUOTE_END,
    QUOTE_START,
    PeerPlan,
    PrefixTiming,
    _prefix_tables,
    cpu_ms_per_request,
    drift,
    overhead_summary,
    prefix_goals,
    prefix_run,
    prefix_sections,
    prefix_summary,
    quote_in_prefix_md,
    requests_started,
    service,
    shares,
    worst_error,
)
from picker.sim.load import LoadResult, RequestRecord


def _record(tenant: str, start: float, prompt: int, output: int, ttft: float = 0.0,
            duration: float = 1.0, status: int = 200) -> RequestRecord:
    return RequestRecord(tenant=tenant, seq=0, kind="backlog", api="completions", stream=True,
                         scheduled_s=start, start_s=start, drawn_prompt_tokens=prompt,
                         max_tokens=output, status=status, ttft_s=ttft, end_s=start + duration,
                         prompt_tokens=prompt, completion_tokens=output, usage_source="usage")


def test_service_is_prompt_plus_twice_the_output_inside_the_window() -> None:
    # Prompt at the first token (t=1), 11 outputs spread evenly over t=1..2.
    records = [_record("a", 1.0, prompt=100, output=11), _record("b", 1.0, 50, 1)]
    assert service(records, "a", 0.0, 5.0) == 100 + 2 * 11
    assert service(records, "a", 1.5, 5.0) == 2 * 5  # outputs at 1.6 .. 2.0
    assert service(records, "b", 0.0, 5.0) == 50 + 2


def test_failed_requests_are_no_service_and_no_dispatch() -> None:
    records = [_record("a", 1.0, 100, 10, status=503), _record("a", 1.0, 100, 10)]
    assert service(records, "a", 0.0, 5.0) == 120
    assert requests_started(records, "a", 0.0, 5.0) == 1


def test_worst_error_is_relative_to_each_weights_share() -> None:
    assert worst_error(shares({"a": 1.0, "b": 1.0}), {"a": 1.0, "b": 1.0}) == 0.0
    # a third for a tenant weighted 1 of 1:2 is on target; 2/3 for b too.
    assert worst_error({"a": 1 / 3, "b": 2 / 3}, {"a": 1.0, "b": 2.0}) == pytest.approx(0.0)
    # 40 % against a fair 50 %: 20 % off.
    assert worst_error({"a": 0.4, "b": 0.6}, {"a": 1.0, "b": 1.0}) == pytest.approx(0.2)


def test_drift_is_the_widest_swing_between_tenants_not_their_total_gap() -> None:
    # a runs first for 2 s, then b for 2 s, each 1 token per 0.5 s (cost 2 each).
    interleaved = [_record(t, start, 0, 1, duration=0.0) for start, t in
                   ((0.0, "a"), (0.5, "a"), (1.0, "a"), (1.5, "a"),
                    (2.0, "b"), (2.5, "b"), (3.0, "b"), (3.5, "b"))]
    weights = {"a": 1.0, "b": 1.0}
    assert drift(interleaved, ["a", "b"], (0.0, 4.0), weights) == pytest.approx(8.0)
    alternating = [_record("a" if i % 2 == 0 else "b", i * 0.5, 0, 1, duration=0.0)
                   for i in range(8)]
    assert drift(alternating, ["a", "b"], (0.0, 4.0), weights) == pytest.approx(2.0)
    # With weights, service is divided by weight first: b at twice a's rate is no drift.
    weighted = [_record("a", float(i), 0, 1, duration=0.0) for i in range(4)] + \
               [_record("b", i + 0.5, 0, 2, duration=0.0) for i in range(4)]
    assert drift(weighted, ["a", "b"], (0.0, 4.0), {"a": 1.0, "b": 2.0}) == pytest.approx(2.0)


def _path(p50: float, p99: float, *, ok: int = 1000, sent: int = 1000, rate: float = 200.0,
          cpu: dict[str, float] | None = None, span: float = 5.0) -> dict[str, Any]:
    return {"latency_ms": {"p50": p50, "p99": p99}, "ok": ok, "sent": sent,
            "errors": sent - ok, "achieved_rate": rate, "span_s": span, "cpu_s": cpu or {}}


def _rung(rate: float, fairway_p99: float, upstream_p99: float) -> dict[str, Any]:
    return {"rate": rate, "baseline": _path(1.0, 2.0, rate=rate),
            "fairway": _path(3.0, 2.0 + fairway_p99, rate=rate),
            "upstream": _path(2.0, 2.0 + upstream_p99, rate=rate)}


def test_the_sustained_rate_is_the_last_rung_of_an_unbroken_run() -> None:
    rungs = [_rung(200, 3.0, 1.0), _rung(400, 12.0, 2.0), _rung(800, 4.0, 11.0)]
    got = overhead_summary(rungs)
    # fairway fails at 400: passing again at 800 does not count.
    assert got["max_sustained_rate"] == {"fairway": 200, "upstream": 400}
    assert got["added_ms"]["fairway"] == {"p50": 2.0, "p99": 3.0}
    assert got["fairway_over_upstream"]["added_p50"] == pytest.approx(2.0)
    assert set(got["cpu_ms_per_request"]) == set(PEERS)


def test_a_rung_with_errors_or_a_missed_rate_is_not_sustained() -> None:
    rung = _rung(200, 1.0, 1.0)
    rung["fairway"] = _path(3.0, 3.0, ok=990)  # 1 % errors
    rung["upstream"] = _path(2.0, 3.0, rate=150.0)  # fell behind
    got = overhead_summary([rung])
    assert got["max_sustained_rate"] == {"fairway": None, "upstream": None}


def test_cpu_per_request_takes_off_what_the_picker_uses_while_the_other_paths_run() -> None:
    rung = _rung(200, 1.0, 1.0)
    # fairway's picker: 0.1 s a second idle (scraping) while the others run, 1.5 s over its
    # own 5 s block of 1,000 requests: (1.5 - 0.5) s / 1,000 = 1 ms a request.
    idle = {"ovh-fairway/picker": 0.5}
    rung["baseline"]["cpu_s"], rung["upstream"]["cpu_s"] = idle, idle
    rung["fairway"]["cpu_s"] = {"ovh-fairway/picker": 1.5, "ovh-fairway/envoy": 9.0}
    assert cpu_ms_per_request(rung, "fairway") == pytest.approx(1.0)
    rung["upstream"]["cpu_s"] = {"ovh-upstream/epp": 0.7, **idle}
    rung["baseline"]["cpu_s"] = {**idle}
    assert cpu_ms_per_request(rung, "upstream") == pytest.approx(0.7)


# -- the prefix workloads (measure 6) ------------------------------------------------------------


def _call(tenant: str, seq: int, call: int, calls: int, start: float, prompt: int, cached: int,
          output: int, status: int = 200) -> RequestRecord:
    record = _record(tenant, start, prompt, output, ttft=0.1, duration=0.5, status=status)
    record.seq, record.call, record.calls, record.cached_tokens = seq, call, calls, cached
    return record


def _engines(t: float, hits: float, queries: float, generated: float) -> Sample:
    """Two servers' counters at ``t``, split evenly."""
    page = {"vllm:prefix_cache_hits_total": [({}, hits / 2)],
            "vllm:prefix_cache_queries_total": [({}, queries / 2)],
            "vllm:generation_tokens_total": [({}, generated / 2)]}
    return Sample(t, {}, [page, page])


def test_prefix_run_reads_the_engines_hit_rate_and_charges_computed_tokens() -> None:
    records = [
        # a's session: two calls, the second mostly cached; complete, 0.0 .. 3.5 s.
        _call("a", 0, 0, 2, 0.0, prompt=1000, cached=0, output=10),
        _call("a", 0, 1, 2, 3.0, prompt=1200, cached=1000, output=10),
        # a's second session lost its second call: started, not completed.
        _call("a", 1, 0, 2, 2.0, prompt=500, cached=0, output=10),
        _call("a", 1, 1, 2, 4.0, prompt=600, cached=500, output=10, status=503),
        # b: one request, nothing cached.
        _call("b", 0, 0, 1, 2.5, prompt=400, cached=0, output=30),
    ]
    run = GatewayRun("x", "fairway", 6.0, (2.0, 6.0),
                     LoadResult(records, {}, 6.0),
                     [_engines(1.0, 0, 1000, 10), _engines(2.0, 0, 1000, 10),
                      _engines(6.0, 1000, 2600, 50)], {})
    got = prefix_run(run, ["a", "b"])
    assert got["prefix_hit_rate"] == pytest.approx(1000 / 1600)  # in the window: 2.0 .. 6.0
    assert got["pool_tokens_per_s"] == pytest.approx(40 / 4.0)
    assert got["errors"] == 1 and got["ok"] == 4
    a, b = got["tenants"]["a"], got["tenants"]["b"]
    assert (a["units_started"], a["units_completed"]) == (2, 1)
    assert a["completion_s"]["p50"] == pytest.approx(3.5)
    computed_a = 1000 + 20 + 200 + 20 + 500 + 20  # answered requests: prompt - cached + 2 x out
    computed_b = 400 + 60
    assert a["computed_cost_share"] == pytest.approx(computed_a / (computed_a + computed_b))
    sent_a = 1020 + 1220 + 520
    assert b["sent_cost_share"] == pytest.approx(460 / (sent_a + 460))
    # TTFT of the requests sent in the window only (a's first call at 0.0 is before it).
    assert got["ttft_ms"]["n"] == 3


def test_prefix_goals_hold_fairway_with_affinity_to_upstream() -> None:
    upstream = {"pool_tokens_per_s": 1000.0, "ttft_p50_ms": 50.0, "ttft_p95_ms": 400.0,
                "prefix_hit_rate": 0.80}
    even = prefix_goals(dict(upstream), upstream)
    assert even == {"tokens_per_s": True, "ttft_p50": True, "ttft_p95": True, "hit_rate": True}
    worse = {"pool_tokens_per_s": 990.0, "ttft_p50_ms": 51.0, "ttft_p95_ms": 300.0,
             "prefix_hit_rate": 0.785}  # 1.5 points under: within the 2 allowed
    assert prefix_goals(worse, upstream) == {"tokens_per_s": False, "ttft_p50": False,
                                             "ttft_p95": True, "hit_rate": True}
    assert prefix_goals({**worse, "prefix_hit_rate": 0.77}, upstream)["hit_rate"] is False
    assert prefix_goals({**worse, "ttft_p50_ms": None}, upstream)["ttft_p50"] is None
    assert prefix_goals(None, upstream) == {}


def test_the_quote_in_prefix_md_is_replaced_not_repeated(tmp_path: Path) -> None:
    page = tmp_path / "prefix.md"
    page.write_text("# Workloads that share prefixes\n\nthe simulator's tables\n")
    block = {"picker": "upstream", "pool_tokens_per_s": 10.0, "prefix_hit_rate": 0.5,
             "ttft_ms": {"p50": 1.0, "p95": 2.0}, "requests": 1, "ok": 1, "picker_cpu_s": 0.1,
             "tenants": {}}
    data = {"server_args": ["--block-size", "16"], "timeout_s": 30.0,
            "blocks_order": ["upstream"], "wall_s": 10.0, "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [2.0, 1.0, 1.0],
            "by_workload": {"rag": {"timing": {"duration_s": 10.0, "warmup_s": 3.0,
                                               "stop_s": None},
                                    "tenants": [], "blocks": [block]}}}
    data["summary"] = prefix_summary(data)
    quote_in_prefix_md(page, [data])
    quote_in_prefix_md(page, [data])
    text = page.read_text()
    assert text.startswith("# Workloads that share prefixes\n\nthe simulator's tables\n")
    assert text.count(QUOTE_START) == 1 and text.count(QUOTE_END) == 1
    assert "| rag | upstream | 10 | 50.0% | 1 | 2 | 1 / 1 | 0.1 |" in text


def _prefix_data(ttft_p50_ms: float) -> dict[str, Any]:
    """Measure 6 with one rag block per picker: fairway's TTFT p50 as given, upstream's 1."""
    def block(picker: str, p50: float) -> dict[str, Any]:
        return {"picker": picker, "pool_tokens_per_s": 10.0, "prefix_hit_rate": 0.5,
                "ttft_ms": {"p50": p50, "p95": 2.0}, "requests": 1, "ok": 1,
                "picker_cpu_s": 0.1, "tenants": {}, "errors": 0, "wall_s": 10.0,
                "loadavg": [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]}
    data: dict[str, Any] = {
        "server_args": [], "timeout_s": 30.0, "blocks_order": [PREFIX_AFFINITY, "upstream"],
        "wall_s": 10.0, "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [1.0, 1.0, 1.0],
        "by_workload": {"rag": {"timing": {"duration_s": 10.0, "warmup_s": 3.0, "stop_s": None},
                                "tenants": [], "blocks": [block(PREFIX_AFFINITY, ttft_p50_ms),
                                                          block("upstream", 1.0)]}}}
    data["summary"] = prefix_summary(data)
    return data


def test_the_goals_line_says_met_only_when_every_goal_is() -> None:
    assert any("(met: yes):" in line for line in _prefix_tables(_prefix_data(1.0)))
    missed = _prefix_tables(_prefix_data(5.0))  # TTFT p50 over upstream's: 3 of 4 met
    assert any("(met: no, 3 of 4):" in line for line in missed)
    assert not any("met: yes" in line for line in missed)


def test_every_fairway_variant_and_the_floor_get_the_checks_the_verdict_is_affinitys() -> None:
    """One table a picker that ran beside upstream, in the order of ``GOAL_CHECKS``, each with
    its own count; only the first (fairway with affinity, inline) says met or not; a stored run
    without the summary key of a later table still renders it (judged from its pickers)."""
    data = _prefix_data(1.0)
    blocks = data["by_workload"]["rag"]["blocks"]
    for picker, p50 in ((PREFIX_PLAIN, 5.0), (PREFIX_METER, 1.0), (PREFIX_FLOOR, 5.0)):
        blocks.append(dict(blocks[0], picker=picker, ttft_ms={"p50": p50, "p95": 2.0}))
        data["blocks_order"].append(picker)
    data["summary"] = prefix_summary(data)
    assert data["summary"]["rag"]["goals_plain"]["ttft_p50"] is False
    del data["summary"]["rag"]["goals_plain"]
    heads = [line for line in _prefix_tables(data) if "against upstream (" in line]
    assert heads == [
        f"The issue's goals, {PREFIX_AFFINITY} against upstream (met: yes):",
        f"The same checks for {PREFIX_METER} against upstream (fairway's own Envoy "
        "configuration, not upstream's; shown, not the issue's verdict: 4 of 4):",
        f"The same checks for {PREFIX_PLAIN} against upstream (what affinity buys; shown, not "
        "the issue's verdict: 3 of 4):",
        f"The same checks for the {PREFIX_FLOOR} against upstream (no picker's work at all on "
        "upstream's Envoy configuration; shown, not a verdict: 3 of 4):"]


def test_agent_blocks_run_the_agent_programs_alone_until_their_tasks_can_finish() -> None:
    plan = PeerPlan(quick=False, agent_block_s=120.0)
    assert list(plan.prefix_workloads) == ["agent programs"]
    assert plan.prefix_timing("agent programs") == PrefixTiming(120.0, 5.0, stop_s=20.0)
    assert len(PeerPlan(quick=False).prefix_workloads) == 4
    data = {"prefix": 1, "prefix at 0.25": 2, "prefix, agent blocks of 120 s": 3, "shares": 4}
    assert prefix_sections(data) == ["prefix", "prefix at 0.25", "prefix, agent blocks of 120 s"]
    long = _prefix_data(1.0)
    long["agent_block_s"] = 120.0
    assert "agent programs alone in blocks of 120 s" in _prefix_tables(long)[1]


def test_the_meter_stream_variant_is_shown_beside_the_goals_it_does_not_judge() -> None:
    order = PeerPlan(quick=False).prefix_blocks
    assert set(order) == set(PREFIX_SHOWN)
    # Every picker's mean position in the run the same: a drift of the machine cancels.
    mean = {p: sum(i for i, q in enumerate(order) if q == p) / order.count(p) for p in order}
    assert set(mean.values()) == {(len(order) - 1) / 2}
    data = _prefix_data(1.0)
    slow = dict(data["by_workload"]["rag"]["blocks"][0], picker=PREFIX_METER,
                ttft_ms={"p50": 5.0, "p95": 2.0})
    data["by_workload"]["rag"]["blocks"].append(slow)
    data["blocks_order"].append(PREFIX_METER)
    data["summary"] = prefix_summary(data)
    assert data["summary"]["rag"]["goals_meter_stream"]["ttft_p50"] is False
    lines = _prefix_tables(data)
    assert any("(met: yes):" in line for line in lines)  # the inline variant's verdict alone
    assert any(f"{PREFIX_METER} against upstream" in line and "3 of 4" in line
               for line in lines)
    assert "| rag | yes | **no** | yes | yes |" in lines


def test_the_floor_is_shown_beside_upstream_with_where_the_time_goes() -> None:
    """Block F (the CPython gRPC floor) gets the issue's checks against upstream, shown and not
    judged, and a table splits every picker's TTFT where the blocks measured it; an order of
    blocks other than the default is named in the command line."""
    data = _prefix_data(1.0)
    split = {"client_mean": 50.0, "picker_queue_wait_mean": None,
             "picker_first_byte_mean": None, "engine_ttft_mean": 20.0,
             "engine_waiting_mean": 0.2, "engine_running_mean": 9.0, "picker_queued_mean": 0.0}
    floor = dict(data["by_workload"]["rag"]["blocks"][1], picker=PREFIX_FLOOR,
                 ttft_ms={"p50": 3.0, "p95": 2.0}, split_ms=split)
    for block in data["by_workload"]["rag"]["blocks"]:
        block["split_ms"] = split
    data["by_workload"]["rag"]["blocks"].append(floor)
    data["blocks_order"].append(PREFIX_FLOOR)
    data["summary"] = prefix_summary(data)
    assert data["summary"]["rag"]["goals_floor"]["ttft_p50"] is False
    lines = _prefix_tables(data)
    assert any(f"{PREFIX_FLOOR} against upstream" in line and "3 of 4" in line
               for line in lines)
    assert any(line.startswith(f"| rag | {PREFIX_FLOOR} | 50 | – | – | 20 | 0.20 |")
               for line in lines)
    assert "--blocks ABF" in lines[3]
    assert PeerPlan(quick=False, order="FB").prefix_blocks == (PREFIX_FLOOR, "upstream")
