"""Does the stack stay healthy under sustained saturation? A soak through the local stack.

``python -m bench.soak --out bench/results [--minutes 10]`` starts real Envoy, the picker and two
simulated vLLM servers on 127.0.0.1, and keeps a few tenants (weights 1:2:1, streaming and not)
at about twice the pool's capacity with closed-loop clients for ``--minutes``. It samples, over
time, the picker's resident memory (``VmRSS``), its queued/running/in-flight gauges, what the
clients saw and the picker log's error lines; then it stops the clients, lets the queue drain and
writes ``soak.md`` (and ``soak.json``) into ``--out`` with a table over time and these checks:

- *RSS bounded*: after the warm-up (the first quarter), the picker's RSS grows by at most 10 % or
  8 MiB, whichever is larger, by the end of the load.
- *Gauges drain*: ``fairway_queued_requests``, ``fairway_running_requests`` and
  ``fairway_endpoint_inflight_tokens`` are all 0 once the clients have stopped.
- *Clean log*: no ``ERROR``/``CRITICAL`` line and no traceback in the picker's log.
- *Clear answers*: every client got 200, or 429/503 with ``Retry-After`` and an OpenAI error
  body; no connection failure, no other status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.experiments import md_table
from picker.stack.launcher import Stack

TENANT_HEADER = "x-gateway-inference-fairness-id"
TENANTS = {"a": {"weight": 1, "stream": 0.0}, "b": {"weight": 2, "stream": 1.0},
           "c": {"weight": 1, "stream": 0.5}}
KV_BUDGET = 2048
"""Per simulated server: with prompts of 40–200 and outputs of 20–150 tokens it runs about ten
requests at once, so the two servers' capacity is about twenty."""
CLIENTS = 44
"""Closed-loop clients over all tenants: about twice the pool's capacity."""
GAUGES = ("fairway_queued_requests", "fairway_running_requests",
          "fairway_endpoint_inflight_tokens")
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")


@dataclass
class Tally:
    """What the clients saw, cumulatively."""

    ok: int = 0
    refused: dict[int, int] = field(default_factory=dict)
    failed: int = 0
    """Connection failures, other statuses, refusals without Retry-After or an OpenAI body."""
    failures: list[str] = field(default_factory=list)
    output_tokens: int = 0


@dataclass
class Row:
    t_s: float
    rss_mib: float
    queued: float
    running: float
    inflight_tokens: float
    ok: int
    refused: int
    failed: int
    output_tok_s: float
    error_lines: int


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    totals = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines()
            if ERROR_LINE.search(line)]


