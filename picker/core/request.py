"""What the core knows about one request: who sent it, its size, and what it has been charged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a request actually consumed, as the engine reports them (or as counted)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(eq=False, slots=True)
class Request:
    """One request as the scheduler sees it.

    Identity is the object itself (``eq=False``): two requests with equal fields are still two
    requests. The scheduler owns the mutable accounting fields below the line.
    """

    tenant: str
    prompt_tokens: int
    lane: str = ""
    max_output_tokens: int = 0
    cached_prompt_tokens: int = 0
    arrival: float = 0.0
    id: str = ""
    resumes: bool = False
    """A call of a program in progress (``picker.core.sessions``): it goes before its tenant's
    requests that do not resume one, in the fair queue's order within the tenant. Set before it
    is queued; never changes while it is."""
    program: int = 0
    """With ``resumes``: when its program started (the order of its first call's dispatch).
    The tenant's programs in progress go oldest first, so they finish in the order they
    started instead of all advancing together."""
    # -- accounting, written by the scheduler only --
    seq: int = field(default=-1, repr=False)
    """Enqueue order, unique per scheduler: FCFS order and the tie-break among equal counters."""
    generated: int = field(default=0, repr=False)
    """Output tokens charged so far as actually produced."""
    estimated_output: int = field(default=0, repr=False)
    """Output tokens charged ahead of production on an estimate (not yet produced)."""
    charged: float = field(default=0.0, repr=False)
    """Weighted service charged for this request so far (not divided by the tenant's weight)."""
    state: str = field(default="new", repr=False)
    """new → queued → running → done (or cancelled)."""
