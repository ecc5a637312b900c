"""Upstream tools built from Go modules, and files read out of Go modules, for tests and benchmarks.

fairway is Python; what it is tested and measured against (kube-apiserver, upstream's endpoint
picker) is Go, built here from the module proxy by a wrapper module in ``scripts/`` and cached
outside the repository under ``~/.cache/fairway/<kind>/<version>-<pins>/bin`` (``FAIRWAY_CACHE``
moves it). ``<pins>`` hashes the wrapper's go.mod and go.sum and the link flags, so a changed
pin builds anew and the older build is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


class GoModuleError(RuntimeError):
    """A Go module could not be fetched or built; the message names the command and its error."""


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise GoModuleError("Go (1.26) is needed: `go` is not on PATH")
    return go


def _environment(goflags: str) -> dict[str, str]:
    return {**os.environ, "GOFLAGS": goflags, "GOTOOLCHAIN": "local"}


def module_dir(module: str) -> Path:
    """The folder of Go module ``path@version`` in Go's module cache (downloaded the first time
    from the module proxy)."""
    done = subprocess.run([_go(), "mod", "download", "-json", module], capture_output=True,
                          text=True, cwd=tempfile.gettempdir(), env=_environment("-mod=mod"))
    try:
        info = json.loads(done.stdout)
    except ValueError:
        info = {"Error": done.stderr.strip() or f"exit {done.returncode}"}
    if info.get("Error") or not info.get("Dir"):
        raise GoModuleError(f"`go mod download {module}` failed: {info.get('Error')}")
    return Path(info["Dir"])


def module_files(module: str, folder: str, *names: str) -> list[Path]:
    """Files ``folder/name`` of Go module ``path@version``; an error names one that is missing."""
    found = [module_dir(module) / folder / name for name in names]
    for path in found:
        if not path.is_file():
            raise GoModuleError(f"{module} has no {folder}/{path.name}")
    return found


@dataclass(frozen=True)
class GoBuild:
    """Commands built from a wrapper module of ``scripts/``."""

    kind: str
    """The cache folder's name, and how progress lines start (``cluster``, ``upstream-epp``)."""
    version: str
    """The pinned release, in the cache path and the messages."""
    module: Path
    """The wrapper module: its go.mod requires the release (and replaces what it must)."""
    packages: tuple[str, ...]
    """Import paths of the ``main`` packages to build; each binary is named after the last part."""
    ldflags: str
    took: str
    """How long a first build takes, for the message before it starts."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.rsplit("/", 1)[1] for p in self.packages)

    def cache_dir(self) -> Path:
        base = os.environ.get("FAIRWAY_CACHE") or Path.home() / ".cache" / "fairway"
        pins = hashlib.sha256((self.module / "go.mod").read_bytes()
                              + (self.module / "go.sum").read_bytes() + self.ldflags.encode())
        return Path(base) / self.kind / f"{self.version}-{pins.hexdigest()[:12]}"

    def binaries(self, *, quiet: bool = False) -> Path:
        """The folder holding the binaries, built now if the cache lacks them (under a lock,
        so two processes never build at once)."""
        folder = self.cache_dir() / "bin"
        if self._built(folder):
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self._built(folder):
                self._build(folder, quiet=quiet)
        return folder

    def _built(self, folder: Path) -> bool:
        return all((folder / name).is_file() for name in self.names)

    def _build(self, folder: Path, *, quiet: bool) -> None:
        staging = Path(tempfile.mkdtemp(prefix="build-", dir=folder.parent))
        command = [_go(), "build", "-p", str(os.cpu_count() or 2), "-trimpath", "-ldflags",
                   self.ldflags, "-o", f"{staging}/", *self.packages]
        if not quiet:
            print(f"{self.kind}: building {', '.join(self.names)} {self.version} from Go modules "
                  f"({self.took} the first time) into {folder}", file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run(command, cwd=self.module, capture_output=True, text=True,
                              env=_environment("-mod=mod -buildvcs=false"))
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise GoModuleError(f"`{' '.join(command)}` in {self.module} failed "
                                f"({done.returncode}):\n{done.stderr[-4000:]}")
        for name in self.names:
            os.replace(staging / name, folder / name)
        shutil.rmtree(staging, ignore_errors=True)
        for other in folder.parent.parent.iterdir():  # builds of older pins: 60-200 MB each
            if other != folder.parent and other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
        if not quiet:
            print(f"{self.kind}: built in {time.monotonic() - started:.0f} s", file=sys.stderr)
