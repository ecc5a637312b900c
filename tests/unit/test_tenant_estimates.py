"""Estimates no tenant can move for another (issue 11, point 2): a tenant's prompt calibration is
its own and bounded, caps are judged on at least the body's own size, and a stream's output
estimate is learned from streams and cannot be talked down."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from picker.config.schema import load_config
from picker.core import Usage
from picker.core.admission import INPUT_TOO_LONG, Admission, Refused, TenantRules
from picker.core.estimates import SCALE_MAX, SCALE_MIN, TenantEstimates
from picker.dispatch import Dispatcher
from picker.errors import RequestError
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest, parse_request

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the pure estimates --

def test_a_tenants_calibration_is_its_own() -> None:
    e = TenantEstimates(256)
    for _ in range(40):  # the cheap tenant's engine reports 4x its body estimate
        e.learn_prompt("cheap", "m", 10, 40, now=0.0)
    assert e.prompt_scale("cheap", "m", 0.0) > 3
    assert e.prompt_scale("honest", "m", 0.0) == 1.0
    assert e.prompt_tokens("honest", "m", 50, 0.0) == 50


def test_the_calibration_is_bounded_both_ways() -> None:
    e = TenantEstimates(256)
    e.learn_prompt("t", "m", 1000, 1, now=0.0)
    assert e.prompt_scale("t", "m", 0.0) == SCALE_MIN
    e.learn_prompt("u", "m", 1, 10_000, now=0.0)
    assert e.prompt_scale("u", "m", 0.0) == SCALE_MAX


def test_a_tenant_cannot_carry_a_long_prompt_past_its_own_cap() -> None:
    e = TenantEstimates(256)
    for _ in range(40):  # very compressible prompts: the engine counts an eighth of chars/4
        e.learn_prompt("t", "m", 800, 100, now=0.0)
    body = 260  # a 200-word prompt, by chars/4
    calibrated = e.prompt_tokens("t", "m", body, 0.0)
    assert calibrated < 60 * 3  # the calibration did learn the tenant's own (compressible) text
    admission = Admission({"t": TenantRules(max_input_tokens=60)}, TenantRules())
    decision = admission.admit("t", "default", calibrated, None, 10, 0.0,
                               cap_prompt_tokens=e.prompt_floor(body, calibrated))
    assert isinstance(decision, Refused) and decision.reason == INPUT_TOO_LONG
    assert "260 tokens" in decision.message


def test_stream_output_is_learned_from_streams_and_not_talked_down() -> None:
    e = TenantEstimates(256)
    for _ in range(50):  # tiny non-streaming answers
        e.learn_output("t", 1, 0.0)
    assert e.output("t", 0.0) < 10
    assert e.output("t", 0.0, stream=True) == 256
    for _ in range(50):  # streams cut short by the client or by their own max_tokens
        e.learn_output("t", 1, 0.0, stream=True, complete=False)
    assert e.output("t", 0.0, stream=True) == 256
    e.learn_output("t", 2000, 0.0, stream=True, complete=False)  # a long one raises it at once
    assert e.output("t", 0.0, stream=True) > 1000
    e.learn_output("t", 1, 0.0, stream=True)  # a short complete one lowers it only a little
    assert e.output("t", 0.0, stream=True) > 1000


def test_an_estimate_past_its_ttl_is_the_default_and_is_dropped() -> None:
    e = TenantEstimates(256, ttl=100)
    e.learn_prompt("t", "m", 100, 200, now=0.0)
    e.learn_output("t", 5, 0.0)
    e.learn_output("t", 900, 0.0, stream=True)
    assert e.prune(50.0) == 0
    assert (e.prompt_scale("t", "m", 101.0), e.output("t", 101.0),
            e.output("t", 101.0, stream=True)) == (1.0, 256, 256)
    assert e.prune(101.0) == 3
    assert e.tenants() == set()


def test_model_names_from_clients_do_not_grow_a_tenants_state_without_bound() -> None:
    e = TenantEstimates(256)
    for i in range(100):
        e.learn_prompt("t", f"model-{i}", 10, 20, now=0.0)
    assert sum(e.prompt_scale("t", f"model-{i}", 0.0) != 1.0 for i in range(100)) == 8


def test_a_flood_of_tenants_keeps_at_most_max_tenants_estimates() -> None:
    e = TenantEstimates(256, max_tenants=100)
    for i in range(1000):
        e.learn_output(f"t{i}", 900, float(i), stream=True)
        e.learn_prompt(f"t{i}", "m", 10, 20, now=float(i))
        if i % 10 == 0:
            e.learn_output("regular", 900, float(i), stream=True)  # refreshed: kept
    assert len(e.tenants()) <= 200
    assert e.output("regular", 1000.0, stream=True) > 256
    assert e.output("t0", 1000.0, stream=True) == 256  # dropped: what a fresh id gets


# -- through the dispatcher, with the config loaded from YAML as the picker loads it --

CONFIG = """
endpoints: [{address: "10.0.0.1:8000"}, {address: "10.0.0.2:8000"}]
capacity: {kvBudgetTokens: 4000, defaultOutputTokens: 256}
tenants:
  - id: honest
    limits: {maxInputTokens: 60}
  - id: cheap
  - id: gamer
    limits: {maxInputTokens: 60}
