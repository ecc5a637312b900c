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
    loop = asyncio.get_running_loop()
    started = loop.time()
    task = asyncio.create_task(Scraper(Dispatcher(config)).run(stop))
    try:
        # Ten reads at the fast cadence (50 ms), however long the machine takes for them.
        while reads["queueing"] < 10 or reads["failing"] < 10:
            assert loop.time() - started < 15, reads
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
        elapsed = loop.time() - started
        for runner in runners:
            await runner.cleanup()
    # The slow cadence: a read at the start, then each 600 ms after the last (at the fast
    # cadence it would have been read about as often as the others).
    assert 1 <= reads["quiet"] <= elapsed / 0.6 + 1.5, (reads, elapsed)
