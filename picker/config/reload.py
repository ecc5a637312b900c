"""Hot reload: re-read the config file when it changes; apply it, or keep the last good one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from picker.config.schema import PickerConfig, load_config

log = logging.getLogger(__name__)


class ConfigWatcher:
    """Polls a config file; a change that loads and applies becomes current, else it is counted
    as a failure (``on_result("failure")``) and the last good config stays in force."""

    def __init__(self, path: str | Path, apply: Callable[[PickerConfig], None],
                 on_result: Callable[[str], None] = lambda result: None,
                 interval: float = 1.0) -> None:
        self.path = Path(path)
        self.apply = apply
        self.on_result = on_result
        self.interval = interval
        self.last_error: str | None = None
        self._digest = self._read_digest()

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def check(self) -> str | None:
        """Reload if the file changed: returns ``success``, ``failure``, or None (unchanged)."""
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return None
        self._digest = digest
        try:
            config = load_config(self.path)
            self.apply(config)
        except Exception as exc:  # any failure keeps the last good config serving
            self.last_error = str(exc)
            log.error("config reload failed, keeping the last good config: %s", exc)
            self.on_result("failure")
            return "failure"
        self.last_error = None
        log.info("config reloaded from %s", self.path)
        self.on_result("success")
        return "success"

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