"""


@pytest.fixture
def dispatcher(tmp_path: Path) -> Dispatcher:
    path = tmp_path / "picker.yaml"
    path.write_text(CONFIG)
    clock = FakeClock()
    return Dispatcher(load_config(path), clock=clock,
                      metrics=PickerMetrics(CollectorRegistry()))


def _body(words: int, *, stream: bool = False, max_tokens: int | None = None) -> InferenceRequest:
    body: dict[str, object] = {"model": "m", "messages": [
        {"role": "user", "content": " ".join(["word"] * words)}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_request(json.dumps(body).encode())


async def _run(d: Dispatcher, tenant: str, request: InferenceRequest, usage: Usage) -> None:
    ticket = await asyncio.wait_for(d.admit(tenant, request), 1.0)
    d.complete(ticket, usage, "ok")


async def test_a_cheap_tenant_cannot_push_anothers_honest_prompt_over_its_cap(
        dispatcher: Dispatcher) -> None:
    honest = _body(40)  # 40 words: about 50 tokens by chars/4, under the cap of 60
    assert honest.prompt_tokens < 60
    ticket = await asyncio.wait_for(dispatcher.admit("honest", honest), 1.0)
    dispatcher.complete(ticket, None, "cancelled")
    cheap = _body(10)
    for _ in range(40):  # the engine reports 10x the body estimate for the cheap tenant
        await _run(dispatcher, "cheap", cheap, Usage(cheap.prompt_tokens * 10, 1))
    ticket = await asyncio.wait_for(dispatcher.admit("honest", honest), 1.0)
    assert ticket.request.prompt_tokens == honest.prompt_tokens


async def test_a_cheap_tenant_cannot_carry_a_long_prompt_past_anothers_or_its_own_cap(
        dispatcher: Dispatcher) -> None:
    long = _body(200)
    assert long.prompt_tokens > 60
    cheap, short = _body(200), _body(40)
    for _ in range(40):  # the engine reports a tenth of the body estimate
        await _run(dispatcher, "cheap", cheap, Usage(max(1, cheap.prompt_tokens // 10), 1))
        await _run(dispatcher, "gamer", short, Usage(max(1, short.prompt_tokens // 10), 1))
    # The gamer's calibration did learn (its own estimates are lower), its cap did not move.
    assert dispatcher.estimates.prompt_tokens("gamer", "m", long.prompt_tokens, 0.0) \
        < long.prompt_tokens
    for tenant in ("honest", "gamer"):
        with pytest.raises(RequestError) as refused:
            await asyncio.wait_for(dispatcher.admit(tenant, long), 1.0)
        assert refused.value.http_status == 400


async def test_a_tenant_cannot_talk_its_stream_estimate_down(dispatcher: Dispatcher) -> None:
    d = dispatcher
    for _ in range(40):  # one-token non-streaming answers, and streams cancelled at once
        await _run(d, "cheap", _body(5), Usage(5, 1))
        ticket = await asyncio.wait_for(d.admit("cheap", _body(5, stream=True)), 1.0)
        d.on_output_tokens(ticket, 1)
        d.complete(ticket, None, "cancelled")
    # 30 long streams: the pool (2 x 4000 tokens) has room for about 2 x 4000 / 260 of them by
    # the default estimate; a talked-down estimate of 1 token would have let all 30 go at once.
    tasks = [asyncio.create_task(d.admit("cheap", _body(5, stream=True))) for _ in range(30)]
    for _ in range(5):
        await asyncio.sleep(0)
    dispatched = sum(t.done() for t in tasks)
    assert dispatched <= 2 * 4000 // 256 + 2
    assert d.scheduler.queued() == 30 - dispatched
    d.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_calibration_taught_down_does_not_lower_what_a_request_reserves(
        dispatcher: Dispatcher) -> None:
    """Prompts the engine counts cheaply (digits: 3 a token where the estimate counts one each)
    teach the calibration its floor; a request the engine counts dearly (images) must still
    reserve at least its body's own estimate from the tenant's budgets (issue 26 point 2)."""
    short = _body(40)
    for _ in range(40):
        await _run(dispatcher, "gamer", short, Usage(max(1, short.prompt_tokens // 10), 1))
    long = _body(50, max_tokens=10)
    calibrated = dispatcher.estimates.prompt_tokens("gamer", "m", long.prompt_tokens, 0.0)
    assert calibrated <= long.prompt_tokens * SCALE_MIN + 1  # the calibration was taught down
    needs = dispatcher.gate.budget_needs("gamer", model="m", prompt_tokens=long.prompt_tokens,
                                         max_tokens=10, stream=False, now=0.0)
    assert needs >= long.prompt_tokens + 10  # reserved at the body's own size, not the taught
    ticket = await asyncio.wait_for(dispatcher.admit("gamer", long), 1.0)
    assert ticket.request.prompt_tokens == calibrated  # ordering and room keep the calibration
    dispatcher.complete(ticket, None, "cancelled")
