"""An engine that queues beside room the picker counts: requests sent since the last read join
its queue, and a read that shows it queueing teaches the picker its limit on running requests.

vLLM runs at most ``max_num_seqs`` requests, a limit no metric states. When requests share their
prompt blocks (a system prompt counted once, ``picker.core.prefix.InflightBlocks``), the KV room
lets far more of them in than that: the engine queues the rest FCFS, one starting per
completion. The picker's waiting count (``picker.core.selection.waiting``) used to subtract the
completions seen since the read and count nothing it sent, so one completion after a read of 2
waiting sent every request the tokens allowed; the next read found them queued, and the fair
queue's head (a light tenant's request) waited them out (1.46 s at p95 on the system-prompt
workload, ``bench.prefix_fairness``).
"""

from __future__ import annotations

from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.selection import CapacityRules, EndpointState, has_room, observe, waiting

E1 = "10.0.0.1:8000"
RULES = CapacityRules(fallback_budget=100_000, max_waiting=2, stale_after=1.0)
NOW = 10.0


def _read(endpoint: EndpointState, waiting_: float, running: float) -> None:
    observe(endpoint, waiting_, running, None, None, NOW)


# -- the waiting count (``selection.waiting``) --

def test_requests_sent_to_a_queueing_engine_since_the_read_join_its_queue() -> None:
    endpoint = EndpointState(E1)
    _read(endpoint, 1, 8)
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)
    endpoint.sent_since_scrape = 1  # a second one waits behind the first
    assert waiting(endpoint, NOW, RULES) == 2
    assert not has_room(endpoint, NOW, RULES, prompt_tokens=10)
    endpoint.completed_since_scrape = 1  # one ended: the engine started the first
    assert waiting(endpoint, NOW, RULES) == 1
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)


def test_a_read_showing_the_engine_queueing_teaches_its_running_limit() -> None:
    endpoint = EndpointState(E1)
    _read(endpoint, 0, 5)
    assert endpoint.running_limit is None  # never seen queueing: no limit known
    _read(endpoint, 3, 8)
    assert endpoint.running_limit == 8
    _read(endpoint, 0, 6)
    assert endpoint.running_limit == 8  # fewer running later: the limit stays
    _read(endpoint, 0, 9)
    assert endpoint.running_limit == 9  # more running: it was higher than learned


def test_requests_just_sent_waiting_for_the_engines_next_step_teach_no_limit() -> None:
    # The first requests of a run: 4 sent, the read comes before the engine's next step has
    # started the last 3. That says nothing about a limit (the old rule took it as 1).
    endpoint = EndpointState(E1)
    _read(endpoint, 0, 0)
    endpoint.sent_since_scrape = 4
    _read(endpoint, 3, 1)
    assert endpoint.running_limit is None
    _read(endpoint, 0, 4)  # the next read: all four run
    endpoint.sent_since_scrape = 50
    assert waiting(endpoint, NOW, RULES) == 0  # it takes whatever its room allows
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)


def test_requests_still_waiting_a_read_later_teach_the_limit() -> None:
    endpoint = EndpointState(E1)
    endpoint.sent_since_scrape = 10
    _read(endpoint, 2, 8)  # 10 sent since the last read: the 2 may be just arrived
    assert endpoint.running_limit is None
    _read(endpoint, 2, 8)  # none sent since, 2 still waiting: the engine holds them back
    assert endpoint.running_limit == 8
    endpoint.sent_since_scrape = 3
    _read(endpoint, 4, 9)  # more waiting than sent since: held back beside 9
    assert endpoint.running_limit == 9


def test_after_a_read_without_a_queue_the_engine_starts_what_its_limit_leaves_room_for() -> None:
    endpoint = EndpointState(E1)
    _read(endpoint, 3, 8)
    _read(endpoint, 0, 6)  # two slots free under the limit of 8
    endpoint.sent_since_scrape = 3
    assert waiting(endpoint, NOW, RULES) == 1
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)
    endpoint.sent_since_scrape = 4
    assert waiting(endpoint, NOW, RULES) == 2
    assert not has_room(endpoint, NOW, RULES, prompt_tokens=10)
    endpoint.completed_since_scrape = 1  # a slot more
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)


def test_an_engine_never_seen_queueing_takes_whatever_its_room_allows() -> None:
    endpoint = EndpointState(E1)
    _read(endpoint, 0, 8)
    endpoint.sent_since_scrape = 500
    assert waiting(endpoint, NOW, RULES) == 0
    assert has_room(endpoint, NOW, RULES, prompt_tokens=10)


