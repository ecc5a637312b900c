"""A background task of the picker that fails (here the endpoint scraper, raising as a bug
would) stops the picker loudly, with the task named and its traceback logged, rather than
leaving it serving on a view that no longer changes: with a shared state store, a sync loop that
died silently would keep every later charge out of the store."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

import picker.server
from picker.scrape import Scraper
from picker.server import RunnerFailed, ServeSettings, serve


class _BrokenScraper(Scraper):
    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(0.2)
        raise KeyError("a bug in the scraper")


async def test_a_failed_background_task_stops_the_picker_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    monkeypatch.setattr(picker.server, "Scraper", _BrokenScraper)
    path = tmp_path / "picker.yaml"
    path.write_text(json.dumps({"endpoints": [{"address": "127.0.0.1:9"}]}))
    settings = ServeSettings(path, grpc_port=0, grpc_health_port=0, metrics_port=0,
                             admin_port=0, grace=0.5)
    ready: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
    with caplog.at_level(logging.CRITICAL, logger="picker.server"), \
            pytest.raises(RunnerFailed) as failed:
        await asyncio.wait_for(serve(settings, asyncio.Event(), ready), 20)
    assert ready.done()  # it was serving when the task failed
    assert isinstance(failed.value.__cause__, KeyError)
    assert any("_BrokenScraper ended: KeyError" in r.getMessage() and r.exc_info
               for r in caplog.records), caplog.text
