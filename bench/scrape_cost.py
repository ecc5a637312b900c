"""What does scraping cost the picker, with a ``/metrics`` page the size of a real vLLM's?

``python -m bench.scrape_cost`` serves a vLLM-shaped page (``vllm_page``: every family vLLM V1
exports for one model, histograms with their buckets, plus the Python process families: about
500 lines, 60 kB) from ``ENDPOINTS`` ports of a separate process, points the picker's own
``Scraper`` at them (the code the picker runs, in this process and nothing else with it), runs it
for ``SECONDS`` at each configured cadence and measures this process's CPU: per scrape, and as a
share of a core per 10 endpoints (issue 16's goal: at most 1 %).

Then what reading less often costs the pool: the isolation benchmark's floods (``bench.isolation``:
a heavy tenant flooding, a light one at 1 request/s) through the pool simulator, every endpoint
read every 50 ms against the adaptive cadence (``figures_decide``: 50 ms while figures may decide
the room, else 500 ms), three seeds each: tokens/s, the light tenant's TTFT, reads per endpoint
per second. Writes ``scrape.md`` and ``scrape.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.isolation import (
    DRAIN_S,
    MODES,
    SIZES,
    WARMUP_S,
    Size,
    _config,
    _flood_traffic,
    _numbers,
    _traffic,
)
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.scrape import Scraper
from picker.sim.pool import simulate

ENDPOINTS = 10
SECONDS = 10.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


def vllm_page() -> str:
    """A page shaped as vLLM V1's ``/metrics`` for one model (names, labels, bucket counts)."""
    labels = f'engine="0",model_name="{MODEL}"'
    lines: list[str] = []

    def family(name: str, kind: str, samples: list[str]) -> None:
        lines.extend([f"# HELP {name} {name.split(':')[-1].replace('_', ' ')}.",
                      f"# TYPE {name} {kind}", *samples])

    def histogram(name: str, buckets: tuple[float, ...]) -> None:
        samples = [f'{name}_bucket{{{labels},le="{b}"}} {i * 7}.0'
                   for i, b in enumerate(buckets)]
        samples += [f'{name}_bucket{{{labels},le="+Inf"}} 999.0', f"{name}_count{{{labels}}} 999.0",
                    f"{name}_sum{{{labels}}} 1234.5"]
        family(name, "histogram", samples)

    for generation in range(3):
        lines.append(f'python_gc_objects_collected_total{{generation="{generation}"}} 1234.0')
    family("process_resident_memory_bytes", "gauge", ["process_resident_memory_bytes 5.1e+09"])
    family("process_cpu_seconds_total", "counter", ["process_cpu_seconds_total 4321.5"])
    family("vllm:cache_config_info", "gauge", [
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="27000",'
        'swap_space="4"} 1.0'])
    for gauge, value in (("num_requests_running", 7), ("num_requests_waiting", 3),
                         ("kv_cache_usage_perc", 0.42)):
        family(f"vllm:{gauge}", "gauge", [f"vllm:{gauge}{{{labels}}} {value}"])
    family("vllm:lora_requests_info", "gauge", [
        'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e+09'])
    for counter in ("num_preemptions", "prompt_tokens", "generation_tokens",
                    "prefix_cache_queries", "prefix_cache_hits", "corrupted_requests"):
        family(f"vllm:{counter}_total", "counter", [f"vllm:{counter}_total{{{labels}}} 98765.0"])
    family("vllm:request_success_total", "counter", [
        f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} 40.0'
        for reason in ("stop", "length", "abort", "error")])
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        histogram(f"vllm:{name}", _TIME_BUCKETS)
    for name in ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "request_max_num_generation_tokens", "request_params_n",
                 "request_params_max_tokens"):
        histogram(f"vllm:{name}", _TOKEN_BUCKETS)
    return "\n".join(lines) + "\n"


