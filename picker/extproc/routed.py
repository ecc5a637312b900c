"""What the ext_proc stream and the access log agree on about a routed request.

It answers: *how is a routed request named in Envoy's dynamic metadata, which Envoy answers mean
that no engine answered, and what does the gateway's access log say of a finished request?* Both
``picker.extproc.service`` (which writes the name and settles the request) and
``picker.extproc.accesslog`` (which reads the log entry) import these; neither imports the other
for them, so the two modules do not form an import cycle (an ``acyclic_siblings`` contract in
``pyproject.toml`` keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass

from picker.core.request import Usage

METER_NAMESPACE = "fairway"
METER_KEY = "request"
"""The dynamic metadata (namespace, key) in which the picker names a request it routed."""

UPSTREAM_FAILURE_DETAILS = ("upstream_reset_before_response_started", "response_timeout",
                            "upstream_per_try_timeout", "no_healthy_upstream")
"""``response.code_details`` of an Envoy answer given because no engine answered: connect
failure or reset before the response began, no response in time, no host."""


@dataclass(frozen=True, slots=True)
class LoggedResponse:
    """What the gateway's access log says about one finished request."""

    request_id: str
    """The picker's name for the request (its ``fairway`` metadata)."""
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int
    client_gone: bool
    """The client's connection ended before the response did."""
    body_bytes: int
    """Response body bytes sent to the client."""
    served: str | None
    """The endpoint that served (``host:port``), after any retry."""
    failure: str | None
    """Why the gateway answered without an engine (its response code details), if it did."""
    first_byte: float | None
    """Seconds from the request's start to the engine's first byte."""

    @property
    def failed(self) -> bool:
        return not 200 <= self.status < 300

    def usage(self, prompt_only: bool) -> Usage | None:
        """The engine's usage, when the log has it whole (``prompt_only``: an API without
        output, whose usage has no completion count)."""
        if self.prompt_tokens is None or (self.completion_tokens is None and not prompt_only):
            return None
        return Usage(self.prompt_tokens, self.completion_tokens or 0, self.cached_tokens)
