"""``python -m picker.config``: ``check FILE`` validates a picker config, naming any bad field
(``--gateway SAMPLE``: and refuses a header it trusts that the gateway form in SAMPLE, Kubernetes
objects or an Envoy bootstrap, does not remove from clients' requests); ``hash-key`` turns API
keys read on stdin into the SHA-256 hashes the config stores."""

from __future__ import annotations

import argparse
import sys

import yaml

from picker.config.schema import load_config
from picker.config.trusted import check_stripped, early_removed
from picker.errors import ConfigError
from picker.identity import hash_api_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.config")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a config file")
    check.add_argument("file")
    check.add_argument("--gateway", metavar="SAMPLE", action="append", default=[],
                       help="a gateway form (the YAML a user applies: Kubernetes objects, or an "
                            "Envoy bootstrap) that must remove every header the config trusts")
    commands.add_parser(
        "hash-key",
        help="print the sha256 of each API key read on stdin, one per line",
        description="Reads API keys on stdin, one per line (so they stay out of shell history), "
                    "and prints the sha256 hex of each, one per line, for the config.",
    )
    args = parser.parse_args(argv)
    if args.command == "hash-key":
        return hash_keys()
    try:
        config = load_config(args.file)
        for sample in args.gateway:
            with open(sample, encoding="utf-8") as f:
                documents = [d for d in yaml.safe_load_all(f) if isinstance(d, dict)]
            check_stripped(config, early_removed(documents), sample)
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok ({len(config.tenants)} tenants, {len(config.lanes)} lanes, "
          f"{len(config.endpoints)} endpoints, policy {config.scheduling.policy})")
    # Said, not left implied: an "ok" alone did not tell a reader that the gateway was checked.
    for sample in args.gateway:
        print(f"{sample}: removes clients' copies of every header {args.file} trusts")
    return 0


def hash_keys() -> int:
    """Hash every key on stdin; print nothing and exit 2 if any line is not a usable key."""
    if sys.stdin.isatty():
        print("reading API keys, one per line; end with Ctrl-D", file=sys.stderr)
    # Surrounding whitespace is dropped, as the picker drops it from the Authorization header.
    keys = [line.strip() for line in sys.stdin.read().splitlines()]
    # All lines are checked before any hash is printed, so a bad line yields no partial output.
    # Messages give line numbers only: the key itself must not land in a terminal or a log.
    for number, key in enumerate(keys, start=1):
        if not key:
            print(f"hash-key: line {number} is empty; give one API key per line",
                  file=sys.stderr)
            return 2
        if any(c.isspace() for c in key):
            print(f"hash-key: line {number} contains whitespace, which a Bearer token cannot "
                  "carry; give one API key per line", file=sys.stderr)
            return 2
    if not keys:
        print("hash-key: no API key on stdin; give one API key per line", file=sys.stderr)
        return 2
    for key in keys:
        print(hash_api_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
