"""fairway's error taxonomy: every error the project raises on purpose derives from FairwayError.

Each kind carries, once, the HTTP status a client sees and the label metrics count it under.
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
    retry_after: float | None = None
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


class QueueFull(RequestError):
    http_status = 429
    metric_label = "queue_full"
    error_type = "rate_limit_exceeded"
    retry_after = 1.0


class QueueTimeout(RequestError):
    http_status = 503
    metric_label = "queue_timeout"
    error_type = "server_error"
    retry_after = 1.0


class NoEndpoint(RequestError):
    http_status = 503
    metric_label = "no_endpoint"
    error_type = "server_error"
    retry_after = 1.0


class ShuttingDown(RequestError):
    http_status = 503
    metric_label = "shutting_down"
    error_type = "server_error"
    retry_after = 1.0


class Unauthorized(RequestError):
    """API-key mode: the ``Authorization`` header is missing, malformed or names no known key."""

    http_status = 401
    metric_label = "unauthorized"
    error_type = "invalid_request_error"


class LaneNotAllowed(RequestError):
    """The lane header asks for a lane the tenant's policy does not allow."""

    http_status = 403
    metric_label = "lane_not_allowed"
    error_type = "permission_error"


class InputTooLong(RequestError):
    """The prompt is over the tenant's ``maxInputTokens``."""

    metric_label = "input_too_long"


class OutputTooLong(RequestError):
    """``max_tokens`` is over the tenant's ``maxOutputTokens`` (and the rule is reject)."""

    metric_label = "output_too_long"


class TenantQueueFull(RequestError):
    """The tenant already has ``maxQueued`` requests waiting."""

    http_status = 429
    metric_label = "tenant_queue_full"
    error_type = "rate_limit_exceeded"
    retry_after = 1.0


class OverBudget(RequestError):
    """The tenant's token budget cannot cover the request (and the rule is reject)."""

    http_status = 429
    metric_label = "over_budget"
    error_type = "rate_limit_exceeded"


class NotLeader(RequestError):
    """This picker replica is a standby (leader election): the gateway should use the leader."""

    http_status = 503
    metric_label = "not_leader"
    error_type = "server_error"
    retry_after = 1.0
