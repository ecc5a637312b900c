"""Hot reload: a changed file that loads and applies becomes current; otherwise the last good
config stays and the failure is reported."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from picker.config.reload import ConfigWatcher
from picker.config.schema import PickerConfig

GOOD_A = "tenants: [{id: a, weight: 1}]\n"
GOOD_B = "tenants: [{id: a, weight: 3}]\n"
BAD = "tenants: [{id: a, weight: 0}]\n"


class Recorder:
    """Stands in for the dispatcher: records what it is asked to apply."""

    def __init__(self, refuse: bool = False) -> None:
        self.applied: list[PickerConfig] = []
        self.results: list[str] = []
        self.refuse = refuse

    def apply(self, config: PickerConfig) -> None:
        if self.refuse:
            raise ValueError("lanes can change only while idle")
        self.applied.append(config)

    def on_result(self, result: str) -> None:
        self.results.append(result)


def _watcher(path: Path, recorder: Recorder) -> ConfigWatcher:
    return ConfigWatcher(path, recorder.apply, recorder.on_result, interval=0.01)


def test_unchanged_file_is_not_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    assert watcher.check() is None
    path.write_text(GOOD_A)  # rewritten with the same bytes: still unchanged
    assert watcher.check() is None
    assert recorder.applied == [] and recorder.results == []


def test_good_change_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.write_text(GOOD_B)
    assert watcher.check() == "success"
    assert [c.tenants[0].weight for c in recorder.applied] == [3.0]
    assert recorder.results == ["success"]
    assert watcher.last_error is None
    assert watcher.check() is None  # applied once, not on every poll


def test_bad_change_keeps_the_old_config_and_records_the_error(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.write_text(BAD)
    assert watcher.check() == "failure"
    assert recorder.applied == []
    assert recorder.results == ["failure"]
    assert watcher.last_error is not None
    assert "tenants[0].weight" in watcher.last_error
    assert watcher.check() is None  # the same bad file is not retried on every poll


def test_recovers_on_the_next_good_change(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.write_text("tenants: [{id: a\n")  # not even YAML
    assert watcher.check() == "failure"
    assert watcher.last_error is not None and "not valid YAML" in watcher.last_error
    path.write_text(GOOD_B)
    assert watcher.check() == "success"
    assert watcher.last_error is None
    assert [c.tenants[0].weight for c in recorder.applied] == [3.0]
    assert recorder.results == ["failure", "success"]


def test_reverting_to_the_original_after_a_bad_change_reloads_it(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.write_text(BAD)
    assert watcher.check() == "failure"
    path.write_text(GOOD_A)
    assert watcher.check() == "success"
    assert [c.tenants[0].weight for c in recorder.applied] == [1.0]


def test_apply_refusing_with_value_error_counts_as_failure(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder(refuse=True)
    watcher = _watcher(path, recorder)
    path.write_text(GOOD_B)
    assert watcher.check() == "failure"
    assert recorder.results == ["failure"]
    assert watcher.last_error == "lanes can change only while idle"


def test_missing_file_is_not_a_change(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.unlink()
    assert watcher.check() is None
    path.write_text(GOOD_B)
    assert watcher.check() == "success"


async def test_run_polls_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    path.write_text(GOOD_B)
    for _ in range(200):
        if recorder.results:
            break
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(task, 1.0)
    assert recorder.results == ["success"]


@pytest.mark.parametrize("content", [BAD, "[]\n", ""])
def test_every_kind_of_bad_file_is_a_failure(tmp_path: Path, content: str) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(GOOD_A)
    recorder = Recorder()
    watcher = _watcher(path, recorder)
    path.write_text(content)
    assert watcher.check() == "failure"
    assert recorder.applied == []


def test_a_config_refused_while_busy_is_applied_once_idle(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("lanes: [{name: default}]\n")
    busy = [True]
    applied: list[object] = []
    results: list[str] = []

    def apply(config: object) -> None:
        if busy[0]:
            raise ValueError("lanes can change only while no request is in the picker")
        applied.append(config)

    watcher = ConfigWatcher(path, apply, results.append)
    path.write_text("lanes: [{name: default}, {name: batch}]\n")
    assert watcher.check() == "failure"
    assert watcher.check() is None  # still busy: retried quietly, not counted again
    busy[0] = False
    assert watcher.check() == "success"
    assert len(applied) == 1 and results == ["failure", "success"]
    assert watcher.check() is None
