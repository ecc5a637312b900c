"""Upstream's endpoint picker (Go), built from Go modules: the peer of fairway's benchmark.

The binary is ``cmd/epp`` of ``sigs.k8s.io/gateway-api-inference-extension`` ``RELEASE``, built
from the wrapper module in ``scripts/upstream_epp`` and cached outside the repository under
``~/.cache/fairway/upstream-epp/`` (``FAIRWAY_CACHE`` moves it).

Why this release: it is the newest that the Go module proxy serves here *and* that has the full
picker with flow control and a fairness policy. v1.6.0 ships only ``cmd/lwepp`` (a lightweight
picker without flow control: the full one moved to llm-d's router, whose module
``github.com/llm-d/llm-d-router`` the proxy refuses here, v0.9.0 and v0.10.0 included); v1.5.1,
v1.5.2 and v1.6.1 are refused. v1.5.0 has ``pkg/epp/flowcontrol`` with the fairness policies
``global-strict-fairness-policy`` (the default) and ``round-robin-fairness-policy``, turned on by
the ``flowControl`` feature gate of its ``EndpointPickerConfig``; tenants are keyed on the
``x-gateway-inference-fairness-id`` header. It has no weighted fairness policy (no per-tenant
weights) and no least-attained-service policy. The release needs Go 1.25; the machine's 1.26
builds it.

It runs against a real API server (``scripts.cluster.ControlPlane``) as in a cluster:
``UpstreamPool`` installs the release's own InferencePool CRD, makes one Pod whose status (patched,
as there is no kubelet) says Ready at ``127.0.0.1``, and an InferencePool whose ``targetPorts``
are the simulated servers' ports (each pod yields one endpoint per target port), then starts the
picker on that pool with flow control on and ``FAIRNESS_POLICY``, configured as upstream's flow
control guide advises for fairness (``queueDepthThreshold: 1``: nearly all queueing happens in
the picker). Its ext_proc port serves TLS with a self-signed certificate, as fairway's does.

    python -m scripts.upstream_picker build    # build or reuse the binary, print its path
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.stack.launcher import reserved_port
from scripts.cluster import ControlPlane
from scripts.gomodules import GoBuild, GoModuleError, module_files

RELEASE = "v1.5.0"
"""The pinned release of ``sigs.k8s.io/gateway-api-inference-extension`` (see the docstring)."""
PACKAGE = "sigs.k8s.io/gateway-api-inference-extension/cmd/epp"
MODULE = Path(__file__).resolve().parent / "upstream_epp"
BINARY = "epp"
COMMIT = "df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849"
"""The release tag's commit, stamped into the binary as upstream's Dockerfile does."""
LDFLAGS = " ".join([
    "-s", "-w",
    f"-X sigs.k8s.io/gateway-api-inference-extension/version.CommitSHA={COMMIT}",
    f"-X sigs.k8s.io/gateway-api-inference-extension/version.BuildRef={RELEASE}",
])


FAIRNESS_POLICY = "round-robin-fairness-policy"
"""The release's fairness policy between tenants of one priority: each backlogged tenant's
oldest request in turn (its other one, ``global-strict-fairness-policy``, is one FCFS queue for
all). Neither takes weights."""
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
"""The header the release keys tenants on (fairway reads it as the deprecated alias of
``x-llm-d-inference-fairness-id``)."""
FAIRNESS_QUEUE_DEPTH = 1
"""The utilization detector's ``queueDepthThreshold`` the flow control guide advises "for maximum
fairness/control" (its default is 5, "for maximum throughput")."""
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: {policy}
- type: fcfs-ordering-policy
- type: utilization-detector
  parameters: {{queueDepthThreshold: {queue_depth}, kvCacheUtilThreshold: 0.8}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: 2}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 2}}
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
saturationDetector: {{pluginRef: utilization-detector}}
flowControl:
  defaultRequestTTL: 60s
  defaultPriorityBand:
    fairnessPolicyRef: {policy}
    orderingPolicyRef: fcfs-ordering-policy
"""
"""The picker's ``EndpointPickerConfig`` (``{policy}`` and ``{queue_depth}`` filled in): the
release's default scheduling profile (its ``loadDefaultConfig``: queue and KV-cache utilization
scorers at weight 2, the prefix-cache scorer at 3; the loader adds the scorer's
``approx-prefix-cache-producer`` at its defaults: block size from the engines'
``vllm:cache_config_info``, 16 tokens read as 64 characters of the request's messages, at most
256 blocks matched, 31,250 remembered per endpoint, least recently used forgotten first), flow
control on with the fairness policy in every priority band, and the utilization detector (its
``kvCacheUtilThreshold`` default 0.8) at a ``queueDepthThreshold``: ``FAIRNESS_QUEUE_DEPTH``
unless asked. A request waits at most 60 s, as
fairway's ``queue.maxWait`` in the benchmark."""
NAMESPACE, POOL, POD = "peer", "peer-pool", "peer-sim"
LABELS = {"app": "peer-sim"}
READY_TIMEOUT = 60.0


class UpstreamPickerError(RuntimeError):
    """The upstream picker could not be started; the message says what failed and how."""


BUILD = GoBuild("upstream-epp", RELEASE, MODULE, (PACKAGE,), LDFLAGS, "about 3 minutes")


def binary(*, quiet: bool = False) -> Path:
    """The path of the ``epp`` binary, built now if the cache lacks it."""
    return BUILD.binaries(quiet=quiet) / BINARY


@dataclass(frozen=True)
class Ports:
    grpc: int
    health: int
    metrics: int


