"""What the fault scenarios share: a client that always returns (status, headers, OpenAI error
body), the check of an OpenAI error, the check that the picker's gauges drained to zero, and a
model server killed and restarted on its port."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from picker.stack.envoy import with_client_cert
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, metric, metric_samples, wait_until

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "gateway"
CHAT = "/v1/chat/completions"
GAUGES = ("fairway_queued_requests", "fairway_running_requests",
          "fairway_endpoint_inflight_tokens")


def post(stack: Stack, tenant: str, body: bytes, timeout: float = 20.0
         ) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One blocking request through the gateway: status, lower-cased headers, parsed JSON body
    (``{}`` when empty or not JSON)."""
    return post_with(stack, {TENANT_HEADER: tenant}, body, timeout)


def post_with(stack: Stack, headers: dict[str, str], body: bytes, timeout: float = 30.0
              ) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``post`` with the request's own headers (identity, credentials) instead of a tenant."""
    request = urllib.request.Request(stack.gateway_url + CHAT, data=body, headers={
        **headers, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, headers, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = error.code, error.headers, error.read()
    return status, {k.lower(): v for k, v in headers.items()}, _json(raw)


async def apost(session: aiohttp.ClientSession, stack: Stack, tenant: str, body: bytes
                ) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``post`` for asyncio: many at once on one session."""
    async with session.post(stack.gateway_url + CHAT, data=body, headers={
            TENANT_HEADER: tenant, "content-type": "application/json"}) as response:
        raw = await response.read()
        return response.status, {k.lower(): v for k, v in response.headers.items()}, _json(raw)


async def flood(stack: Stack, count: int, concurrency: int, tenant: Callable[[], str],
                body: bytes, started: threading.Event | None = None
                ) -> list[tuple[int, dict[str, str], dict[str, Any]]]:
    """``count`` posts of ``body``, ``concurrency`` at a time, each from ``tenant()``; every
    answer (``apost``'s). ``started`` is set as the first leaves."""
    answers: list[tuple[int, dict[str, str], dict[str, Any]]] = []
    left = iter(range(count))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def client() -> None:
            for _ in left:
                if started is not None:
                    started.set()
                answers.append(await apost(session, stack, tenant(), body))
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {"_raw": raw[:200].decode(errors="replace")}
    return value if isinstance(value, dict) else {"_raw": value}


def assert_openai_error(status: int, headers: dict[str, str], body: dict[str, Any],
                        expected_status: int, code: str, retryable: bool) -> None:
    """The refusal is ``expected_status`` with an OpenAI-shaped body naming ``code``, and carries
    ``Retry-After`` exactly when retrying can help."""
    assert status == expected_status, (status, headers, body)
    error = body.get("error")
    assert isinstance(error, dict), body
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"], error
    if retryable:
        assert float(headers["retry-after"]) > 0, headers
    else:
        assert "retry-after" not in headers, headers


def gauges(stack: Stack) -> dict[str, float]:
    """The picker's queued, running and in-flight gauges, each summed over its labels."""
    return {name: metric(stack.metrics_url, name) for name in GAUGES}


def gauges_drain(stack: Stack, timeout: float = 15.0) -> dict[str, float]:
    """The gauges once all are 0 (or as they are at the timeout, for the assertion's message)."""
    wait_until(lambda: not any(gauges(stack).values()), timeout)
    return gauges(stack)


def engine_requests(stack: Stack) -> float:
    """Requests the simulated servers finished, whatever the reason (stop, length, abort): every
    request that reached an engine, once it is over."""
    return sum(metric(f"http://{address}/metrics", "vllm:request_success_total")
               for address in stack.endpoint_addresses)


def shipped_envoy(name: str, jwks: dict[str, Any] | None = None
                  ) -> Callable[[Stack], dict[str, Any]]:
    """manifests/gateway/<name> (an Envoy bootstrap) with the stack's addresses put in, and
    ``jwks`` as the JWT issuer's keys when given, and the stack's gateway certificate as the
    client certificate it presents to the picker; nothing else changed.

    The pool cluster keeps its type (``STRICT_DNS``): only its one DNS name (the headless
    Service of the pool's pods) is replaced by the stack's servers, each an address literal
    that resolves to itself, since on 127.0.0.1 the servers differ by port, not by IP."""
    def build(stack: Stack) -> dict[str, Any]:
        config = yaml.safe_load((SAMPLES / name).read_text())
        config["admin"]["address"]["socket_address"]["port_value"] = stack.admin_port
        resources = config["static_resources"]
        (listener,) = resources["listeners"]
        listener["address"]["socket_address"] = {"address": "127.0.0.1",
                                                 "port_value": stack.gateway_port}
        (picker,) = [c for c in resources["clusters"] if c["name"] == "picker"]
        picker["type"] = "STATIC"
        endpoint = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"] = {"address": "127.0.0.1",
                                                 "port_value": stack.grpc_port}
        (pool,) = [c for c in resources["clusters"] if c["name"] == "pool"]
        (group,) = pool["load_assignment"]["endpoints"]
        group["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {
                "address": host, "port_value": int(port)}}}}
            for host, port in (a.rsplit(":", 1) for a in stack.endpoint_addresses)]
        # The client certificate the sample mounts: the stack's gateway certificate (a picker
        # of the stack's client_auth="mtls" takes ext_proc only from it).
        if stack.secure_serving:
            with_client_cert(config, *stack.gateway_client_cert)
        if jwks is not None:
            manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
            (jwt_filter,) = [f for f in manager["http_filters"]
                             if f["name"] == "envoy.filters.http.jwt_authn"]
            provider = jwt_filter["typed_config"]["providers"]["tenant-issuer"]
            provider["local_jwks"]["inline_string"] = json.dumps(jwks)
        return config
    return build


