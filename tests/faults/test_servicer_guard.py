"""A bug in the picker meets one guard: the client gets a clear 500 with an OpenAI body, the
fault is logged once per kind and counted, and the picker keeps serving (no bare stream failure,
which a fail-closed gateway turns into an empty 500)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from picker.dispatch import Dispatcher
from tests.integration.test_extproc_contract import (
    TENANT_HEADER,
    chat_body,
    refusal,
    route,
    running_picker,
    send_request,
)


async def test_a_fault_is_a_counted_500_and_the_picker_keeps_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    admit = Dispatcher.admit

    async def faulty(self: Dispatcher, tenant: str, *args: Any, **kwargs: Any) -> Any:
        if tenant == "boom":
            raise KeyError("a bug")
        return await admit(self, tenant, *args, **kwargs)

    monkeypatch.setattr(Dispatcher, "admit", faulty)
    caplog.set_level(logging.ERROR, logger="picker.extproc.service")
    async with running_picker(tmp_path, tenants=[{"id": "boom"}, {"id": "a"}]) as picker:
        for _ in range(3):
            stream = picker.open()
            await send_request(stream, chat_body(), headers={TENANT_HEADER: "boom"})
            refused = refusal(await stream.reply())
            assert refused.status == 500
            assert refused.error["code"] == "internal_error"
            assert refused.error["type"] == "server_error"
            assert "KeyError" in refused.error["message"]
            assert await stream.ended()
        assert await picker.metric("fairway_faults_total", kind="KeyError") == 3
        assert await picker.metric("fairway_rejections_total", tenant="boom",
                                   reason="internal") == 3
        logged = [r for r in caplog.records if "fault while handling" in r.getMessage()]
        assert len(logged) == 1  # once per kind
        routed = await route(picker.open(), chat_body(), headers={TENANT_HEADER: "a"})
        assert routed.header in picker.endpoints
        assert await picker.metric("fairway_buffered_body_bytes") == 0
