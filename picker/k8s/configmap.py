"""The picker config from a ConfigMap, read through the API so that a change applies in seconds.

It answers: *what config should the picker run now?* ``ConfigMapWatcher`` lists and watches one
ConfigMap (``picker.k8s.client.Reflector``: aiohttp, re-list on 410 or on errors with backoff). Each
new text under ``key`` is parsed exactly as a config file is (YAML, then ``load_config``); a config
that loads is handed to ``apply``, one that does not is refused (``apply`` is not called), logged
with the path of the bad field and counted as ``on_result("failure")``: the last good config keeps
serving. A config that loads but that ``apply`` refuses for now with ValueError (the dispatcher
refuses a lane change while requests are in flight) is retried every ``retry_interval`` until it
applies or the ConfigMap changes again, its failure counted once, as ``ConfigWatcher`` does for a
file. A deleted ConfigMap, or one without the key, is logged and leaves the config as it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import yaml

from picker.config.reload import ConfigApplier
from picker.config.schema import PickerConfig, load_config
from picker.config.strict import safe_load
from picker.errors import ConfigError
from picker.k8s.client import KubeClient, Reflector, name_of, wait_or_stop

log = logging.getLogger(__name__)

DEFAULT_KEY = "picker.yaml"


def parse_config_text(text: str) -> PickerConfig:
    """A config from YAML text; ConfigError (with the bad field's path) when it is not one."""
    try:
        data = safe_load(text)  # a key written twice is refused, as in a config file
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("", f"must be a mapping of config sections, got "
                              f"{'nothing' if data is None else type(data).__name__}")
    return load_config(data)


def _path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps"


async def fetch_config(client: KubeClient, namespace: str, name: str,
                       key: str = DEFAULT_KEY) -> PickerConfig:
    """The config in the ConfigMap now (for startup): ConfigError when it is missing or bad;
    ApiError/aiohttp errors when the API cannot be asked."""
    configmap = await client.get(f"{_path(namespace)}/{name}")
    text = ((configmap or {}).get("data") or {}).get(key)
    if text is None:
        raise ConfigError("", f"ConfigMap {namespace}/{name} has no key {key!r}")
    try:
        return parse_config_text(text)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} (ConfigMap {namespace}/{name} key {key})"
                          ) from exc


class ConfigMapWatcher:
    """Applies the config in ConfigMap ``namespace/name`` (key ``key``) whenever it changes.

    ``apply(config)`` takes a config (e.g. ``LiveConfig.set_config`` or
    ``Dispatcher.apply_config``); ``on_result`` gets ``"success"`` or ``"failure"`` for each new
    text (e.g. the ``config_reloads`` counter). ``config`` is the last config applied.
    """

    def __init__(self, client: KubeClient, namespace: str, name: str,
                 apply: Callable[[PickerConfig], None],
                 on_result: Callable[[str], None] = lambda result: None, *,
                 key: str = DEFAULT_KEY, retry_interval: float = 1.0,
                 retry_min: float = 0.5, retry_max: float = 10.0,
                 watch_timeout: float = 300.0) -> None:
        self.namespace = namespace
        self.name = name
        self.key = key
        self.retry_interval = retry_interval
        self.applier = ConfigApplier(apply, on_result, self.source)
        self._digest: str | None = None
        self._missing_logged = False
        self.reflector = Reflector(
            client, _path(namespace), self._on_objects,
            params={"fieldSelector": f"metadata.name={name}"},
            keep=lambda obj: name_of(obj) == name,
            retry_min=retry_min, retry_max=retry_max, watch_timeout=watch_timeout)

    @property
    def source(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} key {self.key}"

    @property
    def config(self) -> PickerConfig | None:
        """The last config applied."""
        return self.applier.config

    @property
    def last_error(self) -> str | None:
        return self.applier.last_error

    def _on_objects(self, objects: dict[str, dict[str, Any]]) -> None:
        self.observe(objects.get(self.name))

    def observe(self, configmap: dict[str, Any] | None) -> str | None:
        """Take the ConfigMap as it is now (None: absent): ``success``, ``failure``, or None
        (nothing new)."""
        text = ((configmap or {}).get("data") or {}).get(self.key)
        if not isinstance(text, str):
            if not self._missing_logged:
                log.warning("%s is %s; keeping the current config", self.source,
                            "missing" if configmap is None else "not set")
                self._missing_logged = True
            return None
        self._missing_logged = False
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest == self._digest:
            return None
        self._digest = digest
        return self.applier.offer(lambda: parse_config_text(text))

    def retry_deferred(self) -> str | None:
        """Try again a config that ``apply`` refused for now (ValueError)."""
        return self.applier.retry_deferred()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set."""
        await asyncio.gather(self.reflector.run(stop), self._retry(stop))

    async def _retry(self, stop: asyncio.Event) -> None:
        while not await wait_or_stop(stop, self.retry_interval):
            self.retry_deferred()
