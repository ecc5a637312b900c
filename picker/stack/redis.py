"""A real ``redis-server`` on 127.0.0.1 for the shared state backend's tests and benchmarks
(Debian's package, which ``scripts/install-system-deps.sh`` installs; nothing else listens)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from picker.stack.launcher import hold_port
from picker.tls import self_signed

READY_LINE = b"Ready to accept connections"


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make setup` (it installs "
                           "Debian's redis-server) or install Redis 7 another way")
    return binary


@dataclass
class RedisServer:
    """``start()`` a Redis on a free port of 127.0.0.1, without persistence unless ``aof``;
    ``kill()`` and ``start()`` again on the same port (a restart loses everything without
    ``aof``); ``stop()`` at the end."""

    workdir: Path
    aof: bool = False
    """Append-only persistence in ``workdir``: a restarted server keeps its data."""
    password: str | None = None
    """Required of clients (``requirepass``) when set."""
    tls: bool = False
    """Serve TLS only (``rediss://``), with a self-signed certificate for 127.0.0.1 written to
    ``ca_file`` (clients verify against it; they need no certificate of their own)."""
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)
    _held: socket.socket | None = field(default=None, repr=False)
    """The port while no server listens there (``hold_port``): from ``start`` until Redis is
    ready, and from ``kill`` until the next ``start``."""

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "redis-cert.pem"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._held is None:
            # Port 0: a free one, held until Redis listens there (no other process takes it
            # meanwhile); after ``kill`` the port is held already.
            self._held = hold_port(self.port)
            self.port = self._held.getsockname()[1]
        if not self._spawn(self.port, timeout):
            raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")
        self._release()
        return self

    def _spawn(self, port: int, timeout: float) -> bool:
        args = [redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                "--dir", str(self.workdir), "--protected-mode", "yes"]
        if self.aof:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            pair = self_signed(["127.0.0.1"])
            self.ca_file.write_bytes(pair.cert_pem)
            key = self.workdir / "redis-key.pem"
            key.write_bytes(pair.key_pem)
            at = args.index("--port")
            args[at:at + 2] = ["--port", "0", "--tls-port", str(port)]
            args += ["--tls-cert-file", str(self.ca_file), "--tls-key-file", str(key),
                     "--tls-ca-cert-file", str(self.ca_file), "--tls-auth-clients", "no"]
        log = (self.workdir / "redis.log").open("ab")
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        assert process.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            log.write(line)
            seen += line
            if READY_LINE in line:
                # Keep draining its output so it never blocks on a full pipe.
                subprocess.Popen(["cat"], stdin=process.stdout, stdout=log)
                self.process = process
                return True
        process.kill()
        process.wait(5)
        return False

    def kill(self) -> None:
        """SIGKILL (no shutdown save); the port is held until ``start`` runs it again."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self._held = hold_port(self.port)
        self.process = None

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def stop(self) -> None:
        self.kill()
        self._release()

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