def test_a_read_forgets_what_was_sent_before_it() -> None:
    endpoint = EndpointState(E1)
    _read(endpoint, 1, 8)
    endpoint.sent_since_scrape = 5
    _read(endpoint, 1, 8)
    assert endpoint.sent_since_scrape == 0
    assert waiting(endpoint, NOW, RULES) == 1


# -- the gate --

def _gate() -> Gate:
    gate = Gate(GateRules(capacity=RULES), Scheduler([LaneSpec("default")]),
                Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({E1: 100_000})
    return gate


def _admit(gate: Gate, tenant: str, now: float, prompt: int = 50) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=100, stream=True, now=now)
    assert isinstance(passage, Passage), passage
    return passage


def _sent(passages: list[Passage]) -> list[Passage]:
    return [p for p in passages if p.dispatched_at is not None]


def _complete(gate: Gate, passage: Passage, now: float) -> None:
    gate.complete(passage, Usage(passage.request.prompt_tokens, 100, 0), "ok", now)


def test_one_completion_at_a_queueing_engine_sends_one_request_not_all_the_room_allows(
        ) -> None:
    gate = _gate()
    endpoint = gate.endpoints[E1]
    running = [_admit(gate, "heavy", 1.0) for _ in range(10)]
    assert len(_sent(running)) == 10  # nothing read yet: the tokens decide
    # The engine runs 8 and queues 2 (its limit, not its KV).
    gate.scraped(endpoint, 2, 8, None, None, sent_at=NOW, now=NOW)
    backlog = [_admit(gate, "heavy", NOW) for _ in range(50)]
    assert not _sent(backlog)
    _complete(gate, running[0], NOW)
    # One started at the engine: one sent to take its place in the queue, not the 50 the
    # 100,000 tokens had room for (the old count: 2 - 1 completed < 2, for every one sent).
    assert len(_sent(backlog)) == 1
    assert endpoint.sent_since_scrape == 1
    # A light tenant's request is the fair queue's head: it goes at the next completion, not
    # after a queue of the heavy tenant's.
    light = _admit(gate, "light", NOW)
    assert light.dispatched_at is None
    _complete(gate, running[1], NOW + 0.01)
    assert light.dispatched_at == NOW + 0.01
    assert len(_sent(backlog)) == 1


def test_after_a_read_without_a_queue_only_the_slots_under_the_limit_are_filled() -> None:
    gate = _gate()
    endpoint = gate.endpoints[E1]
    running = [_admit(gate, "heavy", 1.0) for _ in range(10)]
    gate.scraped(endpoint, 2, 8, None, None, sent_at=NOW, now=NOW)
    assert endpoint.running_limit is None  # 10 sent: the 2 may not have met a step yet
    gate.scraped(endpoint, 2, 8, None, None, sent_at=NOW, now=NOW)  # still waiting: the limit
    assert endpoint.running_limit == 8
    for passage in running[:4]:
        _complete(gate, passage, NOW)
    backlog = [_admit(gate, "heavy", NOW + 0.05) for _ in range(50)]
    sent_before = len(_sent(backlog))
    # The engine now runs 6 of its 8 and queues none: two start at once, two more may wait.
    gate.scraped(endpoint, 0, 6, None, None, sent_at=NOW + 0.05, now=NOW + 0.05)
    gate.pump(NOW + 0.05)
    assert len(_sent(backlog)) - sent_before == 4


def test_an_endpoint_read_early_with_requests_waiting_for_a_step_is_not_pinned() -> None:
    # The system-prompt workload behind Envoy (bench.peer): the first read of one endpoint came
    # between the arrival of its first 4 requests and the engine's next step (3 waiting, 1
    # running). Taken as its limit, every request sent past the running count then counted as
    # waiting, so it got 2 more a read and ran 31 after 10 s while the other ran 83.
    gate = _gate()
    endpoint = gate.endpoints[E1]
    first = [_admit(gate, "heavy", 1.0) for _ in range(4)]
    assert len(_sent(first)) == 4
    gate.scraped(endpoint, 3, 1, None, None, sent_at=1.0, now=1.0)
    gate.scraped(endpoint, 0, 4, None, None, sent_at=1.5, now=1.5)  # all four started
    more = [_admit(gate, "heavy", 1.6) for _ in range(30)]
    assert len(_sent(more)) == 30  # its room decides, not 2 past the 4 it was read running

