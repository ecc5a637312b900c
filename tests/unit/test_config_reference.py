"""``docs/configuration.md`` matches the config schema (``python scripts/config_reference.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from picker.config.schema import PickerConfig
from scripts.config_reference import render

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), \
        "docs/configuration.md is stale: run `python scripts/config_reference.py`"


def test_every_key_is_documented_by_its_full_path() -> None:
    text = render()
    for field in dataclasses.fields(PickerConfig):
        assert f"| `{field.metadata.get('key', field.name)}` |" in text
    assert "| `tenants[].budgets.burst.tokens` |" in text
