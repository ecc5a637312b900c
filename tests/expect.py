"""The convention of the bad-input fixtures: each file's first line says the error it must raise;
a TenantPolicy fixture's second line says what a real API server answers (its own wording, which
``kubectl apply`` shows and the cluster tests check)."""

from __future__ import annotations

from pathlib import Path

PREFIX = "# expect: "
SERVER_PREFIX = "# server: "


def expected_message(path: Path) -> str:
    """The message (or a fragment of it) a bad fixture file must be refused with."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(PREFIX), f"{path.name} must start with '{PREFIX}<message>'"
    return first.removeprefix(PREFIX)


def server_message(path: Path) -> str:
    """What a real API server must answer when a bad TenantPolicy fixture is applied."""
    second = path.read_text(encoding="utf-8").splitlines()[1]
    assert second.startswith(SERVER_PREFIX), \
        f"{path.name}: line 2 must be '{SERVER_PREFIX}<message>'"
    return second.removeprefix(SERVER_PREFIX)
