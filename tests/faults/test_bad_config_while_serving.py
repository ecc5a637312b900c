"""A bad config written over the picker's file while it serves: a corrupt YAML and one with a key
written twice. Each is refused (counted, logged with where the fault is) and the last good config
keeps serving; a good config afterwards applies."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric, wait_until
from tests.faults.helpers import assert_openai_error, gauges_drain, post

# Tenant "capped" may ask for at most 10 output tokens: a config change is visible from outside.
CAPPED = {"tenants": [{"id": "a"}, {"id": "capped", "limits": {"maxOutputTokens": 10}}]}
UNCAPPED = {"tenants": [{"id": "a"}, {"id": "capped"}]}


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("bad-config"), endpoints=1,
               picker_config=CAPPED) as running:
        yield running


def _reloads(stack: Stack, result: str) -> float:
    return metric(stack.metrics_url, "fairway_config_reloads_total", result=result)


def _still_capped(stack: Stack) -> None:
    status, headers, body = post(stack, "capped", chat_body(max_tokens=20))
    assert_openai_error(status, headers, body, 400, "max_tokens_exceeded", retryable=False)
    status, _, body = post(stack, "a", chat_body(max_tokens=3))
    assert status == 200, body


def _write_and_wait_for_failure(stack: Stack, text: str) -> str:
    """Write ``text`` over the config; once its failure is counted, the log's new lines."""
    failures = _reloads(stack, "failure")
    log = stack.workdir / "picker.log"
    seen = len(log.read_text())
    # Renamed into place, as ``write_picker_config`` does: written in place, the picker's poll
    # could read it half written, a fault other than the one meant.
    tmp = stack.config_path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(stack.config_path)
    assert wait_until(lambda: _reloads(stack, "failure") == failures + 1, 15)
    assert wait_until(lambda: "keeping the last good config" in log.read_text()[seen:], 15)
    return log.read_text()[seen:]


def test_bad_configs_are_refused_and_the_last_good_one_serves(stack: Stack) -> None:
    _still_capped(stack)
    good = stack.config_path.read_text()

    # Corrupt YAML: an unclosed flow sequence.
    logged = _write_and_wait_for_failure(stack, good + "\ntenants: [{id: a}, {id: b\nqueue: {\n")
    assert re.search(r"line \d+", logged), logged
    _still_capped(stack)

    # Valid YAML, but a key written twice (PyYAML alone would keep the last silently).
    twice = good.replace("- id: capped\n", "- id: capped\n  weight: 2\n  weight: 3\n", 1)
    assert twice != good
    logged = _write_and_wait_for_failure(stack, twice)
    assert "tenants[1].weight" in logged and "key written twice" in logged, logged
    _still_capped(stack)
    assert _reloads(stack, "failure") == 2

    # A good config afterwards applies: the cap is gone.
    successes = _reloads(stack, "success")
    stack.write_picker_config(UNCAPPED)
    assert wait_until(lambda: _reloads(stack, "success") == successes + 1, 15)
    status, _, body = post(stack, "capped", chat_body(max_tokens=20))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 20
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_service_tokens_total",
                                      tenant="capped", kind="completion") == 20)
    # The refused requests cost nothing: only the one served was charged.
    assert metric(stack.metrics_url, "fairway_requests_total", tenant="capped",
                  outcome="ok") == 1
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
