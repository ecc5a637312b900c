"""The config the dispatcher runs: the latest picker config with the latest discovered endpoints.

It answers: *which endpoints does the config name once the cluster has spoken?* Discovered
endpoints replace the config's static list; a static entry whose address is discovered keeps its
``kvBudgetTokens`` override.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from picker.config.schema import Endpoint, PickerConfig

log = logging.getLogger(__name__)


def with_endpoints(config: PickerConfig, addresses: Iterable[str]) -> PickerConfig:
    """``config`` with exactly ``addresses`` as its endpoints (in order, repeats dropped); an
    address the config lists keeps its entry (and so its ``kvBudgetTokens``)."""
    configured = {endpoint.address: endpoint for endpoint in config.endpoints}
    endpoints = tuple(configured.get(a) or Endpoint(a) for a in dict.fromkeys(addresses))
    return dataclasses.replace(config, endpoints=endpoints)


class LiveConfig:
    """Feeds ``apply`` (``Dispatcher.apply_config``) the combination whenever either part changes.

    ``set_config`` is the target of a config watcher (file or ConfigMap): it raises what ``apply``
    raises (ValueError: not applicable now, the watcher retries), and the new config is kept only
    once applied. ``set_endpoints`` is the target of ``PoolDiscovery``. Until endpoints are first
    set, the config's static endpoints are used.
    """

    def __init__(self, apply: Callable[[PickerConfig], None], config: PickerConfig) -> None:
        self.apply = apply
        self.config = config
        """The last picker config applied, with its own (static) endpoints."""
        self.endpoints: list[str] | None = None
        """The last discovered endpoints; None: none discovered yet (static ones serve)."""

    def combined(self, config: PickerConfig | None = None) -> PickerConfig:
        config = self.config if config is None else config
        return config if self.endpoints is None else with_endpoints(config, self.endpoints)

    def set_config(self, config: PickerConfig) -> None:
        self.apply(self.combined(config))
        self.config = config

    def set_endpoints(self, addresses: Iterable[str]) -> None:
        endpoints = list(addresses)
        self.apply(with_endpoints(self.config, endpoints))
        self.endpoints = endpoints
