"""A picker that stalls (CPU-throttled by its limit, paused) while requests end loses none of
their meters: each is charged what its engine generated.

On the meter-stream path Envoy resets a meter stream ``deferred_close_timeout`` after its HTTP
stream ended, and a reset discards whatever of the stream gRPC holds that the picker has not read
yet. With the 0.25 s this project once shipped, eight half-second pauses of the picker under this
flood lost the meters of 60 of 1,500 requests, settled as gone and charged no output
(``fairway_meter_unclaimed_total``). The picker is paused here with SIGSTOP, as a throttled
container is; each pause is shorter than ``picker.stack.envoy.METER_DEFERRED_CLOSE`` (5 s; 2 s
also held). A picker behind for longer refuses new requests instead
(``tests/faults/test_meter_overload.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric, settled_metric
from tests.faults.helpers import flood, gauges_drain

REQUESTS = 600
CONCURRENCY = 40
PAUSES = 4
PAUSE_S = 0.5


def _pause_repeatedly(pid: int, flooding: threading.Event, done: threading.Event) -> None:
    """SIGSTOP the picker ``PAUSES`` times for ``PAUSE_S``, once the flood runs."""
    flooding.wait(30)
    for _ in range(PAUSES):
        if done.wait(0.5):
            return
        os.kill(pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(pid, signal.SIGCONT)


def test_requests_ending_while_the_picker_is_paused_are_all_charged(tmp_path: Path) -> None:
    with Stack(tmp_path, endpoints=2, server_args=["--step-ms", "1"],
               picker_config={"tenants": [{"id": "a"}]}) as stack:
        flooding, done = threading.Event(), threading.Event()
        pauser = threading.Thread(target=_pause_repeatedly,
                                  args=(stack.picker_process.pid, flooding, done))
        pauser.start()
        try:
            answers = asyncio.run(flood(stack, REQUESTS, CONCURRENCY, lambda: "a",
                                        chat_body(words=6, max_tokens=1), flooding))
        finally:
            done.set()
            pauser.join()
            os.kill(stack.picker_process.pid, signal.SIGCONT)
        # Back from a pause behind on its meter streams, the picker may refuse new requests
        # until it has caught up (503 meter_backlog): never lose a served one's meter.
        statuses = Counter(status for status, _, _ in answers)
        assert set(statuses) <= {200, 503}, statuses
        assert all(body["error"]["code"] == "picker_overloaded"
                   for status, _, body in answers if status == 503)
        served = statuses[200]
        assert served >= REQUESTS // 2, statuses
        url = stack.metrics_url
        assert settled_metric(url, "fairway_requests_total", served, tenant="a",
                              outcome="ok") == served
        assert metric(url, "fairway_meter_unclaimed_total") == 0
        assert metric(url, "fairway_settlements_estimated_total") == 0
        assert settled_metric(url, "fairway_service_tokens_total", served, tenant="a",
                              kind="completion") == served
        drained = gauges_drain(stack)
        assert not any(drained.values()), drained
