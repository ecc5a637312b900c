"""Charging what was computed (issue 28 point 3), through the picker in-process and the simulated
server's prefix cache: with ``cost.chargeCachedPrompt: false`` a repeated prompt, routed back to
the endpoint that holds it (``routing.prefixAffinity``), is charged its computed tokens only;
with the default (charge what was sent) it is charged the same both times. The test plays Envoy
(``tests/integration/test_extproc_contract``'s harness)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_extproc_contract import (
    CHAT,
    TENANT_HEADER,
    Picker,
    chat_body,
    fetch,
    relay_response,
    route,
    running_picker,
    split,
)

pytestmark = pytest.mark.integration

PROMPT = "Summarise the fair queueing paper for an operator who runs a GPU pool. " * 40


async def _send(picker: Picker, body: bytes, tenant: str, done: int,
                subset: list[str] | None = None) -> tuple[str, dict]:
    """One non-streaming request through the picker; returns where it went and its usage."""
    stream = picker.open()
    routed = await route(stream, body, headers={TENANT_HEADER: tenant}, subset=subset)
    upstream = await fetch(routed.header, CHAT, body)
    await relay_response(stream, 200, upstream.content_type, split(upstream.data, 2))
    await picker.eventually("fairway_requests_total", done, tenant=tenant, outcome="ok")
    return routed.header, json.loads(upstream.data)["usage"]


@pytest.mark.parametrize("charge_cached", [False, True], ids=["computed", "sent"])
async def test_a_repeated_prompt_is_charged_its_computed_tokens(tmp_path: Path,
                                                                charge_cached: bool) -> None:
    async with running_picker(tmp_path, endpoints=2, tenants=[{"id": "a"}],
                              routing={"prefixAffinity": {}},
                              cost={"chargeCachedPrompt": charge_cached}) as picker:
        body = chat_body(PROMPT, max_tokens=5)
        # The first goes to the second endpoint (the gateway's subset hint): with both idle,
        # load alone would send the repeat to the first.
        first_at, first = await _send(picker, body, "a", 1, subset=[picker.endpoints[1]])
        after_first = await picker.metric("fairway_weighted_service_total", tenant="a")
        second_at, second = await _send(picker, body, "a", 2)
        after_second = await picker.metric("fairway_weighted_service_total", tenant="a")

    # Affinity sent the repeat where the prompt is: the engine found it cached.
    assert first_at == picker.endpoints[1] and second_at == first_at
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"] > 200 and cached > 200
    assert after_first == first["prompt_tokens"] + 2 * first["completion_tokens"]
    charged = after_second - after_first
    if charge_cached:
        assert charged == after_first
    else:
        assert charged == second["prompt_tokens"] - cached + 2 * second["completion_tokens"]
        assert charged < after_first
