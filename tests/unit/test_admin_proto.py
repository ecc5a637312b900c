"""The committed admin API code matches ``proto/fairway/v1/admin.proto`` (run ``make proto``)."""

from __future__ import annotations

from pathlib import Path

from scripts.gen_proto import generate

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date() -> None:
    for name, text in generate().items():
        committed = (ROOT / "picker" / "admin" / "v1" / name).read_text()
        assert committed == text, f"picker/admin/v1/{name} is stale: run `make proto`"
