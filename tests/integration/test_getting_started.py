"""The commands of ``docs/getting-started.md`` run as a reader runs them.

The page's ```` ```sh ```` blocks run in order in one directory that looks like a clone (every
top-level entry of the repository linked into it, so what the commands write stays in the test's
directory): unmarked blocks with ``bash -e`` as they stand, and the stack the page starts by hand
(``python -m picker.stack``) is started in the background, the next block's requests are sent
through it, and it is stopped with Ctrl-C's signal. The one change: the stack gets ``--port 0``
instead of the page's 10000, and the requests its port, so that no other process on the machine
can hold or answer the port. Blocks marked ``slow``, ``cluster`` or ``manual`` are not run here
(``tests/unit/test_docs_site.py`` checks what can be checked of them without their cost).
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from pathlib import Path

from tests.docs_blocks import ROOT, Block, blocks

PAGE_PORT = "10000"


def _clone_like(where: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "site", "demo-out"):
            (where / entry.name).symlink_to(entry)
    return where


def _run(block: Block, cwd: Path, port: str = PAGE_PORT) -> str:
    body = block.body.replace(f"localhost:{PAGE_PORT}", f"localhost:{port}")
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", body], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, \
        f"{block.body}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _start_stack(block: Block, cwd: Path) -> tuple[subprocess.Popen[str], str]:
    (line,) = block.lines()
    assert f"--port {PAGE_PORT}" in line, line
    stack = subprocess.Popen(["bash", "-c", "exec " + line.replace(f"--port {PAGE_PORT}",
                                                                    "--port 0")],
                             cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    found: list[str] = []
    port: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert stack.stdout is not None
        for out in stack.stdout:
            found.append(out)
            if (m := re.search(r"gateway http://127\.0\.0\.1:(\d+)", out)) and not port:
                port.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    # Generous: starting Envoy, the picker and two servers on a busy 2-core machine; a stack
    # that never says where it listens fails here.
    ready.wait(timeout=90)
    assert port, "".join(found)
    return stack, port[0]


def test_the_getting_started_commands_run(tmp_path: Path) -> None:
    cwd = _clone_like(tmp_path)
    page = blocks()
    ran = {"run": 0, "stack-client": 0}
    stack: subprocess.Popen[str] | None = None
    port = PAGE_PORT
    try:
        for block in page:
            if block.kind == "run":
                _run(block, cwd)
                ran["run"] += 1
            elif block.kind == "stack":
                stack, port = _start_stack(block, cwd)
            elif block.kind == "stack-client":
                assert stack is not None, "a stack-client block before any stack block"
                out = _run(block, cwd, port)
                ran["stack-client"] += 1
                # The chat answer, then the refusal the page says the unknown path gets.
                assert '"object": "chat.completion"' in out, out
                assert '"code": "unknown_url"' in out, out
    finally:
        if stack is not None:
            stack.send_signal(signal.SIGINT)
            stack.wait(timeout=60)
    assert ran == {"run": 3, "stack-client": 1}, ran
    assert "ok (2 tenants, 2 lanes, 2 endpoints, policy vtc)" in \
        subprocess.run([".venv/bin/python", "-m", "picker.config", "check", "picker.yaml"],
                       cwd=cwd, capture_output=True, text=True).stdout
    gateway = "manifests/gateway/kgateway.yaml"
    assert f"{gateway}: removes clients' copies of every header picker.yaml trusts" in \
        subprocess.run([".venv/bin/python", "-m", "picker.config", "check", "picker.yaml",
                        "--gateway", gateway], cwd=cwd, capture_output=True, text=True).stdout
    for policy in ("vtc", "fcfs"):
        assert (cwd / f"sim-{policy}" / "summary.json").is_file()


def test_the_demo_runs_and_prints_who_got_what(tmp_path: Path) -> None:
    """What ``make demo`` runs (``tests/unit/test_docs_site.py`` checks that it runs this), with
    3 s of traffic a policy instead of 20: both policies through real Envoy and the picker, the
    side-by-side table with every tenant of the demo's traffic, and the plot."""
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "picker.demo",
                           "--duration", "3", "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line for line in done.stdout.splitlines()
            if line.count("|") == 2}
    assert {"alice", "bob", "carol", "noisy"} <= set(rows), done.stdout
    for tenant in ("alice", "bob", "carol", "noisy"):
        # A share under each policy: "12.3%" twice on the tenant's row.
        assert len(re.findall(r"\d+\.\d%", rows[tenant])) == 2, rows[tenant]
    assert (tmp_path / "out" / "demo_service.png").stat().st_size > 10_000
