"""Every request body mode a gateway configures, through real Envoy.

``FULL_DUPLEX_STREAMED`` is what current gateways send; ``BUFFERED`` is older kgateway's and an
Envoy AI Gateway option; ``STREAMED`` is Envoy's own streaming mode, with and without
``send_body_without_waiting_for_header_response``. In each the picker must route, rewrite the
body as policy says (the client's own ``priority`` removed), charge what the engine served, and
refuse what it must with an OpenAI error, without deadlocking the gateway (a ``BUFFERED`` body
comes only after the headers are answered).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from picker.stack.envoy import envoy_config
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric_samples, settled_metric

MODES = {
    "full-duplex": ("FULL_DUPLEX_STREAMED", False),
    "buffered": ("BUFFERED", False),
    "streamed": ("STREAMED", False),
    "streamed-eager": ("STREAMED", True),
}


def _bootstrap(mode: str, eager: bool):  # type: ignore[no-untyped-def]
    def build(stack: Stack) -> dict[str, Any]:
        config = envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                              picker_port=stack.grpc_port, access_log=stack.access_log,
                              picker_tls=stack.secure_serving,
                              identity="trusted-client")  # the test sends the tenant itself
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        picker = manager["typed_config"]["http_filters"][0]["typed_config"]
        picker["processing_mode"]["request_body_mode"] = mode
        if eager:
            picker["send_body_without_waiting_for_header_response"] = True
        return config
    return build


@pytest.fixture(scope="module", params=list(MODES))
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    mode, eager = MODES[request.param]
    config = {"tenants": [{"id": "a"}, {"id": "capped", "limits": {"maxInputTokens": 10}}]}
    with Stack(tmp_path_factory.mktemp(request.param), endpoints=1,
               server_args=["--step-ms", "2"], picker_config=config,
               envoy_bootstrap=_bootstrap(mode, eager)) as running:
        yield running


def _post(stack: Stack, tenant: str, body: bytes) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.post(
                stack.gateway_url + "/v1/chat/completions", data=body,
                headers={TENANT_HEADER: tenant, "content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=20)) as response:
            return response.status, await response.read()
    return asyncio.run(go())


def test_request_is_routed_rewritten_and_charged(stack: Stack) -> None:
    before = settled_metric(stack.metrics_url, "fairway_service_tokens_total", 0, timeout=0,
                            tenant="a", kind="completion")
    for stream in (False, True):
        # A client's own priority must not reach the engine: the simulated server refuses a
        # non-zero priority (it runs FCFS, as vLLM does without priority scheduling).
        status, body = _post(stack, "a", chat_body(max_tokens=4, stream=stream, priority=7))
        assert status == 200, body
    charged = settled_metric(stack.metrics_url, "fairway_service_tokens_total", before + 8,
                             tenant="a", kind="completion")
    assert charged == before + 8, _diagnosis(stack)


def _diagnosis(stack: Stack) -> str:
    """What the picker counted and logged, and what Envoy logged, for a failure's message."""
    counted = {f"{name}{dict(labels)}": value
               for (name, labels), value in metric_samples(stack.metrics_url).items()
               if name.startswith(("fairway_requests_total", "fairway_settlements_estimated",
                                   "fairway_meter_unclaimed", "fairway_service_tokens_total",
                                   "fairway_faults"))}
    logs = {name: (stack.workdir / name).read_text(errors="replace")[-3000:]
            for name in ("picker.log", "envoy.log", "access.log", "server0.log")
            if (stack.workdir / name).exists()}
    return json.dumps({"metrics": counted, "logs": logs}, indent=1)


def test_refusals_reach_the_client_with_their_status(stack: Stack) -> None:
    status, body = _post(stack, "capped", chat_body(words=200))
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    status, body = _post(stack, "a", b"{not json")
    assert status == 400, body
    status, body = _post(stack, "a", chat_body(max_tokens=1))  # and it keeps serving
    assert status == 200, body