def usage_records(path: Path, tenant: str) -> list[dict[str, Any]]:
    """The picker's metering records (``metering.output: <path>``) of ``tenant``, in order; only
    whole lines, since the picker may be writing the next one."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]
    return [r for r in (json.loads(line) for line in lines if line) if r["tenant_id"] == tenant]


class ScrapesUntilExit:
    """Scrapes a picker's metrics page over and over, on a thread, until the process has exited,
    keeping the last page it got: the figures the picker stopped with, which a test cannot ask
    for once the process is gone.

    A draining picker keeps its metrics server up until its drain is over and its gRPC servers
    are stopped (picker/server.py: it shuts that server last), but that can be within a few
    milliseconds of the last settlement: the last page may predate it. What the picker left in
    flight is in its last log line ("picker stopped, N requests left unsettled")."""

    def __init__(self, stack: Stack, process: subprocess.Popen) -> None:
        self.last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.pages = 0
        """Pages scraped; with ``errors``, for an assertion's message."""
        self.errors: list[str] = []
        self._url, self._process = stack.metrics_url, process
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._process.poll() is None:
            try:
                self.last = metric_samples(self._url)
                self.pages += 1
            except (OSError, http.client.HTTPException, ValueError) as error:
                # The metrics server gone, or cut mid-page: the process is about to be.
                self.errors.append(f"{type(error).__name__}: {error}"[:200])
            # A short pause: a tight loop would take CPU from the draining picker on small
            # machines (it only has to hit the window between the drain's end and the exit).
            time.sleep(0.01)

    def wait(self, timeout: float = 20.0) -> None:
        """Until the process exited (and the thread saw it)."""
        self._process.wait(timeout)
        self._thread.join(timeout)

    def value(self, name: str, **labels: str) -> float:
        """``metric`` of the last page: the sum of ``name``'s samples whose labels include
        ``labels``."""
        wanted = set(labels.items())
        return sum(v for (sample, sample_labels), v in self.last.items()
                   if sample == name and wanted <= set(sample_labels))
