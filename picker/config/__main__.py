"""``python -m picker.config check FILE``: validate a picker config, naming any bad field."""

from __future__ import annotations

import argparse
import sys

from picker.config.schema import load_config
from picker.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.config")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a config file")
    check.add_argument("file")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok ({len(config.tenants)} tenants, {len(config.lanes)} lanes, "
          f"{len(config.endpoints)} endpoints, policy {config.scheduling.policy})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
