"""Helpers for tests through the whole local stack (real Envoy, the picker, simulated servers)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TENANT_HEADER = "x-gateway-inference-fairness-id"


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus page, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in metric_samples(url).items()
               if sample == name and wanted <= set(sample_labels))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``predicate()`` holds within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def settled_metric(url: str, name: str, expected: float, timeout: float = 15.0,
                   **labels: str) -> float:
    """``metric`` once it equals ``expected`` (or its value at the timeout, for the assertion's
    message). On the meter-stream path the picker settles a request after the client has its
    answer, so a charge shows a moment later; one whose meter stream comes too late (a
    CPU-starved machine) is settled when ``--meter-claim-timeout`` (10 s) runs out, hence the
    default timeout."""
    deadline = time.monotonic() + timeout
    while (value := metric(url, name, **labels)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def window_shares(records: Sequence[Any], start: float, end: float) -> dict[str, float]:
    """Each tenant's share of the service (prompt + 2 × output tokens) of the requests whose
    first token came between ``start`` and ``end`` (seconds into the run; ``end`` the end of
    sending). Not the whole run's: before ``start`` the estimates are still being learned, and
    once sending stops every tenant's last backlog completes alike, which pulls the shares
    towards even whatever the weights (by about a tenth in a short run, more on a slow
    machine)."""
    service: dict[str, float] = {}
    for r in records:
        if r.ok and r.ttft_s is not None and start <= r.start_s + r.ttft_s <= end:
            service[r.tenant] = service.get(r.tenant, 0.0) + r.prompt_tokens \
                + 2 * r.completion_tokens
    total = sum(service.values())
    assert total, "no request had its first token in the window"
    return {t: v / total for t, v in service.items()}


def chat_body(words: int = 20, max_tokens: int = 8, stream: bool = False,
              **extra: Any) -> bytes:
    prompt = " ".join(["the", "cat", "sat", "on", "a", "mat"] * (words // 6 + 1))[: words * 4]
    body = {"model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": prompt}], **extra}
    return json.dumps(body).encode()
