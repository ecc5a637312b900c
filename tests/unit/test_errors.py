"""The refusal taxonomy: one status, metric label, OpenAI ``type`` and string ``code`` per error,
the body clients parse, and which budget's refusal becomes which error."""

from __future__ import annotations

import json
import re

import pytest

from picker import errors
from picker.core.admission import Admission, BucketRule, Refused, TenantRules
from picker.dispatch.refusals import refusal_error
from picker.errors import InsufficientQuota, OverBudget, RequestError
from picker.extproc.service import immediate
from picker.openai import error_body

# Every refusal as the client sees it: (status, type, code, metric label).
EXPECTED: dict[type[RequestError], tuple[int, str, str, str]] = {
    errors.BadRequest: (400, "invalid_request_error", "invalid_request", "bad_request"),
    errors.InputTooLong: (400, "invalid_request_error", "context_length_exceeded",
                          "input_too_long"),
    errors.OutputTooLong: (400, "invalid_request_error", "max_tokens_exceeded",
                           "output_too_long"),
    errors.Unauthorized: (401, "invalid_request_error", "invalid_api_key", "unauthorized"),
    errors.LaneNotAllowed: (403, "permission_error", "lane_not_allowed", "lane_not_allowed"),
    errors.NotFound: (404, "invalid_request_error", "unknown_url", "not_found"),
    errors.MethodNotAllowed: (405, "invalid_request_error", "method_not_allowed",
                              "method_not_allowed"),
    errors.BodyTooLarge: (413, "invalid_request_error", "request_too_large", "body_too_large"),
    errors.OverBudget: (429, "tokens", "rate_limit_exceeded", "over_budget"),
    errors.InsufficientQuota: (429, "insufficient_quota", "insufficient_quota",
                               "insufficient_quota"),
    errors.TenantQueueFull: (429, "requests", "tenant_queue_full", "tenant_queue_full"),
    errors.QueueFull: (429, "requests", "queue_full", "queue_full"),
    errors.QueueTimeout: (503, "server_error", "queue_timeout", "queue_timeout"),
    errors.NoEndpoint: (503, "server_error", "no_endpoint_available", "no_endpoint"),
    errors.ShuttingDown: (503, "server_error", "shutting_down", "shutting_down"),
    errors.NotLeader: (503, "server_error", "not_leader", "not_leader"),
    errors.StateUnavailable: (503, "server_error", "state_unavailable", "state_unavailable"),
    errors.BodyBuffersFull: (503, "server_error", "server_overloaded", "buffers_full"),
    errors.MeterBacklog: (503, "server_error", "picker_overloaded", "meter_backlog"),
    errors.BodyTimeout: (408, "invalid_request_error", "request_timeout", "body_timeout"),
    errors.InternalError: (500, "server_error", "internal_error", "internal"),
}

SNAKE = re.compile(r"[a-z][a-z0-9_]*[a-z0-9]")


def _all_subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


def test_every_refusal_is_in_the_table() -> None:
    # A new error class must be given its status, type and code on purpose (and listed here).
    declared = {cls for cls in _all_subclasses(RequestError) if cls.__module__ == errors.__name__}
    assert declared == set(EXPECTED)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_each_refusal_has_its_status_type_code_and_label(cls: type[RequestError]) -> None:
    error = cls("why")
    assert (error.http_status, error.error_type, error.code, error.metric_label) == EXPECTED[cls]
    assert SNAKE.fullmatch(error.code) and SNAKE.fullmatch(error.metric_label)


def test_codes_and_metric_labels_are_unique() -> None:
    codes = [code for _, _, code, _ in EXPECTED.values()]
    labels = [label for _, _, _, label in EXPECTED.values()]
    assert len(set(codes)) == len(codes)
    assert len(set(labels)) == len(labels)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_types_follow_openai_by_status(cls: type[RequestError]) -> None:
    status, error_type = cls.http_status, cls.error_type
    if status == 429:
        # OpenAI's 429 type names the limit that was hit.
        assert error_type in ("tokens", "requests", "insufficient_quota")
    elif status >= 500:
        assert error_type == "server_error"
    else:
        assert error_type in ("invalid_request_error", "permission_error")
        assert (error_type == "permission_error") == (status == 403)


