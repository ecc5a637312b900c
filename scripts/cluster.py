"""A real Kubernetes control plane on 127.0.0.1: what the cluster tests run against.

kube-apiserver and kube-controller-manager are built from Go modules (the wrapper module in
``scripts/controlplane``, Kubernetes ``KUBERNETES``) and cached outside the repository under
``~/.cache/fairway/controlplane/`` (``FAIRWAY_CACHE`` moves it); etcd is Debian's
``etcd-server``. The first build took 5 minutes here on two cores (2 GB of memory, 2.5 GB of Go
build cache; 10 minutes were measured on another machine); later runs reuse the binaries, and a
control plane is ready in a few seconds. The other CRDs the tests install come from Go modules
too: the InferencePool from the Gateway API Inference Extension (``INFERENCE_EXTENSION``), the
Gateway API's (``GATEWAY_API``) and prometheus-operator's ServiceMonitor and PrometheusRule
(``PROMETHEUS_OPERATOR``).

There is no scheduler and no kubelet: Pods stay Pending unless a test patches their status.
The controller manager runs the controllers that a chart's life needs (namespaces, garbage
collection, Deployments and ReplicaSets, service accounts).

    python -m scripts.cluster build        # build or reuse the binaries, print where they are
    python -m scripts.cluster up [DIR]     # start one; prints the kubeconfig; Ctrl-C stops it
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from picker.stack.launcher import reserved_port
from scripts.gomodules import GoBuild, GoModuleError, module_files

KUBERNETES = "v1.36.3"
"""The pinned release: the newest 1.36 the module proxy serves here. 1.37 needs Go 1.27, whose
default ``GOEXPERIMENT=jsonv2`` breaks kube-openapi's ``/openapi/v2`` (every ``kubectl apply``
then fails); the machine's Go is 1.26."""
INFERENCE_EXTENSION = "v1.6.0"
"""The Gateway API Inference Extension release whose InferencePool CRD the tests install: the
newest the module proxy serves here."""
GATEWAY_API = "v1.6.3"
"""The Gateway API release whose CRDs the tests install: the newest v1.6 the module proxy serves
here (v1.7.0 needs Go 1.27)."""
PROMETHEUS_OPERATOR = "v0.89.0"
"""The prometheus-operator release whose ServiceMonitor and PrometheusRule CRDs the tests
install: the newest the module proxy serves here."""
MODULE = Path(__file__).resolve().parent / "controlplane"
COMMANDS = ("kube-apiserver", "kube-controller-manager")
CONTROLLERS = ("namespace", "garbagecollector", "deployment", "replicaset", "serviceaccount",
               "serviceaccount-token", "root-ca-cert-publisher")
LDFLAGS = " ".join([
    "-s", "-w",
    # Stamped as Kubernetes' own release builds stamp it; unstamped, the server reports
    # v0.0.0-master and Helm refuses any chart with a kubeVersion constraint.
    *(f"-X {package}.{name}={value}"
      for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
      for name, value in (("gitVersion", KUBERNETES), ("gitMajor", KUBERNETES[1:].split(".")[0]),
                          ("gitMinor", KUBERNETES.split(".")[1]), ("gitTreeState", "clean")))])
SERVICE_RANGE = "10.96.0.0/24"
READY_TIMEOUT = 60.0


class ClusterError(RuntimeError):
    """The control plane could not be started; the message says what and where."""


BUILD = GoBuild("controlplane", KUBERNETES, MODULE,
                tuple(f"k8s.io/kubernetes/cmd/{c}" for c in COMMANDS), LDFLAGS, "about 5 minutes")


def binaries(*, quiet: bool = False) -> Path:
    """The folder holding ``COMMANDS``, built now if the cache lacks them."""
    return BUILD.binaries(quiet=quiet)


def inference_pool_crd() -> Path:
    """Upstream's InferencePool CRD (``inference.networking.k8s.io/v1``), from the Go module of
    the Inference Extension in Go's module cache (downloaded the first time)."""
    (crd,) = module_files(f"sigs.k8s.io/gateway-api-inference-extension@{INFERENCE_EXTENSION}",
                          "config/crd/bases", "inference.networking.k8s.io_inferencepools.yaml")
    return crd


def gateway_api_crds() -> list[Path]:
    """The Gateway API CRDs that ``manifests/gateway`` uses (GatewayClass, Gateway, HTTPRoute),
    ``GATEWAY_API``'s experimental channel: the samples' HTTPRoute ``retry`` is standard only
    from v1.7, whose module needs Go 1.27."""
    return module_files(f"sigs.k8s.io/gateway-api@{GATEWAY_API}", "config/crd/experimental",
                        *(f"gateway.networking.k8s.io_{kind}.yaml"
                          for kind in ("gatewayclasses", "gateways", "httproutes")))


def prometheus_operator_crds() -> list[Path]:
    """The ServiceMonitor and PrometheusRule CRDs (``monitoring.coreos.com/v1``) the chart may
    render, from prometheus-operator's Go module (``PROMETHEUS_OPERATOR``)."""
    return module_files(f"github.com/prometheus-operator/prometheus-operator@"
                        f"{PROMETHEUS_OPERATOR}", "example/prometheus-operator-crd",
                        "monitoring.coreos.com_servicemonitors.yaml",
                        "monitoring.coreos.com_prometheusrules.yaml")


