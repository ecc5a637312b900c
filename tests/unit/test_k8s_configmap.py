"""The ConfigMap's text to a config: what is applied, refused, counted and retried (no API: the
watcher's ``observe`` is fed ConfigMap objects directly)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.errors import ConfigError
from picker.k8s import ConfigMapWatcher, KubeClient, parse_config_text

GOOD = "capacity:\n  kvBudgetTokens: 1000\ntenants:\n  - id: a\n    weight: 2\n"
OTHER = "capacity:\n  kvBudgetTokens: 2000\n"
UNKNOWN_FIELD = "capacity:\n  kvBudgetTokenz: 1000\n"
BAD_VALUE = "tenants:\n  - id: a\n    weight: -1\n"


def _cm(text: str | None, key: str = "picker.yaml") -> dict[str, Any]:
    return {"metadata": {"name": "picker", "namespace": "ns"},
            "data": {} if text is None else {key: text}}


class Recorder:
    def __init__(self, refuse: type[Exception] | None = None) -> None:
        self.applied: list[PickerConfig] = []
        self.results: list[str] = []
        self.refuse = refuse

    def apply(self, config: PickerConfig) -> None:
        if self.refuse is not None:
            raise self.refuse("not now")
        self.applied.append(config)


def _watcher(recorder: Recorder) -> ConfigMapWatcher:
    return ConfigMapWatcher(KubeClient("http://127.0.0.1:1"), "ns", "picker", recorder.apply,
                            recorder.results.append)


def test_parse_config_text_is_the_file_loader_on_text() -> None:
    config = parse_config_text(GOOD)
    assert config.capacity.kv_budget_tokens == 1000
    assert config.tenant("a").weight == 2


@pytest.mark.parametrize(("text", "path"), [
    (UNKNOWN_FIELD, "capacity.kvBudgetTokenz"),
    (BAD_VALUE, "tenants[0].weight"),
    ("capacity: [unclosed", ""),
    ("", ""),
    ("- a list\n", ""),
])
def test_a_bad_text_is_a_config_error_naming_the_field(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config_text(text)
    assert error.value.path == path


def test_a_new_text_is_applied_and_the_same_text_again_is_nothing_new() -> None:
    rec = Recorder()
    watcher = _watcher(rec)
    assert watcher.observe(_cm(GOOD)) == "success"
    assert watcher.observe(_cm(GOOD)) is None  # a watch replaying the same object
    assert watcher.observe(_cm(OTHER)) == "success"
    assert [c.capacity.kv_budget_tokens for c in rec.applied] == [1000, 2000]
    assert rec.results == ["success", "success"]
    assert watcher.config is rec.applied[-1]


def test_a_bad_config_is_refused_counted_and_logged_with_its_path(
        caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    watcher = _watcher(rec)
    watcher.observe(_cm(GOOD))
    with caplog.at_level(logging.ERROR, logger="picker.k8s.configmap"):
        assert watcher.observe(_cm(BAD_VALUE)) == "failure"
    assert len(rec.applied) == 1 and watcher.config is rec.applied[0]
    assert rec.results == ["success", "failure"]
    assert "tenants[0].weight" in watcher.last_error
    assert "ConfigMap ns/picker key picker.yaml" in caplog.text
    assert "tenants[0].weight" in caplog.text
    assert watcher.observe(_cm(BAD_VALUE)) is None  # counted once, not at every replay
    assert watcher.observe(_cm(OTHER)) == "success"
    assert watcher.last_error is None


def test_a_deleted_configmap_or_missing_key_keeps_the_config() -> None:
    rec = Recorder()
    watcher = _watcher(rec)
    watcher.observe(_cm(GOOD))
    assert watcher.observe(None) is None
    assert watcher.observe(_cm(None)) is None
    assert watcher.observe(_cm(GOOD, key="other.yaml")) is None
    assert rec.results == ["success"]
    assert watcher.observe(_cm(GOOD)) is None  # back as it was: nothing to apply


def test_a_config_apply_refuses_for_now_is_retried_and_counted_once() -> None:
    rec = Recorder(refuse=ValueError)
    watcher = _watcher(rec)
    assert watcher.observe(_cm(GOOD)) == "failure"
    assert watcher.retry_deferred() is None
    assert rec.results == ["failure"]
    rec.refuse = None
    assert watcher.retry_deferred() == "success"
    assert rec.results == ["failure", "success"] and len(rec.applied) == 1
    assert watcher.retry_deferred() is None


def test_a_config_apply_rejects_otherwise_is_not_retried() -> None:
    rec = Recorder(refuse=OSError)
    watcher = _watcher(rec)
    assert watcher.observe(_cm(GOOD)) == "failure"
    rec.refuse = None
    assert watcher.retry_deferred() is None
    assert rec.applied == []
