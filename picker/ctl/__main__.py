"""``python -m picker.ctl top --admin HOST:PORT [--interval 1] [--once] [--token-file FILE]``:
the command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from picker.ctl.top import DEFAULT_ADMIN, run


def _address(text: str) -> str:
    """``HOST:PORT``, checked here so that a typo is an argument error, not a network one."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run ``picker.ctl``; returns the exit code (1: the picker could not be reached)."""
    parser = argparse.ArgumentParser(prog="python -m picker.ctl")
    commands = parser.add_subparsers(dest="command", required=True)
    top = commands.add_parser("top", help="live view of the picker's tenants and endpoints")
    top.add_argument("--admin", type=_address, default=DEFAULT_ADMIN,
                     help=f"the picker's admin API, HOST:PORT (default {DEFAULT_ADMIN})")
    top.add_argument("--interval", type=_positive, default=1.0,
                     help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true",
                     help="print the tables once and exit (for scripts)")
    top.add_argument("--timeout", type=_positive, default=5.0,
                     help="seconds to wait for each answer (default 5)")
    top.add_argument("--token-file", type=Path, metavar="FILE",
                     help="the admin API's bearer token (the picker's --admin-token-file); "
                          "default: $FAIRWAY_ADMIN_TOKEN")
    args = parser.parse_args(argv)
    try:
        token = args.token_file.read_text().strip() if args.token_file \
            else os.environ.get("FAIRWAY_ADMIN_TOKEN") or None
    except OSError as exc:
        parser.error(f"--token-file: {exc}")
    try:
        return run(args.admin, interval=args.interval, once=args.once, timeout=args.timeout,
                   token=token)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
