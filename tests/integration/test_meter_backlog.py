"""A picker behind on its meter streams loses no meter silently: while a routed request's meter
stream waits unread, a new request is refused (503, ``Retry-After``) unless its tenant has less
than an equal share of what is being metered, and a meter stream Envoy
ends while the picker is still reading it (Envoy reset it) is settled on its estimate and counted
(``fairway_settlements_estimated_total``), not as a client that left.

The picker runs in-process and the test plays Envoy (``tests/integration/test_extproc_contract``'s
harness). How far behind counts as behind (``METER_BACKLOG_SHED``) and how quiet a stream must
have been for its reset to be a client's departure (``METER_CUT_IDLE``) are set to their extremes
here, so that what is asserted is the rule, not a machine's pace; the flood through a real Envoy
is ``tests/faults/test_meter_overload.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.extproc import service
from tests.integration.test_extproc_contract import (
    CHAT,
    METERED,
    TENANT_HEADER,
    chat_body,
    content_events,
    expect_route,
    fetch,
    observed,
    refusal,
    request_headers,
    response_body,
    response_headers,
    routed_for_meter,
    running_picker,
    send_request,
    split,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("cut", [True, False], ids=["reset-while-read", "reset-when-quiet"])
async def test_a_reset_meter_stream_is_settled_by_what_its_reset_means(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool) -> None:
    # Any end is "while still reading" (cut) or "long after the last message" (a client that
    # left: Envoy ends a meter stream deferred_close_timeout after the client went).
    monkeypatch.setattr(service, "METER_CUT_IDLE", 3600.0 if cut else 0.0)
    async with running_picker(tmp_path, tenants=[{"id": "a"}]) as picker:
        body = chat_body("tell me a story", max_tokens=12, stream=True)
        routed, request_id = await routed_for_meter(picker, body, "a")
        upstream = await fetch(routed.destinations[0], CHAT, body)
        sent = b"\n\n".join(upstream.data.split(b"\n\n")[:6]) + b"\n\n"
        meter = picker.open()
        await meter.send(observed(request_headers(headers={TENANT_HEADER: "a"}), request_id),
                         observed(response_headers(200, upstream.content_type), request_id),
                         *[observed(response_body(piece, False), request_id)
                           for piece in split(sent, 3)])
        # The picker has read the response's first bytes before Envoy resets the stream.
        await picker.eventually("fairway_ttft_seconds_count", 1, tenant="a")
        await meter.close()

        outcome = "unmetered" if cut else "cancelled"
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome=outcome)
        assert await picker.metric("fairway_settlements_estimated_total",
                                   reason="meter_cut") == (1 if cut else 0)
        charged = await picker.metric("fairway_service_tokens_total", tenant="a",
                                      kind="completion")
        if cut:
            assert charged >= content_events(sent)  # never less than it read
        else:
            assert charged == content_events(sent) == 5
        assert await picker.metric("fairway_running_requests") == 0


async def test_new_requests_are_refused_while_a_meter_stream_waits_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "METER_BACKLOG_SHED", 0.0)  # any wait is a backlog
    async with running_picker(tmp_path, tenants=[{"id": "a"}, {"id": "b"}]) as picker:
        body = chat_body(max_tokens=3, stream=True)
        routed, request_id = await routed_for_meter(picker, body, "a")

        # Its meter stream has not been read: the tenant making the backlog is refused,
        # retryably...
        stream = picker.open(METERED)
        await send_request(stream, body, headers={TENANT_HEADER: "a"})
        refused = refusal(await stream.reply())
        assert refused.status == 503
        assert refused.error["code"] == "picker_overloaded"
        assert float(refused.headers["retry-after"]) >= 1
        assert await picker.metric("fairway_rejections_total", tenant="a",
                                   reason="meter_backlog") == 1
        # ...while a tenant with less than an equal share of what is being metered (here
        # nothing) still gets in.
        light = picker.open(METERED)
        await send_request(light, body, headers={TENANT_HEADER: "b"})
        await expect_route(light, body)

        # Read (the whole response): caught up, the heavy tenant is routed again.
        upstream = await fetch(routed.destinations[0], CHAT, body)
        meter = picker.open()
        await meter.send(observed(request_headers(headers={TENANT_HEADER: "a"}), request_id),
                         observed(response_headers(200, upstream.content_type), request_id),
                         observed(response_body(upstream.data, True), request_id))
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
        # b's meter stream is still unread, and a has nothing being metered: a gets in.
        stream = picker.open(METERED)
        await send_request(stream, body, headers={TENANT_HEADER: "a"})
        await expect_route(stream, body)


async def test_a_meter_stream_that_never_comes_is_no_backlog_once_a_later_one_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A route without the metering filter leaves its requests unclaimed for good; a picker that
    # reads the meter streams routed after them is not behind, and refuses nobody.
    monkeypatch.setattr(service, "METER_BACKLOG_SHED", 0.0)  # any wait is a backlog
    async with running_picker(tmp_path, tenants=[{"id": "a"}, {"id": "b"}]) as picker:
        body = chat_body(max_tokens=3, stream=True)
        await routed_for_meter(picker, body, "a")  # its meter stream never comes
        routed, request_id = await routed_for_meter(picker, body, "b")
        upstream = await fetch(routed.destinations[0], CHAT, body)
        meter = picker.open()
        await meter.send(observed(request_headers(headers={TENANT_HEADER: "b"}), request_id),
                         observed(response_headers(200, upstream.content_type), request_id),
                         observed(response_body(upstream.data, True), request_id))
        await picker.eventually("fairway_requests_total", 1, tenant="b", outcome="ok")
        # a holds all that is being metered (its unclaimed request), yet it is not refused.
        stream = picker.open(METERED)
        await send_request(stream, body, headers={TENANT_HEADER: "a"})
        await expect_route(stream, body)
        assert await picker.metric("fairway_rejections_total", reason="meter_backlog") == 0
