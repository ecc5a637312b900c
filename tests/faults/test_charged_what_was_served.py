"""What a tenant is charged, and what the picker writes, when requests are refused, spelled
oddly or configured badly, through real Envoy (issue 26, point 6):

* a flood of 401, 404 and 405 refusals writes no metering record and a bounded number of log
  lines (each one was a metering row and an INFO line: ~28 GB of metering a day at ~650/s);
* a request the engine refuses (a 400 for the context length) is charged nothing, not its
  prompt estimate;
* ``/v1/chat/completions/`` and ``/V1/chat/completions`` are served (the engine is sent the
  path the picker judged), not answered 404 by the engine and charged;
* a weight of 1e-307 written into the config while serving is refused, and every counter stays
  finite (it passed validation and turned its lane's counters to infinity for good).
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from picker.dispatch.log_budget import LINES_PER_INTERVAL
from picker.identity import hash_api_key
from picker.stack.launcher import Stack
from tests.e2e.conftest import (
    TENANT_HEADER,
    chat_body,
    metric,
    metric_samples,
    settled_metric,
    wait_until,
)
from tests.faults.helpers import usage_records

CONTEXT = 64
"""The engine's context (``--max-model-len``): a prompt plus ``max_tokens`` past it is a 400."""
USAGE = "usage.jsonl"
KEYS = {"ctx": "sk-ctx", "paths": "sk-paths", "flood": "sk-flood", "light": "sk-light",
        "heavy": "sk-heavy"}


def _config(workdir: Path, **weights: float) -> dict[str, Any]:
    return {"tenancy": {"mode": "apiKey", "apiKeys": [
                {"sha256": hash_api_key(key), "tenant": tenant} for tenant, key in KEYS.items()]},
            "tenants": [{"id": tenant, "weight": weights.get(tenant, 1.0)} for tenant in KEYS],
            "metering": {"output": str(workdir / USAGE)}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("charged")
    with Stack(workdir, endpoints=1, picker_config=_config(workdir),
               server_args=["--step-ms", "1", "--max-model-len", str(CONTEXT)]) as running:
        yield running


def _send(stack: Stack, path: str, body: bytes | None, tenant: str | None = None,
          method: str = "POST") -> tuple[int, dict[str, Any]]:
    headers = {"content-type": "application/json"}
    if tenant is not None:
        headers["authorization"] = f"Bearer {KEYS[tenant]}"
    request = urllib.request.Request(stack.gateway_url + path, data=body, headers=headers,
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"_raw": raw[:200].decode(errors="replace")}


def _charged(stack: Stack, tenant: str) -> float:
    return metric(stack.metrics_url, "fairway_weighted_service_total", tenant=tenant)


def test_a_flood_of_refusals_writes_no_metering_and_a_bounded_log(stack: Stack) -> None:
    log = stack.workdir / "picker.log"
    seen = len(log.read_text()) if log.exists() else 0
    each = 100
    refusals = [("/v1/chat/completions", "POST", None, 401),  # no API key
                ("/v2/nothing", "POST", "flood", 404),
                ("/v1/chat/completions", "GET", "flood", 405)]

    async def flood() -> list[int]:
        async with aiohttp.ClientSession() as session:
            async def one(path: str, method: str, tenant: str | None) -> int:
                headers = {"content-type": "application/json"}
                if tenant is not None:
                    headers["authorization"] = f"Bearer {KEYS[tenant]}"
                async with session.request(method, stack.gateway_url + path, headers=headers,
                                           data=chat_body(max_tokens=2)
                                           if method == "POST" else None) as response:
                    await response.read()
                    return response.status
            statuses: list[int] = []
            for _ in range(each):
                statuses += await asyncio.gather(*(one(p, m, t) for p, m, _, t in
                                                   [(p, m, s, t) for p, m, t, s in refusals]))
            return statuses

    statuses = asyncio.run(flood())
    for _, _, _, status in refusals:
        assert statuses.count(status) == each, sorted(set(statuses))
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_rejections_total")
                      >= 3 * each, 15)
    for reason in ("unauthorized", "not_found", "method_not_allowed"):
        assert metric(stack.metrics_url, "fairway_rejections_total", reason=reason) >= each
    # Not one metering record for the refusals, whoever they were charged to.
    usage = stack.workdir / USAGE
    records = [json.loads(line) for line in usage.read_text().splitlines()] \
        if usage.exists() else []
    refused = [r for r in records if r["outcome"] in ("unauthorized", "not_found",
                                                       "method_not_allowed")
               or r["finish_reason"] == "rejected" or r["tenant_id"] == "flood"]
    assert refused == [], refused[:3]
    refused_lines = [line for line in log.read_text()[seen:].splitlines() if "refused " in line]
    assert len(refused_lines) <= LINES_PER_INTERVAL, refused_lines[:3]


