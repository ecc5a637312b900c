"""A flood of random tenant ids through real Envoy: every request is served or clearly refused,
and the metrics' tenant label stays capped (unknown tenants are ``other``). That per-tenant state
is forgotten once forgetting changes no decision (after minutes of idleness, so not within a
test's seconds) is shown with an injected clock in ``tests/unit/test_tenant_forgetting.py`` and
measured in ``bench/tenant_flood.py``."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator

import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric_samples, settled_metric
from tests.faults.helpers import flood, gauges_drain

FLOOD = 2000
CONCURRENCY = 40
KNOWN = ("known",)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("random-tenants"), endpoints=2,
               server_args=["--step-ms", "1"],
               picker_config={"tenants": [{"id": t} for t in KNOWN]}) as running:
        yield running


async def _flood(stack: Stack, count: int) -> Counter[int]:
    """``count`` requests, each from a tenant id never seen before, ``CONCURRENCY`` at a time."""
    answers = await flood(stack, count, CONCURRENCY, lambda: "t-" + secrets.token_hex(12),
                          chat_body(words=6, max_tokens=1))
    for status, headers, answer in answers:
        if status != 200:  # refused clearly, or a failure the test reports
            assert answer["error"]["code"] and "retry-after" in headers, answer
    return Counter(status for status, _, _ in answers)


def _tenant_labels(stack: Stack) -> set[str]:
    samples = metric_samples(stack.metrics_url)
    return {dict(labels)["tenant"] for name, labels in samples
            if name.startswith("fairway_") and "tenant" in dict(labels)}


def test_a_random_tenant_flood_is_served_capped_and_charged(stack: Stack) -> None:
    statuses = asyncio.run(_flood(stack, FLOOD))
    served = statuses[200]
    assert served >= 0.99 * FLOOD, statuses
    assert _tenant_labels(stack) <= {*KNOWN, "other"}, _tenant_labels(stack)
    # Every request served was accounted for (whatever its outcome label) and charged its one
    # output token.
    assert settled_metric(stack.metrics_url, "fairway_requests_total", served,
                          tenant="other") == served
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", served,
                          tenant="other", kind="completion") == served
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
