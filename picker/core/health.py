"""Endpoint health: is this model server taking requests, or ejected for a while?

Pure (time passed in). The rule is Envoy's outlier detection, reduced to what the picker sees:

* **Failures** are scrapes that fail (connection refused, timeout, HTTP error) and requests that
  never reached an engine (the gateway's upstream connect failure or reset, reported on the
  response path). Any success (a scrape answered, a response from the engine) resets the count.
* ``consecutive_failures`` in a row **eject** the endpoint for ``base_ejection × n`` seconds, n
  the number of times it was ejected (capped at ``max_ejection``), as Envoy's
  ``base_ejection_time`` and ``max_ejection_time`` do.
* When that time has passed the endpoint is **probed**: one request or one scrape may try it.
  A success restores it; a failure ejects it again, for longer.
* Each ``max_ejection`` it then stays healthy takes one off its ejection count (Envoy decrements
  its multiplier the same way), so an endpoint that failed long ago starts again from
  ``base_ejection``.
* **The last endpoint still in service is never ejected** (``may_eject``). Envoy bounds ejection
  with ``max_ejection_percent`` and a panic threshold for the same reason: when every endpoint
  looks bad, the signal (a flaky scrape, an overloaded machine) is more likely wrong than the
  whole pool gone, and ejecting it would refuse everyone. A request sent to a truly dead last
  endpoint fails with a retryable 503 and is not charged, which is what refusing it would give.
"""

from __future__ import annotations

from dataclasses import dataclass

HEALTHY = "healthy"
EJECTED = "ejected"
PROBING = "probing"


@dataclass(frozen=True, slots=True)
class HealthRules:
    """When an endpoint is ejected and for how long (see ``picker.config.schema.Health``)."""

    consecutive_failures: int = 3
    base_ejection: float = 1.0
    max_ejection: float = 30.0


@dataclass
class EndpointHealth:
    """One endpoint's standing. Mutated only by the functions of this module."""

    failures: int = 0
    """Consecutive failures since the last success."""
    ejections: int = 0
    """Times ejected (decays while healthy): the backoff multiplier."""
    ejected_until: float | None = None
    """While set, the endpoint is ejected until then, then probing."""
    probe_out: bool = False
    """A probe request is in flight (probing): no other request may go there."""
    healthy_since: float = 0.0
    last_reason: str = ""

    def state(self, now: float) -> str:
        if self.ejected_until is None:
            return HEALTHY
        return EJECTED if now < self.ejected_until else PROBING


def available(health: EndpointHealth, now: float) -> bool:
    """Whether a request may be sent there now: healthy, or probing with no probe in flight."""
    state = health.state(now)
    return state == HEALTHY or (state == PROBING and not health.probe_out)


def ejection_time(health: EndpointHealth, rules: HealthRules) -> float:
    """How long the next ejection lasts."""
    return min(rules.max_ejection, rules.base_ejection * (health.ejections + 1))


def on_dispatch(health: EndpointHealth, now: float) -> None:
    """A request was sent there: while probing, it is the probe."""
    if health.state(now) == PROBING:
        health.probe_out = True


def record_success(health: EndpointHealth, now: float, rules: HealthRules) -> bool:
    """The endpoint answered (a scrape, or a response from its engine). True when this restored
    an ejected endpoint. An answer while ejected (a request sent before the ejection) counts too:
    the endpoint is back."""
    restored = health.ejected_until is not None
    if restored:
        health.ejected_until = None
        health.probe_out = False
        health.healthy_since = now
    elif health.ejections and now - health.healthy_since >= rules.max_ejection:
        health.ejections -= 1
        health.healthy_since = now
    health.failures = 0
    return restored


def record_failure(health: EndpointHealth, now: float, rules: HealthRules, reason: str,
                   may_eject: bool = True) -> bool:
    """The endpoint failed (a scrape, or a request that never reached its engine). True when
    this ejected it. ``may_eject``: False when it is the last endpoint in service."""
    health.last_reason = reason
    state = health.state(now)
    if state == EJECTED:
        return False  # already out; requests sent before the ejection still report back
    health.failures += 1
    if state == PROBING or (health.failures >= rules.consecutive_failures and may_eject):
        health.ejected_until = now + ejection_time(health, rules)
        health.ejections += 1
        health.probe_out = False
        health.failures = 0
        return True
    return False
