"""The product's main path through real Envoy: client → Envoy → ext_proc picker → model server.

One stack serves the module: two simulated vLLM servers with a small KV budget (so the pool is
easily saturated), the picker with VTC, and Envoy routing on the picker's answer, the response
reaching the picker on a meter stream. The tests of the response path run again against a second
stack whose Envoy streams the response through the picker inline (the GIE way), and a third whose
Envoy reads the usage itself and reports it in its gRPC access log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from picker.sim.load import run_traffic
from picker.sim.traffic import load_traffic
from picker.stack.launcher import Stack
from tests.e2e.conftest import (
    TENANT_HEADER,
    chat_body,
    metric,
    settled_metric,
    wait_until,
    window_shares,
)

TENANTS = ["a", "b", "light", "noisy", "meter", "quitter", "streamer", "bad"]


def _stack(tmp_path_factory: pytest.TempPathFactory, response_path: str) -> Stack:
    config = {
        "tenants": [{"id": t, "weight": 2 if t == "b" else 1} for t in TENANTS],
        "limits": {"maxBodyBytes": 20000},
        "queue": {"maxWait": "60s"},
    }
    return Stack(tmp_path_factory.mktemp("stack"), policy="vtc", endpoints=2,
                 server_args=["--kv-budget-tokens", "1024", "--step-ms", "5"],
                 picker_config=config, response_path=response_path)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "meter-stream") as running:
        yield running


@pytest.fixture(scope="module")
def inline_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "inline") as running:
        yield running


@pytest.fixture(scope="module")
def logged_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "access-log") as running:
        yield running


STACKS = {"meter-stream": "stack", "inline": "inline_stack", "access-log": "logged_stack"}


@pytest.fixture(params=list(STACKS))
def any_stack(request: pytest.FixtureRequest) -> Stack:
    """Each response path in turn: the tests of routing, streaming and charging run on each."""
    return request.getfixturevalue(STACKS[request.param])


async def _post(session: aiohttp.ClientSession, stack: Stack, tenant: str, body: bytes,
                path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], bytes]:
    async with session.post(stack.gateway_url + path, data=body,
                            headers={TENANT_HEADER: tenant,
                                     "content-type": "application/json"}) as response:
        return response.status, dict(response.headers), await response.read()


def _post_sync(stack: Stack, tenant: str, body: bytes,
               path: str = "/v1/chat/completions") -> tuple[int, dict[str, str], bytes]:
    async def go() -> tuple[int, dict[str, str], bytes]:
        async with aiohttp.ClientSession() as session:
            return await _post(session, stack, tenant, body, path)
    return asyncio.run(go())


def _inflight(stack: Stack) -> float:
    return metric(stack.metrics_url, "fairway_endpoint_inflight_tokens")


def test_request_is_routed_and_answered_intact(any_stack: Stack) -> None:
    stack = any_stack
    status, _, body = _post_sync(stack, "a", chat_body(max_tokens=6))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == 6
    # Envoy went where the picker said, and got the picker's list in envoy.lb metadata.
    assert wait_until(lambda: stack.access_log.exists() and "tenant=a" in
                       stack.access_log.read_text())
    line = [x for x in stack.access_log.read_text().splitlines() if "tenant=a " in x][-1]
    upstream = line.split("upstream=")[1].split()[0]
    listed = line.split("metadata=")[1].split()[0].split(",")
    assert upstream in stack.endpoint_addresses
    # The picker's choice first (the one that served), then its distinct fallbacks, for the
    # stack's retries over override_host.
    assert listed[0] == upstream
    assert len(set(listed)) == len(listed) and set(listed) <= set(stack.endpoint_addresses)


def test_streaming_response_arrives_chunk_by_chunk(any_stack: Stack) -> None:
    stack = any_stack
    status, headers, body = _post_sync(stack, "a", chat_body(max_tokens=5, stream=True))
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for c in contents if c) == 5
    if stack.response_path == "access-log":
        # The picker asked for usage in every chunk: the count a cut stream leaves in the log.
        assert all(c["usage"] is not None for c in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    else:
        assert all(c["choices"] and c.get("usage") is None for c in chunks)


@pytest.mark.parametrize(("stream", "usage"), [(False, False), (True, True), (True, False)])
def test_tenant_is_charged_what_the_engine_served(any_stack: Stack, stream: bool,
                                                  usage: bool) -> None:
    stack = any_stack
    def engine_tokens() -> tuple[float, float]:
        return (sum(metric(f"http://{a}/metrics", "vllm:prompt_tokens_total")
                    for a in stack.endpoint_addresses),
                sum(metric(f"http://{a}/metrics", "vllm:generation_tokens_total")
                    for a in stack.endpoint_addresses))

    def charged() -> tuple[float, float]:
        return (metric(stack.metrics_url, "fairway_service_tokens_total", tenant="meter",
                       kind="prompt"),
                metric(stack.metrics_url, "fairway_service_tokens_total", tenant="meter",
                       kind="completion"))

    engine_before, charged_before = engine_tokens(), charged()
    done = metric(stack.metrics_url, "fairway_requests_total", tenant="meter")
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    for size in (10, 40, 90):
        status, _, _ = _post_sync(stack, "meter", chat_body(words=size, max_tokens=size // 3,
                                                            stream=stream, **extra))
        assert status == 200
    # Settled once the picker has seen each response end (on the meter stream, just after).
    assert settled_metric(stack.metrics_url, "fairway_requests_total", done + 3,
                          tenant="meter") == done + 3
    engine_after, charged_after = engine_tokens(), charged()
    engine = [after - before for after, before in zip(engine_after, engine_before, strict=True)]
    got = [after - before for after, before in zip(charged_after, charged_before, strict=True)]
    assert got[1] == engine[1] == 3 + 13 + 30  # completion tokens: exactly what was generated
    if stream and not usage:
        # No usage in the stream: the prompt stays at the picker's estimate from the body.
        assert got[0] == pytest.approx(engine[0], rel=0.5)
    else:
        assert got[0] == engine[0]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400,
         "'model' is required"),
        (json.dumps({"model": "sim-model"}).encode(), 400, "'messages' or 'prompt'"),
        (chat_body(words=6000), 413, "exceeds 20000 bytes"),
    ],
    ids=["malformed-json", "missing-model", "no-prompt", "too-large"],
)
def test_bad_requests_get_openai_errors_and_the_picker_keeps_serving(
        stack: Stack, body: bytes, status: int, fragment: str) -> None:
    got, _, answer = _post_sync(stack, "bad", body)
    assert got == status
    error = json.loads(answer)["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert metric(stack.metrics_url, "fairway_rejections_total", tenant="bad") >= 1
    assert _post_sync(stack, "bad", chat_body())[0] == 200


def _traffic(duration: float, **tenants: dict) -> object:
    return load_traffic({"duration_s": duration, "seed": 3, "timeout_s": 30, "tenants": [
        {"name": name, **spec} for name, spec in tenants.items()]})


def test_backlogged_tenants_split_service_by_weight(stack: Stack) -> None:
    spec = {"backlog": 24, "prompt_tokens": [40, 120], "output_tokens": [20, 60],
            "stream_fraction": 0.5, "include_usage": True}
    result = asyncio.run(run_traffic(_traffic(6, a=spec, b=spec), stack.gateway_url))
    shares = window_shares(result.records, 1.0, 6)
    # Weights 1:2. Without fairness (FCFS) both would get one half: the bound is a quarter of the
    # way from 2/3 to that.
    assert shares["b"] == pytest.approx(2 / 3, abs=1 / 24), shares
    assert wait_until(lambda: _inflight(stack) == 0)


def test_light_tenant_is_not_starved_by_a_flood(stack: Stack) -> None:
    result = asyncio.run(run_traffic(_traffic(
        8,
        noisy={"backlog": 48, "prompt_tokens": [200, 400], "output_tokens": [60, 120],
               "stream_fraction": 1.0},
        light={"rate": 3, "start_s": 1, "prompt_tokens": [20, 40], "output_tokens": [5, 10],
               "stream_fraction": 1.0},
    ), stack.gateway_url))
    light, noisy = result.summary["tenants"]["light"], result.summary["tenants"]["noisy"]
    assert light["ok"] == light["sent"] > 10
    # The flood waits its turn; the light tenant goes ahead of it instead of queueing behind it.
    assert light["ttft_s"]["p95"] < noisy["ttft_s"]["p50"]
    assert wait_until(lambda: _inflight(stack) == 0)


def test_client_leaving_while_queued_is_removed_uncharged(stack: Stack) -> None:
    def queued(tenant: str) -> float:
        return metric(stack.metrics_url, "fairway_queued_requests", tenant=tenant)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            # Each of the flood's requests holds its place for 2000 engine steps (10 s or more):
            # once some queue, the pool stays full and a request sent then waits in the queue
            # (VTC puts the quitter first, so only until a flood request ends).
            flood = [asyncio.create_task(_post(session, stack, "noisy", chat_body(
                words=400, max_tokens=2000))) for _ in range(30)]
            assert await asyncio.to_thread(wait_until, lambda: queued("noisy") >= 1, 15), \
                "the flood never filled the pool"
            quitter = asyncio.create_task(_post(session, stack, "quitter", chat_body()))
            assert await asyncio.to_thread(wait_until, lambda: queued("quitter") == 1, 15), \
                "the quitter's request never showed as queued"
            quitter.cancel()
            await asyncio.gather(quitter, return_exceptions=True)
            assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total",
                                              tenant="quitter", outcome="cancelled") == 1)
            assert queued("quitter") == 0
            assert metric(stack.metrics_url, "fairway_service_tokens_total",
                          tenant="quitter") == 0
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)

    asyncio.run(scenario())
    assert wait_until(lambda: _inflight(stack) == 0)


def test_client_leaving_mid_stream_settles_to_what_was_delivered(any_stack: Stack) -> None:
    stack = any_stack
    async def scenario() -> int:
        async with aiohttp.ClientSession() as session, session.post(
                stack.gateway_url + "/v1/chat/completions",
                data=chat_body(max_tokens=2000, stream=True),
                headers={TENANT_HEADER: "streamer"}) as response:
            seen = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    seen += bool(delta.get("content"))
                if seen >= 20:
                    break
            response.close()
            return seen

    seen = asyncio.run(scenario())
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total",
                                      tenant="streamer", outcome="cancelled") == 1)
    charged = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="streamer",
                     kind="completion")
    # What was delivered (plus what the engine made while the close reached it, a token per
    # 5 ms step), not the 2000 asked for: the bound is half way to that.
    assert seen <= charged < 2000 / 2
    assert wait_until(lambda: _inflight(stack) == 0)
    assert wait_until(lambda: sum(metric(f"http://{a}/metrics", "vllm:num_requests_running")
                                   for a in stack.endpoint_addresses) == 0)
