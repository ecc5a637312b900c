"""Marks each test by its tier, from the folder it lives in (run one tier with ``-m``), and
keeps the tiers that drive real load one at a time when ``make test`` runs two workers."""

from __future__ import annotations

import pytest

LOAD_TIERS = ("e2e", "faults", "integration")
"""Tiers whose tests drive load through Envoy, pickers and servers, or judge shares, latency and
timing (the integration tier's load generator and simulated server keep schedules to 0.1 s):
under pytest-xdist they all run on one worker, one after another, as they were tuned; the other
worker takes the pure and cluster tests beside them. (An integration test beside the e2e tier
missed its schedule by 0.2 s in a fresh-ci run.)"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)
        elif "e2e" in parts:
            item.add_marker(pytest.mark.e2e)
        elif "faults" in parts:
            item.add_marker(pytest.mark.faults)
        elif "cluster" in parts:
            item.add_marker(pytest.mark.cluster)
        if any(tier in parts for tier in LOAD_TIERS):
            item.add_marker(pytest.mark.xdist_group("load"))
