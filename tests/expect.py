"""The convention of the bad-input fixtures: each file's first line says the error it must raise."""

from __future__ import annotations

from pathlib import Path

PREFIX = "# expect: "


def expected_message(path: Path) -> str:
    """The message (or a fragment of it) a bad fixture file must be refused with."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(PREFIX), f"{path.name} must start with '{PREFIX}<message>'"
    return first.removeprefix(PREFIX)
