"""The strict loader behind every config and scenario: types, ranges, unknown keys, paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from picker.config.strict import load
from picker.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    size: int = field(default=1, metadata={"ge": 1, "le": 10})


@dataclass(frozen=True)
class Outer:
    mode: Literal["fast", "fair"] = "fair"
    ratio: float = field(default=0.5, metadata={"gt": 0, "lt": 1})
    label: str | None = None
    inner: Inner = Inner()
    items: tuple[Inner, ...] = ()
    limits: dict[str, int] = field(default_factory=dict)
    camel_case: bool = field(default=False, metadata={"key": "camelCase"})


def test_defaults_fill_in_and_ints_widen_to_floats() -> None:
    loaded = load(Outer, {"ratio": 0.25})
    assert loaded == Outer(ratio=0.25)
    assert load(Outer, {"inner": {"size": 3}}).inner.size == 3
    assert isinstance(load(Outer, {"ratio": 1e-3}).ratio, float)


def test_integer_given_for_float_is_a_float() -> None:
    @dataclass(frozen=True)
    class F:
        x: float = 0.0

    assert load(F, {"x": 3}).x == 3.0 and isinstance(load(F, {"x": 3}).x, float)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"mode": "quick"}, "mode: must be one of fast, fair; got 'quick'"),
        ({"ratio": 1}, "ratio: must be < 1"),
        ({"ratio": 0}, "ratio: must be > 0"),
        ({"ratio": "half"}, "ratio: must be a number, not str"),
        ({"ratio": True}, "ratio: must be a number, not bool"),
        ({"label": 5}, "label: must be a string; got 5"),
        ({"inner": {"size": 11}}, "inner.size: must be <= 10"),
        ({"inner": {"size": 2.5}}, "inner.size: must be an integer, not float"),
        ({"inner": []}, "inner: must be a mapping, not list"),
        ({"items": [{"size": 2}, {"sise": 2}]}, "items[1].sise: unknown key"),
        ({"limits": {"a": "x"}}, "limits.a: must be an integer, not str"),
        ({"camel_case": True}, "camel_case: unknown key"),
        ({"camelCase": "yes"}, "camelCase: must be true or false, not str"),
    ],
)
def test_bad_values_name_their_path(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(Outer, data)
    assert str(caught.value).startswith(message)


def test_key_alias_is_read() -> None:
    assert load(Outer, {"camelCase": True}).camel_case is True


def test_none_allowed_only_for_optional_fields() -> None:
    assert load(Outer, {"label": None}).label is None
    with pytest.raises(ConfigError, match="ratio: must be a number, not null"):
        load(Outer, {"ratio": None})


def test_sequences_load_as_tuples_for_frozen_objects() -> None:
    loaded = load(Outer, {"items": [{"size": 2}, {}]})
    assert loaded.items == (Inner(2), Inner(1))
