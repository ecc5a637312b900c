"""Three active-active pickers behind one Envoy, sharing state through a real ``redis-server``:
all Ready and all dispatching, tenants of weights 1:2:3 whose requests reach the replicas
unevenly still get their weighted shares, and the replicas together never hold more of an
endpoint than its KV budget: their leases never sum above 1, nor what they hold, and once the
estimates are learned no engine is given more requests than its KV budget holds, nor has to
preempt one.

Envoy spreads ext_proc streams over one picker cluster; to make arrival uneven on purpose, a
test-only header picks a route whose ext_proc filter is pointed at one replica (``ExtProcPerRoute``
``grpc_service``), as if tenants reached the pool through different gateways."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from picker.stack.envoy import envoy_config
from picker.stack.launcher import Stack
from picker.stack.redis import RedisServer
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, metric_samples

pytestmark = pytest.mark.e2e

REPLICAS = 3
BUDGET = 2048
"""Each endpoint's KV budget (tokens), the picker's and the simulated engine's alike."""
WEIGHTS = {"a": 1, "b": 2, "c": 3}
ARRIVAL = {"a": [0.8, 0.2, 0.0], "b": [0.0, 0.5, 0.5], "c": [0.1, 0.0, 0.9]}
"""Per tenant, the fraction of its requests that reaches each replica."""
REPLICA_HEADER = "x-fairway-test-replica"
CONCURRENCY = 40
"""Requests each tenant keeps open: every tenant stays backlogged."""


def _bootstrap(stack: Stack) -> dict[str, Any]:
    config = envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                          picker_port=[r["grpc"] for r in stack.replica_ports],
                          access_log=stack.access_log, response_path="inline",
                          identity="trusted-client")
    resources = config["static_resources"]
    (picker,) = [c for c in resources["clusters"] if c["name"] == "picker"]
    endpoints = picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for i, endpoint in enumerate(endpoints):
        single = copy.deepcopy(picker)
        single["name"] = single["load_assignment"]["cluster_name"] = f"picker-{i}"
        single["load_assignment"]["endpoints"] = [{"lb_endpoints": [endpoint]}]
        resources["clusters"].append(single)
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    host = manager["route_config"]["virtual_hosts"][0]
    (default,) = host["routes"]
    routed = []
    for i in range(len(endpoints)):
        route = copy.deepcopy(default)
        route["match"] = {"prefix": "/", "headers": [
            {"name": REPLICA_HEADER, "string_match": {"exact": str(i)}}]}
        route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/"
                     "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": f"picker-{i}"},
                                           "timeout": "300s"}}}}
        routed.append(route)
    host["routes"] = [*routed, default]
    return config


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    with RedisServer(tmp_path / "redis") as store, Stack(
            tmp_path / "stack", endpoints=2, picker_replicas=REPLICAS,
            response_path="inline", envoy_bootstrap=_bootstrap,
            server_args=["--kv-budget-tokens", str(BUDGET), "--step-ms", "4"],
            picker_config={
                "tenants": [{"id": t, "weight": w} for t, w in WEIGHTS.items()],
                "capacity": {"kvBudgetTokens": BUDGET, "scrapeInterval": "50ms"},
                "state": {"backend": "redis", "redis": {"url": store.url},
                          # Not a test of staleness: the default 2 s (Redis timeouts of 1 s), so a
                          # loaded machine's slow exchange does not lapse a replica's lease while it
                          # holds requests.
                          "syncInterval": "50ms", "maxStaleness": "2s"}}) as stack:
        yield stack, store


def _service(stack: Stack) -> dict[str, float]:
    return {tenant: sum(metric(f"http://127.0.0.1:{r['metrics']}/metrics",
                               "fairway_weighted_service_total", tenant=tenant)
                        for r in stack.replica_ports) for tenant in WEIGHTS}


async def _tenant(session: aiohttp.ClientSession, stack: Stack, tenant: str, until: float,
                  rng: random.Random, statuses: list[int], sizes: set[int]) -> None:
    """The tenant's clients until ``until``: every status, and every answer's tokens (prompt
    and output: what the request held on its engine at its largest)."""
    async def one_after_another() -> None:
        while time.monotonic() < until:
            replica = rng.choices(range(REPLICAS), ARRIVAL[tenant])[0]
            async with session.post(stack.gateway_url + "/v1/chat/completions",
                                    data=chat_body(words=60, max_tokens=40), headers={
                                        TENANT_HEADER: tenant, REPLICA_HEADER: str(replica),
                                        "content-type": "application/json"}) as response:
                answer = await response.json(content_type=None)
                statuses.append(response.status)
            if response.status == 200:
                sizes.add(answer["usage"]["total_tokens"])
    await asyncio.gather(*(one_after_another() for _ in range(CONCURRENCY)))


