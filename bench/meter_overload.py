"""Is every streamed response the client received whole metered to its usage when the picker is
overloaded on a small machine?

Starts the local stack (``picker.stack.launcher.Stack``: real Envoy, the picker on the
meter-stream response path, two simulated vLLM servers) and sends, through Envoy, ``--heavy``
concurrent streaming requests of tenant ``a`` beside ``--light`` of tenant ``b``, each client
sending its next request as soon as its last one ended, for ``--seconds``. Each request asks
for ``--max-tokens`` output tokens with ``ignore_eos``, so the engine generates exactly that
many. A client's stream is *whole* when it got a 200, the usage chunk and ``data: [DONE]``.

Reported: whole streams per tenant; the picker's settlements by outcome
(``fairway_requests_total``), completion tokens charged against those the whole streams
carried, settlements that fell back to an estimate (``fairway_settlements_estimated_total``,
by reason) and refusals (``fairway_rejections_total``). The goal: no whole stream settled
``cancelled``, no completion token uncharged.

``python -m bench.meter_overload`` (about a minute) writes ``bench/results/meter_overload.md``
and ``.json``; the machine's load (other processes) is part of the condition, and is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.experiments import md_table
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, metric_samples, wait_until

RESULTS = Path(__file__).resolve().parent / "results"


def _body(max_tokens: int) -> bytes:
    return json.dumps({
        "model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "the cat sat on a mat " * 8}]}).encode()


async def _client(session: aiohttp.ClientSession, url: str, tenant: str, body: bytes,
                  until: float, tally: Counter[str]) -> None:
    while time.monotonic() < until:
        try:
            async with session.post(url, data=body, headers={
                    TENANT_HEADER: tenant, "content-type": "application/json"}) as response:
                raw = await response.read()
                if response.status != 200:
                    tally[f"{tenant}:{response.status}"] += 1
                    retry = float(response.headers.get("retry-after", "0") or 0)
                    await asyncio.sleep(min(retry, 1.0) or 0.05)
                    continue
        except (TimeoutError, aiohttp.ClientError):
            tally[f"{tenant}:error"] += 1
            continue
        whole = raw.rstrip().endswith(b"data: [DONE]") and b'"usage"' in raw
        tally[f"{tenant}:{'whole' if whole else 'cut'}"] += 1
        if whole:
            # The usage chunk is the last data chunk before [DONE].
            usage = json.loads(raw.rsplit(b"data: ", 2)[-2])["usage"]
            tally[f"{tenant}:completion_tokens"] += usage["completion_tokens"]


def throttle(pid: int, share: float, stop: threading.Event, period: float = 0.1) -> None:
    """Run ``pid`` ``share`` of each ``period`` and stop it (SIGSTOP) for the rest, as a
    container's CPU quota throttles it (CFS: 100 ms periods), until ``stop`` is set."""
    try:
        while not stop.is_set():
            time.sleep(period * share)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period * (1 - share))
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)


def _sum(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
         **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def _by(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
        label: str, **labels: str) -> dict[str, float]:
    wanted = set(labels.items())
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name and wanted <= set(ls) and v:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0) + v
    return out


async def _drive(stack: Stack, heavy: int, light: int, seconds: float, max_tokens: int
                 ) -> Counter[str]:
    tally: Counter[str] = Counter()
    body = _body(max_tokens)
    url = stack.gateway_url + "/v1/chat/completions"
    until = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(_client(session, url, "a", body, until, tally)
                               for _ in range(heavy)),
                             *(_client(session, url, "b", body, until, tally)
                               for _ in range(light)))
    return tally


