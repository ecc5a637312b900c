"""``python -m picker.stack [--policy vtc|fcfs] [--endpoints N] [--port 10000]``.

Starts real Envoy, the picker and N simulated vLLM servers on 127.0.0.1, prints the gateway URL
when ready, runs until interrupted, and stops everything it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from picker.stack.envoy import RESPONSE_PATHS
from picker.stack.launcher import Stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.stack", description=__doc__)
    parser.add_argument("--policy", choices=("vtc", "lcf", "fcfs"), default="vtc")
    parser.add_argument("--endpoints", type=int, default=2)
    parser.add_argument("--port", type=int, default=10000, help="gateway port (0: any free)")
    parser.add_argument("--kv-budget-tokens", type=int, default=8192,
                        help="KV budget of each simulated server")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="decode step time of each simulated server")
    parser.add_argument("--response-path", choices=RESPONSE_PATHS,
                        default="meter-stream",
                        help="how Envoy hands responses to the picker "
                             "(docs/picker.md, 'Three response paths')")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where configs and logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.endpoints < 1:
        parser.error("--endpoints must be >= 1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="fairway-stack-") as tmp:
        workdir = args.workdir or Path(tmp)
        stack = Stack(workdir, policy=args.policy, endpoints=args.endpoints,
                      gateway_port=args.port, response_path=args.response_path,
                      server_args=["--kv-budget-tokens", str(args.kv_budget_tokens),
                                   "--step-ms", str(args.step_ms)])
        with stack:
            print(f"gateway {stack.gateway_url}  (policy {args.policy}; picker metrics "
                  f"{stack.metrics_url}; endpoints {', '.join(stack.endpoint_addresses)}; "
                  f"logs in {workdir})", flush=True)
            print(f"try: curl -s {stack.gateway_url}/v1/chat/completions -H "
                  f"'x-gateway-inference-fairness-id: team-a' -d '{{\"model\": \"sim-model\", "
                  f"\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'", flush=True)
            stop.wait()
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
