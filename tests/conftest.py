"""Marks each test by its tier, from the folder it lives in (run one tier with ``-m``).

``make test`` runs two pytest-xdist workers with ``--dist loadfile``: each test module runs
whole on one worker, so that its module-scoped stack is started once, while the other worker
takes other modules. (It ran ``--dist loadgroup`` with every process-tier test marked for one
group, meant to run those tests one at a time; the marks were never applied to the node ids, so
tests were spread one by one and a module's fixtures set up on both workers: the gateway
benchmark's 65 s smoke run twice.) Two modules that start processes may therefore run side by
side: these tests must hold on a busy machine, with no wall-clock goals (README,
"Development")."""

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
