"""The scraper's cadence against real HTTP servers: an endpoint whose figures decide its room
(its engine queues) is read every ``scrapeInterval``; one where the picker's own accounting decides
is read every ``slowScrapeInterval``; one whose reads fail is read at the fast cadence (its
failures count towards ejection, and a fresh read is what brings it back)."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.scrape import Scraper

QUIET = ('vllm:num_requests_waiting{model_name="m"} 0\n'
         'vllm:num_requests_running{model_name="m"} 0\n'
         'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n')
QUEUEING = QUIET.replace("waiting{model_name=\"m\"} 0", "waiting{model_name=\"m\"} 3")


async def test_each_endpoint_is_read_as_often_as_its_figures_decide() -> None:
    reads: Counter[str] = Counter()

    def page(name: str, text: str | None) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            reads[name] += 1
            if text is None:
                return web.Response(status=500)
            return web.Response(text=text)
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    runners, ports = [], {}
    for name, text in (("quiet", QUIET), ("queueing", QUEUEING), ("failing", None)):
        runner = web.AppRunner(page(name, text), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports[name] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = load_config({
        "endpoints": [{"address": f"127.0.0.1:{port}"} for port in ports.values()],
        "capacity": {"scrapeInterval": "50ms", "slowScrapeInterval": "600ms",
                     "metricsStaleAfter": "2s"},
        # Failed reads must not eject the failing endpoint during the test (it would not be read).
        "health": {"consecutiveFailures": 100}})
    stop = asyncio.Event()
    task = asyncio.create_task(Scraper(Dispatcher(config)).run(stop))
    try:
        await asyncio.sleep(1.5)
    finally:
        stop.set()
        await task
        for runner in runners:
            await runner.cleanup()
    # 1.5 s: the slow cadence reads 3 times (at 0, 0.6 and 1.2 s), the fast one up to 30.
    assert 2 <= reads["quiet"] <= 4, reads
    assert reads["queueing"] >= 10, reads
    assert reads["failing"] >= 10, reads
