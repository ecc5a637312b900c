"""Workloads that share prefixes (``picker.sim.workloads``), as the load generator plans them and
the pool simulator runs them: the same seed gives the same calls, a chat turn resends the
conversation, an agent task is K calls of the context so far plus a tool result, the pauses are
drawn in their ranges, and the pool plans a unit's next call only once the previous one is
answered."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim import openai_fmt
from picker.sim.load import (
    RequestRecord,
    draw_request,
    plan_open_loop,
    request_body,
    request_headers,
    summarize,
    unit_completions,
)
from picker.sim.pool import PoolSpec, simulate
from picker.sim.traffic import TenantTraffic, Traffic, load_traffic
from picker.sim.workloads import WORDS, Unit, chat_messages, document, system_prompt


def _traffic(seed: int = 7, **tenant: Any) -> Traffic:
    return load_traffic({"duration_s": 100, "seed": seed,
                         "tenants": [{"name": "a", "backlog": 1, **tenant}]})


def _reply(call: int) -> str:
    return f"reply number {call}"


def _run(unit: Unit) -> tuple[list[Any], list[float]]:
    """Every call of ``unit`` and the pauses between them, answering each call."""
    calls, pauses = [], []
    while True:
        call = unit.call()
        calls.append(call)
        pause = unit.answered(_reply(call.call))
        if pause is None:
            return calls, pauses
        pauses.append(pause)


def test_the_same_seed_gives_the_same_calls_and_another_seed_others() -> None:
    chat = {"chat": {"turns": [3, 12], "think_s": [1, 4]}, "system_prompt_tokens": 50}
    tenant = _traffic(**chat).tenants[0]
    first, again = _run(Unit(7, tenant, 3)), _run(Unit(7, tenant, 3))
    assert first == again
    other = _run(Unit(8, tenant, 3))
    assert [c.messages for c in other[0]] != [c.messages for c in first[0]]
    assert _run(Unit(7, tenant, 4))[0][0].messages != first[0][0].messages


def test_a_chat_turn_resends_the_conversation_and_adds_a_question() -> None:
    tenant = _traffic(system_prompt_tokens=40, prompt_tokens=[5, 9],
                      chat={"turns": [5, 20], "think_s": [1, 4]}).tenants[0]
    turns = {len(_run(Unit(7, tenant, seq))[0]) for seq in range(40)}
    assert min(turns) >= 5 and max(turns) <= 20 and len(turns) > 5
    calls, pauses = _run(Unit(7, tenant, 0))
    assert [c.call for c in calls] == list(range(len(calls)))
    assert {c.calls for c in calls} == {len(calls)}
    for t, call in enumerate(calls):
        roles = [role for role, _ in call.messages]
        assert roles == ["system"] + ["user", "assistant"] * t + ["user"]
        assert call.messages[0][1] == system_prompt(7, "a", 40)
        assert [text for role, text in call.messages if role == "assistant"] == \
            [_reply(i) for i in range(t)]
        question = call.messages[-1][1].split(" ")
        assert 5 <= len(question) <= 9 and set(question) <= set(WORDS)
        # The prompt's ids are what the simulated server computes for these messages.
        assert list(call.token_ids) == openai_fmt.chat_prompt_ids(chat_messages(call.messages))
    for earlier, later in itertools.pairwise(calls):
        assert later.messages[:len(earlier.messages)] == earlier.messages
        assert later.token_ids[:len(earlier.token_ids) - 3] == earlier.token_ids[:-3]
    assert len(pauses) == len(calls) - 1 and all(1 <= p <= 4 for p in pauses)
    assert len(set(pauses)) == len(pauses)  # drawn, not a constant


@pytest.mark.parametrize("k", [1, 10, 30])
def test_an_agent_task_is_k_calls_of_the_context_plus_a_tool_result(k: int) -> None:
    tenant = _traffic(prompt_tokens=[20, 30], agent={
        "calls": k, "tool_result_tokens": [11, 17], "tool_latency_s": [0.25, 0.5]}).tenants[0]
    calls, pauses = _run(Unit(7, tenant, 2))
    assert len(calls) == k and [c.calls for c in calls] == [k] * k
    assert len(pauses) == k - 1 and all(0.25 <= p <= 0.5 for p in pauses)
    assert [role for role, _ in calls[0].messages] == ["user"]
    assert 20 <= len(calls[0].messages[0][1].split()) <= 30
    for i in range(1, k):
        context, previous = calls[i].messages, calls[i - 1].messages
        assert context[:-2] == previous
        assert context[-2] == ("assistant", _reply(i - 1))
        role, tool_result = context[-1]
        assert role == "user" and 11 <= len(tool_result.split()) <= 17


def test_rag_puts_shared_documents_in_corpus_order_before_the_question() -> None:
    traffic = load_traffic({"duration_s": 10, "seed": 3, "tenants": [
        {"name": name, "rate": 1, "prompt_tokens": [4, 4],
         "rag": {"documents": 4, "document_tokens": [30, 60], "per_request": 2}}
        for name in ("a", "b")]})
    corpus = [document(3, "shared", i, 30, 60) for i in range(4)]
    firsts = set()
    for tenant in traffic.tenants:
        for seq in range(12):
            calls, pauses = _run(Unit(3, tenant, seq))
            assert len(calls) == 1 and pauses == []
            [(role, text)] = calls[0].messages
            *docs, question = text.split("\n\n")
            assert role == "user" and len(question.split()) == 4
            indexes = [corpus.index(d) for d in docs]
            assert len(indexes) == 2 and indexes == sorted(indexes)
            firsts.add((tenant.name, indexes[0]))
    assert {index for _, index in firsts} == {0, 1, 2}  # both tenants draw from one corpus
    assert {name for name, _ in firsts} == {"a", "b"}


def test_a_system_prompt_tenant_sends_its_own_prompt_first() -> None:
    traffic = load_traffic({"duration_s": 10, "tenants": [
        {"name": n, "rate": 3, "system_prompt_tokens": 2000, "prompt_tokens": [5, 9]}
        for n in ("a", "b")]})
    plan = plan_open_loop(traffic)
    assert plan and all(p.calls == 1 and p.session is None for p in plan)
    for p in plan:
        system, question = p.messages
        assert system == ("system", system_prompt(0, p.tenant, 2000))
        assert len(system[1].split()) == 2000 and 5 <= len(question[1].split()) <= 9
        assert p.prompt_tokens == len(p.token_ids)
        assert 2000 + 5 + 11 <= p.prompt_tokens <= 2000 + 9 + 11  # two messages, a reply header
    assert system_prompt(0, "a", 2000) != system_prompt(0, "b", 2000)


def test_open_loop_sessions_plan_first_calls_only_and_carry_the_session_header() -> None:
    traffic = _traffic(rate=2, backlog=None, stream_fraction=1.0, include_usage=True,
                       chat={"turns": [3, 3], "think_s": [0, 0]})
    plan = plan_open_loop(traffic)
    assert plan and all(p.call == 0 and p.calls == 3 and p.unit is not None for p in plan)
    assert [p.seq for p in plan] == list(range(len(plan)))
    first = plan[0]
    assert first.session == "a-0"
    tenant = traffic.tenants[0]
    assert request_headers(traffic, tenant, first) == {
        "x-gateway-inference-fairness-id": "a", "x-session-id": "a-0"}
    body = request_body(traffic, tenant, first)
    assert body["messages"] == chat_messages(first.messages)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    backlog = draw_request(_traffic(chat={}), _traffic(chat={}).tenants[0], 5, "backlog", None)
    assert backlog.session == "a-5" and backlog.at_s is None


def test_plain_tenants_plan_as_before() -> None:
    tenant = TenantTraffic(name="a", rate=1)
    assert tenant.workload == "requests"
    plan = plan_open_loop(_traffic(rate=5, backlog=None))
    assert all(p.messages is None and p.token_ids is None and p.unit is None for p in plan)


# --- the pool simulator: dependent arrivals ------------------------------------------------


def _config() -> PickerConfig:
    return load(PickerConfig, {"capacity": {"kvBudgetTokens": 32768}})


def test_the_pool_plans_each_next_call_when_the_previous_is_answered() -> None:
    traffic = load_traffic({"duration_s": 60, "seed": 5, "tenants": [
        {"name": "chat", "backlog": 2, "stop_s": 5, "system_prompt_tokens": 200,
         "prompt_tokens": [10, 30], "output_tokens": [10, 20],
         "chat": {"turns": [4, 6], "think_s": [0.5, 1.5]}},
        {"name": "agent", "rate": 0.5, "stop_s": 5, "prompt_tokens": [50, 60],
         "output_tokens": [10, 20],
         "agent": {"calls": 10, "tool_latency_s": [0.2, 0.4], "tool_result_tokens": [30, 40]}}]})
    run = simulate(_config(), traffic, PoolSpec(endpoints=1, kv_budget_tokens=32768),
                   drain_s=5)
    units: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for record in run.records:
        units[(record.tenant, record.seq)].append(record)
    assert {t for t, _ in units} == {"chat", "agent"}
    for (tenant, seq), calls in units.items():
        assert all(r.outcome == "ok" for r in calls)
        assert [r.call for r in calls] == list(range(calls[0].calls))  # every call, in order
        replay = Unit(5, traffic.tenant(tenant), seq)
        for earlier, later in itertools.pairwise(calls):
            pause = replay.answered(openai_fmt.generated_text(openai_fmt.CHAT,
                                                              earlier.completion_tokens))
            assert pause is not None
            # Sent at the first tick at or after the reply plus the drawn pause.
            assert earlier.end_s + pause <= later.arrival_s < earlier.end_s + pause + 0.01
            # One engine: the whole previous prompt and reply are cached (but the reply's
            # last token, whose KV vLLM never computes, and a part block).
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.completion_tokens
            assert later.cached_tokens >= (earlier.prompt_tokens + earlier.completion_tokens
                                           - 1) // 16 * 16
            assert later.cached_tokens > earlier.cached_tokens
        assert replay.answered("") is None
    assert len(units) == sum(1 for t, _ in units if t == "chat") + \
        sum(1 for t, _ in units if t == "agent")
    assert sum(1 for t, _ in units if t == "agent") >= 1
    assert {len(calls) for (t, _), calls in units.items() if t == "agent"} == {10}


def test_a_unit_stops_at_the_end_of_the_run() -> None:
    traffic = load_traffic({"duration_s": 3, "seed": 1, "tenants": [
        {"name": "a", "bursts": [{"at_s": 0, "count": 1}], "prompt_tokens": [5, 5],
         "output_tokens": [5, 5], "agent": {"calls": 30, "tool_latency_s": [0.5, 0.5]}}]})
    run = simulate(_config(), traffic, PoolSpec(endpoints=1, kv_budget_tokens=32768),
                   drain_s=5)
    assert 2 <= len(run.records) < 30 and all(r.seq == 0 for r in run.records)
    assert [r.call for r in run.records] == list(range(len(run.records)))
    last = run.records[-1]
    assert last.arrival_s < 3 and last.outcome == "ok" and last.end_s + 0.5 >= 3


# --- summaries ---------------------------------------------------------------------------------


def test_unit_completions_count_only_units_whose_every_call_was_answered() -> None:
    def record(seq: int, call: int, calls: int, start: float, end: float,
               status: int = 200) -> RequestRecord:
        return RequestRecord(tenant="a", seq=seq, kind="backlog", api="chat", stream=False,
                             scheduled_s=None, start_s=start, drawn_prompt_tokens=10,
                             max_tokens=5, status=status, ttft_s=0.1, end_s=end,
                             session=f"a-{seq}", call=call, calls=calls)

    records = [record(0, 0, 2, 1.0, 2.0), record(0, 1, 2, 3.0, 4.5),  # done: 3.5 s
               record(1, 0, 3, 0.0, 1.0), record(1, 1, 3, 2.0, 3.0),  # cut before call 2
               record(2, 0, 2, 0.0, 1.0), record(2, 1, 2, 2.0, 2.5, status=429)]  # refused
    assert unit_completions(records) == {("a", 0): 3.5, ("a", 1): None, ("a", 2): None}
    units = summarize(records)["tenants"]["a"]["units"]
    assert (units["started"], units["completed"]) == (3, 1)
    assert units["completion_s"]["p50"] == 3.5