@dataclass
class UpstreamPool:
    """One InferencePool on ``plane`` served by upstream's picker; ``serve`` points it at a set
    of ``127.0.0.1:PORT`` endpoints and starts a fresh picker on it."""

    plane: ControlPlane
    workdir: Path
    queue_depth: int = FAIRNESS_QUEUE_DEPTH
    """The utilization detector's ``queueDepthThreshold``."""
    kubectl: str = field(default_factory=lambda: str(Path(sys.executable).parent / "kubectl"))

    def _kubectl(self, *args: str, stdin: str | None = None) -> str:
        argv = [self.kubectl, "--kubeconfig", str(self.plane.kubeconfig), *args]
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise UpstreamPickerError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def prepare(self) -> UpstreamPool:
        """The release's InferencePool CRD, the namespace and the Pod (Ready at 127.0.0.1)."""
        (crd,) = module_files(f"sigs.k8s.io/gateway-api-inference-extension@{RELEASE}",
                              "config/crd/bases",
                              "inference.networking.k8s.io_inferencepools.yaml")
        self._kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        self._kubectl("wait", "--for=condition=Established", "--timeout=30s", "-f", str(crd))
        self._kubectl("create", "namespace", NAMESPACE)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": POD, "namespace": NAMESPACE, "labels": LABELS},
               "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
        self._kubectl("apply", "-f", "-", stdin=json.dumps(pod))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"status": {"phase": "Running", "podIP": "127.0.0.1",
                             "podIPs": [{"ip": "127.0.0.1"}],
                             "conditions": [{"type": "Ready", "status": "True",
                                             "lastTransitionTime": now}]}}
        self._kubectl("patch", "pod", POD, "-n", NAMESPACE, "--subresource=status",
                      "--type=merge", "-p", json.dumps(status))
        return self

    def point_at(self, endpoints: list[str]) -> None:
        """The pool's target ports become the endpoints' (all on 127.0.0.1, at most 8)."""
        hosts = {e.rsplit(":", 1)[0] for e in endpoints}
        if hosts != {"127.0.0.1"} or not 1 <= len(endpoints) <= 8:
            raise UpstreamPickerError(f"one to eight endpoints on 127.0.0.1, got {endpoints}")
        pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": POOL, "namespace": NAMESPACE},
                "spec": {"selector": {"matchLabels": LABELS},
                         "targetPorts": [{"number": int(e.rsplit(":", 1)[1])}
                                         for e in endpoints],
                         "endpointPickerRef": {"name": "upstream-epp",
                                               "port": {"number": 9002}}}}
        self._kubectl("apply", "-f", "-", stdin=json.dumps(pool))

    def command(self, ports: Ports) -> list[str]:
        config = self.workdir / f"epp-config-{self.queue_depth}.yaml"
        config.write_text(CONFIG.format(policy=FAIRNESS_POLICY, queue_depth=self.queue_depth))
        return [str(binary()), "--pool-name", POOL, "--pool-namespace", NAMESPACE,
                "--grpc-port", str(ports.grpc), "--grpc-health-port", str(ports.health),
                "--metrics-port", str(ports.metrics), "--metrics-endpoint-auth=false",
                "--tracing=false", "--enable-pprof=false", "--config-file", str(config),
                # Its own gauges (ready pods: when it is ready to measure) flushed every second,
                # not five; scheduling reads the endpoints' metrics every 50 ms either way.
                "--refresh-prometheus-metrics-interval", "1s",
                "--zap-encoder", "json", "-v", "1"]

    def environment(self) -> dict[str, str]:
        """The picker's environment: the admin kubeconfig (it has no ``--kubeconfig`` flag), and
        nothing that could make it take in-cluster credentials."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE_")}
        return {**env, "KUBECONFIG": str(self.plane.kubeconfig)}

    def serve(self, endpoints: list[str], log: Path) -> tuple[subprocess.Popen[bytes], Ports]:
        """Point the pool at ``endpoints`` and start a picker on it; returns when it is ready
        and sees every endpoint."""
        self.point_at(endpoints)
        ports = Ports(reserved_port(), reserved_port(), reserved_port())
        with log.open("wb") as out:
            process = subprocess.Popen(self.command(ports), stdout=out, stderr=subprocess.STDOUT,
                                       env=self.environment(), start_new_session=True)
        try:
            _wait_ready(process, ports, len(endpoints), log)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return process, ports


def _ready(ports: Ports) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{ports.health}") as channel:
        try:
            # The stubs declare HealthStub without its generated methods.
            answer = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def _ready_endpoints(ports: Ports) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/metrics",
                                    timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("inference_pool_ready_pods"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _listening(port: int) -> bool:
    """The ext_proc port accepts connections: the release reports readiness before its ext_proc
    server listens, which waits for its self-signed certificate (a 4,096-bit RSA key: seconds on
    a busy machine; Envoy's first requests failed 503 in the meantime)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _wait_ready(process: subprocess.Popen[bytes], ports: Ports, endpoints: int,
                log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not (_ready(ports) and _ready_endpoints(ports) >= endpoints
               and _listening(ports.grpc)):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            state = f"exited {process.returncode}" if process.poll() is not None else \
                f"not ready after {READY_TIMEOUT:.0f} s"
            raise UpstreamPickerError(f"upstream picker {state}:\n" + "\n".join(tail))
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.upstream_picker",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the binary (or find it in the cache), print its path")
    parser.parse_args(argv)
    try:
        print(binary())
    except (UpstreamPickerError, GoModuleError) as exc:
        print(f"upstream-picker: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
