"""``python -m picker.ctl top --admin HOST:PORT [--interval 1] [--once] [--token-file FILE]``
and ``python -m picker.ctl whatif -f candidate.yaml --baseline current.yaml [--admin HOST:PORT]
[--minutes 15] [--max-records 20000] [--timeout 60] [--json]``: the command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from picker.ctl.top import DEFAULT_ADMIN, run
from picker.ctl.whatif import run as whatif_run
from picker.whatif.recent import Bounds


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
    whatif = commands.add_parser(
        "whatif", help="replay the picker's recent traffic under a candidate config or "
                       "TenantPolicy (a dry run: the picker is only read)")
    whatif.add_argument("-f", "--candidate", type=Path, required=True, metavar="FILE",
                        help="TenantPolicy YAML (as kubectl apply takes it), or a config file")
    whatif.add_argument("--baseline", type=Path, required=True, metavar="FILE",
                        help="the picker's config now: a file, or its ConfigMap "
                             "(kubectl get configmap fairway-picker-config -o yaml)")
    whatif.add_argument("--admin", type=_address, default=DEFAULT_ADMIN,
                        help=f"the picker's admin API, HOST:PORT (default {DEFAULT_ADMIN})")
    whatif.add_argument("--minutes", type=_positive, default=Bounds.minutes,
                        help=f"replay the last this many minutes (default {Bounds.minutes:g})")
    whatif.add_argument("--max-records", type=int, default=Bounds.max_records,
                        help=f"at most this many requests, the latest "
                             f"(default {Bounds.max_records:,})")
    whatif.add_argument("--timeout", type=_positive, default=Bounds.timeout_s,
                        help=f"seconds the replay may take (default {Bounds.timeout_s:g})")
    whatif.add_argument("--min-requests", type=int, default=Bounds.min_records,
                        help=f"fewer requests in the window: no prediction "
                             f"(default {Bounds.min_records})")
    whatif.add_argument("--min-seconds", type=float, default=Bounds.min_span_s,
                        help=f"arrivals spanning less: no prediction "
                             f"(default {Bounds.min_span_s:g})")
    whatif.add_argument("--json", action="store_true", help="print JSON")
    whatif.add_argument("--token-file", type=Path, metavar="FILE",
                        help="the admin API's bearer token (the picker's --admin-token-file); "
                             "default: $FAIRWAY_ADMIN_TOKEN")
    args = parser.parse_args(argv)
    try:
        token = args.token_file.read_text().strip() if args.token_file \
            else os.environ.get("FAIRWAY_ADMIN_TOKEN") or None
    except OSError as exc:
        parser.error(f"--token-file: {exc}")
    if args.command == "whatif":
        if args.max_records < 1 or args.min_requests < 1 or args.min_seconds < 0:
            parser.error("--max-records and --min-requests must be at least 1, "
                         "--min-seconds at least 0")
        bounds = Bounds(minutes=args.minutes, max_records=args.max_records,
                        timeout_s=args.timeout, min_records=args.min_requests,
                        min_span_s=args.min_seconds)
        return whatif_run(args.admin, args.candidate, args.baseline, bounds, timeout=10.0,
                          token=token, json_out=args.json, out=sys.stdout, err=sys.stderr)
    try:
        return run(args.admin, interval=args.interval, once=args.once, timeout=args.timeout,
                   token=token)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
