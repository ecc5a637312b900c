"""Starting and stopping the local stack: simulated model servers, the picker, Envoy.

Every process listens on 127.0.0.1, on a port it bound itself (port 0, read back) or on one held
for it (``hold_port``): no port is found free here and bound later, when any other process could
have taken it. Each logs to a file in the work directory, and is stopped (SIGTERM, then SIGKILL)
by ``Stack.stop`` or on leaving the ``with`` block.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from picker.config.schema import load_config
from picker.stack.envoy import (
    FALLBACK_ENDPOINTS,
    GATEWAY_NAME,
    JwtIdentity,
    client_controlled_headers,
    envoy_binary,
    write_envoy_config,
)
from picker.tls import certificate_authority, issue


def hold_port(port: int) -> socket.socket:
    """A socket bound to ``port`` of 127.0.0.1 that never listens, so that while a process is
    down its port is neither handed out to another (a port-0 bind, a connection's ephemeral
    port) nor answered: a connection is refused, as to a dead pod. It sets ``SO_REUSEADDR``, as
    Envoy, gRPC, aiohttp and Redis do on their listeners, so the process restarted on the port
    binds it while it is still held; close it once that process listens."""
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        hold.bind(("127.0.0.1", port))
    except OSError:
        hold.close()
        raise
    return hold


_HELD_FOR_LIFE: list[socket.socket] = []


def reserved_port() -> int:
    """A free port of 127.0.0.1 for a process that cannot bind port 0 and say what it bound
    (etcd, the API server, Prometheus, a Kubernetes pod's fixed ports): held (``hold_port``)
    for the rest of this process's life, so nothing else is given it before, or after, that
    process binds it. Where a process can bind port 0 and report it, prefer that."""
    held = hold_port(0)
    _HELD_FOR_LIFE.append(held)
    return int(held.getsockname()[1])


def _command(process: subprocess.Popen) -> list[str]:
    """The command line ``process`` was started with, as the strings ``_spawn`` gave it."""
    args = process.args
    return [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]


def _wait_for_line(process: subprocess.Popen, marker: str, timeout: float, log: Path) -> str:
    """Read the process's stdout until a line containing ``marker``; copy all of it to ``log``.

    Returns what it read (the marker's line and everything before it, at least).

    Reads the raw descriptor (no Python buffering), so nothing sits unseen in a buffer while
    ``select`` says there is nothing to read.
    """
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    with log.open("ab") as sink:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], 0.1)
            if not readable:
                if process.poll() is not None:
                    break
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            sink.write(data)
            seen += data
            if marker.encode() in seen:
                return seen.decode(errors="replace")
    tail = "\n".join(seen.decode(errors="replace").splitlines()[-15:])
    ended = "" if process.poll() is None else f" (it exited with {process.returncode})"
    raise RuntimeError(f"{_command(process)[:4]} did not print {marker!r} within {timeout}s"
                       f"{ended}; see {log}; its last lines:\n{tail}")


def merge_sections(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A picker config: ``base`` with each top-level section of ``overrides`` merged into its
    own (a key of both is the override's); a section that is not a mapping replaces."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _picker_ports(grpc: int, health: int, metrics: int, admin: int) -> list[str]:
    return ["--grpc-port", str(grpc), "--grpc-health-port", str(health),
            "--metrics-port", str(metrics), "--admin-port", str(admin)]


def _printed_port(output: str, name: str) -> str:
    found = re.search(rf"\b{name}=\S+:(\d+)", output)
    if found is None:
        raise RuntimeError(f"the picker did not print its {name} port; it printed:\n{output}")
    return found.group(1)


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready within {timeout}s")


@dataclass
class Stack:
    """Real Envoy in front of the picker and ``endpoints`` simulated vLLM servers."""

    workdir: Path
    policy: str = "vtc"
    endpoints: int = 2
    """Simulated vLLM servers to start."""
    external_endpoints: list[str] = field(default_factory=list)
    """``host:port`` of model servers started elsewhere (e.g. a real engine), added to the pool."""
    server_args: list[str] = field(default_factory=list)
    """Extra flags for every ``python -m picker.sim.server``."""
    picker_config: dict[str, Any] = field(default_factory=dict)
    """Config keys merged over the generated picker config (endpoints are filled in)."""
    gateway_port: int = 0
    """Envoy's listener; 0: a port Envoy binds and the stack reads back once it runs."""
    with_picker: bool = True
    """False: Envoy routes on the client's own destination header (overhead baseline)."""
    response_path: str = "meter-stream"
    """How Envoy hands the response to the picker: ``meter-stream`` or ``inline`` (see envoy.py)."""
    picker_source: list[str] = field(default_factory=list)
    """Flags that replace ``--config FILE``, e.g. ``--config-map ns/name --kube-server URL``."""
    secure_serving: bool = True
    """The picker serves ext_proc over TLS (self-signed) and Envoy dials it without verification,
    as the gateways do; False: both plaintext (``--secure-serving=false``)."""
    picker_args: list[str] = field(default_factory=list)
    """Extra flags for ``python -m picker serve`` (e.g. ``--cert-path DIR``)."""
    client_auth: str | None = None
    """Who may speak ext_proc to the picker (``--client-auth``): ``mtls``, Envoy presenting
    ``gateway_client_cert`` (signed by the stack's own CA, ``GATEWAY_NAME``); ``trust-network``
    (TEST ONLY, like ``identity``'s default: tenant headers believed from any client);
    ``none``. None: ``mtls`` with ``secure_serving`` and envoy.py's Envoy, else
    ``trust-network`` (a plaintext picker, or an ``envoy_bootstrap`` that presents no
    certificate unless it uses ``gateway_client_cert`` and sets this to ``mtls``). Flags
    ``--client-auth``/``--client-ca`` in ``picker_args`` win."""
    identity: str = "trusted-client"
    """How envoy.py's Envoy establishes the tenant (``picker.stack.envoy.IDENTITY_MODES``). The
    default is the TEST-ONLY ``trusted-client``: the tests, benchmarks and demos send the tenant
    header themselves, standing in for a gateway that authenticated them; ``strip`` and ``jwt``
    are what a deployment runs (manifests/gateway/envoy.yaml, envoy-jwt.yaml)."""
    jwt: JwtIdentity | None = None
    """The JWT issuer of ``identity="jwt"``."""
    gateway_retries: bool | None = None
    """Envoy routes with ``override_host`` over the pool's endpoints (a ``STATIC`` cluster) and
    retries a request that never reached an engine on the picker's fallbacks
    (``routing.fallbackEndpoints: FALLBACK_ENDPOINTS``). ``None`` (default): whenever the stack
    knows the endpoints for good, i.e. it started or was given them and the picker reads them
    from the stack's own config file; with ``picker_source`` (the picker discovers pods) or a
    ``picker_config`` that names other endpoints, ``ORIGINAL_DST`` on the header instead, which
    reaches endpoints that appear later but cannot retry elsewhere. ``False``: always that.
    An ``envoy_bootstrap`` decides for itself (the picker then names no fallbacks unless
    ``picker_config`` asks)."""
    envoy_bootstrap: Callable[[Stack], dict[str, Any]] | None = None
    """Builds Envoy's bootstrap from the started stack (its ports and endpoints) instead of
    envoy.py's, e.g. a gateway flavour of ``picker.stack.gateways``."""
    processes: list[subprocess.Popen] = field(default_factory=list)
    endpoint_addresses: list[str] = field(default_factory=list)
    server_processes: list[subprocess.Popen] = field(default_factory=list)
    """The simulated servers started, in the order of ``endpoint_addresses``."""
    picker_replicas: int = 1
    """Active-active pickers behind Envoy's one ext_proc cluster (more than one needs
    ``response_path='inline'`` and a shared state backend in ``picker_config``)."""
    picker_streams_per_connection: int | None = None
    """Envoy puts at most this many ext_proc streams on one connection to a picker (so that it
    opens several, for a picker of ``--workers``); None: Envoy's default."""
    picker_processes: list[subprocess.Popen] = field(default_factory=list)
    """The running pickers, in the order of ``replica_ports``."""
    replica_ports: list[dict[str, int]] = field(default_factory=list)
    """Each picker's ports (``grpc``, ``health``, ``metrics``, ``admin``), the first picker's
    also in ``grpc_port`` and the others."""
    grpc_port: int = 0
    metrics_port: int = 0
    admin_port: int = 0
    """Envoy's admin port."""
    admin_grpc_port: int = 0
    """The picker's admin API (``fairway.v1.Admin``), as the picker reported it."""
    health_port: int = 0
    """The picker's gRPC health port (plaintext: liveness, readiness), as it reported it."""
    _startup_output: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    """Each waited-for process's stdout up to its ready line, by name."""
    _held_ports: dict[int, socket.socket] = field(default_factory=dict, init=False, repr=False)
    """Ports of killed processes, held (``hold_port``) until they run again or the stack
    stops."""

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def admin_address(self) -> str:
        """``host:port`` of the picker's admin API, for ``python -m picker.ctl --admin``."""
        return f"127.0.0.1:{self.admin_grpc_port}"

    @property
    def retries(self) -> bool:
        """Envoy retries on the picker's fallbacks (see ``gateway_retries``)."""
        if self.gateway_retries is not None:
            return self.gateway_retries
        return (self.with_picker and self.envoy_bootstrap is None
                and bool(self.endpoint_addresses) and not self.picker_source
                and "endpoints" not in self.picker_config)

    @property
    def picker_client_auth(self) -> str:
        """``client_auth`` resolved."""
        if self.client_auth is not None:
            return self.client_auth
        return "mtls" if self.secure_serving and self.envoy_bootstrap is None \
            else "trust-network"

    @property
    def tls_dir(self) -> Path:
        """The stack's CA (``ca.crt``) and the gateway's client pair (``gateway.crt``/``.key``)."""
        return self.workdir / "tls"

    @property
    def gateway_client_cert(self) -> tuple[Path, Path]:
        """The certificate and key Envoy presents to the picker (made at ``start``)."""
        return self.tls_dir / "gateway.crt", self.tls_dir / "gateway.key"

    def _make_certificates(self) -> None:
        if (self.tls_dir / "ca.crt").exists():
            return
        ca = certificate_authority("fairway-stack-ca")
        ca.write(self.tls_dir, "ca.crt", "ca.key")
        issue(ca, [GATEWAY_NAME]).write(self.tls_dir, "gateway.crt", "gateway.key")

    def _client_auth_args(self) -> list[str]:
        if any(arg.startswith(("--client-auth", "--client-ca")) for arg in self.picker_args):
            return []
        mode = self.picker_client_auth
        if mode == "mtls":
            return ["--client-ca", str(self.tls_dir / "ca.crt"), "--client-name", GATEWAY_NAME]
        return [f"--client-auth={mode}"]

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    @property
    def config_path(self) -> Path:
        return self.workdir / "picker.yaml"

    def _spawn(self, args: list[str], name: str, marker: str | None,
               timeout: float = 30.0) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(args, stdout=subprocess.PIPE if marker else log.open("w"),
                                   stderr=subprocess.STDOUT, env=env, bufsize=0,
                                   start_new_session=True)
        self.processes.append(process)
        if marker:
            self._startup_output[name] = _wait_for_line(process, marker, timeout, log)
            # Keep draining stdout into the log so the process never blocks on a full pipe.
            drain = subprocess.Popen(["cat"], stdin=process.stdout, stdout=log.open("a"))
            self.processes.append(drain)
        return process

    def start(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.secure_serving:
            self._make_certificates()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        # Processes that print the port they bound are started on port 0: a port found free here
        # and bound later can be taken in between by any connection's ephemeral port.
        for i in range(self.endpoints):
            self.server_processes.append(self._spawn(
                [sys.executable, "-m", "picker.sim.server", "--port", "0", *self.server_args],
                f"server{i}", "listening on"))
            url = re.search(r"listening on http://(\S+)", self._startup_output[f"server{i}"])
            assert url is not None
            self.endpoint_addresses.append(url.group(1).rstrip("/"))
        self.endpoint_addresses.extend(self.external_endpoints)
        if self.with_picker:
            self.write_picker_config(self.picker_config)
            for _ in range(self.picker_replicas):
                self.add_picker()
            first = self.replica_ports[0]
            self.grpc_port, self.health_port = first["grpc"], first["health"]
            self.metrics_port, self.admin_grpc_port = first["metrics"], first["admin"]
        # Envoy too binds port 0 (unless the caller chose the gateway's port); the bootstrap is
        # built with 0 and the bound ports are read back once Envoy runs.
        self.admin_port = 0
        if self.envoy_bootstrap is not None:
            envoy_yaml = self.workdir / "envoy.yaml"
            envoy_yaml.write_text(yaml.safe_dump(self.envoy_bootstrap(self), sort_keys=False))
        else:
            envoy_yaml = write_envoy_config(
                self.workdir / "envoy.yaml", listen_port=self.gateway_port,
                admin_port=self.admin_port,
                picker_port=[r["grpc"] for r in self.replica_ports] if self.with_picker
                else None,
                access_log=self.access_log, response_path=self.response_path,
                picker_tls=self.secure_serving, identity=self.identity, jwt=self.jwt,
                picker_client_cert=self.gateway_client_cert
                if self.picker_client_auth == "mtls" else None,
                endpoints=self.endpoint_addresses if self.retries else None,
                picker_streams_per_connection=self.picker_streams_per_connection,
                # The headers this picker's config trusts, not a fixed four.
                strip_headers=client_controlled_headers(load_config(
                    {"tenancy": self.picker_config.get("tenancy", {})}).tenancy))
        self._start_envoy(envoy_yaml)
        self.gateway_port = self.gateway_port or self._listener_port()

    def _start_envoy(self, config: Path) -> None:
        """Start Envoy on ``config`` and wait until it is ready; sets ``admin_port`` to the port
        its admin bound. Hot restart is off: these Envoys never hand over to a successor, and
        without it parallel Envoys share no memory (no base id to keep apart)."""
        address_file = self.workdir / "envoy-admin.address"
        address_file.unlink(missing_ok=True)
        process = self._spawn([envoy_binary(), "-c", str(config), "--log-level", "warn",
                               "--disable-hot-restart", "--concurrency", "1",
                               "--admin-address-path", str(address_file),
                               "--file-flush-interval-msec", "50"], "envoy", None)
        deadline = time.monotonic() + 20
        while not address_file.exists() or not address_file.read_text().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Envoy did not bind its admin within 20 s (exit status "
                                   f"{process.poll()}); see {self.workdir / 'envoy.log'}")
            time.sleep(0.02)
        self.admin_port = int(address_file.read_text().strip().rsplit(":", 1)[1])
        _wait_http(f"http://127.0.0.1:{self.admin_port}/ready", 20)

    def _listener_port(self) -> int:
        """The port Envoy's one listener bound, from its admin."""
        url = f"http://127.0.0.1:{self.admin_port}/listeners?format=json"
        with urllib.request.urlopen(url, timeout=5) as response:
            statuses = json.load(response)["listener_statuses"]
        if len(statuses) != 1:
            raise RuntimeError(f"the stack's Envoy should have one listener, it has {statuses}")
        return int(statuses[0]["local_address"]["socket_address"]["port_value"])

    @property
    def envoy_process(self) -> subprocess.Popen:
        """The running Envoy (the last one started)."""
        return next(p for p in reversed(self.processes) if p.args[0] == envoy_binary())

    @property
    def picker_process(self) -> subprocess.Popen:
        """The running picker (the first replica)."""
        return self.picker_processes[0]

    def _kill(self, process: subprocess.Popen, ports: list[int]) -> None:
        """SIGKILL ``process`` (if it still runs) and hold its ports."""
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        for port in ports:
            if port not in self._held_ports:
                self._held_ports[port] = hold_port(port)

    def _release(self, ports: list[int]) -> None:
        for port in ports:
            held = self._held_ports.pop(port, None)
            if held is not None:
                held.close()

    def kill_server(self, index: int) -> None:
        """SIGKILL model server ``index`` and hold its port until ``restart_server`` (or the
        stack's stop): connections to it are refused, as to a dead pod, and no other process
        (another test's, on the other xdist worker) can take the port and answer in its
        place."""
        self._kill(self.server_processes[index], [self._server_port(index)])

    def restart_server(self, index: int, extra: list[str] | None = None) -> None:
        """Model server ``index`` again on its port, with ``extra`` flags instead of
        ``server_args`` when given."""
        process = self.server_processes[index]
        port = self._server_port(index)
        self._kill(process, [port])
        self.processes.remove(process)
        self.server_processes[index] = self._spawn(
            [sys.executable, "-m", "picker.sim.server", "--port", str(port),
             *(self.server_args if extra is None else extra)],
            f"server{index}-again", "listening on")
        self._release([port])

    def _server_port(self, index: int) -> int:
        return int(self.endpoint_addresses[index].rsplit(":", 1)[1])

    def restart_envoy(self) -> None:
        """SIGKILL Envoy and start it again with the same config on the same ports (as a
        gateway's Service keeps its address), held meanwhile."""
        old = self.envoy_process
        ports = [self.gateway_port, self.admin_port]
        self._kill(old, ports)
        self.processes.remove(old)
        config = yaml.safe_load((self.workdir / "envoy.yaml").read_text())
        config["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        (listener,) = config["static_resources"]["listeners"]
        listener["address"]["socket_address"]["port_value"] = self.gateway_port
        restarted = self.workdir / "envoy-restarted.yaml"
        restarted.write_text(yaml.safe_dump(config, sort_keys=False))
        self._start_envoy(restarted)
        self._release(ports)

    def restart_picker(self, replica: int = 0) -> None:
        """Start a picker again (SIGKILLed first if it still runs) on the same ports and
        config; its ports are held meanwhile."""
        old = self.picker_processes[replica]
        ports = self.replica_ports[replica]
        held = [ports["grpc"], ports["health"], ports["metrics"], ports["admin"]]
        self._kill(old, held)
        self.processes.remove(old)
        # The same ports as before (Envoy's config names them), no longer 0.
        args = _command(old)
        at = args.index("--grpc-port")
        args[at:at + 8] = _picker_ports(*held)
        self.picker_processes[replica] = self._spawn(
            args, "picker" if replica == 0 else f"picker{replica}", "picker listening")
        self._release(held)

    def add_picker(self) -> int:
        """Start one more picker replica on the stack's config, on ports of its own (0: it prints
        what it bound); returns its index in ``picker_processes`` and ``replica_ports``. Envoy's
        configuration is not changed: a replica added after the start is reached only through a
        bootstrap that discovers it (e.g. EDS, ``tests/faults/test_rolling_update.py``)."""
        index = len(self.picker_processes)
        name = "picker" if index == 0 else f"picker{index}"
        source = self.picker_source or ["--config", str(self.config_path)]
        self.picker_processes.append(self._spawn(
            [sys.executable, "-m", "picker", "serve", *source, *_picker_ports(0, 0, 0, 0),
             "--grace", "2", f"--secure-serving={str(self.secure_serving).lower()}",
             *self._client_auth_args(), *self.picker_args], name, "picker listening"))
        # The ports it bound, as it printed them (their lines come before the marker's).
        output = self._startup_output[name]
        self.replica_ports.append({port: int(_printed_port(output, port))
                                   for port in ("grpc", "health", "metrics", "admin")})
        return index

    def stop_picker(self, replica: int, timeout: float = 30.0) -> int:
        """SIGTERM a picker replica, as Kubernetes stops a pod, and wait until it has drained
        (``--grace``) and exited; returns its exit status. It keeps its index (and
        ``restart_picker`` can start it again)."""
        process = self.picker_processes[replica]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        return process.wait(timeout)

    def write_picker_config(self, overrides: dict[str, Any]) -> None:
        """(Re)write the picker's config file; the running picker hot-reloads it."""
        config: dict[str, Any] = {
            "scheduling": {"policy": self.policy},
            "endpoints": [{"address": a} for a in self.endpoint_addresses],
            "capacity": {"scrapeInterval": "50ms"},
        }
        if self.retries:
            named = [entry["address"] for entry in overrides.get("endpoints", [])]
            if "endpoints" in overrides and named != self.endpoint_addresses:
                # Envoy's cluster lists the started endpoints: others would be unreachable.
                raise ValueError("a retrying stack's endpoints are fixed; start it with "
                                 "gateway_retries=False to change them")
            config["routing"] = {"fallbackEndpoints": FALLBACK_ENDPOINTS}
        config = merge_sections(config, overrides)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.replace(self.config_path)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    process.terminate()
        deadline = time.monotonic() + 5
        for process in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                process.wait(remaining)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    process.kill()
                process.wait()
        self.processes.clear()
        self._release(list(self._held_ports))

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