def test_a_request_the_engine_refuses_for_its_context_is_charged_nothing(stack: Stack) -> None:
    # ~80 prompt tokens + 200 > 64: the engine's 400, its prompt estimate never computed.
    body = chat_body(80, max_tokens=200)
    status, answer = _send(stack, "/v1/chat/completions", body, "ctx")
    assert status == 400, answer
    assert "maximum context length" in answer["error"]["message"], answer
    assert settled_metric(stack.metrics_url, "fairway_requests_total", 1, tenant="ctx",
                          outcome="error") == 1
    assert _charged(stack, "ctx") == 0
    assert metric(stack.metrics_url, "fairway_service_tokens_total", tenant="ctx") == 0
    (record,) = usage_records(stack.workdir / USAGE, "ctx")
    assert (record["prompt_tokens"], record["completion_tokens"], record["cost"]) == (0, 0, 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/V1/chat/completions",
                                  "/v1//chat/completions?x=1"])
def test_a_path_spelled_otherwise_is_served_as_judged(stack: Stack, path: str) -> None:
    before = metric(stack.metrics_url, "fairway_requests_total", tenant="paths", outcome="ok")
    status, answer = _send(stack, path, chat_body(max_tokens=3), "paths")
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 3
    assert settled_metric(stack.metrics_url, "fairway_requests_total", before + 1,
                          tenant="paths", outcome="ok") == before + 1
    assert metric(stack.metrics_url, "fairway_requests_total", tenant="paths",
                  outcome="error") == 0


def test_a_tiny_weight_written_while_serving_is_refused_and_counters_stay_finite(
        stack: Stack) -> None:
    def reloads(result: str) -> float:
        return metric(stack.metrics_url, "fairway_config_reloads_total", result=result)

    failures = reloads("failure")
    stack.write_picker_config(_config(stack.workdir, heavy=1e-307))
    assert wait_until(lambda: reloads("failure") == failures + 1, 15)
    for tenant in ("heavy", "light", "heavy"):
        status, answer = _send(stack, "/v1/chat/completions", chat_body(max_tokens=2), tenant)
        assert status == 200, answer
    assert settled_metric(stack.metrics_url, "fairway_requests_total", 2, tenant="heavy",
                          outcome="ok") == 2
    counters = {dict(labels)["tenant"]: value for (name, labels), value
                in metric_samples(stack.metrics_url).items()
                if name == "fairway_virtual_service"}
    assert counters and all(math.isfinite(v) for v in counters.values()), counters
    assert metric(stack.metrics_url, "fairway_vtc_faults_total") == 0
    assert metric(stack.metrics_url, "fairway_tenant_weight", tenant="heavy") == 1.0


def test_a_messages_stream_left_early_on_the_access_log_path_is_charged_what_it_delivered(
        tmp_path: Path) -> None:
    """A /v1/messages stream reports its output count only at its end: left early, on the
    access-log path, it was charged the output estimate or its whole max_tokens."""
    config = {"tenants": [{"id": "reader"}], "metering": {"output": str(tmp_path / USAGE)}}
    body = json.dumps({"model": "sim-model", "max_tokens": 2000, "stream": True,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": "tell me a long story"}]})

    async def read_and_leave(stack: Stack) -> tuple[int, int]:
        """Read until 20 text deltas came, then drop the connection: (deltas, bytes read)."""
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                stack.gateway_url + "/v1/messages", data=body,
                headers={TENANT_HEADER: "reader", "content-type": "application/json"})
            assert response.status == 200
            data = b""
            while data.count(b"event: content_block_delta") < 20:
                data += await response.content.readany()
            response.close()  # the client leaves mid-stream
            return data.count(b"event: content_block_delta"), len(data)

    with Stack(tmp_path / "stack", endpoints=1, picker_config=config, response_path="access-log",
               server_args=["--step-ms", "20"]) as stack:
        deltas, read = asyncio.run(read_and_leave(stack))
        assert wait_until(lambda: usage_records(tmp_path / USAGE, "reader"), 20)
        (record,) = usage_records(tmp_path / USAGE, "reader")
        assert record["outcome"] == "cancelled", record
        # What the bytes sent can have carried: at least what was read, far from 2000 (or the
        # output estimate), whatever else was in flight when the client left.
        assert deltas <= record["completion_tokens"] <= 4 * deltas + 20, (record, read)
