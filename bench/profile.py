"""Where does the picker's CPU go, on the request path and on the meter stream?

``python -m bench.profile --out bench/results`` (``make bench-profile``) starts the local stack on
127.0.0.1 (real Envoy dialling the picker over TLS, the picker as its own process, simulated vLLM
servers) and samples the picker with py-spy in two phases:

* **requests**: short non-streaming completions at a fixed 200 requests/s, one tenant with
  budgets and caps that never bind (admission runs on every request), as the overhead benchmark;
* **stream**: streamed completions back to back (``STREAMS`` at once, ``--streams`` to change,
  ``STREAM_TOKENS`` tokens, one chunk per engine step of ``STREAM_STEP_MS``): the meter stream's
  cost per streamed token (an SSE event; at 40 streams a pool's rate, where several may share a
  wake-up).

Each phase records the picker once as collapsed stacks (``profile_<phase>.txt``, the data the
tables are made from) and once as a flame graph (``profile_<phase>.svg``), and measures the
picker's CPU from ``/proc`` over the same window: per request and per streamed chunk. Samples are
attributed twice: by **activity** (the outermost frame that says what the picker was doing:
request path, meter stream, scraping, metrics exposition, shared state, the rest) and by **kind
of work** (the innermost frame of a known kind: gRPC, protobuf, JSON, SSE parsing, admission and
scheduling, Prometheus metrics, logging, asyncio). Writes ``profile.md`` and ``profile.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.gateway.common import fetch_metrics, loadavg, msum, process_cpu
from bench.gateway.overhead import (
    ADMISSION_RULES,
    FAST_SERVER_ARGS,
    RawTarget,
    envoy_stats,
    fixed_rate,
    raw_post,
)
from picker.sim.traffic import DEFAULT_TENANT_HEADER
from picker.stack.envoy import DESTINATION_HEADER, RESPONSE_PATHS
from picker.stack.launcher import Stack

RATE = 200.0
STREAMS = 4
STREAM_TOKENS = 300
STREAM_STEP_MS = 5.0
SAMPLE_RATE = 250
"""py-spy samples a second."""

# (label, substrings of a frame), in priority order: the first label with a substring in ANY frame
# of a sample names what the picker was doing (the meter stream runs inside ``Process``).
ACTIVITIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("meter stream", ("_meter (picker/extproc",)),
    ("request path", ("Process (picker/extproc",)),
    ("scraping", ("picker/scrape/",)),
    ("metrics exposition", ("prometheus_client/exposition.py",)),
    ("shared state", ("picker/state/",)),
    ("config and watches", ("picker/config/reload", "picker/k8s/")),
    ("gRPC completion-queue thread (C core)", ("Thread.run (threading.py",)),
    ("event loop: callbacks from gRPC and timers", ("Handle._run (asyncio/events.py",)),
    ("event loop: polling", ("select (selectors.py",)),
)
# (label, substrings): the INNERMOST frame with one of these substrings names the kind of work.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logging", ("logging/",)),
    ("Prometheus metrics", ("prometheus_client/",)),
    ("JSON", ("json/",)),
    ("protobuf", ("google/protobuf",)),
    ("SSE and usage parsing (picker/openai)", ("picker/openai/",)),
    ("admission and scheduling (picker/core)", ("picker/core/",)),
    ("dispatcher (picker/dispatch)", ("picker/dispatch/",)),
    ("ext_proc handler (picker/extproc)", ("picker/extproc/",)),
    ("scraper (picker/scrape)", ("picker/scrape/",)),
    ("picker metrics (picker/metrics)", ("picker/metrics/",)),
    ("gRPC (grpc.aio, cygrpc)", ("grpc/", "cygrpc", ".pyx")),
    ("gRPC completion-queue thread (C core)", ("Thread.run (threading.py",)),
    ("asyncio event loop (and the gRPC callbacks it runs)", ("asyncio/", "selectors.py")),
)


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format: ``frame;frame;...;frame count`` per line, outermost first."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def attribute(samples: Iterable[tuple[list[str], int]],
              table: tuple[tuple[str, tuple[str, ...]], ...], *, innermost: bool) -> Counter[str]:
    """``innermost``: the innermost frame of a known kind labels a sample; else the first entry
    of ``table`` found in any frame."""
    counts: Counter[str] = Counter()
    for frames, count in samples:
        label = "other"
        if innermost:
            for frame in reversed(frames):
                found = next((name for name, keys in table if any(k in frame for k in keys)),
                             None)
                if found is not None:
                    label = found
                    break
        else:
            label = next((name for name, keys in table
                          if any(k in frame for frame in frames for k in keys)), "other")
        counts[label] += count
    return counts


def top_functions(samples: Iterable[tuple[list[str], int]],
                  limit: int = 15) -> list[tuple[str, int]]:
    """Self samples by innermost frame (function and file, without the line)."""
    counts: Counter[str] = Counter()
    for frames, count in samples:
        leaf = frames[-1]
        name, _, where = leaf.partition(" (")
        counts[f"{name} ({where.rsplit(':', 1)[0]})" if where else name] += count
    return counts.most_common(limit)


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    return found


def record(pid: int, seconds: float, out: Path, fmt: str) -> None:
    subprocess.run([_py_spy(), "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE),
                    "--duration", str(int(seconds)), "--format", fmt, "--output", str(out),
                    "--nonblocking"], check=True, capture_output=True)


def _picker_cpu(stack: Stack) -> float:
    return next(v for k, v in process_cpu([stack]).items() if k.endswith("/picker"))


def _envoy_cpu(stack: Stack) -> float:
    return next(v for k, v in process_cpu([stack]).items() if k.endswith("/envoy"))


async def _while(action: Callable[[], None], load: Callable[[float], Any],
                 seconds: float) -> Any:
    """Run ``load`` for ``seconds`` + 2 while ``action`` (a recording) runs in a thread."""
    recording = asyncio.create_task(asyncio.to_thread(action))
    result = await load(seconds + 2.0)
    await recording
    return result


def _phase(stack: Stack, name: str, out: Path, seconds: float,
           load: Callable[[float], Any]) -> dict[str, Any]:
    pid = stack.picker_processes[0].pid
    asyncio.run(load(2.0))  # warm: connections, the estimates, the JIT of nothing
    raw, svg = out / f"profile_{name}.txt", out / f"profile_{name}.svg"
    metered_before = _metered(stack)
    cpu_before, wall_before = _picker_cpu(stack), time.monotonic()
    envoy_before = _envoy_cpu(stack)
    units = asyncio.run(_while(lambda: record(pid, seconds, raw, "raw"), load, seconds))
    cpu, wall = _picker_cpu(stack) - cpu_before, time.monotonic() - wall_before
    # Envoy's too: on the access-log path it, not the picker, reads every chunk's JSON.
    envoy = _envoy_cpu(stack) - envoy_before
    # What the picker charged over the window: had it fallen behind, it would have settled on
    # estimates (unclaimed meter streams) and its cost per chunk would flatter it.
    metered = {k: v - metered_before[k] for k, v in _metered(stack).items()}
    asyncio.run(_while(lambda: record(pid, seconds, svg, "flamegraph"), load, seconds))
    samples = parse_collapsed(raw.read_text())
    total = sum(count for _, count in samples)
    return {"cpu_s": cpu, "wall_s": wall, "units": units, "cpu_ms_per_unit": cpu / units * 1000,
            "envoy_cpu_ms_per_unit": envoy / units * 1000,
            "units_per_s": units / wall, **metered,
            "cpu_ms_per_meter_message": cpu / metered["meter_messages"] * 1000
            if metered["meter_messages"] else None,
            "core_fraction": cpu / wall, "samples": total,
            "activities": dict(attribute(samples, ACTIVITIES, innermost=False).most_common()),
            "kinds": dict(attribute(samples, KINDS, innermost=True).most_common()),
            "top": top_functions(samples)}


def _metered(stack: Stack) -> dict[str, float]:
    got = fetch_metrics(stack.metrics_url, frozenset({"fairway_service_tokens_total",
                                                      "fairway_meter_unclaimed_total"}))
    return {"completion_tokens_charged": msum(got, "fairway_service_tokens_total",
                                              kind="completion"),
            "meter_unclaimed": msum(got, "fairway_meter_unclaimed_total"),
            # Envoy sends one message per read from the engine: busy, it reads several events.
            "meter_messages": envoy_stats(stack).get("meter.stream_msgs_sent", 0.0)}


def profile(out: Path, seconds: float, workdir: Path | None = None, *,
            response_path: str = "meter-stream", secure_serving: bool = True,
            phases: tuple[str, ...] = ("requests", "stream"),
            streams: int = STREAMS) -> dict[str, Any]:
    picker_config: dict[str, Any] = {"tenants": [{"id": "bench", **ADMISSION_RULES}],
                                     "queue": {"maxWait": "10s"}}
    results: dict[str, Any] = {"streams": streams}
    with tempfile.TemporaryDirectory(prefix="fairway-profile-") as scratch:
        tmp = workdir or Path(scratch)
        with Stack(Path(tmp) / "fast", with_picker=False, endpoints=1,
                   server_args=FAST_SERVER_ARGS) as fast, \
                Stack(Path(tmp) / "slow", with_picker=False, endpoints=1,
                      server_args=["--step-ms", f"{STREAM_STEP_MS:g}", "--kv-budget-tokens",
                                   str(max(8192, streams * 512))]) as streamer, \
                Stack(Path(tmp) / "picked", policy="vtc", endpoints=0,
                      response_path=response_path, secure_serving=secure_serving,
                      picker_config={**picker_config, "endpoints": [
                          {"address": fast.endpoint_addresses[0]}]}) as picked:
            server = fast.endpoint_addresses[0]
            headers = {DEFAULT_TENANT_HEADER: "bench", DESTINATION_HEADER: server}
            body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 1}
            raw = raw_post(picked.gateway_port, "/v1/completions", body, headers)

            async def requests(duration: float) -> int:
                target = RawTarget("picker", picked.gateway_port)
                shots = await fixed_rate(target, raw, RATE, duration)
                target.close()
                return sum(shot.ok for shot in shots)

            if "requests" in phases:
                print(f"  profile: requests at {RATE:g}/s", flush=True)
                results["requests"] = _phase(picked, "requests", out, seconds, requests)
                results["requests"]["unit"] = "request"

            slow = streamer.endpoint_addresses[0]
            picked.write_picker_config({**picker_config, "endpoints": [{"address": slow}]})
            time.sleep(1.0)
            stream_body = {"model": "sim-model", "prompt": "hello there",
                           "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
            stream_raw = raw_post(picked.gateway_port, "/v1/completions", stream_body,
                                  {**headers, DESTINATION_HEADER: slow})

            async def stream_load(duration: float) -> int:
                target = RawTarget("picker", picked.gateway_port)
                chunks = 0
                until = time.monotonic() + duration

                def count(data: bytes, _: float) -> None:
                    nonlocal chunks
                    chunks += data.count(b"data:")  # events, however the reads fall

                async def one() -> None:
                    while time.monotonic() < until:
                        await target.call(stream_raw, count, timeout=30)
                await asyncio.gather(*(one() for _ in range(streams)))
                target.close()
                return chunks

            if "stream" in phases:
                print(f"  profile: {streams} streams of {STREAM_TOKENS} tokens", flush=True)
                results["stream"] = _phase(picked, "stream", out, seconds, stream_load)
                results["stream"]["unit"] = "streamed chunk"
    return results


def _table(counts: dict[str, int], total: int, per_unit_ms: float, unit: str) -> list[str]:
    """Samples, their share, and that share of the CPU per unit: where each millisecond goes
    (samples are wall-clock of running threads, so the split is proportional, not exact)."""
    lines = [f"| | samples | share | ms per {unit} |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {count} | {count / total:.0%} | {count / total * per_unit_ms:.3f} |"
              for label, count in counts.items()]
    return lines


def report(results: dict[str, Any], seconds: float) -> str:
    lines = ["# Where the picker's CPU goes", "",
             f"`python -m bench.profile` ({seconds:g} s a phase; py-spy at {SAMPLE_RATE} "
             f"samples/s, non-blocking: the picker is never paused), Python "
             f"{platform.python_version()}, {os.cpu_count()} cores shared by Envoy, the "
             f"picker, the simulated servers and the load client; "
             f"load average {loadavg()}. Flame graphs: `profile_requests.svg`, "
             "`profile_stream.svg`; the collapsed stacks they are drawn from: `.txt`.", ""]
    for phase, title in (("requests", f"Requests: {RATE:g}/s, non-streaming, one token"),
                         ("stream", f"Meter stream: {results.get('streams', STREAMS)} streams "
                                    f"of {STREAM_TOKENS} tokens, "
                                    f"a chunk every {STREAM_STEP_MS:g} ms each")):
        got = results[phase]
        lines += [f"## {title}", "",
                  f"Picker CPU {got['cpu_s']:.2f} s over {got['wall_s']:.1f} s "
                  f"({got['core_fraction']:.0%} of a core): **{got['cpu_ms_per_unit']:.3f} ms per "
                  f"{got['unit']}** ({got['units']} {got['unit']}s). {got['samples']} samples.",
                  "", "By activity (outermost frame):", ""]
        lines += _table(got["activities"], got["samples"], got["cpu_ms_per_unit"], got["unit"])
        lines += ["", "By kind of work (innermost frame of a known kind):", ""]
        lines += _table(got["kinds"], got["samples"], got["cpu_ms_per_unit"], got["unit"])
        lines += ["", "Top functions by self samples:", "", "| function | samples |", "|---|---:|"]
        lines += [f"| `{name}` | {count} |" for name, count in got["top"]]
        lines.append("")
    lines += ["## The floor: Python gRPC alone", "",
              "`bench/grpc_floor.py`: a servicer that only reads each message's body length, fed "
              "meter-stream messages (one 150-byte SSE chunk each) by a client in another "
              "process. Server CPU per message:", "",
              "| server | arrival | streams | messages | µs per message |",
              "|---|---|---:|---:|---:|"]
    lines += [f"| {r['server']} | {r['arrival']} | {r['streams']} | {r['messages']} | "
              f"{r['us_per_message']:.0f} |" for r in results["grpc_floor"]["messages"]]
    lines += ["", f"Per request, at {results['grpc_floor']['requests'][0]['rate']:g} requests/s "
              "(a servicer that answers what must be answered with an empty message):", "",
              "| server | RPCs | server CPU ms per request |", "|---|---|---:|"]
    lines += [f"| {r['server']} | {r['shape']} | {r['ms_per_request']:.3f} |"
              for r in results["grpc_floor"]["requests"]]
    lines.append("")
    return "\n".join(lines)


DENSITY_COLUMNS = (("streams", "streams", "{:d}"),
                   ("units_per_s", "tokens/s streamed", "{:,.0f}"),
                   ("cpu_ms_per_unit", "picker CPU ms / token", "{:.3f}"),
                   ("core_fraction", "picker cores", "{:.2f}"),
                   ("envoy_cpu_ms_per_unit", "Envoy CPU ms / token", "{:.3f}"),
                   ("messages_per_unit", "meter messages / token", "{:.2f}"),
                   ("cpu_ms_per_meter_message", "picker CPU ms / message", "{:.3f}"),
                   ("meter_unclaimed", "meter streams unclaimed", "{:.0f}"))


def density(out: Path, seconds: float, counts: list[int],
            response_path: str = "meter-stream") -> None:
    """The response path's cost per streamed token as more streams run at once: writes
    ``stream_density.md`` and ``.json`` (``stream_density_access_log.*`` for that path)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="fairway-density-") as graphs:
        for streams in [*counts, *counts[::-1]]:
            print(f"  density: {streams} streams", flush=True)
            got = profile(Path(graphs), seconds, phases=("stream",), streams=streams,
                          response_path=response_path)["stream"]
            rows.append({"streams": streams, **{k: got[k] for k in (
                "units_per_s", "cpu_ms_per_unit", "envoy_cpu_ms_per_unit", "core_fraction",
                "cpu_ms_per_meter_message", "meter_unclaimed", "completion_tokens_charged",
                "units")},
                "messages_per_unit": got["meter_messages"] / got["units"]})
    name = "stream_density" if response_path == "meter-stream" else \
        f"stream_density_{response_path.replace('-', '_')}"
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# The {response_path} path's cost per streamed token, by how many streams run at "
             "once", "",
             f"`python -m bench.profile --density {','.join(map(str, counts))}"
             + ("" if response_path == "meter-stream" else f" --response-path {response_path}")
             + "` (each count "
             f"twice, in that order and back; {seconds:g} s of streaming each, {STREAM_TOKENS}-"
             f"token completions, a chunk every {STREAM_STEP_MS:g} ms per stream, real Envoy "
             f"dialling the picker over TLS), {os.cpu_count()} cores shared by Envoy, the "
             f"picker, the simulated server and the load client; load average {loadavg()}. "
             "A token is an SSE event the client received. Unclaimed: requests settled on their "
             "estimate because their meter stream or log entry never came. A busy Envoy "
             "reads several events from an engine at once and sends them as one message.", "",
             "| " + " | ".join(label for _, label, _ in DENSITY_COLUMNS) + " |",
             "|" + "---:|" * len(DENSITY_COLUMNS)]
    for row in sorted(rows, key=lambda r: r["streams"]):
        lines.append("| " + " | ".join(form.format(row[key]) if row[key] is not None else "-"
                                       for key, _, form in DENSITY_COLUMNS) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--workdir", type=Path, help="keep the stacks' logs here")
    parser.add_argument("--response-path", choices=RESPONSE_PATHS,
                        default="meter-stream")
    parser.add_argument("--plaintext", action="store_true",
                        help="ext_proc without TLS (--secure-serving=false)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU per request and per chunk only: no report, no floor")
    parser.add_argument("--streams", type=int, default=STREAMS,
                        help=f"streams at once in the stream phase (default {STREAMS})")
    parser.add_argument("--phase", choices=("requests", "stream"), action="append",
                        help="only this phase (repeatable; default both)")
    parser.add_argument("--density", metavar="N,N,...",
                        help="the stream phase alone at each of these stream counts, each twice "
                             "(in the order given, then reversed): stream_density.md")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.density:
        density(args.out, args.seconds, [int(n) for n in args.density.split(",")],
                args.response_path)
        return
    results = profile(args.out, args.seconds, args.workdir, response_path=args.response_path,
                      secure_serving=not args.plaintext, streams=args.streams,
                      phases=tuple(args.phase or ("requests", "stream")))
    if args.quick:
        for phase in args.phase or ("requests", "stream"):
            got = results[phase]
            print(f"{phase}: {got['cpu_ms_per_unit']:.3f} ms per {got['unit']}, "
                  f"{got['units_per_s']:.0f} a second, {got['core_fraction']:.0%} of a core; "
                  f"completion tokens charged {got['completion_tokens_charged']:.0f}, "
                  f"meter streams unclaimed {got['meter_unclaimed']:.0f}, "
                  f"{got['meter_messages'] / got['units']:.2f} meter-stream messages a "
                  f"{got['unit']}")
        return
    print("  profile: the gRPC floor", flush=True)
    results["grpc_floor"] = json.loads(subprocess.run(
        [sys.executable, "-m", "bench.grpc_floor"], check=True, capture_output=True,
        text=True).stdout)
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    text = report(results, args.seconds)
    (args.out / "profile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
