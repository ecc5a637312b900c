"""What a replay needs in the metering record (issue 29 point 2): the arrival, ``max_tokens``
asked, stream or not, the lane asked; records written before these fields still load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from picker.core import Usage
from picker.metering import MeteringRecord
from tests.unit.test_dispatcher import A, FakeClock, _admit, _config, _request
from tests.unit.test_dispatcher import _dispatcher as _plain_dispatcher

OLD_RECORD = {  # as the picker wrote it before the replay fields
    "request_id": "r1", "timestamp": 1000.5, "tenant_id": "a", "model": "m",
    "priority_lane": "default", "outcome": "ok", "finish_reason": "stop", "endpoint": A,
    "prompt_tokens": 10, "completion_tokens": 5, "cached_prompt_tokens": 0, "estimated": False,
    "cost": 20.0, "demoted": False, "queue_ms": 1.0, "ttft_ms": 20.0, "e2e_ms": 500.0}


def test_the_replay_fields_come_after_the_old_ones_and_old_records_still_load() -> None:
    names = [f.name for f in dataclasses.fields(MeteringRecord)]
    assert names[:len(OLD_RECORD)] == list(OLD_RECORD)  # readers of today's fields see no change
    assert names[len(OLD_RECORD):] == ["arrived_at", "max_tokens", "stream", "lane_asked"]
    old = MeteringRecord(**OLD_RECORD)
    assert (old.arrived_at, old.max_tokens, old.stream, old.lane_asked) == (None,) * 4


async def test_the_dispatcher_records_arrival_max_tokens_stream_and_the_lane_asked(
        tmp_path: Path) -> None:
    out = tmp_path / "metering.jsonl"
    clock = FakeClock(50.0)
    config = _config([A], tenants=[{"id": "a", "allowedLanes": ["batch"]}],
                     lanes=[{"name": "online"}, {"name": "batch"}],  # type: ignore[arg-type]
                     metering={"output": str(out)})
    d = _plain_dispatcher(config, clock)
    d.wall_clock = lambda: 1_700_000_000.0 + clock.now
    first = await _admit(d, "a", _request(100, stream=False, max_tokens=64))
    ticket = await d.admit("a", _request(100, stream=True), lane="batch")
    clock.now += 2.5
    d.complete(first, Usage(100, 30), "ok")
    d.complete(ticket, Usage(100, 7), "ok")
    one, two = (json.loads(line) for line in out.read_text().splitlines())
    assert one["arrived_at"] == 1_700_000_050.0 and one["timestamp"] == 1_700_000_052.5
    assert (one["max_tokens"], one["stream"], one["lane_asked"]) == (64, False, None)
    assert (two["max_tokens"], two["stream"], two["lane_asked"]) == (None, True, "batch")
    assert two["priority_lane"] == "batch"
    assert MeteringRecord(**two).lane_asked == "batch"
