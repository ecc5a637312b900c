"""Strict loading of plain data (parsed YAML) into frozen dataclasses.

It answers: *is this document exactly what the schema allows, and if not, where is it wrong?*
Unknown keys, missing required keys, wrong types and out-of-range values are errors whose path
names the field (``tenants[1].arrivals[0].rate: must be >= 0``). Field metadata carries the rules:
``key`` (the document's spelling, e.g. camelCase), ``ge``/``gt``/``le``/``lt`` (ranges),
``min_length`` (strings) and
``duration`` (a float of seconds: a number, or Go's duration syntax as Kubernetes and the picker
itself write it, ``250ms``, ``60s``, ``1m30s``, ``1h2m3.5s``, ``1.5h``, plus ``d`` for days).
Cross-field rules live in the dataclass's ``__post_init__``, raising ``ConfigError`` with a path
relative to the object. A key that moved elsewhere is named in the class's ``MOVED_KEYS`` (old
key to where it went, in words): writing it at the old place is an error that says where.

YAML is read by ``safe_load`` (``yaml.safe_load`` with one difference: a mapping key written
twice is an error naming its path and both lines, where PyYAML would keep the last silently).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from picker.errors import ConfigError

T = TypeVar("T")

_RANGE_RULES = {
    "min_length": (lambda v, b: len(v) >= b, "must have at least {} character(s)"),
    "ge": (lambda v, b: v >= b, "must be >= {}"),
    "gt": (lambda v, b: v > b, "must be > {}"),
    "le": (lambda v, b: v <= b, "must be <= {}"),
    "lt": (lambda v, b: v < b, "must be < {}"),
}


# Go's time.ParseDuration units (both spellings of micro), plus ``d``: fairway accepted days
# before it accepted Go's syntax, and 24h windows read better as 1d. Go has no ``d``.
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3,
                   "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# One ``<number><unit>`` term; a number is digits with an optional fraction (``1.``, ``.5``),
# as Go allows. Longer units first, so ``ms`` is not read as ``m`` followed by junk.
_DURATION_TERM = re.compile(
    r"(\d+\.?\d*|\.\d+)(" + "|".join(sorted(map(re.escape, _DURATION_UNITS), key=len,
                                              reverse=True)) + ")")
_DURATION = re.compile(rf"[+-]?(?:{_DURATION_TERM.pattern})+")
_DURATION_HINT = "a duration such as 250ms, 60s, 5m, 1m30s or 24h"


def parse_duration(value: Any, path: str) -> float:
    """Seconds from a number, or a string in Go's duration syntax (``1m30s``, ``250ms``, ``24h``).

    Go's ``time.ParseDuration`` grammar: an optional sign, then one or more ``<number><unit>``
    terms (``ns``, ``us``/``µs``, ``ms``, ``s``, ``m``, ``h``), summed; ``"0"`` alone needs no
    unit. fairway also takes ``d`` (86400 s) and a YAML number (seconds). A string of digits
    without a unit (``"50"``) is refused, as Go refuses it: a quoted number is more likely a
    mistake than seconds. The range (``> 0`` and so on) is the field's rule, checked after.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite duration, got {value}")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text in ("0", "+0", "-0"):
            return 0.0
        if _DURATION.fullmatch(text):
            seconds = sum(float(number) * _DURATION_UNITS[unit]
                          for number, unit in _DURATION_TERM.findall(text))
            if math.isfinite(seconds):
                return -seconds if text.startswith("-") else seconds
    raise ConfigError(path, f"must be {_DURATION_HINT}; got {value!r}")


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key written twice (ConfigError naming it).

    The check walks the composed node tree before anything is constructed, so the error can say
    where the key is (``tenants[1].weight``) and on which lines. Keys brought in by a merge
    (``<<: *defaults``) may be overridden, as YAML's merge rule says; only keys written out
    twice in one mapping are refused.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(self, node, "", set())
        return super().construct_document(node)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.Node, path: str,
                           seen: set[int]) -> None:
    if id(node) in seen:  # an alias: its node was checked where it was anchored
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(loader, item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _refuse_duplicate_keys(loader, value_node, path, seen)
                continue
            key = _key_of(loader, key_node)
            where = f"{path}.{key}" if path else str(key)
            line = key_node.start_mark.line + 1
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the constructor refuses it with its own error
                continue
            if earlier is not None:
                lines = f"line {line}" if earlier == line else f"lines {earlier} and {line}"
                raise ConfigError(where, f"key written twice ({lines})")
            first_line[key] = line
            _refuse_duplicate_keys(loader, value_node, where, seen)


def _key_of(loader: yaml.SafeLoader, key_node: yaml.Node) -> Any:
    """The key as PyYAML would construct it (``1`` and ``"1"`` differ; ``a`` and ``"a"`` do not)."""
    if isinstance(key_node, yaml.ScalarNode):
        return loader.construct_object(key_node)
    return key_node.start_mark.index  # a collection key cannot repeat a scalar one


def safe_load(text: str) -> Any:
    """``yaml.safe_load(text)``, except that a mapping key written twice raises ConfigError."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader: no arbitrary objects


def load_yaml_file(cls: type[T], path: str | Path) -> T:
    """Read a YAML file and load it strictly into ``cls``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path} is not valid YAML: {exc}") from exc
    return load(cls, data)


