"""How much service a request's tokens are worth.

A cost function answers: *what does serving these tokens cost, in weighted service units?* It is
VTC's ``h(n_p, n_q)`` hook: the prompt is charged once at dispatch, and output tokens are charged
as they are produced, each token costing the increment ``h(n_p, n) - h(n_p, n - 1)``. Any cost that
is monotone in both arguments keeps the fairness guarantee (with a bound that grows with the
largest per-token increment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CostFunction(Protocol):
    """Weighted service of a request's prompt and output tokens."""

    def prompt_cost(self, prompt_tokens: int, cached_prompt_tokens: int = 0) -> float:
        """Service charged for the prompt when the request is dispatched."""
        ...

    def output_cost(self, prompt_tokens: int, generated_before: int, tokens: int) -> float:
        """Service of ``tokens`` output tokens produced after ``generated_before`` others."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``w_p`` per prompt token plus ``w_q`` per output token (the paper's cost)."""

    prefill_weight: float = 1.0
    decode_weight: float = 2.0

    def prompt_cost(self, prompt_tokens: int, cached_prompt_tokens: int = 0) -> float:
        return self.prefill_weight * prompt_tokens

    def output_cost(self, prompt_tokens: int, generated_before: int, tokens: int) -> float:
        return self.decode_weight * tokens


@dataclass(frozen=True, slots=True)
class ContextAwareCost:
    """Each output token costs ``w_q + β·context_length``: memory bandwidth, not token count.

    The context length of the k-th output token (1-based) is ``prompt + k``: a decode step reads the
    whole KV cache of the sequence, so long contexts pay for the bytes they move.
    """

    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    context_beta: float = 0.0
    cached_weight: float = 1.0
    """What a prompt token served from the prefix cache costs beside a computed one (1: as
    much, the tokens sent; 0: nothing)."""

    def prompt_cost(self, prompt_tokens: int, cached_prompt_tokens: int = 0) -> float:
        cached = min(max(cached_prompt_tokens, 0), prompt_tokens)
        return self.prefill_weight * (prompt_tokens - cached + self.cached_weight * cached)

    def output_cost(self, prompt_tokens: int, generated_before: int, tokens: int) -> float:
        # Sum over k = g+1 … g+n of (w_q + β·(p + k)), in closed form.
        g, n = generated_before, tokens
        context_sum = n * prompt_tokens + (n * (2 * g + n + 1)) // 2
        return self.decode_weight * n + self.context_beta * context_sum


@dataclass(frozen=True, slots=True)
class ComputedTokenCost:
    """Linear cost over the tokens the engine computed: prefix-cache hits are not charged.

    A tenant whose requests share a cached system prompt should not pay for a prefill that never
    happened. When the cached count is unknown (0), this is the linear cost. ``cached_weight``:
    what a cached prompt token costs beside a computed one (0: nothing; the KV it holds and
    the lookup are not free, an operator may say they cost something).
    """

    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    cached_weight: float = 0.0

    def prompt_cost(self, prompt_tokens: int, cached_prompt_tokens: int = 0) -> float:
        cached = min(max(cached_prompt_tokens, 0), prompt_tokens)
        return self.prefill_weight * (prompt_tokens - cached + self.cached_weight * cached)

    def output_cost(self, prompt_tokens: int, generated_before: int, tokens: int) -> float:
        return self.decode_weight * tokens


def request_cost(cost: CostFunction, prompt: int, completion: int, cached: int = 0) -> float:
    """Total service of a whole request: what it settles to."""
    return cost.prompt_cost(prompt, cached) + cost.output_cost(prompt, 0, completion)
