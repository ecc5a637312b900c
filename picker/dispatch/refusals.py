"""Which error a client gets for each admission refusal of the core (``picker.core.admission``).

One mapping, beside the dispatcher that raises them; the errors' HTTP statuses and metric labels
are ``picker.errors``'.
"""

from __future__ import annotations

from picker.core.admission import (
    INPUT_TOO_LONG,
    INSUFFICIENT_QUOTA,
    OUTPUT_TOO_LONG,
    OVER_BUDGET,
    Refused,
)
from picker.errors import (
    InputTooLong,
    InsufficientQuota,
    OutputTooLong,
    OverBudget,
    RequestError,
    TenantQueueFull,
)

_REFUSALS: dict[str, type[RequestError]] = {
    INPUT_TOO_LONG: InputTooLong, OUTPUT_TOO_LONG: OutputTooLong, OVER_BUDGET: OverBudget,
    INSUFFICIENT_QUOTA: InsufficientQuota}


def refusal_error(refused: Refused) -> RequestError:
    """The error a client gets for an admission refusal."""
    kind = _REFUSALS.get(refused.reason, TenantQueueFull)
    return kind(refused.message, retry_after=refused.retry_after)