def extra_crds() -> list[Path]:
    """Every CRD besides fairway's own that the cluster tests install."""
    return [inference_pool_crd(), *gateway_api_crds(), *prometheus_operator_crds()]


@dataclass
class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager on 127.0.0.1, their files in
    ``workdir``. ``start`` returns when the API server is ready; ``stop`` ends all three."""

    workdir: Path
    url: str = ""
    """``https://127.0.0.1:PORT`` of the API server."""
    admin_token: str = ""
    """A static token of group ``system:masters``."""
    apiserver_args: tuple[str, ...] = ()
    """More flags for kube-apiserver (e.g. ``--watch-cache=false``: watches served by etcd)."""
    etcd_url: str = ""
    """``http://127.0.0.1:PORT``: etcd's client URL (its v3 JSON gateway, e.g. compaction)."""
    processes: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def ca_file(self) -> Path:
        return self.workdir / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig."""
        return self.workdir / "admin.kubeconfig"

    def start(self) -> ControlPlane:
        bin_dir = binaries()
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ClusterError("etcd is not on PATH: `make setup` installs Debian's etcd-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(bin_dir, etcd)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, bin_dir: Path, etcd: str) -> None:
        w = self.workdir
        _write_pki(w)
        self.admin_token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
        (w / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        client, peer, port = reserved_port(), reserved_port(), reserved_port()
        # etcd's data on tmpfs where there is one: fsyncs cost seconds on a busy disk.
        shm = Path("/dev/shm")
        data = Path(tempfile.mkdtemp(prefix="fairway-etcd-", dir=shm if shm.is_dir() else w))
        (w / "etcd-data").write_text(str(data))
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._run("etcd", [
            etcd, "--name", "default", "--data-dir", str(data),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--listen-metrics-urls", "", "--log-level", "warn"])
        self.url = f"https://127.0.0.1:{port}"
        self._run("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{client}",
            "--bind-address", "127.0.0.1", "--secure-port", str(port),
            "--advertise-address", "127.0.0.1", "--endpoint-reconciler-type", "none",
            "--tls-cert-file", str(w / "apiserver.crt"),
            "--tls-private-key-file", str(w / "apiserver.key"),
            "--client-ca-file", str(w / "ca.crt"),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(w / "sa.pub"),
            "--service-account-signing-key-file", str(w / "sa.key"),
            "--service-cluster-ip-range", SERVICE_RANGE,
            "--authorization-mode", "RBAC",
            "--token-auth-file", str(w / "tokens.csv"),
            "--profiling=false", "-v", "1", *self.apiserver_args])
        self._write_kubeconfig(self.kubeconfig, self.admin_token)
        self._wait_ready()
        self._run("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"),
            "--kubeconfig", str(self.kubeconfig),
            "--authentication-kubeconfig", str(self.kubeconfig),
            "--authorization-kubeconfig", str(self.kubeconfig),
            "--bind-address", "127.0.0.1", "--secure-port", str(reserved_port()),
            "--controllers", ",".join(CONTROLLERS),
            "--service-account-private-key-file", str(w / "sa.key"),
            "--root-ca-file", str(w / "ca.crt"),
            "--leader-elect=false", "--profiling=false", "-v", "1"])

    def _run(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.processes.append((name, process))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(f"{self.url}/readyz",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
        last = ""
        while time.monotonic() < deadline:
            for name, process in self.processes:
                if process.poll() is not None:
                    raise ClusterError(f"{name} exited with {process.returncode}: "
                                       f"{self._tail(name)}")
            try:
                with urllib.request.urlopen(request, context=context, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ClusterError(f"the API server was not ready within {READY_TIMEOUT:.0f} s "
                           f"({last}): {self._tail('kube-apiserver')}")

    def _tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig at ``path`` that authenticates with ``token``."""
        return self._write_kubeconfig(path, token, namespace)

    def _write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fairway",
            "clusters": [{"name": "fairway", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "fairway", "context": {
                "cluster": "fairway", "user": "user", "namespace": namespace}}],
        }
        path.write_text(json.dumps(config, indent=1))
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        # One at a time, the last started first: an API server whose etcd went away at the same
        # moment spends its shutdown timeout retrying it.
        for _name, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        marker = self.workdir / "etcd-data"
        if marker.exists():
            shutil.rmtree(marker.read_text(), ignore_errors=True)
            marker.unlink()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def _write_pki(folder: Path) -> None:
    """A CA, the API server's serving certificate (127.0.0.1, localhost, the in-cluster names)
    and the service-account signing key pair."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fairway-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                       "kubernetes.default.svc")]
    ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([*names, *ips]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    files = {
        "ca.crt": ca.public_bytes(pem),
        "apiserver.crt": cert.public_bytes(pem),
        "apiserver.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain),
        "sa.key": sa_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain),
        "sa.pub": sa_key.public_key().public_bytes(
            pem, serialization.PublicFormat.SubjectPublicKeyInfo),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the binaries (or find them in the cache) and fetch "
                                      "the CRDs the tests install")
    up = commands.add_parser("up", help="start a control plane until Ctrl-C")
    up.add_argument("workdir", nargs="?", help="its files (default: a new temporary folder)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(binaries())
            for crd in extra_crds():
                print(crd)
            return 0
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fairway-cluster-"))
        with ControlPlane(workdir) as plane:
            print(f"API server {plane.url} ready; export KUBECONFIG={plane.kubeconfig}",
                  flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except (ClusterError, GoModuleError) as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
