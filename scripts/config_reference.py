"""Write ``docs/configuration.md``: every key of the picker's config, from the schema itself.

The keys, types, defaults and rules come from the dataclasses in ``picker/config/schema.py`` and
their field metadata; the descriptions are the docstrings under each field (read with ``ast``,
since Python keeps no attribute docstrings). ``tests/unit/test_config_reference.py`` fails when
the committed document and the schema disagree; ``python scripts/config_reference.py`` rewrites it.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import sys
import types
import typing
from pathlib import Path
from typing import Any, cast

from picker.config import schema

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
RULES = {"ge": ">= {}", "gt": "> {}", "le": "<= {}", "lt": "< {}",
         "min_length": "at least {} character(s)"}


def _field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) → the docstring written under the field."""
    tree = ast.parse(Path(schema.__file__).read_text())
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, after in itertools.pairwise(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.name, stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X``, ``X | None``, ``tuple[X, ...]``), if any."""
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        found = _dataclass_of(arg)
        if found is not None:
            return found
    return None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "object"
    return getattr(tp, "__name__", str(tp))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(see below)"
    if value is None and field.metadata.get("profile"):
        return "the profile's"
    if value == () or value is None:
        return "unset" if value is None else "none"
    if isinstance(value, tuple):
        return ", ".join(f"`{cast(Any, v).name if dataclasses.is_dataclass(v) else v}`"
                         for v in value)
    return f"`{value}`"


def _rows(cls: type, prefix: str, docs: dict[tuple[str, str], str],
          seen: set[type]) -> list[list[str]]:
    hints = typing.get_type_hints(cls)
    rows: list[list[str]] = []
    for field in dataclasses.fields(cls):
        key = field.metadata.get("key", field.name)
        path = f"{prefix}{key}"
        tp = hints[field.name]
        rules = [text.format(field.metadata[rule]) for rule, text in RULES.items()
                 if rule in field.metadata]
        if field.metadata.get("duration"):
            rules.append("a duration (`250ms`, `60s`, `1m30s`, `24h`)")
        nested = _dataclass_of(tp)
        is_list = typing.get_origin(tp) is tuple
        meaning = docs.get((cls.__name__, field.name)) or \
            (" ".join((nested.__doc__ or "").split()) if nested is not None else "")
        rows.append([f"`{path}`", _type_name(tp), _default(field), "; ".join(rules),
                     meaning.replace("``", "`")])
        if nested is not None and nested not in seen:
            rows += _rows(nested, f"{path}[]." if is_list else f"{path}.", docs,
                          seen | {nested})
    return rows


def render() -> str:
    """The whole document."""
    docs = _field_docs()
    head = ("# Picker configuration reference\n\n"
            "Generated from `picker/config/schema.py` by `python scripts/config_reference.py`; "
            "a test keeps the two in step. Keys are camelCase; unknown keys, and a key written "
            "twice in one mapping, are errors naming their path. Durations are a number of "
            "seconds or Go's duration syntax, as Kubernetes writes it (`250ms`, `90s`, `1m30s`, "
            "`1h2m3.5s`, `1.5h`; units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`), plus `d` for days "
            "(`1d`; Go has no `d`); a quoted number without a unit (`\"50\"`) is refused. "
            "`python -m picker.config check FILE` validates a file.\n\n"
            f"{' '.join((schema.PickerConfig.__doc__ or '').split())}\n\n")
    table = ["| key | type | default | rules | meaning |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(cell.replace("|", "\\|") if i != 1 else cell
                                for i, cell in enumerate(row)) + " |"
              for row in _rows(schema.PickerConfig, "", docs, {schema.PickerConfig})]
    return head + "\n".join(table) + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