def _body(rng: random.Random, stream: bool) -> bytes:
    words = rng.randint(40, 200)
    prompt = " ".join(rng.choice(("the", "cat", "sat", "on", "a", "mat")) for _ in range(words))
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": rng.randint(20, 150),
                            "ignore_eos": True, "stream": stream,
                            "messages": [{"role": "user", "content": prompt}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def _one(session: aiohttp.ClientSession, url: str, tenant: str, stream: bool,
               rng: random.Random, tally: Tally) -> float:
    """One request; returns how long to wait before the next (Retry-After on a refusal)."""
    try:
        async with session.post(url, data=_body(rng, stream), headers={
                TENANT_HEADER: tenant, "content-type": "application/json"}) as response:
            raw = await response.read()
            if response.status == 200:
                tally.ok += 1
                tally.output_tokens += _completion_tokens(raw, stream)
                return 0.0
            retry_after = response.headers.get("retry-after")
            code = _error_code(raw)
            if response.status in (429, 503) and retry_after and code:
                tally.refused[response.status] = tally.refused.get(response.status, 0) + 1
                return min(float(retry_after), 1.0)
            tally.failed += 1
            tally.failures.append(f"{response.status} retry-after={retry_after} {raw[:120]!r}")
    except (TimeoutError, aiohttp.ClientError) as error:
        tally.failed += 1
        tally.failures.append(f"{type(error).__name__}: {error}")
    return 0.5


def _completion_tokens(raw: bytes, stream: bool) -> int:
    if not stream:
        return int(json.loads(raw)["usage"]["completion_tokens"])
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return int(usage["completion_tokens"])
    return 0


def _error_code(raw: bytes) -> str | None:
    try:
        error = json.loads(raw)["error"]
        return error["code"] if {"message", "type", "param", "code"} <= set(error) else None
    except (ValueError, KeyError, TypeError):
        return None


async def _client(session: aiohttp.ClientSession, url: str, tenant: str, stream_share: float,
                  seed: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        pause = await _one(session, url, tenant, rng.random() < stream_share, rng, tally)
        if pause:
            await asyncio.sleep(pause)


async def soak(stack: Stack, seconds: float, interval: float) -> tuple[list[Row], Tally, dict]:
    url = stack.gateway_url + "/v1/chat/completions"
    pid = stack.picker_process.pid
    log = stack.workdir / "picker.log"
    tally, stop, rows = Tally(), asyncio.Event(), []
    t0 = time.monotonic()
    last_tokens, last_t = 0, t0

    def sample() -> None:
        nonlocal last_tokens, last_t
        now = time.monotonic()
        g = gauges(stack.metrics_url)
        rate = (tally.output_tokens - last_tokens) / max(now - last_t, 1e-9)
        last_tokens, last_t = tally.output_tokens, now
        rows.append(Row(round(now - t0, 1), round(rss_kib(pid) / 1024, 1),
                        g["fairway_queued_requests"], g["fairway_running_requests"],
                        g["fairway_endpoint_inflight_tokens"], tally.ok,
                        sum(tally.refused.values()), tally.failed, round(rate),
                        len(error_lines(log))))

    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=CLIENTS + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        names = list(TENANTS)
        clients = [asyncio.create_task(_client(
            session, url, names[i % len(names)], TENANTS[names[i % len(names)]]["stream"], i,
            stop, tally)) for i in range(CLIENTS)]
        sample()
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(min(interval, max(0.0, seconds - (time.monotonic() - t0))))
            await asyncio.to_thread(sample)
        load_end_rss = rss_kib(pid)
        stop.set()  # each client finishes the request it has out, then stops
        await asyncio.gather(*clients)
    drain_deadline = time.monotonic() + 30
    while any(gauges(stack.metrics_url).values()) and time.monotonic() < drain_deadline:
        await asyncio.sleep(0.2)
    sample()
    return rows, tally, {"load_end_rss_kib": load_end_rss}


def checks(rows: list[Row], tally: Tally, extra: dict, log: Path) -> list[tuple[str, bool, str]]:
    warm = next(r for r in rows if r.t_s >= rows[-2].t_s / 4)
    end_mib = extra["load_end_rss_kib"] / 1024
    allowed = max(0.10 * warm.rss_mib, 8.0)
    final = rows[-1]
    errors = error_lines(log)
    return [
        ("RSS bounded after warm-up",
         end_mib - warm.rss_mib <= allowed,
         f"{warm.rss_mib:.1f} MiB at {warm.t_s:.0f} s → {end_mib:.1f} MiB at the end of the "
         f"load (+{end_mib - warm.rss_mib:.1f}, allowed +{allowed:.1f})"),
        ("gauges drain to 0",
         final.queued == final.running == final.inflight_tokens == 0,
         f"queued {final.queued:g}, running {final.running:g}, in-flight tokens "
         f"{final.inflight_tokens:g}"),
        ("no ERROR lines or tracebacks in the picker log", not errors,
         f"{len(errors)} line(s)" + (f", first: `{errors[0][:160]}`" if errors else "")),
        ("every answer clear (200, or 429/503 + Retry-After + OpenAI body)", tally.failed == 0,
         f"{tally.ok} ok, refused {tally.refused or 0}, {tally.failed} failed"
         + (f", first: `{tally.failures[0]}`" if tally.failures else "")),
        ("saturated (requests were queued)", max(r.queued for r in rows) > 0,
         f"max queued {max(r.queued for r in rows):g}"),
    ]


def _tenants_text() -> str:
    return ", ".join(f"{t} (weight {s['weight']}, {s['stream']:.0%} streaming)"
                     for t, s in TENANTS.items())


def report(rows: list[Row], results: list[tuple[str, bool, str]], minutes: float) -> str:
    header = ["t (s)", "picker RSS (MiB)", "queued", "running", "in-flight tokens", "ok",
              "refused", "failed", "output tok/s", "picker error lines"]
    table = md_table(header, [[f"{r.t_s:g}", f"{r.rss_mib:.1f}", f"{r.queued:g}",
                               f"{r.running:g}", f"{r.inflight_tokens:g}", str(r.ok),
                               str(r.refused), str(r.failed), f"{r.output_tok_s:g}",
                               str(r.error_lines)] for r in rows])
    verdicts = md_table(["check", "result", "numbers"],
                        [[name, "PASS" if ok else "FAIL", detail]
                         for name, ok, detail in results], numeric=False)
    return (f"# Saturation soak ({minutes:g} min)\n\n"
            f"`python -m bench.soak --minutes {minutes:g}`: real Envoy, the picker and two "
            f"simulated vLLM servers ({KV_BUDGET}-token KV budget each, 10 ms steps) on "
            f"127.0.0.1; {CLIENTS} closed-loop clients over tenants "
            f"{_tenants_text()}, "
            "about twice the pool's capacity. The last row is taken after the clients stopped "
            "and the queue drained.\n\n"
            f"{table}\n\n## Checks\n\n{verdicts}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between samples (default: the run in 20 rows, ≥ 5 s)")
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    interval = args.interval or max(5.0, seconds / 20)
    config = {"tenants": [{"id": t, "weight": s["weight"]} for t, s in TENANTS.items()],
              "queue": {"maxQueued": 500, "maxWait": "60s"}}
    with tempfile.TemporaryDirectory(prefix="fairway-soak-") as workdir, Stack(
            Path(workdir), endpoints=2, picker_config=config,
            server_args=["--kv-budget-tokens", str(KV_BUDGET), "--step-ms", "10"]) as stack:
        rows, tally, extra = asyncio.run(soak(stack, seconds, interval))
        results = checks(rows, tally, extra, stack.workdir / "picker.log")
    text = report(rows, results, args.minutes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.md").write_text(text)
    (args.out / "soak.json").write_text(json.dumps({
        "minutes": args.minutes, "rows": [asdict(r) for r in rows],
        "checks": [{"check": n, "pass": ok, "numbers": d} for n, ok, d in results],
        "failures": tally.failures[:20]}, indent=1))
    print(text)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
