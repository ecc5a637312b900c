"""Marks each test by its tier, from the folder it lives in (run one tier with ``-m``)."""

from __future__ import annotations

import pytest


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
