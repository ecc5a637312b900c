"""What does counting a streamed chunk's tokens by its text cost, per chunk, against counting one
token an event?

``python -m bench.meter_chunk_cost`` feeds ``ResponseMeter.feed`` 5,000 SSE events of three
shapes (vLLM chat chunks of one token, chat chunks of eight, Anthropic ``content_block_delta``
events of one token) and reports the CPU time per chunk (``time.process_time``, the best of
``--rounds`` interleaved rounds, so that other processes on a busy machine do not count), for
the meter as it is and as it was before it counted text (``picker/openai/response.py`` at
``BEFORE``, read with ``git show``). Writes ``bench/results/meter_chunk_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from picker.openai import response as current
from picker.openai.paths import ApiKind

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BEFORE = "1b5d065~1"
"""The last commit whose meter counted one token an event."""
EVENTS = 5000


def _chat(text: str) -> bytes:
    return b"data: " + json.dumps({
        "id": "chatcmpl-0cc73a884c204799b3f026f2943b355b", "object": "chat.completion.chunk",
        "created": 1796304202, "model": "sim-model", "choices": [{
            "index": 0, "delta": {"content": text}, "logprobs": None,
            "finish_reason": None}]}, separators=(",", ":")).encode() + b"\n\n"


def _messages(text: str) -> bytes:
    return b"event: content_block_delta\ndata: " + json.dumps({
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": text}}, separators=(",", ":")).encode() + b"\n\n"


SHAPES = [("chat, one token an event", ApiKind.CHAT, _chat(" the")),
          ("chat, eight tokens an event", ApiKind.CHAT, _chat(" the cat sat on the mat and")),
          ("messages, one token an event", ApiKind.MESSAGES, _messages(" the"))]


def _before() -> types.ModuleType | None:
    """``picker.openai.response`` as it was at ``BEFORE`` (None without git)."""
    try:
        source = subprocess.run(["git", "show", f"{BEFORE}:picker/openai/response.py"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("response_before")
    exec(compile(source, "response_before.py", "exec"), module.__dict__)
    return module


def _per_chunk(module: Any, kind: ApiKind, event: bytes) -> tuple[float, int]:
    meter = module.ResponseMeter(True, kind)
    start = time.process_time()
    for _ in range(EVENTS):
        meter.feed(event)
    return (time.process_time() - start) / EVENTS * 1e6, meter.counted_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    modules = {"after": current}
    before = _before()
    if before is not None:
        modules["before"] = before
    rows = []
    for name, kind, event in SHAPES:
        best = {label: float("inf") for label in modules}
        counted = {}
        for _ in range(args.rounds):
            for label, module in modules.items():
                us, counted[label] = _per_chunk(module, kind, event)
                best[label] = min(best[label], us)
        rows.append({"shape": name, "us_per_chunk": best, "counted": counted})
        print(name, {k: round(v, 2) for k, v in best.items()}, counted)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "meter_chunk_cost.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["# Counting a streamed chunk's tokens by its text: CPU per chunk", "",
             f"`python -m bench.meter_chunk_cost` ({EVENTS:,} events a shape, best of "
             f"{args.rounds} interleaved rounds, CPU time; before: `{BEFORE}`).", "",
             "| shape | before µs/chunk | after µs/chunk | counted before | counted after |",
             "|---|---|---|---|---|"]
    for row in rows:
        us, counted = row["us_per_chunk"], row["counted"]
        lines.append(f"| {row['shape']} | {us.get('before', float('nan')):.2f} | "
                     f"{us['after']:.2f} | {counted.get('before', '')} | {counted['after']} |")
    (RESULTS / "meter_chunk_cost.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
