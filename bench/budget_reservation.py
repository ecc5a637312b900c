"""What worst-case budget reservation costs a well-behaved tenant.

It answers: a tenant that stays within its budget's rate, but whose requests reserve their
worst case (``budgets.reserve: worstCase``, the default) or their expected output with the
outstanding worst case held against the level (``expected``), how much of its demand is served,
how many of its requests run at once, and how long they wait for admission? The reservation is
held from admission to settlement, so a request that may cost much more than it will (a client
that never sets ``max_tokens``) holds a large part of the budget while it runs.

A pure discrete-event run of ``picker.core.admission.Admission`` (nothing else; no engine
queueing): ``--workers`` closed-loop clients of one tenant, each sending its next request as
soon as the last one ends, with a prompt of ``--prompt`` tokens and an output drawn uniformly
from 100 to 300 tokens (mean 200) streamed at ``--tokens-per-s`` a request. A refused request
waits the ``Retry-After`` it was given and is sent again. The budget is a burst bucket of
``--budget`` tokens refilled over ``--per`` seconds; the default demand (4 clients, 700 tokens
per 10 s each: 280 tokens/s) is below its refill rate (333 tokens/s), so with no reservation
rule at all every request would be served at once.

Three client shapes: ``max_tokens 1000``; no ``max_tokens`` on a model whose context
(``models[].maxModelLen``) is 8,192; no ``max_tokens`` and no known context (the output cap is
then what a full budget can pay). The expected output given to admission is the true mean
(200): the best case for ``expected``.

``python -m bench.budget_reservation --out bench/results`` prints a table and writes
``budget_reservation.md`` and ``budget_reservation.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from pathlib import Path
from typing import Any

from picker.core.admission import Admission, Admitted, BucketRule, TenantRules

SHAPES: dict[str, tuple[int | None, int | None]] = {
    "max_tokens 1000": (1000, None),
    "no max_tokens, maxModelLen 8192": (None, 8192),
    "no max_tokens, context unknown": (None, None),
}
"""Client shape: (max_tokens, the model's context)."""


def run(mode: str, max_tokens: int | None, context: int | None, *, workers: int, prompt: int,
        budget: int, per: float, tokens_per_s: float, duration: float,
        seed: int) -> dict[str, Any]:
    """One tenant's closed-loop clients against one admission rule for ``duration`` seconds."""
    rules = TenantRules(burst=BucketRule(budget, per), reserve=mode)  # type: ignore[arg-type]
    admission = Admission({"t": rules}, TenantRules())
    rng = random.Random(seed)
    # (time, order, kind, worker, payload): "send" a request, or "end" one.
    events: list[tuple[float, int, str, int, Any]] = []
    order = 0
    for worker in range(workers):
        events.append((0.0, order, "send", worker, 0.0))
        order += 1
    heapq.heapify(events)
    in_flight = 0
    weighted_in_flight = 0.0
    last = 0.0
    served_tokens = 0
    served = 0
    refusals = 0
    waits: list[float] = []
    refused_since: dict[int, float] = {}  # worker -> when its waiting request was first sent
    limit = None if context is None else context - prompt
    while events:
        now, _, kind, worker, payload = heapq.heappop(events)
        if now > duration:
            break
        weighted_in_flight += in_flight * (now - last)
        last = now
        if kind == "end":
            reservation, used = payload
            admission.finish(reservation, used, now)
            in_flight -= 1
            served += 1
            served_tokens += used
            heapq.heappush(events, (now, order, "send", worker, now))
            order += 1
            continue
        first_sent = payload
        outcome = admission.admit("t", "default", prompt, max_tokens, 200, now,
                                  output_limit=limit)
        if not isinstance(outcome, Admitted):
            refusals += 1
            refused_since[worker] = first_sent
            wait = max(outcome.retry_after or 0.0, 0.001)
            heapq.heappush(events, (now + wait, order, "send", worker, first_sent))
            order += 1
            continue
        admission.start(outcome.reservation)
        refused_since.pop(worker, None)
        waits.append(now - first_sent)
        output = rng.randint(100, 300)
        in_flight += 1
        heapq.heappush(events, (now + output / tokens_per_s, order, "end", worker,
                                (outcome.reservation, prompt + output)))
        order += 1
    weighted_in_flight += in_flight * (duration - last)
    # A request still refused at the end has waited until then (a client may never get in).
    waits += [duration - since for since in refused_since.values()]
    waits.sort()
    return {
        "mode": mode, "served_tokens_per_s": served_tokens / duration,
        "requests_per_s": served / duration, "mean_in_flight": weighted_in_flight / duration,
        "refusals_per_request": refusals / max(1, served),
        "wait_p50_s": statistics.median(waits) if waits else 0.0,
        "wait_p95_s": waits[int(0.95 * (len(waits) - 1))] if waits else 0.0,
        "wait_max_s": waits[-1] if waits else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--budget", type=int, default=20_000)
    parser.add_argument("--per", type=float, default=60.0)
    parser.add_argument("--tokens-per-s", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    demand = args.workers * (args.prompt + 200) / (200 / args.tokens_per_s)
    rows = []
    for shape, (max_tokens, context) in SHAPES.items():
        for mode in ("worst_case", "expected"):
            row = run(mode, max_tokens, context, workers=args.workers, prompt=args.prompt,
                      budget=args.budget, per=args.per, tokens_per_s=args.tokens_per_s,
                      duration=args.duration, seed=args.seed)
            rows.append({"shape": shape, **row, "share_of_demand":
                         row["served_tokens_per_s"] / demand})
    header = (f"{args.workers} clients of one tenant, prompt {args.prompt}, output 100-300 "
              f"(mean 200) at {args.tokens_per_s:g} tokens/s; burst budget {args.budget} per "
              f"{args.per:g} s (refill {args.budget / args.per:.0f} tokens/s); demand "
              f"{demand:.0f} tokens/s; {args.duration:g} s simulated, seed {args.seed}.")
    lines = [header, "",
             "| client | reserve | served tokens/s | of demand | requests in flight (mean) "
             "| refusals per request | admission wait p50 / p95 / max |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['mode']} | {r['served_tokens_per_s']:.0f} | "
                     f"{r['share_of_demand']:.0%} | {r['mean_in_flight']:.2f} | "
                     f"{r['refusals_per_request']:.2f} | {r['wait_p50_s']:.1f} / "
                     f"{r['wait_p95_s']:.1f} / {r['wait_max_s']:.0f} s |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python -m bench.budget_reservation --out bench/results"
        (args.out / "budget_reservation.md").write_text(
            "# What worst-case budget reservation costs a well-behaved tenant\n\n"
            f"`{command}` (pure: `picker.core.admission` alone, no engine).\n\n{text}\n")
        (args.out / "budget_reservation.json").write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                       indent=2) + "\n")


if __name__ == "__main__":
    main()
