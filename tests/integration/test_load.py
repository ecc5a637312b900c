"""The load generator against a real HTTP server: does every tenant send what its traffic says,
and is what it got recorded right?

The server is a small aiohttp OpenAI-compatible fake on 127.0.0.1 (ephemeral port) started by the
``fake`` fixture: it answers ``/v1/chat/completions`` and ``/v1/completions`` in JSON or SSE, counts
requests and concurrency per tenant header, and can be told to delay, to pace its tokens, to leave
usage out, or to refuse a tenant with 429 + ``Retry-After`` + an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from picker.sim.load import CSV_COLUMNS, make_session, plan_open_loop, run_traffic
from picker.sim.traffic import load_traffic

HEADER = "x-gateway-inference-fairness-id"
ROOT = Path(__file__).parent.parent.parent


class FakeOpenAI:
    """An OpenAI-compatible fake model server that remembers what it was sent."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        """Wait before answering (before the response headers)."""
        self.token_interval_s = 0.0
        """Wait between streamed tokens."""
        self.json_usage = True
        """Put ``usage`` in non-streaming replies."""
        self.reject: dict[str, tuple[int, str | None, str]] = {}
        """Tenant -> (status, Retry-After or None, error message)."""
        self.arrivals: dict[str, list[float]] = defaultdict(list)
        self.bodies: list[tuple[str, str, dict]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.total_in_flight = 0
        self.max_total_in_flight = 0
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None

    def counts(self) -> Counter[str]:
        return Counter({tenant: len(times) for tenant, times in self.arrivals.items()})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.loop is not None
        tenant = request.headers.get(HEADER, "-")
        body = await request.json()
        self.arrivals[tenant].append(self.loop.time())
        self.bodies.append((tenant, request.path, body))
        self.headers.append(dict(request.headers))
        self.in_flight[tenant] += 1
        self.total_in_flight += 1
        self.max_in_flight[tenant] = max(self.max_in_flight[tenant], self.in_flight[tenant])
        self.max_total_in_flight = max(self.max_total_in_flight, self.total_in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if tenant in self.reject:
                status, retry_after, message = self.reject[tenant]
                headers = {"Retry-After": retry_after} if retry_after else {}
                error = {"error": {"message": message, "type": "rate_limit_exceeded",
                                   "code": status}}
                return web.json_response(error, status=status, headers=headers)
            return await self._answer(request, body)
        finally:
            self.in_flight[tenant] -= 1
            self.total_in_flight -= 1

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(prompt.split()) + body["max_tokens"]}
        n = body["max_tokens"]
        if not body.get("stream"):
            text = " ".join(["tok"] * n)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                      if chat else {"index": 0, "text": text})
            reply: dict[str, Any] = {"id": "x", "object": "chat.completion", "choices": [choice]}
            if self.json_usage:
                reply["usage"] = usage
            return web.json_response(reply)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(data: Any) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        if chat:  # like vLLM and OpenAI: a role-only first chunk, which carries no content
            await event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for _ in range(n):
            if self.token_interval_s:
                await asyncio.sleep(self.token_interval_s)
            await event({"choices": [{"index": 0, "delta": {"content": " tok"}}
                                     if chat else {"index": 0, "text": " tok"}]})
        await event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}
                                 if chat else {"index": 0, "text": "", "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    server.loop = asyncio.get_running_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    app.router.add_post("/v1/completions", server.handle)
    # Handlers stop when the client goes away, and cleanup does not wait long for stragglers.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


def _traffic(duration_s: float, *tenants: dict, **top: Any) -> Any:
    return load_traffic({"duration_s": duration_s, "seed": 11, **top, "tenants": list(tenants)})


def _by_tenant(records: list) -> dict[str, list]:
    grouped: dict[str, list] = defaultdict(list)
    for r in records:
        grouped[r.tenant].append(r)
    return grouped


async def test_counts_follow_the_rates(fake: FakeOpenAI) -> None:
    traffic = _traffic(2.0, {"name": "a", "rate": 30, "prompt_tokens": [4, 8],
                             "output_tokens": [1, 2]},
                       {"name": "b", "rate": 5, "prompt_tokens": [4, 8], "output_tokens": [1, 2]})
    planned = Counter(p.tenant for p in plan_open_loop(traffic))
    result = await run_traffic(traffic, fake.url)
    assert fake.counts() == planned
    assert Counter(r.tenant for r in result.records) == planned
    # Poisson: 60 and 10 expected; bounds of about four standard deviations.
    assert 30 <= planned["a"] <= 95 and 1 <= planned["b"] <= 25
    assert all(r.ok for r in result.records)
    assert result.summary["tenants"]["a"]["sent"] == planned["a"]
    # Open loop: no request leaves before its time (how late one leaves is the event loop's
    # load, which the slow-server test below bounds against what waiting for answers gives).
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in result.records)
    starts = [r.start_s for r in sorted(result.records, key=lambda r: r.scheduled_s)]
    assert starts == sorted(starts)
    # The run ends when the last answer is in, not timeout_s (120 s) after duration_s.
    assert result.wall_s < 30


async def test_a_slow_server_does_not_slow_the_sender(fake: FakeOpenAI) -> None:
    fake.delay_s = 0.8
    traffic = _traffic(1.0, {"name": "a", "rate": 40, "prompt_tokens": [4, 8],
                             "output_tokens": [1, 2]}, timeout_s=3)
    result = await run_traffic(traffic, fake.url)
    records = result.records
    assert len(records) >= 20 and all(r.ok for r in records)
    # A sender that waited for answers would leave its second request delay_s late and its
    # last one some 30 delays late; an open-loop one is late only by the event loop's load.
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in records)
    assert max(r.start_s - r.scheduled_s for r in records) < fake.delay_s
    assert fake.max_in_flight["a"] >= 15  # they were all out at once, none waited for another
    assert all(r.e2e_s >= 0.8 for r in records)


async def test_bursts_arrive_at_once(fake: FakeOpenAI) -> None:
    fake.delay_s = 1.0  # long enough that a burst sent one by one could not all be in at once
    traffic = _traffic(1.0, {"name": "b", "bursts": [{"at_s": 0.3, "count": 25}],
                             "prompt_tokens": [4, 8], "output_tokens": [1, 2]}, timeout_s=5)
    result = await run_traffic(traffic, fake.url)
    assert len(fake.arrivals["b"]) == 25 and fake.max_in_flight["b"] == 25
    assert all(r.ok and r.kind == "burst" and r.scheduled_s == 0.3 for r in result.records)
    assert all(r.start_s >= 0.3 - 1e-3 for r in result.records)


async def test_max_in_flight_caps_concurrency(fake: FakeOpenAI) -> None:
    fake.delay_s = 0.1
    traffic = _traffic(1.0, {"name": "b", "bursts": [{"at_s": 0.0, "count": 12}],
                             "prompt_tokens": [4, 8], "output_tokens": [1, 2]},
                       max_in_flight=3)
    result = await run_traffic(traffic, fake.url)
    assert fake.max_total_in_flight == 3
    assert len(result.records) == 12 and all(r.ok for r in result.records)
    # The wait for a connection counts in the latency: the last ones waited 3 rounds.
    assert max(r.e2e_s for r in result.records) >= 0.35


async def test_backlog_keeps_n_outstanding(fake: FakeOpenAI) -> None:
    fake.delay_s = 0.1
    traffic = _traffic(1.0, {"name": "a", "backlog": 3, "prompt_tokens": [4, 8],
                             "output_tokens": [1, 2]},
                       {"name": "late", "backlog": 2, "start_s": 0.5, "prompt_tokens": [4, 8],
                        "output_tokens": [1, 2]})
    result = await run_traffic(traffic, fake.url)
    assert fake.max_in_flight["a"] == 3 and fake.max_in_flight["late"] == 2
    grouped = _by_tenant(result.records)
    # 3 slots x at most 10 round trips of 0.1 s each (how many fewer is the machine's load;
    # that the slots never idle is asserted below).
    assert 3 <= len(grouped["a"]) <= 33
    assert 2 <= len(grouped["late"]) <= 12
    assert min(r.start_s for r in grouped["late"]) >= 0.5
    assert max(r.start_s for r in result.records) < 1.0  # nothing sent after duration_s
    assert sorted(r.seq for r in grouped["a"]) == list(range(len(grouped["a"])))
    assert all(r.kind == "backlog" and r.scheduled_s is None for r in result.records)
    # Closed loop: a slot's next request leaves as soon as its previous one ended (in the same
    # step of the event loop; a worker pausing BACKLOG_ERROR_PAUSE_S (0.1 s) after a success too
    # would leave gaps of 0.1 s).
    ends = sorted(r.end_s for r in grouped["a"])
    starts = sorted(r.start_s for r in grouped["a"])
    assert max(s - e for s, e in zip(starts[3:], ends, strict=False)) < 0.05
    # So each slot was busy from its first request until past duration_s (when its first request
    # left depends on the machine's load; one idle pause of 0.1 s would show).
    busy_from_first_start = sum(1.0 - s for s in starts[:3])
    assert sum(r.e2e_s for r in grouped["a"]) >= busy_from_first_start - 0.05


async def test_stream_fraction_is_respected(fake: FakeOpenAI) -> None:
    common = {"rate": 150, "prompt_tokens": [4, 8], "output_tokens": [1, 2]}
    traffic = _traffic(1.0, {"name": "some", "stream_fraction": 0.3, **common},
                       {"name": "all", "stream_fraction": 1.0, **common},
                       {"name": "none", **common})
    result = await run_traffic(traffic, fake.url)
    streamed: dict[str, list[bool]] = defaultdict(list)
    for tenant, _, body in fake.bodies:
        streamed[tenant].append(body["stream"])
    assert all(streamed["all"]) and not any(streamed["none"])
    share = sum(streamed["some"]) / len(streamed["some"])
    assert 0.15 <= share <= 0.45
    recorded = [r.stream for r in result.records if r.tenant == "some"]
    assert sum(recorded) == sum(streamed["some"])


async def test_ttft_is_measured_before_the_end_of_a_stream(fake: FakeOpenAI) -> None:
    fake.token_interval_s = 0.02
    traffic = _traffic(0.5, {"name": "s", "stream_fraction": 1.0, "bursts": [
                                 {"at_s": 0, "count": 3}], "output_tokens": [10, 10]},
                       {"name": "j", "bursts": [{"at_s": 0, "count": 3}],
                        "output_tokens": [10, 10]})
    result = await run_traffic(traffic, fake.url)
    grouped = _by_tenant(result.records)
    for r in grouped["s"]:
        assert r.ok and r.ttft_s is not None
        # Nine more tokens, 0.02 s apart, came after the first.
        assert r.e2e_s - r.ttft_s >= 0.15
    for r in grouped["j"]:  # a JSON reply's first token comes with its last
        assert r.ttft_s <= r.e2e_s and r.ttft_s == pytest.approx(r.e2e_s, abs=0.05)


async def test_usage_read_or_counted(fake: FakeOpenAI) -> None:
    common = {"bursts": [{"at_s": 0, "count": 4}], "prompt_tokens": [20, 30],
              "output_tokens": [3, 7]}
    traffic = _traffic(0.5, {"name": "usage", "stream_fraction": 1.0, "include_usage": True,
                             **common},
                       {"name": "counted", "stream_fraction": 1.0, "api": "completions",
                        **common},
                       {"name": "json", **common})
    result = await run_traffic(traffic, fake.url)
    grouped = _by_tenant(result.records)
    sent = {(t, b["max_tokens"]): b for t, _, b in fake.bodies}
    assert len(sent) >= 3
    for r in result.records:
        assert r.ok and r.completion_tokens == r.max_tokens
    for r in grouped["usage"] + grouped["json"]:
        assert r.usage_source == "usage" and 20 <= r.prompt_tokens <= 30
        assert r.prompt_tokens == r.drawn_prompt_tokens  # the fake counts words
    for r in grouped["counted"]:
        assert r.usage_source == "counted" and r.prompt_tokens == r.drawn_prompt_tokens
    paths = {t: p for t, p, _ in fake.bodies}
    assert paths == {"usage": "/v1/chat/completions", "counted": "/v1/completions",
                     "json": "/v1/chat/completions"}
    for tenant, _, body in fake.bodies:
        assert body["ignore_eos"] is True and body["model"] == "sim-model"
        assert ("stream_options" in body) == (tenant == "usage")
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        assert 20 <= len(prompt.split()) <= 30


async def test_json_without_usage_counts_words(fake: FakeOpenAI) -> None:
    fake.json_usage = False
    traffic = _traffic(0.5, {"name": "a", "bursts": [{"at_s": 0, "count": 2}],
                             "output_tokens": [6, 6]})
    result = await run_traffic(traffic, fake.url)
    assert [(r.usage_source, r.completion_tokens) for r in result.records] == [("counted", 6)] * 2


async def test_429s_recorded_with_retry_after_and_message(fake: FakeOpenAI) -> None:
    fake.reject["noisy"] = (429, "3", "tenant noisy is over its token budget")
    traffic = _traffic(0.5, {"name": "noisy", "bursts": [{"at_s": 0, "count": 5}],
                             "stream_fraction": 0.5},
                       {"name": "quiet", "bursts": [{"at_s": 0, "count": 2}]})
    result = await run_traffic(traffic, fake.url)
    grouped = _by_tenant(result.records)
    for r in grouped["noisy"]:
        assert (r.status, r.retry_after) == (429, "3")
        assert r.error == "tenant noisy is over its token budget"
        assert not r.ok and r.completion_tokens == 0
    assert all(r.ok and r.retry_after is None for r in grouped["quiet"])
    noisy = result.summary["tenants"]["noisy"]
    assert (noisy["sent"], noisy["ok"], noisy["errors"]) == (5, 0, {"429": 5})
    assert result.summary["tenants"]["quiet"]["service_share"] == 1.0


async def test_backlog_pauses_for_retry_after(fake: FakeOpenAI) -> None:
    fake.reject["a"] = (429, "0.4", "slow down")
    traffic = _traffic(1.0, {"name": "a", "backlog": 2})
    result = await run_traffic(traffic, fake.url)
    # 2 slots, each sending at 0, 0.4 + its round trip, ... while before 1.0 s: 2 or 3 rounds
    # (without the pause each slot would send a request every round trip, many more).
    assert 4 <= len(result.records) <= 6
    # A slot's next request waits 0.4 s after its previous one ended: so when a request leaves,
    # at most one other (the other slot's, running or in its pause) ended less than 0.4 s ago or
    # is still running; without the pause its own slot's previous request would be a second one.
    for i, r in enumerate(result.records):
        recent = [q for q in result.records[:i] if q.end_s > r.start_s - (0.4 - 0.01)]
        assert len(recent) <= 1, (r, recent)


async def test_connection_errors_and_timeouts_are_status_0(fake: FakeOpenAI) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    traffic = _traffic(0.3, {"name": "a", "bursts": [{"at_s": 0, "count": 2}]})
    result = await run_traffic(traffic, f"http://127.0.0.1:{closed_port}")
    assert [r.status for r in result.records] == [0, 0]
    assert all("Connect" in r.error for r in result.records)
    assert result.summary["tenants"]["a"]["errors"] == {"0": 2}

    fake.delay_s = 5
    slow = _traffic(0.3, {"name": "a", "bursts": [{"at_s": 0, "count": 2}]}, timeout_s=0.4)
    result = await run_traffic(slow, fake.url)
    assert [r.status for r in result.records] == [0, 0]
    assert all(r.error.startswith(("timeout after 0.4s", "cancelled")) for r in result.records)
    # Stopped at each request's timeout (0.4 s), not at the server's pace (5 s).
    assert 0.4 - 0.05 <= result.wall_s < fake.delay_s


async def test_stragglers_are_cancelled_after_timeout(fake: FakeOpenAI) -> None:
    fake.token_interval_s = 0.3  # a stream that started fine and then stalls
    traffic = _traffic(0.2, {"name": "a", "stream_fraction": 1.0, "output_tokens": [20, 20],
                             "bursts": [{"at_s": 0.1, "count": 1}]}, timeout_s=0.5)
    result = await run_traffic(traffic, fake.url)
    [record] = result.records
    assert record.status == 0 and not record.ok
    # Stopped by its timeout (0.5 s after it left at 0.1 s), not at the stream's pace (6 s).
    assert 0.6 - 0.05 <= result.wall_s < 3
    assert record.error.endswith("(after HTTP 200)")


async def test_headers_sent(fake: FakeOpenAI) -> None:
    traffic = _traffic(0.3, {"name": "a", "bursts": [{"at_s": 0, "count": 1}],
                             "headers": {"x-extra": "yes"}},
                       {"name": "anon", "bursts": [{"at_s": 0, "count": 1}],
                        "send_tenant_header": False})
    await run_traffic(traffic, fake.url + "/v1/")
    assert fake.counts() == Counter({"a": 1, "-": 1})
    assert Counter(h.get("x-extra") for h in fake.headers) == Counter({"yes": 1, None: 1})


async def test_session_uses_tcp_nodelay(fake: FakeOpenAI) -> None:
    fake.token_interval_s = 0.1  # keep the stream, and so its connection, open while we look
    traffic = _traffic(1.0, {"name": "a", "rate": 1})
    async with make_session(traffic) as session, session.post(
            fake.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 3, "stream": True}) as resp:
        sock = resp.connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        await resp.read()
        assert session.connector.limit == 2000


async def test_cli_writes_requests_csv_and_summary(fake: FakeOpenAI, tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("duration_s: 30\nseed: 2\ntenants:\n"
                    "  - {name: a, rate: 20, stream_fraction: 0.5, output_tokens: [2, 4]}\n"
                    "  - {name: b, backlog: 2, output_tokens: [2, 4]}\n")
    out = tmp_path / "out"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "picker.sim.load", str(path), "--target", fake.url,
        "--out", str(out), "--duration", "0.6", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 0, stderr.decode()
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert len(rows) == sum(fake.counts().values())
    assert {r["tenant"] for r in rows} == {"a", "b"}
    # Nothing is scheduled past the duration (backlog requests have no schedule; when a request
    # was issued depends on how busy the machine is, so that is not asserted).
    assert all(r["status"] == "200" for r in rows)
    assert all(float(r["scheduled_s"]) < 0.6 for r in rows if r["scheduled_s"])
    assert any(r["scheduled_s"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["duration_s"] == 0.6 and summary["wall_s"] > 0
    assert set(summary["tenants"]) == {"a", "b"}
    for name in ("a", "b"):
        stats = summary["tenants"][name]
        assert stats["sent"] == stats["ok"] == sum(r["tenant"] == name for r in rows)
        assert set(stats["ttft_s"]) == {"p50", "p95", "p99"}
        assert stats["service"] == stats["prompt_tokens"] + 2 * stats["completion_tokens"]
    shares = sum(s["service_share"] for s in summary["tenants"].values())
    assert shares == pytest.approx(1.0)
    text = stdout.decode()
    assert "tenant" in text and "TOTAL" in text and "\na " in text and "\nb " in text


async def test_cli_refuses_a_bad_file_naming_the_field(tmp_path: Path) -> None:
    bad = ROOT / "tests" / "fixtures" / "traffic" / "bad" / "rate_with_backlog.yaml"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "picker.sim.load", str(bad), "--target", "http://127.0.0.1:9",
        "--out", str(tmp_path / "out"), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 2
    assert "tenants[1].backlog: cannot be combined with rate > 0" in stderr.decode()
    assert not (tmp_path / "out").exists()
