"""The cluster tier: fairway against a real Kubernetes control plane on 127.0.0.1.

One control plane (``scripts/cluster.py``: kube-apiserver and kube-controller-manager built from
Go modules, Debian's etcd) serves the whole session, with the TenantPolicy CRD (the one users
apply, ``manifests/crd``) and the CRDs of what fairway works with installed from their upstream
Go modules: the InferencePool, the Gateway API's GatewayClass, Gateway and HTTPRoute, and
prometheus-operator's ServiceMonitor and PrometheusRule. Each test gets a namespace of its own.
``make setup`` builds the binaries (or finds them cached) and fetches the CRDs before any test
runs.

No test's process, and no client a test makes in-process, sees ``KUBERNETES_SERVICE_HOST`` or
``_PORT``: run inside a pod, they would take the pod's credentials instead of the chart's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.cluster import ControlPlane, extra_crds
from tests.cluster.kube import IN_CLUSTER, ROOT, Kube, until


@pytest.fixture(autouse=True)
def _outside_any_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inherited by every child (picker.stack's too) and read by in-process KubeClients.
    for name in IN_CLUSTER:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane")).start()
    try:
        setup = Kube(plane, "default", plane.workdir)
        crds = (ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml", *extra_crds())
        files = [f"--filename={crd}" for crd in crds]
        setup.kubectl("apply", "--server-side", "--validate=strict", *files, namespaced=False)
        setup.kubectl("wait", "--for=condition=Established", "--timeout=30s", *files,
                      namespaced=False)
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def kube(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Kube]:
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    view = Kube(control_plane, namespace, tmp_path)
    view.kubectl("create", "namespace", namespace, namespaced=False)
    # The controller manager makes the namespace's default ServiceAccount; pods need it.
    until(lambda: view.get("serviceaccount", "default"), what="default ServiceAccount")
    yield view
    view.kubectl("delete", "namespace", namespace, "--wait=false", namespaced=False,
                 check=False)
