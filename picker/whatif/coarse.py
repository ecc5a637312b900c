"""The replay's fast mode: engines that take ``k`` decode tokens a step, in steps ``k`` times as
long (``python -m picker.whatif --coarse K``).

It answers: *how can a day of traffic replay in minutes?* An exact replay steps every engine
every ``step_s`` and charges the gate one output token per running request per step, so its cost
grows with the output tokens served (about 10 µs each on one core: a day at 50 requests/s of
~110 output tokens is hours). Here a step lasts ``k × step_s`` and a running request emits up to
``k`` tokens in it (the step that ends its prefill too: a fine engine would prefill and then
decode for the rest of that time), its KV blocks growing by as many. Per step the scheduler is
vLLM's (``picker.sim.vllm``) unchanged: the same order, the same preemptions, a token budget
``k`` times the fine one. The gate is charged each request's ``k`` tokens at once at the step's
end, and a request's first token is stamped one fine step after the step's start (where a fine
engine's would be).

A request of n output tokens takes ceil(n / k) long steps, k × ceil(n / k) fine steps' time
where a fine engine takes n: its last step is partly idle. Over a log's outputs that is a pool
``step_scale`` slower than the exact one (7 % for k = 8 and outputs of 20-80 tokens), so the long
step is shortened by that factor (``step_scale``, from the log's output lengths): the pool serves
as many tokens a second as the exact replay's.

What it loses (measured in bench/results/whatif.md): arrivals, scrapes and dispatches happen on
long-step ticks, so a request can wait up to that much longer for its dispatch; the gate sees
output in chunks of ``k`` (its fairness counters move in larger steps); a request finishing
mid-step holds its blocks to the step's end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from picker.sim.vllm import SeqRequest, VllmConfig, VllmScheduler


def step_scale(outputs: Mapping[int, int], k: int) -> float:
    """The long step's share of ``k`` fine steps that keeps the pool's token rate: mean output
    over mean ``k × ceil(output / k)``, over ``outputs`` (requests by output length)."""
    fine = sum(n * count for n, count in outputs.items() if n > 0)
    coarse = sum(k * math.ceil(n / k) * count for n, count in outputs.items() if n > 0)
    return fine / coarse if coarse else 1.0


class CoarseScheduler(VllmScheduler):
    """``VllmScheduler`` whose steps each emit up to ``k`` tokens per request whose prompt is
    computed (the step's ``emitted``: how many, where more than one). Only ``_extra`` differs:
    vLLM's order, budget and preemptions are the engine's own."""

    def __init__(self, config: VllmConfig, k: int) -> None:
        super().__init__(config)
        if k < 1:
            raise ValueError("k must be at least 1")
        self.k = k

    def _extra(self, request: SeqRequest, tokens: int) -> int:
        """Tokens beyond the first that ``request`` emits this step, given it computes
        ``tokens``: none unless that completes its prompt (or its newest token)."""
        if request.output_tokens <= 0 or request.computed + tokens < request.num_tokens:
            return 0
        return max(0, min(self.k, request.output_tokens - request.generated) - 1)
