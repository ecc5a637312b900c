"""Cost functions, alone and as the Scheduler charges them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core import (
    ComputedTokenCost,
    ContextAwareCost,
    CostFunction,
    LinearCost,
    Request,
    Scheduler,
    Usage,
)
from picker.core.cost import request_cost


def per_token_context_cost(cost: ContextAwareCost, prompt: int, before: int, tokens: int) -> float:
    """The definition: output token k (1-based) costs ``w_q + β·(prompt + k)``."""
    return sum(cost.decode_weight + cost.context_beta * (prompt + k)
               for k in range(before + 1, before + tokens + 1))


def run_request(scheduler: Scheduler, request: Request, output: int, step: int = 1) -> float:
    """Enqueue, dispatch and decode ``output`` tokens ``step`` at a time; the charge so far."""
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    produced = 0
    while produced < output:
        n = min(step, output - produced)
        scheduler.charge_output(request, n)
        produced += n
    return request.charged


# -- LinearCost --


def test_linear_cost_charges_w_p_per_prompt_token_and_w_q_per_output_token() -> None:
    cost = LinearCost(prefill_weight=1.5, decode_weight=3.0)
    assert cost.prompt_cost(100) == 150.0
    assert cost.prompt_cost(100, cached_prompt_tokens=60) == 150.0  # linear ignores the cache
    assert cost.output_cost(100, 0, 10) == 30.0
    assert cost.output_cost(5000, 700, 10) == 30.0  # context length does not matter
    assert cost.output_cost(100, 0, 0) == 0.0


def test_linear_cost_defaults_are_the_papers_weights() -> None:
    cost = LinearCost()
    assert (cost.prefill_weight, cost.decode_weight) == (1.0, 2.0)
    assert request_cost(cost, 100, 50) == 200.0


# -- ContextAwareCost --


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(0, 5000),
    before=st.integers(0, 2000),
    tokens=st.integers(0, 300),
    w_q=st.sampled_from([0.0, 1.0, 2.0, 0.5]),
    beta=st.sampled_from([0.0, 0.001, 0.01, 0.25, 1.0]),
)
def test_context_aware_closed_form_equals_the_per_token_sum(
    prompt: int, before: int, tokens: int, w_q: float, beta: float
) -> None:
    cost = ContextAwareCost(prefill_weight=1.0, decode_weight=w_q, context_beta=beta)
    assert cost.output_cost(prompt, before, tokens) == pytest.approx(
        per_token_context_cost(cost, prompt, before, tokens), rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("prompt,before,tokens", [(0, 0, 1), (7, 0, 1), (7, 3, 2), (10, 4, 5),
                                                  (1, 1, 1), (3, 0, 4)])
def test_context_aware_closed_form_is_exact_for_odd_and_even_token_counts(
    prompt: int, before: int, tokens: int
) -> None:
    cost = ContextAwareCost(prefill_weight=1.0, decode_weight=2.0, context_beta=1.0)
    assert cost.output_cost(prompt, before, tokens) == per_token_context_cost(
        cost, prompt, before, tokens)


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(0, 4000), first=st.integers(0, 500), second=st.integers(0, 500))
def test_context_aware_output_cost_is_additive_over_chunks(
    prompt: int, first: int, second: int
) -> None:
    cost = ContextAwareCost(prefill_weight=1.0, decode_weight=2.0, context_beta=0.5)
    whole = cost.output_cost(prompt, 0, first + second)
    parts = cost.output_cost(prompt, 0, first) + cost.output_cost(prompt, first, second)
    assert whole == pytest.approx(parts)


def test_context_aware_with_zero_beta_is_the_linear_cost() -> None:
    context = ContextAwareCost(prefill_weight=1.0, decode_weight=2.0, context_beta=0.0)
    linear = LinearCost(1.0, 2.0)
    for prompt, before, tokens in [(10, 0, 5), (4000, 100, 33), (1, 0, 0)]:
        assert context.output_cost(prompt, before, tokens) == linear.output_cost(
            prompt, before, tokens)
        assert context.prompt_cost(prompt) == linear.prompt_cost(prompt)


def test_context_aware_later_tokens_of_a_longer_context_cost_more() -> None:
    cost = ContextAwareCost(prefill_weight=1.0, decode_weight=2.0, context_beta=0.01)
    assert cost.output_cost(4096, 0, 1) > cost.output_cost(256, 0, 1)
    assert cost.output_cost(256, 100, 1) > cost.output_cost(256, 0, 1)
    assert cost.output_cost(256, 0, 1) == pytest.approx(2.0 + 0.01 * 257)
    assert cost.prompt_cost(300) == 300.0


# -- ComputedTokenCost --


def test_computed_token_cost_does_not_charge_cached_prompt_tokens() -> None:
    cost = ComputedTokenCost(prefill_weight=2.0, decode_weight=3.0)
    assert cost.prompt_cost(100) == 200.0
    assert cost.prompt_cost(100, cached_prompt_tokens=64) == 72.0
    assert cost.output_cost(100, 0, 10) == 30.0


@pytest.mark.parametrize("cached,charged", [(-5, 100.0), (0, 100.0), (100, 0.0), (150, 0.0),
                                            (99, 1.0)])
def test_computed_token_cost_clamps_the_cached_count_to_the_prompt(
    cached: int, charged: float
) -> None:
    assert ComputedTokenCost(1.0, 2.0).prompt_cost(100, cached) == charged


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(0, 10_000), cached=st.integers(-100, 20_000))
def test_computed_token_prompt_cost_is_between_zero_and_the_linear_cost(
    prompt: int, cached: int
) -> None:
    charged = ComputedTokenCost(1.0, 2.0).prompt_cost(prompt, cached)
    assert 0.0 <= charged <= LinearCost(1.0, 2.0).prompt_cost(prompt)


# -- request_cost --


@pytest.mark.parametrize(
    "cost,expected",
    [
        (LinearCost(1.0, 2.0), 100 + 2 * 20),
        (ComputedTokenCost(1.0, 2.0), 40 + 2 * 20),
        # 2·20 + β·(20·100 + (1 + … + 20)) = 40 + 0.5·(2000 + 210)
        (ContextAwareCost(1.0, 2.0, 0.5), 100 + 40 + 0.5 * 2210),
    ],
)
def test_request_cost_is_prompt_cost_plus_output_cost_from_zero(
    cost: CostFunction, expected: float
) -> None:
    assert request_cost(cost, 100, 20, cached=60) == pytest.approx(expected)


# -- through the Scheduler --


def test_context_aware_scheduler_charges_more_for_long_contexts() -> None:
    scheduler = Scheduler(cost=ContextAwareCost(1.0, 2.0, 0.01))
    short = Request(tenant="short", prompt_tokens=256)
    long = Request(tenant="long", prompt_tokens=4096)
    run_request(scheduler, short, 100)
    run_request(scheduler, long, 100)
    short_output = scheduler.service["short"] - 256
    long_output = scheduler.service["long"] - 4096
    assert long_output > short_output
    assert short_output == pytest.approx(200 + 0.01 * (100 * 256 + 5050))
    assert long_output == pytest.approx(200 + 0.01 * (100 * 4096 + 5050))


@pytest.mark.parametrize("step", [1, 7, 100])
def test_context_aware_charging_in_chunks_settles_to_the_same_total(step: int) -> None:
    cost = ContextAwareCost(1.0, 2.0, 0.25)
    scheduler = Scheduler(cost=cost)
    request = Request(tenant="a", prompt_tokens=300)
    charged = run_request(scheduler, request, 100, step=step)
    assert charged == pytest.approx(request_cost(cost, 300, 100))
    delta = scheduler.settle(request, Usage(300, 100))
    assert delta == pytest.approx(0.0, abs=1e-6)


def test_context_aware_estimate_then_output_charges_each_position_once() -> None:
    cost = ContextAwareCost(1.0, 2.0, 0.1)
    scheduler = Scheduler(cost=cost)
    request = Request(tenant="a", prompt_tokens=50)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    scheduler.charge_estimate(request, 30)
    scheduler.charge_output(request, 10)
    scheduler.charge_output(request, 40)  # 20 covered by the estimate, 20 new (positions 31-50)
    assert request.charged == pytest.approx(request_cost(cost, 50, 50))
    scheduler.finish(request)
    assert scheduler.service["a"] == pytest.approx(request_cost(cost, 50, 50))


def test_computed_token_scheduler_charges_less_for_cached_prompts() -> None:
    scheduler = Scheduler(cost=ComputedTokenCost(1.0, 2.0))
    cold = Request(tenant="cold", prompt_tokens=1000)
    warm = Request(tenant="warm", prompt_tokens=1000, cached_prompt_tokens=800)
    run_request(scheduler, cold, 10)
    run_request(scheduler, warm, 10)
    assert scheduler.service["cold"] == 1000 + 20
    assert scheduler.service["warm"] == 200 + 20
    scheduler.finish(cold)
    scheduler.finish(warm)  # settling to the counted usage keeps the cache discount
    assert scheduler.service["warm"] == 200 + 20


def test_computed_token_settle_uses_the_cached_count_the_engine_reports() -> None:
    scheduler = Scheduler(cost=ComputedTokenCost(1.0, 2.0))
    request = Request(tenant="a", prompt_tokens=1000)  # the picker did not know of a cache hit
    run_request(scheduler, request, 10)
    assert scheduler.service["a"] == 1020
    scheduler.finish(request, Usage(prompt_tokens=1000, completion_tokens=10,
                                    cached_prompt_tokens=900))
    assert scheduler.service["a"] == 100 + 20


def test_linear_scheduler_charges_cached_prompts_in_full() -> None:
    scheduler = Scheduler(cost=LinearCost(1.0, 2.0))
    warm = Request(tenant="warm", prompt_tokens=1000, cached_prompt_tokens=800)
    run_request(scheduler, warm, 10)
    scheduler.finish(warm)
    assert scheduler.service["warm"] == 1020
