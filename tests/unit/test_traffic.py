"""Traffic files and the load generator's pure parts: schema, planning, request bodies, summaries.

Each bad file under ``tests/fixtures/traffic/bad/`` starts with ``# expect: <message>`` and must
fail loading with that message (which names the bad field's path).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.errors import ConfigError
from picker.sim.load import (
    CSV_COLUMNS,
    WORDS,
    RequestRecord,
    chunk_text,
    error_message,
    format_table,
    percentile,
    plan_open_loop,
    prompt_text,
    request_body,
    request_headers,
    request_path,
    summarize,
)
from picker.sim.traffic import Burst, TenantTraffic, Traffic, load_traffic
from tests.expect import expected_message

ROOT = Path(__file__).parent.parent.parent
BAD_DIR = ROOT / "tests" / "fixtures" / "traffic" / "bad"
BAD = sorted(BAD_DIR.glob("*.yaml"))
EXAMPLES = sorted((ROOT / "bench" / "traffic").glob("*.yaml"))



@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_traffic_is_rejected_with_its_path(path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_traffic(path)
    assert expected_message(path) in str(caught.value)


def test_the_required_failures_have_fixtures() -> None:
    names = {p.stem for p in BAD}
    required = {"negative_rate", "stream_fraction_above_one", "rate_with_backlog",
                "duplicate_tenant", "unknown_tenant_key", "unknown_top_key",
                "prompt_range_reversed"}
    assert required <= names
    assert len(BAD) >= 25


def test_good_traffic_loads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("duration_s: 12\ntenants:\n  - {name: a, rate: 2}\n  - {name: b, backlog: 3}\n")
    traffic = load_traffic(path)
    assert isinstance(traffic, Traffic)
    assert traffic.duration_s == 12.0 and isinstance(traffic.duration_s, float)
    assert traffic.model == "sim-model"
    assert traffic.tenant_header == "x-gateway-inference-fairness-id"
    assert (traffic.seed, traffic.max_in_flight, traffic.timeout_s) == (0, 2000, 120.0)
    a, b = traffic.tenants
    assert a == TenantTraffic(name="a", rate=2.0)
    assert (a.start_s, a.stop_s, a.bursts, a.backlog) == (0.0, None, (), None)
    assert a.prompt_tokens == (32, 256) and a.output_tokens == (16, 128)
    assert (a.stream_fraction, a.api, a.include_usage) == (0.0, "chat", False)
    assert a.headers == {} and a.send_tenant_header is True
    assert (b.rate, b.backlog) == (0.0, 3)
    assert traffic.tenant("b") is b
    with pytest.raises(KeyError):
        traffic.tenant("c")


def test_every_field_can_be_set() -> None:
    traffic = load_traffic({
        "duration_s": 30, "model": "m", "tenant_header": "x-tenant", "seed": 9,
        "max_in_flight": 50, "timeout_s": 5,
        "tenants": [{
            "name": "a", "rate": 0.5, "start_s": 2, "stop_s": 20,
            "bursts": [{"at_s": 1, "count": 4}], "prompt_tokens": [8, 8],
            "output_tokens": [1, 3], "stream_fraction": 0.25, "api": "completions",
            "include_usage": True, "headers": {"authorization": "Bearer k"},
            "send_tenant_header": False,
        }],
    })
    a = traffic.tenants[0]
    assert a.bursts == (Burst(at_s=1.0, count=4),)
    assert (a.start_s, a.stop_s, a.api, a.include_usage) == (2.0, 20.0, "completions", True)
    assert a.headers == {"authorization": "Bearer k"} and not a.send_tenant_header


def test_own_tenant_header_allowed_when_not_sending_the_default() -> None:
    traffic = load_traffic({"duration_s": 1, "tenants": [{
        "name": "spoof", "rate": 1, "send_tenant_header": False,
        "headers": {"x-gateway-inference-fairness-id": "victim"}}]})
    assert request_headers(traffic, traffic.tenants[0]) == {
        "x-gateway-inference-fairness-id": "victim"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_traffic_files_load(path: Path) -> None:
    assert load_traffic(path).tenants


def test_demo_has_three_modest_tenants_and_a_noisy_neighbour() -> None:
    demo = load_traffic(ROOT / "bench" / "traffic" / "demo.yaml")
    assert len(demo.tenants) == 4 and 30 <= demo.duration_s <= 60
    noisy = max(demo.tenants, key=lambda t: t.rate)
    others = [t for t in demo.tenants if t is not noisy]
    assert all(noisy.rate >= 4 * t.rate for t in others)
    assert all(noisy.prompt_tokens[0] > t.prompt_tokens[1] for t in others)
    assert all(noisy.output_tokens[0] > t.output_tokens[1] for t in others)
    assert {t.stream_fraction for t in others} - {0.0, 1.0}  # a mix


def test_two_backlogged_is_closed_loop() -> None:
    traffic = load_traffic(ROOT / "bench" / "traffic" / "two_backlogged.yaml")
    assert [t.backlog is not None for t in traffic.tenants] == [True, True]
    assert plan_open_loop(traffic) == []


def test_traffic_is_frozen() -> None:
    traffic = load_traffic({"duration_s": 1, "tenants": [{"name": "a", "rate": 1}]})
    with pytest.raises(AttributeError):
        traffic.seed = 5  # type: ignore[misc]


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_traffic(tmp_path / "nope.yaml")


# --- planning ----------------------------------------------------------------------------------


def _traffic(**tenant: object) -> Traffic:
    duration = tenant.pop("duration_s", 100)
    return load_traffic({"duration_s": duration, "seed": 3,
                         "tenants": [{"name": "a", **tenant}]})


def test_poisson_count_and_window() -> None:
    traffic = _traffic(rate=20, start_s=10, stop_s=60)
    plan = plan_open_loop(traffic)
    # 1000 expected, standard deviation about 32.
    assert 850 < len(plan) < 1150
    assert all(10 <= p.at_s < 60 for p in plan)
    assert [p.seq for p in plan] == list(range(len(plan)))
    assert all(p.kind == "poisson" for p in plan)
    assert plan == plan_open_loop(traffic)  # the seed decides everything


def test_seed_changes_the_plan() -> None:
    plan = plan_open_loop(_traffic(rate=5))
    other = plan_open_loop(load_traffic({"duration_s": 100, "seed": 4,
                                         "tenants": [{"name": "a", "rate": 5}]}))
    assert [p.at_s for p in plan] != [p.at_s for p in other]


def test_shorter_duration_plans_a_prefix() -> None:
    traffic = _traffic(rate=5, bursts=[{"at_s": 50, "count": 3}])
    full = plan_open_loop(traffic)
    short = plan_open_loop(traffic, duration_s=40)
    assert short == [p for p in full if p.at_s < 40]
    assert short and all(p.kind == "poisson" for p in short)


def test_bursts_are_sent_at_once_and_numbered_in_time_order() -> None:
    traffic = _traffic(rate=1, bursts=[{"at_s": 30, "count": 7}, {"at_s": 5, "count": 2}])
    plan = plan_open_loop(traffic)
    bursts = [p for p in plan if p.kind == "burst"]
    assert [p.at_s for p in bursts] == [5.0] * 2 + [30.0] * 7
    assert [p.seq for p in plan] == list(range(len(plan)))


def test_lengths_and_streaming_are_drawn_in_range() -> None:
    plan = plan_open_loop(_traffic(rate=20, prompt_tokens=[5, 9], output_tokens=[2, 4],
                                   stream_fraction=0.3))
    assert {p.prompt_tokens for p in plan} == set(range(5, 10))
    assert {p.max_tokens for p in plan} == {2, 3, 4}
    share = sum(p.stream for p in plan) / len(plan)
    assert 0.25 < share < 0.35
    assert not any(p.stream for p in plan_open_loop(_traffic(rate=20, stream_fraction=0)))
    assert all(p.stream for p in plan_open_loop(_traffic(rate=20, stream_fraction=1)))


def test_tenants_have_independent_streams() -> None:
    alone = plan_open_loop(load_traffic({"duration_s": 50, "seed": 1,
                                         "tenants": [{"name": "a", "rate": 3}]}))
    together = plan_open_loop(load_traffic({"duration_s": 50, "seed": 1, "tenants": [
        {"name": "a", "rate": 3}, {"name": "b", "rate": 9}]}))
    assert [p for p in together if p.tenant == "a"] == alone


def test_backlog_tenants_are_not_planned() -> None:
    assert plan_open_loop(_traffic(backlog=5)) == []


# --- request bodies ----------------------------------------------------------------------------


def test_prompt_is_n_filler_words_fixed_by_the_seed() -> None:
    text = prompt_text(1, "a", 7, 50)
    words = text.split(" ")
    assert len(words) == 50 and set(words) <= set(WORDS)
    assert text == prompt_text(1, "a", 7, 50)
    assert text != prompt_text(1, "a", 8, 50)


def test_chat_body() -> None:
    traffic = _traffic(rate=50, stream_fraction=1, include_usage=True, prompt_tokens=[10, 10])
    tenant = traffic.tenants[0]
    planned = plan_open_loop(traffic)[0]
    body = request_body(traffic, tenant, planned)
    assert set(body) == {"model", "messages", "max_tokens", "ignore_eos", "stream",
                         "stream_options"}
    assert body["model"] == "sim-model" and body["ignore_eos"] is True
    assert body["max_tokens"] == planned.max_tokens and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    [message] = body["messages"]
    assert message["role"] == "user" and len(message["content"].split()) == 10
    assert request_path("chat") == "/v1/chat/completions"


def test_completions_body_without_streaming_has_no_stream_options() -> None:
    traffic = _traffic(rate=50, api="completions", include_usage=True, prompt_tokens=[4, 4])
    body = request_body(traffic, traffic.tenants[0], plan_open_loop(traffic)[0])
    assert len(body["prompt"].split()) == 4 and "messages" not in body
    assert body["stream"] is False and "stream_options" not in body
    assert request_path("completions") == "/v1/completions"


def test_headers() -> None:
    traffic = _traffic(rate=1, headers={"x-extra": "1"})
    assert request_headers(traffic, traffic.tenants[0]) == {
        "x-gateway-inference-fairness-id": "a", "x-extra": "1"}
    anonymous = _traffic(rate=1, send_tenant_header=False)
    assert request_headers(anonymous, anonymous.tenants[0]) == {}


# --- reading responses -------------------------------------------------------------------------


def test_error_message() -> None:
    assert error_message('{"error": {"message": "over budget", "type": "x"}}') == "over budget"
    assert error_message('{"error": "plain"}') == "plain"
    assert error_message('{"message": "top"}') == "top"
    assert error_message("upstream connect error") == "upstream connect error"
    assert error_message("") == "(empty body)"


def test_chunk_text() -> None:
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text({"choices": [{"text": " a"}]}) == " a"
    assert chunk_text({"choices": [{"message": {"content": "x y"}}]}) == "x y"
    assert chunk_text({"choices": [], "usage": {"prompt_tokens": 1}}) == ""


# --- summaries ---------------------------------------------------------------------------------


def _record(tenant: str, seq: int, status: int = 200, start: float = 0.0,
            ttft: float | None = 0.1, end: float | None = 1.0, prompt: int = 10,
            completion: int = 5) -> RequestRecord:
    return RequestRecord(tenant=tenant, seq=seq, kind="poisson", api="chat", stream=False,
                         scheduled_s=start, start_s=start, drawn_prompt_tokens=prompt,
                         max_tokens=completion, status=status, ttft_s=ttft, end_s=end,
                         prompt_tokens=prompt if status == 200 else 0,
                         completion_tokens=completion if status == 200 else 0,
                         usage_source="usage" if status == 200 else "none")


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_summarize() -> None:
    records = [_record("a", i, ttft=0.1 * (i + 1), end=1.0 + i) for i in range(4)]
    records += [_record("b", 0, prompt=100, completion=50)]
    failed = _record("b", 1, status=429, ttft=None, end=0.01)
    failed.error, failed.retry_after = "over budget", "2"
    records += [failed, _record("b", 2, status=0, ttft=None, end=0.5)]
    summary = summarize(records, wall_s=10.0, tenants=["b", "a", "c"])
    assert list(summary["tenants"]) == ["b", "a", "c"] and summary["wall_s"] == 10.0
    a, b, c = (summary["tenants"][n] for n in "abc")
    assert (a["sent"], a["ok"], a["errors"]) == (4, 4, {})
    assert (b["sent"], b["ok"], b["errors"]) == (3, 1, {"0": 1, "429": 1})
    assert c["sent"] == 0 and c["ttft_s"]["p50"] is None
    assert a["ttft_s"]["p50"] == pytest.approx(0.25) and a["e2e_s"]["p99"] == pytest.approx(3.97)
    assert (a["prompt_tokens"], a["completion_tokens"], a["service"]) == (40, 20, 80)
    assert b["service"] == 200 and a["output_tokens_per_s"] == pytest.approx(2.0)
    assert a["service_share"] == pytest.approx(80 / 280)
    assert b["service_share"] == pytest.approx(200 / 280)
    totals = summary["totals"]
    assert (totals["sent"], totals["ok"], totals["service"]) == (7, 5, 280)
    table = format_table(summary)
    assert "TOTAL" in table and "429x1" in table and table.splitlines()[1].startswith("b ")


def test_summarize_defaults_wall_time_to_the_records_span() -> None:
    records = [_record("a", 0, start=1.0, end=2.0), _record("a", 1, start=1.5, end=4.0)]
    assert summarize(records)["wall_s"] == pytest.approx(3.0)
    assert summarize([])["totals"]["sent"] == 0


def test_record_row_follows_the_csv_columns() -> None:
    record = _record("a", 3, start=0.5, end=1.25)
    row = dict(zip(CSV_COLUMNS, record.row(), strict=True))
    assert row["tenant"] == "a" and row["seq"] == "3" and row["stream"] == "false"
    assert row["e2e_s"] == "0.750000" and row["retry_after"] == "" and row["error"] == ""
    assert record.ok and not _record("a", 4, status=503).ok
