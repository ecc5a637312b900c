"""The picker in a cluster: its config from a ConfigMap, its endpoints from an InferencePool, and
leader election on a Lease, all through the Kubernetes API (``picker.k8s.client``: aiohttp for
HTTP, the ``kubernetes`` package only to find credentials).

Wiring, in ``serve()`` (each ``run(stop)`` returns promptly once ``stop`` is set)::

    client = KubeClient.from_environment(server_url_or_None)
    config = await fetch_config(client, ns, configmap)   # or load_config(path)
    dispatcher = Dispatcher(config, metrics=metrics)
    live = LiveConfig(dispatcher.apply_config, config)
    watcher = ConfigMapWatcher(client, ns, configmap, live.set_config,
                               lambda result: metrics.config_reloads.labels(result).inc())
    discovery = PoolDiscovery(client, pool_namespace, pool_name, live.set_endpoints)
    elector = LeaderElector(client, ns, lease_name, on_leading)
    tasks += [asyncio.create_task(c.run(stop)) for c in (watcher, discovery, elector)]
    ...
    await client.close()   # after the tasks have ended
"""

from picker.k8s.client import UNREACHABLE, ApiError, KubeClient
from picker.k8s.combine import LiveConfig, with_endpoints
from picker.k8s.configmap import ConfigMapWatcher, fetch_config, parse_config_text
from picker.k8s.discovery import PoolDiscovery, endpoints_of
from picker.k8s.leader import LeaderElector, default_identity

__all__ = [
    "UNREACHABLE",
    "ApiError",
    "ConfigMapWatcher",
    "KubeClient",
    "LeaderElector",
    "LiveConfig",
    "PoolDiscovery",
    "default_identity",
    "endpoints_of",
    "fetch_config",
    "parse_config_text",
    "with_endpoints",
]
