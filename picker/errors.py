"""fairway's error taxonomy: every error the project raises on purpose derives from FairwayError.

Each kind carries, once, the HTTP status a client sees and the label metrics count it under; a
refusal (``RequestError``) also carries the ``type`` and string ``code`` of its OpenAI-style error
body. Where OpenAI has a code for the same situation it is used (``rate_limit_exceeded``,
``insufficient_quota``, ``invalid_api_key``, ``context_length_exceeded``), so clients written for
OpenAI read fairway's refusals right; elsewhere the code is fairway's own snake_case name. OpenAI's
429 ``type`` says which limit was hit: ``tokens``, ``requests`` or ``insufficient_quota``.
"""

from __future__ import annotations


class FairwayError(Exception):
    """Base of all deliberate errors."""

    http_status = 500
    metric_label = "internal"


class ConfigError(FairwayError):
    """A config or scenario value is wrong; ``path`` names the field (``tenants[1].weight``)."""

    http_status = 500
    metric_label = "config"

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error, its path placed under ``prefix``."""
        if not prefix:
            return self
        if not self.path:
            path = prefix
        elif self.path.startswith("["):
            path = prefix + self.path
        else:
            path = f"{prefix}.{self.path}"
        return ConfigError(path, self.message)


class RequestError(FairwayError):
    """A request the picker refuses; carries what the client is told."""

    http_status = 400
    metric_label = "bad_request"
    error_type = "invalid_request_error"
    code = "invalid_request"
    """The error body's string ``code``."""
    retry_after: float | None = None
    should_retry = True
    """``False`` where retrying soon cannot help: the response then says ``x-should-retry: false``,
    which the ``openai`` clients obey before their own rules (they retry every 429 and 5xx).
    ``True`` sends no header and leaves the choice to the client."""
    metered = False
    """The request already has its metering record (it was refused after it had queued)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after is not None:
            self.retry_after = retry_after


class BadRequest(RequestError):
    """Malformed JSON, or a required field missing or wrong."""


class BodyTooLarge(RequestError):
    http_status = 413
    metric_label = "body_too_large"
    code = "request_too_large"


class QueueFull(RequestError):
    """The picker's queue is full (or the request was shed for a higher lane's)."""

    http_status = 429
    metric_label = "queue_full"
    error_type = "requests"
    code = "queue_full"
    retry_after = 1.0


class QueueTimeout(RequestError):
    http_status = 503
    metric_label = "queue_timeout"
    error_type = "server_error"
    code = "queue_timeout"
    retry_after = 1.0


class NoEndpoint(RequestError):
    http_status = 503
    metric_label = "no_endpoint"
    error_type = "server_error"
    code = "no_endpoint_available"
    retry_after = 1.0


class ShuttingDown(RequestError):
    http_status = 503
    metric_label = "shutting_down"
    error_type = "server_error"
    code = "shutting_down"
    retry_after = 1.0


class Unauthorized(RequestError):
    """API-key mode: the ``Authorization`` header is missing, malformed or names no known key."""

    http_status = 401
    metric_label = "unauthorized"
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class LaneNotAllowed(RequestError):
    """The lane header asks for a lane the tenant's policy does not allow."""

    http_status = 403
    metric_label = "lane_not_allowed"
    error_type = "permission_error"
    code = "lane_not_allowed"


class InputTooLong(RequestError):
    """The prompt is over the tenant's ``maxInputTokens``."""

    metric_label = "input_too_long"
    code = "context_length_exceeded"


class OutputTooLong(RequestError):
    """``max_tokens`` is over the tenant's ``maxOutputTokens`` (and the rule is reject)."""

    metric_label = "output_too_long"
    code = "max_tokens_exceeded"


class TenantQueueFull(RequestError):
    """The tenant already has ``maxQueued`` requests waiting."""

    http_status = 429
    metric_label = "tenant_queue_full"
    error_type = "requests"
    code = "tenant_queue_full"
    retry_after = 1.0


class OverBudget(RequestError):
    """The tenant's burst (short-window) token budget cannot cover the request (and the rule is
    reject): a rate limit, which the ``Retry-After`` wait lifts."""

    http_status = 429
    metric_label = "over_budget"
    error_type = "tokens"
    code = "rate_limit_exceeded"


class InsufficientQuota(OverBudget):
    """The tenant's sustained (long-window) token budget cannot cover the request: a quota spent
    for hours, not a rate limit. Clients must not retry it soon (OpenAI's own clients retry every
    429 unless told otherwise)."""

    metric_label = "insufficient_quota"
    error_type = "insufficient_quota"
    code = "insufficient_quota"
    should_retry = False


class NotLeader(RequestError):
    """This picker replica is a standby (leader election): the gateway should use the leader."""

    http_status = 503
    metric_label = "not_leader"
    error_type = "server_error"
    code = "not_leader"
    retry_after = 1.0


class StateUnavailable(RequestError):
    """The shared state store is unreachable and ``state.onUnavailable`` is ``failClosed``:
    budgets and fair shares cannot be judged across replicas, so nothing is admitted."""

    http_status = 503
    metric_label = "state_unavailable"
    error_type = "server_error"
    code = "state_unavailable"
    retry_after = 1.0


class NotFound(RequestError):
    """A path that is neither an inference path nor on the pass-through list."""

    http_status = 404
    metric_label = "not_found"
    code = "unknown_url"


class MethodNotAllowed(RequestError):
    """An inference path asked for with a method other than POST (or a pass-through path with
    another method than the one listed)."""

    http_status = 405
    metric_label = "method_not_allowed"
    code = "method_not_allowed"


class BodyBuffersFull(RequestError):
    """The request bodies buffered at once, all streams together, are at ``maxBufferedBytes``:
    one more would let stalled or slow uploads take the picker's memory."""

    http_status = 503
    metric_label = "buffers_full"
    error_type = "server_error"
    code = "server_overloaded"
    retry_after = 1.0


class MeterBacklog(RequestError):
    """The picker has fallen behind reading its meter streams (the meter-stream response path):
    a new request is refused until it catches up, since Envoy resets a meter stream the picker
    reads too late and that request's usage would be lost."""

    http_status = 503
    metric_label = "meter_backlog"
    error_type = "server_error"
    code = "picker_overloaded"
    retry_after = 1.0


class BodyTimeout(RequestError):
    """No request body chunk came for ``bodyIdleTimeout``: a stalled upload gives back its
    buffer."""

    http_status = 408
    metric_label = "body_timeout"
    code = "request_timeout"


class InternalError(RequestError):
    """A fault of the picker's own (a bug): the client gets a clear 500, the fault is logged and
    counted, and the picker keeps serving."""

    http_status = 500
    metric_label = "internal"
    error_type = "server_error"
    code = "internal_error"
