"""The committed admin API code matches ``proto/fairway/v1/admin.proto`` (run ``make proto``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    for name, text in gen_proto.generate().items():
        committed = (ROOT / "picker" / "admin" / "v1" / name).read_text()
        assert committed == text, f"picker/admin/v1/{name} is stale: run `make proto`"
