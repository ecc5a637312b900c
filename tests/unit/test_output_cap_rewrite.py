"""The output cap admission decides, as the body sent to the engine says it: written when
admission lowered it (the tenant's limit, or what the budget can pay), never raised above the
client's own."""

from __future__ import annotations

from picker.extproc.service import rewrite_body


def test_a_cap_admission_lowered_is_written_where_the_engine_reads_it() -> None:
    body = {"model": "m", "max_tokens": 1000}
    assert rewrite_body(body, None, 400, "max_tokens")
    assert body["max_tokens"] == 400
    chat = {"model": "m", "max_tokens": 1000, "max_completion_tokens": 900}
    assert rewrite_body(chat, None, 400, "max_tokens")
    assert chat["max_completion_tokens"] == 400
    responses = {"model": "m", "input": "hi"}
    assert rewrite_body(responses, None, 2900, "max_output_tokens")
    assert responses["max_output_tokens"] == 2900  # set where the request set none


def test_a_smaller_cap_of_the_clients_own_is_kept() -> None:
    """A body routed before it was read (``AT_HEADERS``) was admitted without its max_tokens:
    the cap admission wrote for it bounds it, and a client's smaller one stays."""
    body = {"model": "m", "max_tokens": 100}
    assert not rewrite_body(body, None, 2900, "max_tokens")
    assert body["max_tokens"] == 100