def test_a_retry_can_help_every_refusal_that_suggests_one() -> None:
    for cls in EXPECTED:
        if cls.http_status == 429 or cls.http_status >= 500:
            continue
        # Client errors fail the same way again: no Retry-After invites a retry.
        assert cls.retry_after is None, cls
    # Only the spent quota tells the client not to retry: every other 429/503 passes in time.
    assert [cls for cls in EXPECTED if not cls.should_retry] == [InsufficientQuota]
    assert InsufficientQuota.should_retry is False


def test_insufficient_quota_is_an_over_budget_refusal() -> None:
    # Code that handles "over budget" keeps handling both windows.
    assert issubclass(InsufficientQuota, OverBudget)
    error = InsufficientQuota("spent", retry_after=3600.0)
    assert error.retry_after == 3600.0 and error.metered is False


def test_error_body_is_openais_shape_with_a_string_code() -> None:
    raw = error_body("over the burst token budget", "tokens", "rate_limit_exceeded")
    decoded = json.loads(raw)
    assert list(decoded) == ["error"]
    assert list(decoded["error"]) == ["message", "type", "param", "code"]
    assert decoded["error"] == {"message": "over the burst token budget", "type": "tokens",
                                "param": None, "code": "rate_limit_exceeded"}
    with_param = json.loads(error_body("too many", "invalid_request_error",
                                       "max_tokens_exceeded", param="max_tokens"))
    assert with_param["error"]["param"] == "max_tokens"


# -- the wire: what Envoy is asked to send --

def _immediate(error: RequestError) -> tuple[int, dict[str, str], dict]:
    response = immediate(error).immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in response.headers.set_headers}
    return response.status.code, headers, json.loads(response.body)["error"]


def test_immediate_response_carries_the_string_code() -> None:
    status, headers, body = _immediate(OverBudget("over the burst budget", retry_after=2.5))
    assert status == 429
    assert body == {"message": "over the burst budget", "type": "tokens", "param": None,
                    "code": "rate_limit_exceeded"}
    assert headers["retry-after"] == "3"
    assert "x-should-retry" not in headers  # the client may retry after Retry-After


def test_immediate_response_tells_clients_not_to_retry_a_spent_quota() -> None:
    status, headers, body = _immediate(InsufficientQuota("spent", retry_after=7200.0))
    assert status == 429
    assert (body["type"], body["code"]) == ("insufficient_quota", "insufficient_quota")
    assert headers["x-should-retry"] == "false"
    assert headers["retry-after"] == "7200"  # still true, for a client that schedules work


# -- which budget refused: rate limit or quota --

def _refusal(rules: TenantRules, spend: int, ask: int, now: float) -> Refused:
    admission = Admission({}, rules)
    first = admission.admit("t", "default", spend, 0, 0, 0.0)
    assert not isinstance(first, Refused)
    admission.finish(first.reservation, spend, 0.0)
    refused = admission.admit("t", "default", ask, 0, 0, now)
    assert isinstance(refused, Refused)
    return refused


def test_an_empty_burst_budget_is_a_rate_limit() -> None:
    rules = TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(100_000, 86_400))
    refused = _refusal(rules, 1000, 500, now=0.0)  # burst: 5 s away; sustained: plenty
    assert (refused.reason, refused.window) == ("over_budget", "burst")
    error = refusal_error(refused)
    assert type(error) is OverBudget and error.code == "rate_limit_exceeded"
    assert error.retry_after == pytest.approx(5.0)


def test_an_empty_sustained_budget_is_insufficient_quota() -> None:
    rules = TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(2000, 86_400))
    # After 10 s the burst bucket is full again, the sustained one about 1800 short of 2000.
    refused = _refusal(rules, 2000, 500, now=10.0)
    assert (refused.reason, refused.window) == ("insufficient_quota", "sustained")
    error = refusal_error(refused)
    assert type(error) is InsufficientQuota
    assert (error.http_status, error.code, error.should_retry) == (429, "insufficient_quota",
                                                                    False)
    assert error.retry_after is not None and error.retry_after > 3600


def test_the_budget_that_waits_longest_decides_when_both_are_short() -> None:
    # Both short: burst 10 s away, sustained about 200 s away: the quota binds.
    rules = TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(1000, 200))
    refused = _refusal(rules, 1000, 1000, now=0.0)
    assert refused.window == "sustained" and type(refusal_error(refused)) is InsufficientQuota
    # Burst 100 s away, sustained 50 s away: a rate limit.
    rules = TenantRules(burst=BucketRule(1000, 100), sustained=BucketRule(2000, 100))
    refused = _refusal(rules, 1000, 1000, now=0.0)
    assert refused.window == "burst" and type(refusal_error(refused)) is OverBudget
