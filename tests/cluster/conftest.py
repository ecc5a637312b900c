"""The cluster tier: fairway against a real Kubernetes control plane on 127.0.0.1.

One control plane (``scripts/cluster.py``: kube-apiserver and kube-controller-manager built from
Go modules, Debian's etcd) serves the whole session, with the TenantPolicy CRD (the one users
apply, ``manifests/crd``) and upstream's InferencePool CRD installed; each test gets a namespace
of its own. ``make setup`` builds the binaries (or finds them cached) and fetches the CRD before
any test runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.cluster import ControlPlane, inference_pool_crd
from tests.cluster.kube import ROOT, Kube, until


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane")).start()
    try:
        setup = Kube(plane, "default", plane.workdir)
        crds = (ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml",
                inference_pool_crd())
        for crd in crds:
            setup.kubectl("apply", "--server-side", "--validate=strict", "-f", str(crd),
                          namespaced=False)
        for crd in crds:
            setup.kubectl("wait", "--for=condition=Established", "--timeout=30s", "-f",
                          str(crd), namespaced=False)
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
