"""Scraping each endpoint's vLLM metrics into the dispatcher's endpoint states.

Parsed with prometheus_client's text parser. Figures older than ``metricsStaleAfter`` are ignored by
the capacity check, which then relies on the picker's own in-flight accounting; an endpoint that
exports no metrics (404) is polled rarely and runs on that accounting alone.

Each scrape is also a health check: a refused connection, a timeout or an HTTP error counts as a
failure of the endpoint, any answer as a success (``Dispatcher.endpoint_failed``/``endpoint_ok``,
outlier ejection in ``picker.core.health``). An ejected endpoint is not scraped until its
ejection time is up; the next scrape is then its probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker.core.health import EJECTED
from picker.core.selection import observe
from picker.dispatch import Dispatcher

log = logging.getLogger(__name__)

NO_METRICS_RETRY_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class EndpointFigures:
    """What one scrape said (summed over the models an endpoint serves)."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    kv_budget_tokens: int | None = None


_WANTED_LINES = re.compile(
    r"^(?:# (?:HELP|TYPE) )?(?:vllm:num_requests_waiting|vllm:num_requests_running"
    r"|vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc|vllm:cache_config_info)[ {].*$",
    re.MULTILINE)
"""The lines of the families the gate reads. A real vLLM page has hundreds of lines (histograms
per model) and the gate reads four figures: only these lines go to the parser."""


def parse_vllm_metrics(text: str) -> EndpointFigures:
    """The capacity-relevant figures from a vLLM ``/metrics`` page."""
    waiting = running = kv_usage = None
    budget = None
    wanted = "\n".join(_WANTED_LINES.findall(text))
    for family in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        name = family.name
        for sample in family.samples:
            if sample.name != name and name != "vllm:cache_config_info":
                continue
            if name == "vllm:num_requests_waiting":
                waiting = (waiting or 0.0) + sample.value
            elif name == "vllm:num_requests_running":
                running = (running or 0.0) + sample.value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv_usage = max(kv_usage or 0.0, sample.value)
            elif name == "vllm:cache_config_info":
                try:
                    blocks = int(sample.labels.get("num_gpu_blocks", ""))
                    block_size = int(sample.labels.get("block_size", ""))
                except ValueError:
                    continue
                budget = blocks * block_size
    return EndpointFigures(waiting, running, kv_usage, budget)


class Scraper:
    """Polls every endpoint of the dispatcher, every ``capacity.scrapeInterval``."""

    def __init__(self, dispatcher: Dispatcher,
                 session: aiohttp.ClientSession | None = None) -> None:
        self.dispatcher = dispatcher
        self._session = session
        self._no_metrics_until: dict[str, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        session = self._session or aiohttp.ClientSession()
        try:
            while not stop.is_set():
                interval = self.dispatcher.config.capacity.scrape_interval
                await self.scrape_all(session, timeout=max(interval * 4, 0.25))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
        finally:
            if self._session is None:
                await session.close()

    async def scrape_all(self, session: aiohttp.ClientSession, timeout: float) -> None:
        now = self.dispatcher.clock()
        endpoints = [e for e in self.dispatcher.endpoints.values()
                     if self._no_metrics_until.get(e.address, 0.0) <= now
                     and e.health.state(now) != EJECTED]
        await asyncio.gather(*(self._scrape(session, e.address, timeout) for e in endpoints))
        self.dispatcher.pump()

    async def _scrape(self, session: aiohttp.ClientSession, address: str, timeout: float) -> None:
        try:
            async with session.get(f"http://{address}/metrics",
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status == 404:
                    self.dispatcher.endpoint_ok(address)  # up, without metrics
                    self._no_metrics_until[address] = (self.dispatcher.clock()
                                                       + NO_METRICS_RETRY_SECONDS)
                    return
                if response.status != 200:
                    self.dispatcher.endpoint_failed(address, f"scrape: HTTP {response.status}")
                    return
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # The figures go stale (capacity falls back to own accounting) and the failure
            # counts towards ejecting the endpoint.
            self.dispatcher.endpoint_failed(address, f"scrape: {type(exc).__name__}")
            return
        self.dispatcher.endpoint_ok(address)
        try:
            figures = parse_vllm_metrics(text)
        except ValueError as exc:
            log.warning("unparseable metrics from %s: %s", address, exc)
            return
        endpoint = self.dispatcher.endpoints.get(address)
        if endpoint is None:
            return
        observe(endpoint, figures.waiting, figures.running, figures.kv_usage,
                figures.kv_budget_tokens, self.dispatcher.clock())
