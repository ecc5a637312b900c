"""Envoy itself retries a request whose model server is dead, on another one, before the picker
has ejected it: the client never sees the failure, the tenant pays for what was served, and the
picker is told which endpoint served.

Through real Envoy, the picker and two simulated servers on 127.0.0.1, one of them SIGKILLed:
the stack's default Envoy (``override_host`` over a ``STATIC`` cluster, ``RETRY_POLICY``) and
the committed plain-Envoy samples manifests/gateway/envoy.yaml, envoy-jwt.yaml and
envoy-access-log.yaml, whose
``STRICT_DNS`` pool cluster gets the two servers instead of the headless Service's DNS name
(``tests.faults.helpers.shipped_envoy``). Ejection is held off (many failures needed, slow
scrapes), so every 200 after the kill is Envoy's retry, not the picker avoiding the dead server.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from picker.stack.envoy import FALLBACK_ENDPOINTS
from picker.stack.launcher import Stack
from scripts import gen_gateway_envoy
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, settled_metric, wait_until
from tests.faults.helpers import gauges_drain, post_with, shipped_envoy
from tests.faults.test_forged_identity import TEST_JWKS, mint

HEALTH = {"consecutiveFailures": 100, "baseEjectionTime": "30s"}
"""Far more failures than the test causes: the dead server stays in service throughout."""
SEQUENTIAL = 8
CONCURRENT = 8
SMALL_CHAT = chat_body(max_tokens=2)
"""A chat request the engine answers in two tokens."""


def picker_config(usage: Path, fallbacks: int = FALLBACK_ENDPOINTS) -> dict[str, Any]:
    """Tenant ``a``, ejection held off, ``fallbacks`` named, usage records to ``usage``."""
    return {"tenants": [{"id": "a"}], "health": HEALTH,
            "capacity": {"scrapeInterval": "5s"},
            "routing": {"fallbackEndpoints": fallbacks},
            "metering": {"output": str(usage)}}


def _envoy_stat(stack: Stack, suffix: str) -> int:
    """The sum over Envoy's clusters of the counter ``cluster.<name>.<suffix>`` (the gateway
    flavours name their pool cluster each their own way)."""
    pattern = urllib.parse.quote(rf"^cluster\..*\.{suffix}$")
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.admin_port}/stats?filter={pattern}",
                                timeout=5) as page:
        text = page.read().decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)


def _envoy_hosts(stack: Stack) -> list[str]:
    """Envoy's per-host counters (its admin ``/clusters``: requests, errors, connect failures
    of each model server), for a failure's message: which attempts reached which server."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.admin_port}/clusters",
                                timeout=5) as page:
        return [line for line in page.read().decode().splitlines()
                if any(f"::{name}::" in line for name in ("rq_total", "rq_error", "rq_success",
                                                          "cx_connect_fail", "cx_active"))]


ATTEMPT_FORMAT = ("%UPSTREAM_HOST% attempt=%UPSTREAM_REQUEST_ATTEMPT_COUNT% code=%RESPONSE_CODE% "
                  "flags=%RESPONSE_FLAGS% failure=%UPSTREAM_TRANSPORT_FAILURE_REASON% "
                  "details=%RESPONSE_CODE_DETAILS% id=%REQ(X-REQUEST-ID)%\n")
"""One line per upstream attempt (the router's ``upstream_log``), for a failure's message."""


def with_attempt_log(build: Callable[[Stack], dict[str, Any]], path: Path
                     ) -> Callable[[Stack], dict[str, Any]]:
    """``build``'s Envoy bootstrap with every upstream attempt logged to ``path``: a test's
    instrument only, so a failed retry shows each attempt's host and why it failed."""
    def with_log(stack: Stack) -> dict[str, Any]:
        config = build(stack)
        (listener,) = config["static_resources"]["listeners"]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (router,) = [f for f in manager["http_filters"]
                     if f["name"] == "envoy.filters.http.router"]
        router["typed_config"]["upstream_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3"
                         ".FileAccessLog",
                "path": str(path),
                "log_format": {"text_format_source": {"inline_string": ATTEMPT_FORMAT}}}}]
        return config
    return with_log


