"""The load generator's sessions and programs against the simulated vLLM server on 127.0.0.1:
each turn resends the conversation with the server's own reply in it, so the server's prefix
cache finds more of each turn's prompt (``usage.prompt_tokens_details.cached_tokens`` grows)."""

from __future__ import annotations

import itertools
from collections import defaultdict

from picker.sim.load import RequestRecord, run_traffic
from picker.sim.server import SimServer, SimServerConfig
from picker.sim.traffic import load_traffic

BLOCK = 16


async def test_each_turn_finds_the_conversation_so_far_cached() -> None:
    shape = {"backlog": 1, "system_prompt_tokens": 100, "prompt_tokens": [20, 30],
             "output_tokens": [20, 30], "include_usage": True}
    traffic = load_traffic({"duration_s": 3, "seed": 3, "timeout_s": 10, "tenants": [
        {"name": "chat-sse", **shape, "stream_fraction": 1.0,
         "chat": {"turns": [4, 4], "think_s": [0.02, 0.05]}},
        {"name": "chat-json", **shape, "chat": {"turns": [4, 4], "think_s": [0.02, 0.05]}},
        {"name": "agent", **shape, "stream_fraction": 1.0,
         "agent": {"calls": 5, "tool_result_tokens": [10, 20], "tool_latency_s": [0.02, 0.05]}},
    ]})
    server = SimServer(SimServerConfig(step_ms=2.0))
    await server.start()
    try:
        result = await run_traffic(traffic, server.url, duration_s=3)
    finally:
        await server.stop()
    units: dict[tuple[str, int], list[RequestRecord]] = defaultdict(list)
    for record in result.records:
        units[(record.tenant, record.seq)].append(record)
    whole = {key: calls for key, calls in units.items() if len(calls) == calls[0].calls}
    assert {tenant for tenant, _ in whole} == {"chat-sse", "chat-json", "agent"}
    for (tenant, _), calls in whole.items():
        assert [r.call for r in calls] == list(range(len(calls)))
        assert all(r.ok and r.usage_source == "usage" for r in calls), calls
        assert {r.session for r in calls} == {calls[0].session}
        for earlier, later in itertools.pairwise(calls):
            sent_before = earlier.prompt_tokens + earlier.completion_tokens
            assert later.prompt_tokens > sent_before
            assert later.cached_tokens is not None and earlier.cached_tokens is not None
            # The previous prompt and reply in whole blocks (the reply's last token has no KV).
            assert later.cached_tokens >= (sent_before - 1) // BLOCK * BLOCK, (tenant, calls)
            assert later.cached_tokens > earlier.cached_tokens
    summary = result.summary["tenants"]
    assert all(summary[t]["units"]["completed"] >= 1 for t in ("chat-sse", "chat-json", "agent"))
    assert all(summary[t]["cached_tokens"] > 0 for t in summary)
