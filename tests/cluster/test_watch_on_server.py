"""The picker's watches resume after ``410 Gone`` on a real API server: its InferencePool, Pod and
ConfigMap watches (``picker.k8s``: ``PoolDiscovery``, ``ConfigMapWatcher``) are re-opened from
the last ``resourceVersion`` they saw; once etcd has compacted that revision away the server
answers 410, and each must list again and carry on.

The session's API server cannot show it: its watch cache serves a watch from a compacted
revision out of its own window (tried: the events are replayed, no 410). So this module starts a
control plane of its own with ``--watch-cache=false``, where every watch is etcd's, and compacts
etcd through its v3 JSON gateway. The picker's classes run in-process with a one-second watch
timeout (the server then ends each watch after a second, and the next one starts from the old
revision); the picker process itself re-opens a watch only every five minutes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from picker.config.schema import PickerConfig
from picker.k8s import KubeClient
from picker.k8s.configmap import ConfigMapWatcher
from picker.k8s.discovery import PoolDiscovery
from scripts.cluster import ControlPlane, inference_pool_crd
from tests.cluster.kube import Kube, until

NAMESPACE = "watched"
POOL = "llm-pool"
CONFIG_MAP = "picker-config"


@pytest.fixture(scope="module")
def etcd_watches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("etcd-watches"),
                         apiserver_args=("--watch-cache=false",)).start()
    try:
        setup = Kube(plane, "default", plane.workdir)
        crd = str(inference_pool_crd())
        setup.kubectl("apply", "--server-side", "--validate=strict", "-f", crd, namespaced=False)
        setup.kubectl("wait", "--for=condition=Established", "--timeout=30s", "-f", crd,
                      namespaced=False)
        yield plane
    finally:
        plane.stop()


def _config(weight: int) -> str:
    return json.dumps({"data": {"picker.yaml": f"scheduling: {{policy: vtc}}\ntenants:\n"
                                               f"  - {{id: team-a, weight: {weight}}}\n"}})


def _compact(kube: Kube) -> int:
    """Two writes elsewhere (the watched collections see none), then etcd compacted up to the
    second: every revision a watch of this namespace has seen is gone. The revision."""
    for name in ("noise-1", "noise-2"):
        kube.kubectl("create", "configmap", name, "-n", "default", namespaced=False)
    done = kube.kubectl("get", "configmap", "noise-2", "-n", "default", "-o", "json",
                        namespaced=False)
    revision = int(json.loads(done.stdout)["metadata"]["resourceVersion"])
    request = urllib.request.Request(
        f"{kube.plane.etcd_url}/v3/kv/compaction", method="POST",
        data=json.dumps({"revision": str(revision), "physical": True}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
    return revision


async def _until(check: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout:.0f} s"
        await asyncio.sleep(0.05)


async def test_the_pickers_watches_list_again_after_410_gone_and_carry_on(
        etcd_watches: ControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="picker.k8s.client")
    kube = Kube(etcd_watches, NAMESPACE, tmp_path)
    kube.kubectl("create", "namespace", NAMESPACE, namespaced=False)
    until(lambda: kube.get("serviceaccount", "default"), what="default ServiceAccount")
    kube.apply(json.dumps({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "fairway-picker", "port": {"number": 9002}}}}))
    kube.apply(json.dumps({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": "llm-0", "labels": {"app": "llm"}},
                           "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}))
    kube.patch_status("pod", "llm-0", {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}],
                                       "conditions": [{"type": "Ready", "status": "True"}]})
    kube.kubectl("create", "configmap", CONFIG_MAP)
    kube.kubectl("patch", "configmap", CONFIG_MAP, "--type=merge", "-p", _config(1))

    client = KubeClient.from_environment(kubeconfig=str(etcd_watches.kubeconfig))
    published: list[list[str]] = []
    configs: list[PickerConfig] = []
    pool = PoolDiscovery(client, NAMESPACE, POOL, published.append, watch_timeout=1)
    watcher = ConfigMapWatcher(client, NAMESPACE, CONFIG_MAP, configs.append, watch_timeout=1)
    reflectors = {"inferencepools": pool.pools, "pods": pool.pods,
                  "configmaps": watcher.reflector}
    stop = asyncio.Event()
    running = asyncio.gather(pool.run(stop), watcher.run(stop))
    try:
        await _until(lambda: published == [["10.0.0.1:8000"]] and len(configs) == 1,
                     "listed and watching")
        # Let every watch end and start again once from the revision of its list: no 410 yet.
        await asyncio.sleep(1.5)
        assert "(410)" not in caplog.text

        await asyncio.to_thread(_compact, kube)

        def gone() -> set[str]:
            return {kind for kind, reflector in reflectors.items()
                    if f"watch of {reflector.path} expired (410); listing again" in caplog.text}

        await _until(lambda: gone() == set(reflectors), "a 410 for each watch, then a list")
        # They carry on: what changes after the new list arrives.
        await asyncio.to_thread(kube.patch_status, "pod", "llm-0",
                                {"conditions": [{"type": "Ready", "status": "False"}]})
        await _until(lambda: published[-1] == [], "the unready pod drained")
        await asyncio.to_thread(kube.kubectl, "patch", "configmap", CONFIG_MAP, "--type=merge",
                                "-p", _config(3))
        await _until(lambda: len(configs) == 2, "the new config applied")
        assert configs[-1].tenants[0].weight == 3
        assert pool.synced and pool.endpoints == []
        # A 410 is not an error: no backoff, nothing counted.
        assert {kind: r.errors for kind, r in reflectors.items()} == dict.fromkeys(reflectors, 0)
    finally:
        stop.set()
        await running
        await client.close()