def require_unique(values: Sequence[str], path: str, what: str) -> None:
    """ConfigError at the first repeat: ``path`` names the field, with ``{}`` for the index."""
    for i, value in enumerate(values):
        if value in values[:i]:
            raise ConfigError(path.format(i), f"duplicate {what} {value!r}")


def require_known(value: str | None, known: Sequence[str], path: str, what: str) -> None:
    """ConfigError unless ``value`` (when set) is one of ``known``."""
    if value is not None and value not in known:
        raise ConfigError(path, f"unknown {what} {value!r}; {what}s are {', '.join(known)}")


def load(cls: type[T], data: Any, path: str = "") -> T:
    """Build a ``cls`` dataclass from ``data``, or raise ConfigError naming the bad field."""
    return _convert(cls, data, path)


def _kind(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if tp in names:
        return names[tp]
    return "a mapping" if dataclasses.is_dataclass(tp) else "a list"


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(exc)
        deeper = [e for e in errors if e.path != path]
        if deeper:
            raise deeper[0]
        wanted = " or ".join(_kind(o) for o in options if o is not type(None))
        raise ConfigError(path, f"must be {wanted}; got {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")
        return value
    if origin in (list, tuple):
        return _convert_sequence(tp, value, path)
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, not {_describe(value)}")
        return {
            _convert(key_type, k, path): _convert(value_type, v, f"{path}.{k}" if path else str(k))
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, path)


def _convert_sequence(tp: Any, value: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if not isinstance(value, list):
        raise ConfigError(path, f"must be a list, not {_describe(value)}")
    if typing.get_origin(tp) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ConfigError(path, f"must be a list of {len(args)} items, got {len(value)}")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in pairs)
    item_type = args[0]
    items = [_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if typing.get_origin(tp) is tuple else items


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, not {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, not {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, not {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, not {_describe(value)}")
        return value
    raise TypeError(f"schema type {tp!r} at {path or '<root>'} is not supported")


def _key(field: dataclasses.Field) -> str:
    return field.metadata.get("key", field.name)


def _load_dataclass(cls: Any, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be a mapping, not {_describe(value)}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = {_key(f) for f in fields}
    moved: dict[str, str] = getattr(cls, "MOVED_KEYS", {})
    for key in value:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            if key in moved:
                raise ConfigError(where, f"moved: {moved[key]}")
            raise ConfigError(where, f"unknown key; expected one of {', '.join(sorted(known))}")
    kwargs = {}
    for field in fields:
        key = _key(field)
        where = f"{path}.{key}" if path else key
        if key not in value:
            required = dataclasses.MISSING is field.default is field.default_factory
            if required:
                raise ConfigError(where, "is required")
            continue
        if field.metadata.get("duration"):
            converted = parse_duration(value[key], where)
        else:
            converted = _convert(hints[field.name], value[key], where)
        _check_range(field, converted, where)
        kwargs[field.name] = converted
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(path) from None


def _check_range(field: dataclasses.Field, value: Any, path: str) -> None:
    if value is None:
        return
    if isinstance(value, list | tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        items = [(path, value)]
    for rule, (ok, message) in _RANGE_RULES.items():
        if rule in field.metadata:
            bound = field.metadata[rule]
            for where, v in items:
                if not ok(v, bound):
                    raise ConfigError(where, message.format(bound))
