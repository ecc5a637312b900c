"""Health like upstream's picker: which gRPC health service names answer SERVING when.

``readiness``, ``""`` and the ext_proc service name follow readiness (leading, or no election;
endpoints synced; not draining); ``liveness`` is SERVING while the process runs, standbys
included. ``PoolDiscovery`` says when an InferencePool has synced.
"""

from __future__ import annotations

from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from picker.k8s.discovery import PoolDiscovery
from picker.server import (
    EXT_PROC_SERVICE,
    HEALTH_SERVICES,
    LIVENESS,
    READINESS,
    Health,
    HealthState,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_NAMES = ("", READINESS, EXT_PROC_SERVICE)


def test_the_service_names_are_upstreams() -> None:
    assert set(HEALTH_SERVICES) == {"", "liveness", "readiness",
                                    "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert set(HealthState().statuses()) == set(HEALTH_SERVICES)


@pytest.mark.parametrize(("state", "ready"), [
    (HealthState(leading=True, synced=True), True),              # the leader, after sync
    (HealthState(leading=True, synced=False), False),            # before the pool syncs
    (HealthState(leading=False, synced=True), False),            # a standby
    (HealthState(leading=True, synced=True, draining=True), False),  # SIGTERM came
    (HealthState(leading=False, synced=False), False),
])
def test_readiness_needs_leading_synced_and_not_draining(state: HealthState, ready: bool) -> None:
    statuses = state.statuses()
    for name in READY_NAMES:
        assert statuses[name] == (SERVING if ready else NOT_SERVING), name
    # Alive whatever readiness says: a standby or a picker waiting for its pool is not restarted.
    assert statuses[LIVENESS] == SERVING


def test_only_the_end_of_shutdown_takes_liveness() -> None:
    statuses = HealthState(leading=True, synced=True, alive=False).statuses()
    assert set(statuses.values()) == {NOT_SERVING}


class FakeServicer:
    """Records what a ``grpc_health`` servicer would answer."""

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}

    async def set(self, service: str, status: int) -> None:
        self.statuses[service] = status


async def test_health_publishes_the_same_answers_to_every_servicer() -> None:
    probe, ext_proc = FakeServicer(), FakeServicer()
    health = Health(probe, ext_proc, state=HealthState(leading=False, synced=False))  # type: ignore[arg-type]
    await health.update()
    assert probe.statuses == ext_proc.statuses
    assert probe.statuses[READINESS] == NOT_SERVING and probe.statuses[LIVENESS] == SERVING
    await health.update(synced=True)
    assert probe.statuses[READINESS] == NOT_SERVING  # still a standby
    await health.update(leading=True)
    assert all(probe.statuses[n] == SERVING for n in READY_NAMES)
    assert probe.statuses == ext_proc.statuses
    await health.update(draining=True)
    assert all(ext_proc.statuses[n] == NOT_SERVING for n in READY_NAMES)
    assert ext_proc.statuses[LIVENESS] == SERVING


async def test_changes_from_callbacks_end_on_the_latest_state() -> None:
    probe = FakeServicer()
    health = Health(probe, state=HealthState(leading=False, synced=True))  # type: ignore[arg-type]
    health.change(leading=True)
    health.change(leading=False)  # lost again before the first publication ran
    health.change(leading=True)
    await health.update()
    assert probe.statuses[READINESS] == SERVING
    health.change(leading=False)
    await health.update()
    assert probe.statuses[READINESS] == NOT_SERVING


# -- PoolDiscovery's synced signal --


def _discovery(seen: list[bool]) -> PoolDiscovery:
    return PoolDiscovery(None, "ns", "pool", lambda endpoints: None,  # type: ignore[arg-type]
                         on_synced=seen.append)


def _pool() -> dict[str, Any]:
    return {"metadata": {"name": "pool"},
            "spec": {"selector": {"matchLabels": {"app": "llm"}},
                     "targetPorts": [{"number": 8000}]}}


def test_pool_is_synced_once_both_lists_are_in_and_the_pool_exists() -> None:
    seen: list[bool] = []
    discovery = _discovery(seen)
    discovery.pools.objects["pool"] = _pool()
    discovery.pools.synced = True
    discovery._changed()
    assert (discovery.synced, seen) == (False, [])  # pods not listed yet
    discovery.pods.synced = True
    discovery._changed()
    assert (discovery.synced, seen) == (True, [True])
    discovery._changed()
    assert seen == [True]  # told once per change


def test_a_missing_or_deleted_pool_is_not_synced() -> None:
    seen: list[bool] = []
    discovery = _discovery(seen)
    discovery.pools.synced = discovery.pods.synced = True
    discovery._changed()  # listed, but the InferencePool does not exist
    assert (discovery.synced, seen, discovery.endpoints) == (False, [], [])
    discovery.pools.objects["pool"] = _pool()
    discovery._changed()
    assert seen == [True]
    del discovery.pools.objects["pool"]
    discovery._changed()
    assert (discovery.synced, seen) == (False, [True, False])
