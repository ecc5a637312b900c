"""Helpers for tests through the whole local stack (real Envoy, the picker, simulated servers)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
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


def settled_metric(url: str, name: str, expected: float, timeout: float = 5.0,
                   **labels: str) -> float:
    """``metric`` once it equals ``expected`` (or its value at the timeout, for the assertion's
    message). On the meter-stream path the picker settles a request after the client has its
    answer, so a charge shows a moment later."""
    deadline = time.monotonic() + timeout
    while (value := metric(url, name, **labels)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def chat_body(words: int = 20, max_tokens: int = 8, stream: bool = False,
              **extra: Any) -> bytes:
    prompt = " ".join(["the", "cat", "sat", "on", "a", "mat"] * (words // 6 + 1))[: words * 4]
    body = {"model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": prompt}], **extra}
    return json.dumps(body).encode()
