"""The fairness-policy plugin interface and its registry.

A fairness policy answers one question: *within one lane, which queued request goes next?* It
holds the lane's queue and, for counter-based policies, each tenant's virtual counter. The
``Scheduler`` (``picker.core.lanes``) owns lanes, weights and costs, and tells the policy what each
tenant was charged, already divided by the tenant's weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from picker.core.request import Request


class FairnessPolicy(Protocol):
    """One lane's queue, ordered by a fairness rule."""

    name: str
    counters: dict[str, float]
    """Each tenant's virtual counter (normalized service received, plus lifts for VTC)."""

    def enqueue(self, request: Request, now: float) -> None:
        """Add a request (its ``seq`` is already set and increases with every call)."""
        ...

    def peek(self, now: float) -> Request | None:
        """The request this policy would dispatch next, or None if it would dispatch nothing."""
        ...

    def pop(self, request: Request, now: float) -> None:
        """Remove ``request`` (normally the one ``peek`` returned) because it is dispatched."""
        ...

    def remove(self, request: Request) -> None:
        """Remove a queued request that will not be dispatched (cancelled, timed out)."""
        ...

    def charge(self, tenant: str, normalized: float) -> None:
        """Record service given to ``tenant`` (weighted service ÷ tenant weight; may be < 0)."""
        ...

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter: normalized service received (plus lifts, for VTC)."""
        ...

    def queued(self) -> int:
        """How many requests are queued in this lane."""
        ...


PolicyFactory = Callable[..., FairnessPolicy]


def _registry() -> dict[str, PolicyFactory]:
    from picker.core.baselines import FirstComeFirstServed, RequestsPerWindow
    from picker.core.vtc import LeastCounterFirst, VirtualTokenCounter

    return {
        "vtc": VirtualTokenCounter,
        "lcf": LeastCounterFirst,
        "fcfs": FirstComeFirstServed,
        "rpm": RequestsPerWindow,
    }


POLICIES: tuple[str, ...] = ("vtc", "lcf", "fcfs", "rpm")


def make_policy(name: str, **options: float) -> FairnessPolicy:
    """A new, empty policy instance by name (``rpm`` takes ``limit`` and ``window``)."""
    factories = _registry()
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if name == "rpm":
        return factories[name](**options)
    return factories[name]()