def _attempts(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _served(usage: Path) -> list[str | None]:
    return [json.loads(line)["endpoint"] for line in usage.read_text().splitlines() if line]


def assert_retried_to_the_live_server(stack: Stack, usage: Path,
                                      headers: Callable[[], dict[str, str]],
                                      served_reported: bool = True,
                                      attempts: Path | None = None) -> None:
    """Server 0 is SIGKILLed after one request; every request after it gets 200, charged once,
    and (``served_reported``: the gateway tells the picker) metered on the live server."""
    assert post_with(stack, headers(), SMALL_CHAT)[0] == 200
    assert settled_metric(stack.metrics_url, "fairway_requests_total", 1.0, outcome="ok") == 1
    prompt = metric(stack.metrics_url, "fairway_service_tokens_total", kind="prompt")
    assert prompt > 0
    dead, live = stack.endpoint_addresses
    stack.kill_server(0)

    answers = [post_with(stack, headers(), SMALL_CHAT) for _ in range(SEQUENTIAL)]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers += list(pool.map(lambda _: post_with(stack, headers(), SMALL_CHAT),
                                 range(CONCURRENT)))
    failed = [(i, status, head, body) for i, (status, head, body) in enumerate(answers)
              if status != 200]
    assert not failed, (failed, _envoy_stat(stack, "upstream_rq_retry_overflow"),
                        _envoy_hosts(stack), _attempts(attempts) if attempts else None)

    # Envoy retried (the picker kept naming the dead server first: it is the least loaded and
    # was never ejected), and had room to: no retry refused by the circuit breaker.
    assert _envoy_stat(stack, "upstream_rq_retry") >= 1
    assert _envoy_stat(stack, "upstream_rq_retry_overflow") == 0
    assert metric(stack.metrics_url, "fairway_endpoint_ejected", endpoint=dead) == 0.0
    # Charged once per request, for what the live server served, and nothing failed.
    served = 1 + SEQUENTIAL + CONCURRENT
    assert settled_metric(stack.metrics_url, "fairway_requests_total", float(served),
                          outcome="ok") == served
    assert metric(stack.metrics_url, "fairway_requests_total", outcome="upstream_failed") == 0
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", prompt * served,
                          kind="prompt") == prompt * served
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", 2.0 * served,
                          kind="completion") == 2.0 * served
    # The endpoint reported back (and metered) is the one that served: the live one. (The record
    # is written just after the counters the metrics page shows.)
    wait_until(lambda: len(_served(usage)) >= served)
    records = _served(usage)
    assert len(records) == served
    if served_reported:
        assert records[1:] == [live] * (SEQUENTIAL + CONCURRENT), records
    assert not any(gauges_drain(stack).values())


def _tenant_a() -> dict[str, str]:
    return {TENANT_HEADER: "a"}


def test_the_default_stack_retries_a_dead_server_s_requests_on_the_live_one(
        tmp_path: Path) -> None:
    usage = tmp_path / "usage.jsonl"
    with Stack(tmp_path / "stack", endpoints=2, picker_config=picker_config(usage)) as stack:
        assert stack.retries
        assert_retried_to_the_live_server(stack, usage, _tenant_a)
        # Envoy's log agrees: every request after the kill went upstream to the live server.
        def upstreams() -> list[str]:
            return [line.split("upstream=", 1)[1].split(" ", 1)[0]
                    for line in stack.access_log.read_text().splitlines()]
        wait_until(lambda: len(upstreams()) >= 1 + SEQUENTIAL + CONCURRENT, timeout=15)
        assert upstreams()[1:] == [stack.endpoint_addresses[1]] * (SEQUENTIAL + CONCURRENT)


def test_without_fallbacks_the_retry_still_leaves_the_dead_server(tmp_path: Path) -> None:
    """``routing.fallbackEndpoints: 0`` (the picker's default): the metadata names one host;
    once it failed, override_host's fallback policy picks and ``previous_hosts`` skips it."""
    usage = tmp_path / "usage.jsonl"
    with Stack(tmp_path / "stack", endpoints=2,
               picker_config=picker_config(usage, fallbacks=0)) as stack:
        assert_retried_to_the_live_server(stack, usage, _tenant_a)


@pytest.mark.parametrize("sample", ["envoy.yaml", "envoy-jwt.yaml", "envoy-access-log.yaml"])
def test_each_shipped_envoy_sample_retries_on_the_live_server(tmp_path: Path,
                                                              sample: str) -> None:
    usage = tmp_path / "usage.jsonl"
    jwt = sample == "envoy-jwt.yaml"
    if jwt:
        token = mint("a", issuer=gen_gateway_envoy.PLACEHOLDER_JWT.issuer)

        def headers() -> dict[str, str]:
            return {"authorization": f"Bearer {token}"}
    else:
        def headers() -> dict[str, str]:
            return {}  # the sample strips tenant headers: charged to the default tenant
    attempts = tmp_path / "attempts.log"
    with Stack(tmp_path / "stack", endpoints=2, picker_config=picker_config(usage),
               envoy_bootstrap=with_attempt_log(
                   shipped_envoy(sample, TEST_JWKS if jwt else None), attempts)) as stack:
        assert not stack.retries  # the sample, not the stack, decides how Envoy routes
        assert_retried_to_the_live_server(stack, usage, headers, attempts=attempts)
