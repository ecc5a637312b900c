"""The picker's Prometheus page is served on a thread of its own while the event loop changes
the queue: a scrape must never see the state mid-change (it used to fail now and then with
"dictionary changed size during iteration", wsgiref's error page instead of metrics)."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from picker.config.schema import load_config
from picker.dispatch import Dispatcher, Ticket
from picker.openai import parse_request
from tests.e2e.conftest import chat_body


async def test_scrapes_from_another_thread_see_a_whole_snapshot() -> None:
    config = load_config({"endpoints": [{"address": "127.0.0.1:9"}],
                          "capacity": {"kvBudgetTokens": 10**9}})
    dispatcher = Dispatcher(config)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=dispatcher.metrics.registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    inference = parse_request(chat_body(max_tokens=1))
    stop = asyncio.Event()

    async def churn() -> None:
        # Hundreds of requests in flight, twenty coming and twenty going at a time.
        live: list[Ticket] = []
        n = 0
        while not stop.is_set():
            live += [await dispatcher.admit(f"t{(n * 20 + i) % 500}", inference)
                     for i in range(20)]
            if len(live) > 400:
                for ticket in live[:20]:
                    dispatcher.complete(ticket, None, "ok")
                del live[:20]
            n += 1
            await asyncio.sleep(0.002)  # a busy picker, not a loop that never breathes
        for ticket in live:
            dispatcher.complete(ticket, None, "ok")

    task = asyncio.create_task(churn())
    try:
        for _ in range(30):
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            families = {f.name for f in text_string_to_metric_families(text)}
            assert "fairway_queued_requests" in families
    finally:
        stop.set()
        await task
        server.shutdown()
        thread.join(timeout=2)
