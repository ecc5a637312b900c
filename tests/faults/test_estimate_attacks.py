"""Budgets hold against request shapes the prompt estimate used to miss, through real Envoy and
the simulated vLLM server (issue 26 point 2).

The attacks: on a 10,000-token budget, 10 concurrent chat requests with 4 base64 images each
were served 54,081 tokens (5.4x), because image parts counted 0 in the prompt estimate; and 10
concurrent 4,000-character CJK prompts were served 20,045 tokens (2x), because chars/4 counted a
CJK character as a quarter of a token. The simulated server counts as an engine does (an image
part ``--image-tokens``, a CJK character one token: ``picker.sim.tokenizer``), the picker
estimates each image from its PNG header (Qwen2-VL's rule, no ``models`` entry: the defaults)
and CJK at two tokens a character, so each request reserves at least what the engine will count
and a tenant is served no more than its budget plus one request's worst case.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from PIL import Image

from picker.openai import parse_request
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, metric, wait_until
from tests.faults.helpers import CHAT, usage_records

USAGE = "usage.jsonl"
BUDGET = 10_000
PER_S = 3600.0
"""The budget refills over an hour: a few tokens a second, counted in the bound all the same."""
IMAGE_TOKENS = 1500
"""What the engine counts per image: four make about the 6,000 tokens a request of the attack
cost (54,081 over 9 requests)."""
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("estimates")
    budget = {"burst": {"tokens": BUDGET, "per": f"{PER_S:g}s"}}
    config = {"tenants": [{"id": t, "budgets": budget} for t in ("images", "cjk", "teacher")],
              "metering": {"output": str(workdir / USAGE)}}
    with Stack(workdir, endpoints=1, picker_config=config,
               server_args=["--step-ms", "1", "--kv-budget-tokens", "262144",
                            "--image-tokens", str(IMAGE_TOKENS)]) as running:
        yield running


def _png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (30, 120, 200)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _body(content: Any) -> bytes:
    return json.dumps({"model": "sim-model", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "messages": [{"role": "user", "content": content}]}).encode()


async def _post(session: aiohttp.ClientSession, stack: Stack, tenant: str, body: bytes
                ) -> tuple[int, dict[str, Any]]:
    async with session.post(stack.gateway_url + CHAT, data=body, headers={
            TENANT_HEADER: tenant, "content-type": "application/json"}) as response:
        raw = await response.read()
        return response.status, json.loads(raw) if raw.startswith(b"{") else {}


async def _at_once(stack: Stack, tenant: str, body: bytes, count: int
                   ) -> list[tuple[int, dict[str, Any]]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(_post(session, stack, tenant, body)
                                      for _ in range(count)))


def _attack(stack: Stack, tenant: str, body: bytes, budget: float = BUDGET) -> tuple[int, int]:
    """Ten of ``body`` at once from ``tenant`` (whose level is ``budget``): returns (requests
    served, tokens served), after checking the bound and that the level left owes all of it."""
    path = stack.workdir / USAGE
    before = len(usage_records(path, tenant))
    started = time.monotonic()
    answers = asyncio.run(_at_once(stack, tenant, body, 10))
    ok = [answer for status, answer in answers if status == 200]
    assert {status for status, _ in answers} <= {200, 429}, [s for s, _ in answers]
    assert wait_until(lambda: len(usage_records(path, tenant)) >= before + len(ok), 15.0)
    records = usage_records(path, tenant)[before:]
    # The records are the engine's own counts, as the answers reported them.
    assert sorted(r["prompt_tokens"] for r in records) == \
        sorted(a["usage"]["prompt_tokens"] for a in ok)
    served = sum(r["prompt_tokens"] + r["completion_tokens"] for r in records)
    refill = BUDGET / PER_S * (time.monotonic() - started)
    worst_case = parse_request(body).prompt_tokens + MAX_TOKENS  # one request's, as reserved
    assert served <= budget + refill + worst_case, (served, len(ok), worst_case)
    left = metric(stack.metrics_url, "fairway_budget_remaining_tokens", tenant=tenant,
                  window="burst")
    assert budget - served - 1 <= left <= budget - served + refill + 1, (left, served)
    return len(ok), served


def test_ten_requests_of_four_base64_images_get_no_more_than_the_budget(stack: Stack) -> None:
    image = _png(1120, 1120)  # 40 x 40 patches of 28 pixels: estimated 1,600, the engine 1,500
    body = _body([{"type": "text", "text": "What differs between these four pictures?"},
                  *[{"type": "image_url", "image_url": {"url": image}}] * 4])
    estimate = parse_request(body).prompt_tokens
    assert estimate >= 4 * 1600  # before: about 20 (the text alone)
    served_requests, served = _attack(stack, "images", body)
    # Each reserves its 6,400-token estimate: one fits in 10,000 (before: 9, 54,081 tokens).
    assert served_requests == 1
    assert 4 * IMAGE_TOKENS <= served < BUDGET


def test_ten_cjk_prompts_of_4000_characters_get_no_more_than_the_budget(stack: Stack) -> None:
    text = ("公平调度让每个租户按照权重获得服务。" * 250)[:4000]
    body = _body(text)
    assert parse_request(body).prompt_tokens >= 8000  # before: 1,004
    served_requests, served = _attack(stack, "cjk", body)
    # The engine counts 4,000 and more: one request at a time (before: 20,045 tokens served).
    assert served_requests == 1
    assert 4000 <= served < BUDGET


def test_a_calibration_taught_down_does_not_carry_images_past_the_budget(stack: Stack) -> None:
    """The engine counts 3 digits a token where the estimate counts one each: a tenant's one
    digit prompt teaches its calibration the floor (0.5), then ten one-image requests would
    each reserve half their cost. Budgets are judged on at least the body's own estimate, so
    calibration can raise what a request reserves, never lower it."""
    teach = _body("1234567890" * 300)
    (status, answer), = asyncio.run(_at_once(stack, "teacher", teach, 1))
    assert status == 200 and answer["usage"]["prompt_tokens"] * 2 < parse_request(teach) \
        .prompt_tokens  # the engine counted under half the estimate
    image = _png(1120, 1120)
    body = _body([{"type": "text", "text": "Describe it."},
                  {"type": "image_url", "image_url": {"url": image}}])
    started_level = metric(stack.metrics_url, "fairway_budget_remaining_tokens",
                           tenant="teacher", window="burst")
    served_requests, served = _attack(stack, "teacher", body, budget=started_level)
    # 1,640 reserved each of ~8,900: 5 (taught down: 820 each, all 10, 15,000 tokens served).
    assert served_requests <= 5, (served_requests, served)
