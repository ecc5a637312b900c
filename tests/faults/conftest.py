"""What every fault scenario gets: a killed model server's port released at the test's end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.helpers import release_held_ports


@pytest.fixture(autouse=True)
def _release_held_ports() -> Iterator[None]:
    yield
    release_held_ports()
