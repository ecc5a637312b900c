"""``python -m picker serve --config FILE``: run the fairway Endpoint Picker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from picker.errors import ConfigError
from picker.server import ServeSettings, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the Endpoint Picker (ext_proc gRPC)")
    run.add_argument("--config", type=Path, required=True, help="picker config YAML")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--grpc-port", type=int, default=9002)
    run.add_argument("--metrics-port", type=int, default=9090)
    run.add_argument("--admin-port", type=int, default=9003,
                     help="read-only admin API, fairway.v1.Admin (0: any free port)")
    run.add_argument("--grace", type=float, default=10.0,
                     help="seconds running requests get to finish on SIGTERM")
    run.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServeSettings(config_path=args.config, host=args.host, grpc_port=args.grpc_port,
                             metrics_port=args.metrics_port, admin_port=args.admin_port,
                             grace=args.grace)
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # a port in use, an address not available
        print(f"picker: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
