"""The access-log response path in the pool simulator (``PoolSpec.output_seen_at_end``).

Does a picker that sees each request's output only once it has ended get no token while a
stream runs (so no first token ends its prefill), and still settle every request to what its
engine served?
"""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core.gate import Gate
from picker.sim.pool import PoolSpec, simulate
from picker.sim.traffic import load_traffic

PROMPT, OUTPUT, COUNT = 400, 20, 6


@pytest.mark.parametrize("seen_at_end", [False, True])
def test_streams_are_seen_token_by_token_or_only_at_their_end(
        seen_at_end: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    seen_while_running: list[int] = []
    charge_output = Gate.charge_output

    def spy(self: Gate, passage: Any, tokens: int, now: float | None = None) -> None:
        seen_while_running.append(tokens)
        charge_output(self, passage, tokens, now)

    monkeypatch.setattr(Gate, "charge_output", spy)
    traffic = load_traffic({"duration_s": 0.5, "seed": 3, "timeout_s": 60, "tenants": [
        {"name": "a", "bursts": [{"at_s": 0, "count": COUNT}],
         "prompt_tokens": [PROMPT, PROMPT], "output_tokens": [OUTPUT, OUTPUT],
         "api": "completions", "stream_fraction": 1.0, "include_usage": True}]})
    run = simulate(load(PickerConfig, {}), traffic,
                   PoolSpec(endpoints=1, output_seen_at_end=seen_at_end), drain_s=60)
    assert [r.outcome for r in run.records] == ["ok"] * COUNT
    assert all(r.first_token_s is not None for r in run.records)
    assert sum(seen_while_running) == (0 if seen_at_end else COUNT * OUTPUT)
    # Settled to what was served either way: the usage at the end carries it.
    assert [r.completion_tokens for r in run.records] == [OUTPUT] * COUNT
    (endpoint,) = run.gate.endpoints.values()
    assert endpoint.prefill_tokens == 0 and endpoint.inflight_requests == 0
