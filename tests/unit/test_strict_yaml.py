"""Strict YAML (a key written twice is an error naming its path) and Go-style durations.

Every reader of config and scenarios goes through ``picker.config.strict.safe_load``: the picker's
config file, its ConfigMap text, the operator's base config, scenarios and traffic files. The
bad-file fixtures (``tests/fixtures/*/bad/duplicate_*.yaml``) cover the loaders end to end; these
tests cover the loader's rules and each entry point.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fairway_operator.render import parse_base
from picker.config.schema import load_config
from picker.config.strict import parse_duration, safe_load
from picker.core.admission import format_duration
from picker.errors import ConfigError
from picker.k8s.configmap import parse_config_text

# -- duplicate keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nb: 2\na: 3\n", "a: key written twice (lines 1 and 3)"),
    ("x:\n  y:\n    z: 1\n    z: 2\n", "x.y.z: key written twice (lines 3 and 4)"),
    ("- {}\n- [{}, {k: 1, k: 1}]\n", "[1][1].k: key written twice (line 2)"),
    # PyYAML reads a plain and a quoted spelling as the same string key
    ("key: 1\n'key': 2\n", "key: key written twice (lines 1 and 2)"),
    # and 0x10 and 16 as the same integer
    ("16: a\n0x10: b\n", "16: key written twice (lines 1 and 2)"),
])
def test_a_key_written_twice_is_refused_with_its_path_and_lines(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        safe_load(text)
    assert str(caught.value) == message


def test_without_repeats_it_reads_what_pyyaml_reads() -> None:
    text = ("a: 1\nb: [1, 2.5, {c: d}]\n'1': string\n2: integer\nnull: ~\n"
            "when: 2024-01-02\nyes: no\n2.5: f\n")
    assert safe_load(text) == yaml.safe_load(text)
    assert safe_load("") is None
    # keys Python takes as equal collide in the dict PyYAML builds: refused, not overwritten
    with pytest.raises(ConfigError, match=r"key written twice \(lines 1 and 2\)"):
        safe_load("1: a\ntrue: b\n")


def test_a_merge_may_be_overridden_but_an_anchored_repeat_is_still_found() -> None:
    text = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n"
    assert safe_load(text) == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}
    with pytest.raises(ConfigError, match=r"^base\.x: key written twice"):
        safe_load("base: &b {x: 1, x: 2}\nother: *b\n")


def test_it_stays_safe() -> None:
    with pytest.raises(yaml.YAMLError):
        safe_load("!!python/object/apply:os.system ['true']")


def test_the_config_cli_names_the_duplicate(tmp_path) -> None:
    from picker.config.__main__ import main

    path = tmp_path / "picker.yaml"
    path.write_text("tenants:\n  - id: a\n  - id: b\n    weight: 1\n    weight: 2\n")
    with pytest.raises(ConfigError, match=r"^tenants\[1\]\.weight: key written twice "
                                          r"\(lines 4 and 5\)$"):
        load_config(path)
    assert main(["check", str(path)]) == 1


def test_configmap_text_is_strict() -> None:
    assert parse_config_text("queue: {maxWait: 1m30s}\n").queue.max_wait == 90.0
    with pytest.raises(ConfigError, match=r"^queue: key written twice \(lines 1 and 2\)$"):
        parse_config_text("queue: {maxWait: 5s}\nqueue: {maxWait: 6s}\n")


def test_the_operators_base_config_is_strict() -> None:
    assert parse_base({"base.yaml": "lanes: [{name: a}]\n"}, "base.yaml", "ns/base") == {
        "lanes": [{"name": "a"}]}
    with pytest.raises(ConfigError) as caught:
        parse_base({"base.yaml": "lanes: [{name: a}]\nlanes: []\n"}, "base.yaml", "ns/base")
    assert caught.value.path == "lanes"
    assert caught.value.message == "key written twice (lines 1 and 2) (ConfigMap ns/base key " \
                                   "base.yaml)"


# -- durations ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("1m30s", 90.0), ("1h2m3.5s", 3723.5), ("250ms", 0.25), ("1.5h", 5400.0), ("0s", 0.0),
    ("0", 0.0), ("500us", 0.0005), ("500\u00b5s", 0.0005), ("500\u03bcs", 0.0005),
    ("1500ns", 1.5e-6), ("2h45m", 9900.0), ("1m0.001s", 60.001), (".5s", 0.5), ("1.s", 1.0),
    ("-1m30s", -90.0), ("+5s", 5.0), ("2d", 172800.0), ("1d12h", 129600.0), (" 60s ", 60.0),
    (30, 30.0), (0.5, 0.5),
])
def test_go_durations_are_read(text: str | float, seconds: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(seconds, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("text", [
    "50", "1", "s", "", "1 m", "1h 2m", "1e3s", "infs", "nans", "1.5.5s", "1S", "1M", "1min",
    "5 seconds", "m5", "1h-2m", "--1s", ".s", "1hh", True, None, [], float("inf"),
])
def test_what_go_refuses_is_refused(text: object) -> None:
    with pytest.raises(ConfigError, match=r"^q\.w: must be a (finite )?duration"):
        parse_duration(text, "q.w")


def test_a_config_takes_what_kubernetes_writes() -> None:
    config = load_config({"queue": {"maxWait": "1m30s"},
                          "capacity": {"scrapeInterval": "50ms", "metricsStaleAfter": "1.5s"}})
    assert (config.queue.max_wait, config.capacity.scrape_interval,
            config.capacity.metrics_stale_after) == (90.0, 0.05, 1.5)


@settings(max_examples=400, deadline=None)
@given(st.floats(min_value=0, max_value=10 * 86400, allow_nan=False))
def test_what_the_picker_writes_reads_back(seconds: float) -> None:
    """``format_duration`` (``x-ratelimit-reset-*``, Retry messages) parses back to its value:
    the seconds rounded up to the millisecond, and writing it again gives the same text."""
    text = format_duration(seconds)
    parsed = parse_duration(text, "reset")
    assert parsed == pytest.approx(math.ceil(seconds * 1000 - 1e-6) / 1000 if seconds > 0 else 0,
                                   abs=1e-9)
    assert parsed >= seconds - 1e-6  # never early
    assert format_duration(parsed) == text


# -- the same durations at the gates before the picker ------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml").read_text())
CRD_PER = re.compile(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
                     ["properties"]["budgets"]["properties"]["burst"]["properties"]["per"]
                     ["pattern"])
CHART_SCHEMA = json.loads((ROOT / "charts" / "fairway" / "values.schema.json").read_text())
CHART_POSITIVE = re.compile(CHART_SCHEMA["definitions"]["positiveDuration"]["pattern"])
CHART_DURATION = re.compile(CHART_SCHEMA["definitions"]["duration"]["pattern"])


@pytest.mark.parametrize("text", ["1m30s", "1h30m", "1d12h", "0m1s", "2h0m0.5s", "250ms", "24h"])
def test_the_crd_and_the_chart_take_go_durations_too(text: str) -> None:
    assert CRD_PER.match(text) and CHART_POSITIVE.match(text) and CHART_DURATION.match(text)
    assert parse_duration(text, "per") > 0


@pytest.mark.parametrize("text", ["0s", "0m0s", "0.0h0s"])
def test_zero_is_a_duration_but_not_a_positive_one(text: str) -> None:
    assert CHART_DURATION.match(text) and parse_duration(text, "x") == 0
    assert not CRD_PER.match(text) and not CHART_POSITIVE.match(text)


_TERM = st.tuples(st.integers(0, 999), st.sampled_from(["", ".0", ".5", ".25", ".000"]),
                  st.sampled_from(["ms", "s", "m", "h", "d"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_TERM, min_size=1, max_size=4))
def test_the_crd_takes_exactly_the_positive_durations_of_its_units(terms: list) -> None:
    text = "".join(f"{number}{fraction}{unit}" for number, fraction, unit in terms)
    assert bool(CRD_PER.match(text)) == (parse_duration(text, "per") > 0), text
    assert bool(CHART_POSITIVE.match(text)) == (parse_duration(text, "per") > 0), text
    assert CHART_DURATION.match(text), text
