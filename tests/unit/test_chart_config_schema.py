"""The chart's ``config`` values take every key the picker's config takes.

``charts/fairway/values.schema.json`` closes each section of ``config`` (``additionalProperties:
false``, so that a misspelt value fails at ``helm install``, not in a crash-looping pod). A key
the picker learns and the chart's schema does not is one a Helm user cannot set at all: Helm
refuses the values. These tests walk ``picker.config.schema.PickerConfig`` and find every key in
the chart's schema, and check that both refuse and accept the same values of the knobs most
often set.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from helm_python import Chart, HelmValuesError

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "charts" / "fairway" / "values.schema.json").read_text())
FROM_TOP_LEVEL = {"state"}
"""Config sections the chart writes from its top-level values (``redis``), never from
``config``: the schema of ``config`` leaves them out on purpose."""


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _dataclass_in(hint: Any) -> Any:
    """The dataclass a field holds (alone, in a tuple, or optional), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (tuple, typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            found = _dataclass_in(arg)
            if found is not None:
                return found
    return None


def _missing(cls: Any, node: dict[str, Any], path: str) -> list[str]:
    node = _resolve(node)
    if node.get("type") == "array":
        node = _resolve(node["items"])
    properties = node.get("properties", {})
    hints = typing.get_type_hints(cls)
    missing = []
    for field in dataclasses.fields(cls):
        key = field.metadata.get("key", field.name)
        if path == "config." and key in FROM_TOP_LEVEL:
            continue
        if key not in properties:
            missing.append(path + key)
            continue
        nested = _dataclass_in(hints[field.name])
        if nested is not None:
            missing += _missing(nested, properties[key], f"{path}{key}.")
    return missing


def test_every_config_key_has_a_place_in_the_charts_schema() -> None:
    assert _missing(PickerConfig, SCHEMA["properties"]["config"], "config.") == []


CHART = Chart.load(ROOT / "charts" / "fairway")


def _chart_accepts(config: dict[str, Any]) -> bool:
    """What ``helm install`` does with a values file setting ``config``: Helm's own merge onto
    the chart's values, then its schema check."""
    try:
        CHART.validate_schema(CHART.merge_values({"config": config}))
    except HelmValuesError:
        return False
    return True


def test_the_charts_own_values_pass_its_schema() -> None:
    assert _chart_accepts({})


def _picker_accepts(config: dict[str, Any]) -> bool:
    try:
        load(PickerConfig, config)
    except ConfigError:
        return False
    return True


GOOD = [
    {"scheduling": {"policy": "vtc", "enginePolicy": "priority", "preempt": False}},
    {"queue": {"maxQueued": 100, "maxWait": "30s", "newestFirstAfter": "5s"}},
    {"capacity": {"idleTenantReserve": "10s", "growthRoom": True, "maxPrefillTokens": 8192,
                  "readyReserve": True}},
    {"capacity": {"profile": "isolation"}},
    {"capacity": {"profile": "throughput", "growthRoom": True}},
    {"limits": {"maxBodyBytes": 1024, "maxBufferedBytes": 4096, "bodyIdleTimeout": "10s"}},
    {"health": {"consecutiveFailures": 3, "baseEjectionTime": "5s",
                "maxEjectionTime": "60s"}},
    {"routing": {"passThrough": [{"method": "GET", "path": "/v1/models"}]}},
]
BAD = [
    {"scheduling": {"enginePolicy": "random"}},
    {"scheduling": {"preempt": "yes"}},
    {"queue": {"newestFirstAfter": "soon"}},
    {"capacity": {"growthRoom": 1}},
    {"capacity": {"profile": "latency"}},
    {"capacity": {"maxPrefillTokens": -1}},
    {"limits": {"maxBufferedBytes": 0}},
    {"health": {"consecutiveFailures": 0}},
    {"routing": {"passThrough": [{"method": "GET"}]}},
]


@pytest.mark.parametrize("config", GOOD, ids=lambda c: next(iter(c)))
def test_the_chart_takes_what_the_picker_takes(config: dict[str, Any]) -> None:
    assert _picker_accepts(config)
    assert _chart_accepts(config)


@pytest.mark.parametrize("config", BAD, ids=lambda c: json.dumps(c))
def test_the_chart_refuses_what_the_picker_refuses(config: dict[str, Any]) -> None:
    assert not _picker_accepts(config)
    assert not _chart_accepts(config)
