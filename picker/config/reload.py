"""Hot reload: re-read the config file when it changes; apply it, or keep the last good one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal, overload

from picker.config.schema import PickerConfig, load_config

log = logging.getLogger(__name__)


class ConfigApplier:
    """The part of a reload that does not care where the config came from (a file, a
    ConfigMap): hand each new config to ``apply`` and keep the last good one.

    A config that does not load, or that ``apply`` refuses, is a failure: logged, counted with
    ``on_result("failure")``, and the last good config stays in force. One that ``apply``
    refuses for now with ValueError (the dispatcher refuses a lane change while requests are in
    flight) is kept and retried by ``retry_deferred`` until it applies or a newer one arrives;
    its failure is counted once.
    """

    def __init__(self, apply: Callable[[PickerConfig], None],
                 on_result: Callable[[str], None], source: str) -> None:
        self.apply = apply
        self.on_result = on_result
        self.source = source
        self.config: PickerConfig | None = None
        """The last config applied."""
        self.last_error: str | None = None
        self._deferred: PickerConfig | None = None

    def offer(self, load: Callable[[], PickerConfig]) -> str:
        """A new config, loaded by ``load``: ``success`` or ``failure``."""
        self._deferred = None
        try:
            config = load()
        except Exception as exc:  # any failure keeps the last good config serving
            return self._failed(exc)
        return self._apply(config, count_failure=True)

    def retry_deferred(self) -> str | None:
        """Try again a config that ``apply`` refused for now; None when there is none."""
        if self._deferred is None:
            return None
        return self._apply(self._deferred, count_failure=False)

    @overload
    def _apply(self, config: PickerConfig, count_failure: Literal[True]) -> str: ...
    @overload
    def _apply(self, config: PickerConfig, count_failure: bool) -> str | None: ...
    def _apply(self, config: PickerConfig, count_failure: bool) -> str | None:
        try:
            self.apply(config)
        except ValueError as exc:  # valid, but not applicable now: retry later
            self._deferred = config
            return self._failed(exc) if count_failure else None
        except Exception as exc:
            self._deferred = None
            return self._failed(exc)
        self._deferred = None
        self.config = config
        self.last_error = None
        log.info("config reloaded from %s", self.source)
        self.on_result("success")
        return "success"

    def _failed(self, exc: Exception) -> str:
        self.last_error = str(exc)
        log.error("config reload failed (%s), keeping the last good config: %s", self.source, exc)
        self.on_result("failure")
        return "failure"


class ConfigWatcher:
    """Polls a config file; a change that loads and applies becomes current, else it is counted
    as a failure (``on_result("failure")``) and the last good config stays in force."""

    def __init__(self, path: str | Path, apply: Callable[[PickerConfig], None],
                 on_result: Callable[[str], None] = lambda result: None,
                 interval: float = 1.0) -> None:
        self.path = Path(path)
        self.interval = interval
        self.applier = ConfigApplier(apply, on_result, str(self.path))
        self._digest = self._read_digest()

    @property
    def last_error(self) -> str | None:
        return self.applier.last_error

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def check(self) -> str | None:
        """Reload if the file changed: returns ``success``, ``failure``, or None (nothing new).

        A config refused for now (``ConfigApplier``) is retried at every check until it applies
        or the file changes again.
        """
        digest = self._read_digest()
        if digest is None:
            return None
        if digest == self._digest:
            return self.applier.retry_deferred()
        self._digest = digest
        return self.applier.offer(lambda: load_config(self.path))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
