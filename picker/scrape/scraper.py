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
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker.core.health import EJECTED
from picker.core.selection import EndpointState, figures_decide
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
    prefix_caching: bool | None = None
    """The ``enable_prefix_caching`` label of ``vllm:cache_config_info`` (None: absent)."""


_WANTED_FAMILIES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                    "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                    "vllm:cache_config_info")
"""The families the gate reads. A real vLLM page has hundreds of lines (histograms per model)
and the gate reads four figures: only their sample lines go to the parser."""


def wanted_lines(text: str) -> list[str]:
    """The sample lines of ``_WANTED_FAMILIES`` in ``text``, found by substring search (a regex
    over the whole page cost more than the rest of the scrape), in page order per family."""
    page = "\n" + text  # every sample line starts after a newline; comments start with '#'
    lines = []
    for name in _WANTED_FAMILIES:
        marker = "\n" + name
        at = page.find(marker)
        while at >= 0:
            end = page.find("\n", at + 1)
            line = page[at + 1:] if end < 0 else page[at + 1:end]
            if line[len(name):len(name) + 1] in (" ", "{"):  # not a longer name's prefix
                lines.append(line)
            at = -1 if end < 0 else page.find(marker, end)
    return lines


_CACHE_CONFIGS: dict[str, tuple[int | None, bool | None]] = {}
"""``vllm:cache_config_info`` sample line → the KV budget it gives and whether it says the
engine caches prefixes. The line is the same on every scrape of an engine and its many labels
are most of the parser's work, so each distinct line is parsed once (bounded: a page whose line
keeps changing does not grow this)."""
_CACHE_CONFIGS_KEPT = 256
_FLAGS = {"true": True, "1": True, "false": False, "0": False}
"""A label's boolean as Python's ``str(bool)`` writes it (vLLM's labels), or as 1 and 0."""


def _cache_config(line: str) -> tuple[int | None, bool | None]:
    if line in _CACHE_CONFIGS:
        return _CACHE_CONFIGS[line]
    budget = caching = None
    for family in text_string_to_metric_families(line + "\n"):
        for sample in family.samples:
            flag = _FLAGS.get(sample.labels.get("enable_prefix_caching", "").strip().lower())
            caching = caching if flag is None else flag
            try:
                blocks = int(sample.labels.get("num_gpu_blocks", ""))
                block_size = int(sample.labels.get("block_size", ""))
            except ValueError:
                continue
            budget = blocks * block_size
    if len(_CACHE_CONFIGS) >= _CACHE_CONFIGS_KEPT:
        _CACHE_CONFIGS.clear()
    _CACHE_CONFIGS[line] = (budget, caching)
    return budget, caching


def parse_vllm_metrics(text: str) -> EndpointFigures:
    """The capacity-relevant figures from a vLLM ``/metrics`` page."""
    waiting = running = kv_usage = None
    budget = caching = None
    lines = wanted_lines(text)
    for line in lines:
        if line.startswith("vllm:cache_config_info"):
            found, says = _cache_config(line)
            budget = found or budget
            caching = caching if says is None else says
    wanted = "\n".join(line for line in lines if not line.startswith("vllm:cache_config_info"))
    for family in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        name = family.name
        for sample in family.samples:
            if sample.name != name:
                continue
            if name == "vllm:num_requests_waiting":
                waiting = (waiting or 0.0) + sample.value
            elif name == "vllm:num_requests_running":
                running = (running or 0.0) + sample.value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv_usage = max(kv_usage or 0.0, sample.value)
    return EndpointFigures(waiting, running, kv_usage, budget, caching)


class Scraper:
    """Reads every endpoint's figures: at ``capacity.scrapeInterval`` while they decide its room
    (``figures_decide``) or its reads fail, else at ``capacity.slowScrapeInterval``."""

    def __init__(self, dispatcher: Dispatcher,
                 session: aiohttp.ClientSession | None = None) -> None:
        self.dispatcher = dispatcher
        self._session = session
        self._no_metrics_until: dict[str, float] = {}
        self._next_at: dict[str, float] = {}
        """When each endpoint is next read (absent: at once)."""

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
        """Read the endpoints that are due."""
        now = self.dispatcher.clock()
        endpoints = [e for e in self.dispatcher.endpoints.values()
                     if self._no_metrics_until.get(e.address, 0.0) <= now
                     and e.health.state(now) != EJECTED
                     and self._next_at.get(e.address, 0.0) <= now]
        if endpoints:
            await asyncio.gather(*(self._scrape(session, e.address, timeout) for e in endpoints))
            self._schedule(endpoints)
        # Every tick, read or not: time alone can give room (an ejection ending, figures going
        # stale, an idle tenant's reserve lapsing), and nothing else would dispatch then.
        self.dispatcher.pump()

    def _schedule(self, scraped: list[EndpointState]) -> None:
        capacity = self.dispatcher.config.capacity
        rules = self.dispatcher.rules
        now = self.dispatcher.clock()
        for endpoint in scraped:
            self._next_at[endpoint.address] = now + (
                capacity.scrape_interval if figures_decide(endpoint, now, rules)
                else capacity.slow_scrape_cadence)
        if len(self._next_at) > 2 * len(self.dispatcher.endpoints):
            known = self.dispatcher.endpoints
            self._next_at = {a: t for a, t in self._next_at.items() if a in known}

    async def _scrape(self, session: aiohttp.ClientSession, address: str, timeout: float) -> None:
        sent_at = self.dispatcher.clock()
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
                # The text format is UTF-8 (no charset sniffing, which ``text()`` may do).
                text = (await response.read()).decode("utf-8", "replace")
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
        self.dispatcher.gate.scraped(endpoint, figures.waiting, figures.running,
                                     figures.kv_usage, figures.kv_budget_tokens,
                                     sent_at=sent_at, now=self.dispatcher.clock(),
                                     prefix_caching=figures.prefix_caching)