def watch_leases(store: RedisServer, stop: threading.Event,
                  sums: list[tuple[float, float, float]]) -> None:
    """Until ``stop``: when, and the replicas' leases as the store holds them (one atomic read)
    summed: what they were granted, and what each holds or may hold (its grant, or more when it
    holds more: a lease shrinks no lower than what is in use)."""
    client = redis.Redis(port=store.port, decode_responses=True)
    try:
        while not stop.is_set():
            leases = [value.split() for value in client.hgetall("{fairway}:leases").values()]
            sums.append((time.monotonic(), sum(float(lease[1]) for lease in leases),
                         sum(float(lease[0]) for lease in leases)))
            time.sleep(0.02)
    finally:
        client.close()


class EngineLoad:
    """What each simulated engine holds, sampled in a thread while in the ``with`` block: its
    running plus waiting requests, both from one ``/metrics`` page (that engine at one instant;
    the pickers' own counts could be read only one picker after another, while room passes
    between them)."""

    def __init__(self, stack: Stack) -> None:
        self.urls = [f"http://{address}/metrics" for address in stack.endpoint_addresses]
        self.samples: list[tuple[float, float]] = []
        """(when, requests on one engine)."""
        self.since, self._preempted = 0.0, 0.0
        """Set by ``mark``."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def __enter__(self) -> EngineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for url in self.urls:
                page = metric_samples(url)
                held = sum(value for (name, _), value in page.items()
                           if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
                self.samples.append((time.monotonic(), held))
            time.sleep(0.01)

    def mark(self) -> None:
        """Measure from now on (``most(since_mark=True)``, ``preempted``)."""
        self.since, self._preempted = time.monotonic(), self._preemptions()

    def most(self, since_mark: bool = True) -> float:
        """The most requests one engine held at once (since the mark, or ever)."""
        since = self.since if since_mark else 0.0
        return max(held for when, held in self.samples if when >= since)

    def preempted(self, since_mark: bool = True) -> float:
        """Requests the engines preempted (their KV ran out; since the mark, or ever)."""
        return self._preemptions() - (self._preempted if since_mark else 0.0)

    def _preemptions(self) -> float:
        return sum(metric(url, "vllm:num_preemptions_total") for url in self.urls)


def test_three_replicas_keep_weighted_shares_and_never_over_commit(
        replicas: tuple[Stack, RedisServer]) -> None:
    stack, store = replicas
    stop, sums = threading.Event(), []
    watcher = threading.Thread(target=watch_leases, args=(store, stop, sums))
    watcher.start()
    statuses: list[int] = []
    sizes: set[int] = set()
    marks: dict[str, dict[str, float]] = {}

    async def run(engines: EngineLoad) -> None:
        start = time.monotonic()
        rng = random.Random(11)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                         connector=aiohttp.TCPConnector(limit=200)) as session:
            load = asyncio.gather(*(_tenant(session, stack, tenant, start + 24, rng, statuses,
                                            sizes) for tenant in WEIGHTS))
            await asyncio.sleep(6)  # warm-up: leases, counters and estimates settle
            marks["from"] = await asyncio.to_thread(_service, stack)
            await asyncio.to_thread(engines.mark)
            await asyncio.sleep(15)
            marks["to"] = await asyncio.to_thread(_service, stack)
            await load

    try:
        with EngineLoad(stack) as engines:
            asyncio.run(run(engines))
    finally:
        stop.set()
        watcher.join()
    assert set(statuses) == {200}, sorted(set(statuses))
    _assert_no_over_commit(engines, sizes, sums)
    served = {t: marks["to"][t] - marks["from"][t] for t in WEIGHTS}
    total = sum(served.values())
    shares = {t: served[t] / total for t in WEIGHTS}
    print("shares", {t: round(share, 4) for t, share in shares.items()})
    # Shares of 1/6, 2/6 and 3/6; without fairness the equally many clients would get a third
    # each, 1/6 away from the lightest's and the heaviest's: the bound is a quarter of the way
    # to that (a loaded machine's 15 s of real traffic came within 1/100 of the weights).
    for tenant, weight in WEIGHTS.items():
        fair = weight / sum(WEIGHTS.values())
        assert shares[tenant] == pytest.approx(fair, abs=1 / 24), (shares, served)
    # Every replica dispatched, and together they never held more than the pool.
    for ports in stack.replica_ports:
        url = f"http://127.0.0.1:{ports['metrics']}/metrics"
        assert metric(url, "fairway_requests_total", outcome="ok") > 0
        assert metric(url, "fairway_ready") == 1


def _assert_no_over_commit(engines: EngineLoad, sizes: set[int],
                           sums: list[tuple[float, float, float]]) -> None:
    """No endpoint was given more than its KV budget by the replicas together."""
    # Every request is the same size (prompt, and its output at full length: ``ignore_eos``),
    # so what an engine holds, in tokens it will need at most, is its requests times that size.
    # Checked from the warm-up's end: until the first answers teach the estimates, a request
    # is sized short (measured: about 105 tokens of its 113), and a picker alone as much as
    # three replicas puts a request or two more on an engine than its budget holds.
    (size,) = sizes
    most, preempted = engines.most(), engines.preempted()
    grants, holds = most_leased(sums, engines.since)
    print("an engine held at most", most, "requests of", size, "tokens (", most * size, "of",
          BUDGET, "), preempted", preempted, "; in the warm-up too:", engines.most(False),
          engines.preempted(False), "; leases summed at most", round(grants, 4), "held",
          round(holds, 4))
    assert most * size <= BUDGET, (most, size)
    # The engine counts 16-token blocks: what fits by tokens here fits by blocks too (18 of
    # these requests take at most 126 of its 128 blocks), so an engine that preempts was given
    # more than it holds.
    assert preempted == 0, preempted
    # The replicas' own view: what the store granted, and what each reported holding (each
    # dispatches within its grant; a replica that held more than its grant would show here).
    assert grants <= 1.0 + 1e-9 and holds <= 1.0 + 1e-9, (grants, holds)


def most_leased(sums: list[tuple[float, float, float]], since: float) -> tuple[float, float]:
    """The most the replicas were granted together, and the most they held or were granted
    together from ``since``: until its first exchange shows it the others, the first replica
    is alone, with all of the pool, and a picker alone admits a request whose prompt fits,
    its output growing past the budget."""
    assert sums
    return max(s[1] for s in sums), max(s[2] for s in sums if s[0] >= since)


BUDGET_TOKENS = 8000


def _spend_budget(stack: Stack) -> list[int]:
    """30 clients (spread over the replicas) send a budgeted tenant's requests until refused;
    the tokens of every request served."""
    spent: list[int] = []

    async def client(session: aiohttp.ClientSession, replica: int) -> None:
        for _ in range(40):
            async with session.post(
                    stack.gateway_url + "/v1/chat/completions",
                    data=chat_body(words=60, max_tokens=20),
                    headers={TENANT_HEADER: "a", REPLICA_HEADER: str(replica),
                             "content-type": "application/json"}) as response:
                answer = await response.json()
                if response.status == 200:
                    usage = answer["usage"]
                    spent.append(usage["prompt_tokens"] + usage["completion_tokens"])
                else:
                    assert response.status == 429, answer

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await asyncio.gather(*(client(session, i % REPLICAS) for i in range(30)))

    asyncio.run(run())
    return spent


def test_three_replicas_spend_a_budget_once_not_three_times(tmp_path: Path) -> None:
    # A tenant with a burst budget (refilled over 24 h) sends from 30 clients until refused
    # everywhere. Even one picker overruns a budget by what its estimates fell short (a budget
    # is reserved on estimates and settled on use); three replicas may add one request each at
    # most (issue 13). They reserve a budgeted tenant's requests in Redis: measured, they spend
    # what one picker does (judging on their own views with a part each, they overran by one to
    # fourteen requests).
    tenant = {"id": "a", "budgets": {"burst": {"tokens": BUDGET_TOKENS, "per": "24h"}}}
    with Stack(tmp_path / "one", endpoints=2, server_args=["--step-ms", "2"],
               picker_config={"tenants": [tenant]}) as one:
        alone = _spend_budget(one)
    with RedisServer(tmp_path / "redis") as store, Stack(
            tmp_path / "three", endpoints=2, picker_replicas=REPLICAS,
            response_path="inline", envoy_bootstrap=_bootstrap,
            server_args=["--step-ms", "2"],
            picker_config={"tenants": [tenant], "state": {
                "backend": "redis", "redis": {"url": store.url}, "syncInterval": "100ms",
                "maxStaleness": "2s"}}) as three:
        replicated = _spend_budget(three)
    largest = max(alone + replicated)
    print("one picker spent", sum(alone), "three", sum(replicated), "of", BUDGET_TOKENS,
          "largest request", largest)
    assert sum(alone) >= BUDGET_TOKENS - largest
    assert sum(replicated) <= max(sum(alone), BUDGET_TOKENS) + REPLICAS * largest
