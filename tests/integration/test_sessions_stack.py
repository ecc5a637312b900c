"""Programs and sessions through the real stack (issue 28 point 5): Envoy in front of the picker
(``routing.sessions``) and two simulated vLLM servers. A session's calls land on the endpoint of
its first call even while that endpoint is the busier one; a second tenant sending the same
session id is routed by load (it neither rides nor moves the first tenant's session), as is a
new session of the first tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body
from tests.faults.helpers import CHAT, usage_records

pytestmark = pytest.mark.integration

USAGE = "usage.jsonl"
SESSION = "x-session-id"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("sessions")
    config = {"routing": {"sessions": {}}, "tenants": [{"id": "a"}, {"id": "b"}],
              "metering": {"output": str(workdir / USAGE)}}
    with Stack(workdir, endpoints=2, picker_config=config,
               server_args=["--step-ms", "5"]) as running:
        yield running


async def _call(session: aiohttp.ClientSession, stack: Stack, tenant: str, key: str,
                tokens: int) -> None:
    """One call of ``tenant``'s session ``key``; its output length (``tokens``) names it in
    the metering records."""
    async with session.post(stack.gateway_url + CHAT, data=chat_body(40, max_tokens=tokens),
                            headers={TENANT_HEADER: tenant, SESSION: key,
                                     "content-type": "application/json"}) as response:
        assert response.status == 200, await response.text()
        await response.read()


def _endpoint(stack: Stack, tenant: str, tokens: int) -> str:
    """Where the call of ``tenant`` that produced ``tokens`` tokens was served."""
    records = [r for r in usage_records(stack.workdir / USAGE, tenant)
               if r["completion_tokens"] == tokens]
    assert len(records) == 1, records
    return str(records[0]["endpoint"])


async def _eventually_recorded(stack: Stack, tenant: str, count: int) -> None:
    for _ in range(200):
        if len(usage_records(stack.workdir / USAGE, tenant)) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{tenant}: fewer than {count} metering records")


async def test_a_sessions_calls_stay_on_its_endpoint_and_another_tenant_does_not_share_it(
        stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        await _call(http, stack, "a", "task-1", 4)
        await _eventually_recorded(stack, "a", 1)
        home = _endpoint(stack, "a", 4)
        other = next(e for e in stack.endpoint_addresses if e != home)
        # A long call of the same session keeps its endpoint busy (about 2 s of output),
        # so that load alone would send anything new to the other endpoint.
        long_body = chat_body(40, max_tokens=400, stream=True)
        async with http.post(stack.gateway_url + CHAT, data=long_body, headers={
                TENANT_HEADER: "a", SESSION: "task-1",
                "content-type": "application/json"}) as stream:
            assert stream.status == 200
            await stream.content.readany()  # its first bytes: it runs
            await _call(http, stack, "a", "task-1", 5)  # the session's next call
            await _call(http, stack, "b", "task-1", 6)  # b's own session of the same id
            await _call(http, stack, "a", "task-2", 7)  # a new session of a
            await _call(http, stack, "a", "task-1", 8)  # the session again
            await stream.read()
        await _eventually_recorded(stack, "a", 5)
        await _eventually_recorded(stack, "b", 1)
    assert _endpoint(stack, "a", 400) == home
    assert _endpoint(stack, "a", 5) == home and _endpoint(stack, "a", 8) == home
    assert _endpoint(stack, "b", 6) == other
    assert _endpoint(stack, "a", 7) == other