def _serve(ports: int) -> None:
    """The metrics servers (run in their own process): print the ports, serve until killed."""
    from aiohttp import web

    page = vllm_page().encode()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=page, headers={
            "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})  # as vLLM's

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        bound = []
        for _ in range(ports):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            bound.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        print(json.dumps(bound), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _measure(addresses: list[str], interval: str, seconds: float) -> dict[str, Any]:
    config = load_config({"endpoints": [{"address": a} for a in addresses],
                          "capacity": {"scrapeInterval": interval,
                                       "metricsStaleAfter": "10s"}})
    dispatcher = Dispatcher(config)
    scraper = Scraper(dispatcher)
    scrapes = 0
    original = scraper._scrape

    async def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal scrapes
        scrapes += 1
        await original(*args, **kwargs)

    scraper._scrape = counted  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(scraper.run(stop))
    await asyncio.sleep(1.0)  # connections opened, first pages read
    scrapes, cpu, wall = 0, time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    done = scrapes
    stop.set()
    await task
    per_10 = cpu / wall * 10 / len(addresses)
    return {"interval": interval, "endpoints": len(addresses), "scrapes": done,
            "scrapes_per_s": done / wall, "cpu_ms_per_scrape": cpu / done * 1000 if done else None,
            "core_share_per_10_endpoints": per_10}


HEADROOM = Size("8k, a third busy", SIZES[1].spec, _flood_traffic((600, 900), (150, 250), 2.5,
                                                                    1.0, 120),
                "the 8k pool with 2.5 heavy requests/s instead of 30: room to spare")
SIM_SIZES = ("1k (hard case)", "8k", "64k", HEADROOM.name)
SIM_MODES = ("vtc, fcfs engines", "vtc, priority engines")
SEEDS = (1, 2, 3)


def simulated() -> list[dict[str, Any]]:
    """Fixed 50 ms reads against the adaptive cadence, per size, mode and seed."""
    out = []
    for size in [*(s for s in SIZES if s.name in SIM_SIZES), HEADROOM]:
        for mode_name in SIM_MODES:
            mode, policy = MODES[mode_name]
            for cadence, slow in (("every 50 ms", None), ("adaptive 50/500 ms", 0.5)):
                for seed in SEEDS:
                    spec = replace(size.spec, engine_policy=policy, scrape_interval_s=0.05,
                                   slow_scrape_interval_s=slow)
                    traffic = replace(_traffic(size), seed=seed)
                    run = simulate(_config(mode, spec), traffic, spec, warmup_s=WARMUP_S,
                                   drain_s=DRAIN_S)
                    got = _numbers(run, 0.0)
                    out.append({"size": size.name, "mode": mode_name, "cadence": cadence,
                                "seed": seed, "tokens_per_s": got["tokens_per_s"],
                                "light_ttft_p50_ms": got["light_ttft_p50_ms"],
                                "light_ttft_p95_ms": got["light_ttft_p95_ms"],
                                "reads_per_endpoint_s": run.scrapes / spec.endpoints
                                / (run.steps * spec.step_s)})
                    print(f"  {size.name} {mode_name} {cadence} seed {seed}: "
                          f"{out[-1]['reads_per_endpoint_s']:.1f} reads/s", flush=True)
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) / len(values) if values else float("nan")


def report(out: dict[str, Any]) -> str:
    lines = ["# Scraping: what a read costs, and what reading less often costs the pool", "",
             "`python -m bench.scrape_cost` (`make bench-scrape`).", "",
             f"## CPU per read: a real vLLM-sized page ({out['page_lines']} lines, "
             f"{out['page_bytes']} bytes), {ENDPOINTS} endpoints, the picker's `Scraper`", "",
             "| scrapeInterval | reads/s | CPU ms per read | share of a core per 10 endpoints |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['interval']} | {r['scrapes_per_s']:.0f} | {r['cpu_ms_per_scrape']:.3f} | "
              f"{r['core_share_per_10_endpoints']:.1%} |" for r in out["runs"]]
    lines += ["", "## The pool with fewer reads (simulated, means of seeds "
              f"{', '.join(map(str, SEEDS))})", "",
              "The isolation benchmark's floods (a heavy tenant flooding, a light one at 1 "
              f"request/s), and {HEADROOM.source}. Adaptive: 50 ms while an endpoint's figures "
              "may decide its room (`figures_decide`: none fresh, its engine queues, it holds "
              "more than the picker sent it, or it is 80 % full by the picker's own count), else "
              "500 ms.", "",
              "| size | engines | reads | tokens/s | light TTFT p50 ms | light TTFT p95 ms | "
              "reads per endpoint per s |", "|---|---|---|---:|---:|---:|---:|"]
    rows = out["simulated"]
    keys = sorted({(r["size"], r["mode"], r["cadence"]) for r in rows},
                  key=lambda k: (SIM_SIZES.index(k[0]), k[1], k[2] != "every 50 ms"))
    for size, mode, cadence in keys:
        group = [r for r in rows if (r["size"], r["mode"], r["cadence"]) == (size, mode, cadence)]
        lines.append(f"| {size} | {mode} | {cadence} | {_mean(group, 'tokens_per_s'):.0f} | "
                     f"{_mean(group, 'light_ttft_p50_ms'):.0f} | "
                     f"{_mean(group, 'light_ttft_p95_ms'):.0f} | "
                     f"{_mean(group, 'reads_per_endpoint_s'):.1f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scrape_cost")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--intervals", default="50ms,500ms,1s")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--no-simulation", action="store_true")
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
        return
    page = vllm_page()
    server = subprocess.Popen([sys.executable, "-m", "bench.scrape_cost", "--serve",
                               str(ENDPOINTS)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())
        addresses = [f"127.0.0.1:{port}" for port in ports]
        results = [asyncio.run(_measure(addresses, interval, args.seconds))
                   for interval in args.intervals.split(",")]
    finally:
        server.kill()
        server.wait()
    out: dict[str, Any] = {"page_lines": page.count("\n"), "page_bytes": len(page),
                           "runs": results}
    out["simulated"] = [] if args.no_simulation else simulated()
    text = report(out)
    if not args.no_simulation:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scrape.json").write_text(json.dumps(out, indent=1))
        (args.out / "scrape.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
