"""The engines' prefix cache in the room, without prefix affinity (``capacity.engineCache``).

An engine that caches prefixes (vLLM V1's default) stores a prompt block that requests running on
it share once, whoever routed them there. So the picker counts such blocks once in an endpoint's
room whenever the engines are assumed to cache, affinity or not; affinity only adds the routing
preference. Before, without ``routing.prefixAffinity`` the picker cut no blocks and counted every
request's whole prompt: a tenant's 2,000-token system prompt on every request held requests the
engines had room for (the pool simulator's vtc rows: TTFT p50 1.2 s on the system prompt).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.config.build import gate_rules
from picker.config.schema import PickerConfig, load_config
from picker.config.strict import load
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import DEFAULT_BLOCK_CHARS, AffinityRules
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest
from picker.openai.paths import ApiKind
from picker.openai.prefix import prompt_blocks
from picker.sim.load import percentile
from picker.sim.pool import PoolRecord, PoolSpec, simulate
from picker.sim.traffic import load_traffic

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
SYSTEM = "You are a careful assistant who answers in one sentence, citing the manual. " * 40
"""About 3,000 characters: a system prompt of some 750 tokens at four characters a token."""


def chat(question: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": question}]}


def make_gate(budgets: dict[str, int], **rules: Any) -> Gate:
    gate = Gate(GateRules(**rules), Scheduler([LaneSpec("default")]),
                Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints(budgets)
    return gate


def send(gate: Gate, body: dict[str, Any], tenant: str = "t", now: float = 0.0) -> Passage:
    """Cut as the dispatcher cuts it (``GateRules.block_chars``), four characters a token."""
    size = gate.rules.block_chars()
    blocks, chars = prompt_blocks("m", body, ApiKind.CHAT, size) if size else ((), 0)
    prompt = sum(len(m["content"]) for m in body["messages"]) // 4
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=50, stream=True, now=now, prefix_blocks=blocks,
                         prefix_chars=chars)
    assert isinstance(passage, Passage), passage
    return passage


def test_without_affinity_a_shared_system_prompt_counts_once_in_the_room() -> None:
    gate = make_gate({E1: 1200})  # the default rules: engines cache prefixes, no affinity
    assert gate.rules.affinity is None and gate.prefix_index is None
    first = send(gate, chat("What does the red light mean?"))
    second = send(gate, chat("How do I reset the device?"), tenant="u", now=0.1)
    # Two prompts of about 760 tokens on 1,200 tokens of room: the second fits only because the
    # system prompt both start with is counted once.
    assert first.dispatched_at == 0.0 and second.dispatched_at == 0.1
    endpoint = gate.endpoints[E1]
    whole = first.reserved_tokens + second.reserved_tokens
    assert endpoint.inflight_tokens < whole - 600
    assert gate.inflight_blocks.blocks(E1) > 0
    assert second.request.cached_prompt_tokens == 0  # no index: charged whole, settled later
    for passage, at in ((first, 1.0), (second, 2.0)):
        gate.complete(passage, Usage(passage.request.prompt_tokens, 10), "ok", at)
    assert (endpoint.inflight_tokens, endpoint.projected_tokens) == (0, 0)
    assert gate.inflight_blocks.blocks(E1) == 0


def test_engines_without_a_prefix_cache_count_each_prompt_whole() -> None:
    gate = make_gate({E1: 1200}, engine_cache=False)
    assert gate.rules.block_chars() == 0  # nothing to cut the prompt for
    first = send(gate, chat("What does the red light mean?"))
    second = send(gate, chat("How do I reset the device?"), tenant="u", now=0.1)
    assert first.dispatched_at == 0.0 and second.dispatched_at is None
    assert second.prefix_blocks == () and gate.inflight_blocks.blocks(E1) == 0
    gate.complete(first, Usage(first.request.prompt_tokens, 10), "ok", 1.0)
    assert second.dispatched_at == 1.0


def test_blocks_handed_in_are_not_counted_when_the_engines_do_not_cache() -> None:
    """A caller that cut blocks anyway (a rules reload between the cut and admission): with
    ``engine_cache`` off they take no part in the room, and without affinity are not kept."""
    gate = make_gate({E1: 1200}, engine_cache=False)
    blocks, chars = prompt_blocks("m", chat("q"), ApiKind.CHAT, DEFAULT_BLOCK_CHARS)
    passage = gate.admit(Passage, "t", None, model="m", prompt_tokens=760, max_tokens=50,
                         stream=True, now=0.0, prefix_blocks=blocks, prefix_chars=chars)
    assert isinstance(passage, Passage)
    assert passage.prefix_block_chars == 0 and passage.prefix_blocks == ()
    assert gate.endpoints[E1].inflight_tokens == passage.reserved_tokens


def test_the_block_size_is_the_affinitys_when_set_else_the_default() -> None:
    assert GateRules().block_chars() == DEFAULT_BLOCK_CHARS == 256
    assert GateRules(engine_cache=False).block_chars() == 0
    affine = AffinityRules(block_chars=128)
    assert GateRules(affinity=affine).block_chars() == 128
    # Affinity without an engine cache still routes by the blocks: they are still cut.
    assert GateRules(engine_cache=False, affinity=affine).block_chars() == 128


def test_the_config_learns_each_engines_cache_when_told_or_with_affinity() -> None:
    assert load_config({}).capacity.engine_cache is None
    # Unset without affinity: every prompt counted whole, no prompt cut into blocks.
    unset = gate_rules(load_config({}))
    assert not unset.engine_cache and not unset.learn_engine_cache
    assert unset.block_chars() == 0
    # Unset with affinity: learned from each engine.
    affine = gate_rules(load_config({"routing": {"prefixAffinity": {}}}))
    assert affine.engine_cache and affine.learn_engine_cache and affine.block_chars() == 256
    auto = gate_rules(load_config({"capacity": {"engineCache": "auto"}}))
    assert auto.engine_cache and auto.learn_engine_cache and auto.block_chars() == 256
    told = gate_rules(load_config({"capacity": {"engineCache": True}}))
    assert told.engine_cache and not told.learn_engine_cache
    assert gate_rules(load_config({"capacity": {"engineCache": False}})).engine_cache is False
    rules = gate_rules(load_config({"capacity": {"engineCache": False},
                                    "routing": {"prefixAffinity": {"blockChars": 64}}}))
    assert not rules.engine_cache and rules.affinity is not None and rules.block_chars() == 64


# -- capacity.engineCache: auto, each endpoint as its engine says --

def test_auto_counts_shared_blocks_once_only_where_a_read_said_the_engine_caches() -> None:
    gate = make_gate({E1: 1200, E2: 1200}, learn_engine_cache=True)
    e1, e2 = gate.endpoints[E1], gate.endpoints[E2]
    assert not gate.caches(e1)  # not read yet: nothing known, prompts counted whole
    gate.scraped(e1, 0.0, 0.0, 0.0, None, sent_at=0.0, now=0.0, prefix_caching=False)
    gate.scraped(e2, 0.0, 0.0, 0.0, None, sent_at=0.0, now=0.0)  # a page without the label
    assert not gate.caches(e1) and gate.caches(e2)
    e2.inflight_tokens = e2.projected_tokens = 1200  # full: the first two go to E1
    first = send(gate, chat("What does the red light mean?"))
    second = send(gate, chat("How do I reset the device?"), tenant="u", now=0.1)
    assert first.endpoint is e1 and second.dispatched_at is None  # whole there: no room
    assert not first.holds_blocks and first.prefix_tokens == 0
    assert gate.inflight_blocks.blocks(E1) == 0 and e1.inflight_tokens == first.reserved_tokens
    e2.inflight_tokens = e2.projected_tokens = 0
    gate.pump(0.2)
    assert second.endpoint is e2 and second.holds_blocks
    third = send(gate, chat("Is it waterproof?"), tenant="v", now=0.3)
    assert third.endpoint is e2  # only its question beside the second's system prompt there
    assert e2.inflight_tokens < second.reserved_tokens + third.reserved_tokens - 600
    # Moving between an engine that caches and one that does not keeps both counts exact.
    gate.served_by(third, E1, 0.4)
    assert not third.holds_blocks and e1.inflight_tokens == first.reserved_tokens + \
        third.reserved_tokens
    assert e2.inflight_tokens == second.reserved_tokens
    gate.served_by(first, E2, 0.5)
    assert first.holds_blocks and e2.inflight_tokens < second.reserved_tokens + \
        first.reserved_tokens - 600
    for passage, at in ((first, 1.0), (second, 1.1), (third, 1.2)):
        gate.complete(passage, Usage(passage.request.prompt_tokens, 10), "ok", at)
    for endpoint in (e1, e2):
        assert (endpoint.inflight_tokens, endpoint.projected_tokens) == (0, 0)
        assert gate.inflight_blocks.blocks(endpoint.address) == 0


def _system_prompt_sim(engine_cache: Any, duration: float,
                       engines_cache: bool = True) -> list[PoolRecord]:
    """bench.prefix's system-prompt shape (a heavy tenant at 60 requests/s and a light one at
    4, each prompt a 2,000-token system prompt and a question) on its pool, vtc without
    affinity."""
    data = {"duration_s": duration, "seed": 28, "timeout_s": 60, "tenants": [
        {"name": name, "rate": rate, "system_prompt_tokens": 2000, "prompt_tokens": [20, 80],
         "output_tokens": [40, 160], "stream_fraction": 1.0, "include_usage": True}
        for name, rate in (("heavy", 60), ("light", 4))]}
    config = load(PickerConfig, {"tenants": [{"id": "heavy"}, {"id": "light"}],
                                 "capacity": {"engineCache": engine_cache}})
    return simulate(config, load_traffic(data), PoolSpec(
        endpoints=2, kv_budget_tokens=65536, max_num_batched_tokens=8192,
        prefill_s_per_token=0.00005, enable_prefix_caching=engines_cache), drain_s=30).records


def _no_cache_run(engine_cache: Any) -> list[tuple[str, float | None, float | None]]:
    return [(r.tenant, r.dispatched_s, r.end_s)
            for r in _system_prompt_sim(engine_cache, 8, engines_cache=False)]


def test_auto_in_front_of_engines_without_a_cache_is_false_to_the_request() -> None:
    """The pool simulator's engines state their cache as vLLM's ``cache_config_info`` does:
    the default reads it before anything is dispatched on a shared prefix counted once, so
    every request leaves and ends as with ``engineCache: false``; told ``true``, the picker
    sends past what the engines hold."""
    whole = _no_cache_run(False)
    assert _no_cache_run("auto") == whole
    assert _no_cache_run(True) != whole


# -- the dispatcher cuts the body's prompt when no affinity is configured --

def _dispatcher(**capacity: Any) -> Dispatcher:
    config = load_config({"endpoints": [{"address": E1}],
                          "capacity": {"kvBudgetTokens": 1200, **capacity}})
    return Dispatcher(config, clock=lambda: 0.0, metrics=PickerMetrics(CollectorRegistry()))


def _inference(question: str) -> InferenceRequest:
    body = chat(question)
    return InferenceRequest(model="m", prompt_tokens=760, max_tokens=50, stream=True,
                            include_usage=True, body=body)


@pytest.mark.parametrize("engine_cache", [True, False])
async def test_the_dispatcher_counts_a_shared_system_prompt_once_without_affinity(
        engine_cache: bool) -> None:
    d = _dispatcher(engineCache=engine_cache)
    first = await asyncio.wait_for(d.admit("a", _inference("What does the red light mean?")),
                                   1.0)
    second = asyncio.create_task(d.admit("b", _inference("How do I reset the device?")))
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.dispatched_at is not None
    assert second.done() is engine_cache
    if not engine_cache:
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second


# -- the pool simulator: a shared system prompt on every request, vtc without affinity --

def _system_prompt_run(engine_cache: bool) -> list[float]:
    records = _system_prompt_sim(engine_cache, 12)
    assert records and all(r.outcome == "ok" for r in records)
    return [r.dispatched_s - r.arrival_s for r in records if r.dispatched_s is not None]


def test_in_the_pool_simulator_shared_prompts_no_longer_wait_in_the_picker() -> None:
    """bench.prefix's system-prompt shape, 12 s: with the engines' cache assumed the picker
    holds requests only while the engines are full by what they store; counting every prompt
    whole, it held them for seconds while the engines had room."""
    counted_once, counted_whole = _system_prompt_run(True), _system_prompt_run(False)
    once_p95, whole_p50 = percentile(counted_once, 95), percentile(counted_whole, 50)
    assert once_p95 is not None and whole_p50 is not None
    assert once_p95 < 0.05, once_p95
    assert whole_p50 > 0.2, whole_p50