def run(heavy: int, light: int, seconds: float, max_tokens: int, step_ms: float,
        picker_share: float = 1.0, picker_overrides: dict[str, Any] | None = None
        ) -> dict[str, Any]:
    """One run; the figures as a dict."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, Stack(
            Path(tmp), endpoints=2, server_args=["--step-ms", str(step_ms)],
            picker_config={"tenants": [{"id": "a"}, {"id": "b"}],
                           **(picker_overrides or {})}) as stack:
        stop = threading.Event()
        throttler = threading.Thread(target=throttle, args=(
            stack.picker_process.pid, picker_share, stop)) if picker_share < 1 else None
        if throttler is not None:
            throttler.start()
        started = time.monotonic()
        try:
            tally = asyncio.run(_drive(stack, heavy, light, seconds, max_tokens))
        finally:
            stop.set()
            if throttler is not None:
                throttler.join()
        elapsed = time.monotonic() - started
        # Every request settled: none queued or running (a lost meter stream is settled
        # within --meter-claim-timeout, 10 s).
        wait_until(lambda: not any(_sum(metric_samples(stack.metrics_url), name)
                                   for name in ("fairway_queued_requests",
                                                "fairway_running_requests")), 30)
        samples = metric_samples(stack.metrics_url)
        log = (Path(tmp) / "picker.log").read_text(errors="replace")
    outcomes = {t: _by(samples, "fairway_requests_total", "outcome", tenant=t) for t in "ab"}
    charged = {t: _sum(samples, "fairway_service_tokens_total", tenant=t, kind="completion")
               for t in "ab"}
    delivered = {t: tally[f"{t}:completion_tokens"] for t in "ab"}
    return {
        "heavy": heavy, "light": light, "seconds": seconds, "elapsed_s": round(elapsed, 1),
        "max_tokens": max_tokens, "step_ms": step_ms, "cpus": os.cpu_count(),
        "picker_share": picker_share,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "clients": dict(sorted(tally.items())),
        "outcomes": outcomes,
        "completion_delivered": delivered, "completion_charged": charged,
        "uncharged": {t: delivered[t] - charged[t] for t in "ab"},
        "estimated": _by(samples, "fairway_settlements_estimated_total", "reason"),
        "meter_unclaimed": _sum(samples, "fairway_meter_unclaimed_total"),
        "rejections": _by(samples, "fairway_rejections_total", "reason"),
        "log_warnings": [line[:240] for line in log.splitlines()
                         if "WARNING" in line or "ERROR" in line][:10],
    }


def report(runs: list[dict[str, Any]]) -> str:
    """``runs`` (each with its ``label``) as a Markdown table."""
    rows = []
    for r in runs:
        whole = {t: r["clients"].get(f"{t}:whole", 0) for t in "ab"}
        refused = sum(v for k, v in r["clients"].items() if k.endswith(":503"))
        cancelled = sum(r["outcomes"][t].get("cancelled", 0) for t in "ab")
        estimated = sum(r["estimated"].values())
        rows.append([r["label"], f"{r['heavy']} + {r['light']}", f"{r['picker_share']:.0%}",
                     f"{whole['a']:,} + {whole['b']:,}", f"{refused:,}", f"{cancelled:,.0f}",
                     f"{estimated:,.0f}", f"{sum(r['uncharged'].values()):,.0f}",
                     f"{r['load_before'][0]:.1f}"])
    head = ["run", "streams a + b", "picker CPU", "whole streams a + b", "refused 503",
            "whole but settled cancelled", "settled on an estimate", "tokens uncharged",
            "load (1 min) before"]
    return md_table(head, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy", type=int, default=300)
    parser.add_argument("--light", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=5)
    parser.add_argument("--picker-share", type=float, default=1.0,
                        help="the picker's CPU quota, as a share of each 100 ms (SIGSTOP)")
    parser.add_argument("--label", default="this tree",
                        help="the run's name in the results (appended to --out's runs)")
    parser.add_argument("--out", default="", help="results/<out>.json gets this run appended")
    args = parser.parse_args()
    result = {"label": args.label,
              **run(args.heavy, args.light, args.seconds, args.max_tokens, args.step_ms,
                    args.picker_share)}
    print(json.dumps(result, indent=1))
    if args.out:
        path = RESULTS / f"{args.out}.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append(result)
        path.write_text(json.dumps(runs, indent=1) + "\n")
        print(report(runs))


if __name__ == "__main__":
    main()
