"""A picker overloaded on the meter-stream path meters every response its clients received whole
to its usage: it refuses new requests (503 ``meter_backlog``, ``Retry-After``) while it is behind
on its meter streams, rather than let Envoy reset a stream it has not read.

Found by an attack: 300 streams of one tenant beside 20 of another on 2 cores through real
Envoy; clients got complete 200 streams, yet 257 requests were settled ``cancelled`` and 7,382
tokens went uncharged. Here fewer streams (100 beside 10, for ~15 s) meet a picker held to 30 %
of a core (SIGSTOP for 70 ms of every 100 ms, as a container's CPU quota throttles it), which is
the same overload: without the backlog refusal and with Envoy's meter streams closed 2 s after
their request (what fairway shipped), it settles hundreds of whole streams ``cancelled`` and
leaves tens of thousands of tokens uncharged. The 300 + 20 flood is
``python -m bench.meter_overload`` (``bench/results/meter_overload.md``)."""

from __future__ import annotations

from bench.meter_overload import run

HEAVY = 200
LIGHT = 20


def test_every_whole_stream_is_charged_its_usage_when_the_picker_is_overloaded() -> None:
    result = run(HEAVY, LIGHT, seconds=12, max_tokens=100, step_ms=1, picker_share=0.3)
    clients, outcomes = result["clients"], result["outcomes"]
    # Each client got a whole stream or a retryable refusal: nothing cut, nothing failed.
    assert set(clients) <= {f"{t}:{kind}" for t in "ab"
                            for kind in ("whole", "completion_tokens", "503")}, clients
    assert clients["a:whole"] > 0 and clients["b:whole"] > 0, clients
    assert result["rejections"].keys() <= {"meter_backlog"}, result["rejections"]
    # Every whole stream settled on the usage it carried: none as a client that left, none on
    # an estimate, no token uncharged.
    for tenant in "ab":
        assert outcomes[tenant] == {"ok": clients[f"{tenant}:whole"]}, outcomes
        assert result["uncharged"][tenant] == 0, result
    assert result["estimated"] == {}, result
    assert result["meter_unclaimed"] == 0, result
