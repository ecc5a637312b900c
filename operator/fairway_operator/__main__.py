"""``python -m fairway_operator``: run the operator of one pool (flags, or FAIRWAY_* env vars)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import overload

from fairway_operator.settings import Settings
from picker.config.strict import parse_duration
from picker.errors import ConfigError

ENV = "FAIRWAY_"


@overload
def _env(name: str) -> str | None: ...
@overload
def _env(name: str, default: str) -> str: ...
def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV + name, default)


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    """Settings from flags; each flag's default comes from its environment variable."""
    defaults = Settings(pool="x")
    parser = argparse.ArgumentParser(
        prog="python -m fairway_operator",
        description="Render the TenantPolicies of one InferencePool, with the base config, into "
                    "the fairway picker's config ConfigMap, and copy the picker's live figures "
                    "into each policy's status. Every flag can also be set by the environment "
                    "variable named after it.")
    parser.add_argument("--pool", default=_env("POOL"),
                        help="InferencePool whose TenantPolicies to render (FAIRWAY_POOL; "
                             "required)")
    parser.add_argument("--namespace", "-n", action="append", dest="namespaces",
                        help="namespace to watch; repeat for several (FAIRWAY_NAMESPACES, "
                             "comma-separated; default: $POD_NAMESPACE)")
    parser.add_argument("--all-namespaces", "-A", action="store_true",
                        default=_env("ALL_NAMESPACES", "") in ("1", "true", "yes"),
                        help="watch every namespace (FAIRWAY_ALL_NAMESPACES=true)")
    parser.add_argument("--base-configmap", default=_env("BASE_CONFIGMAP",
                                                         defaults.base_configmap),
                        help="ConfigMap with the picker config without tenants "
                             "(FAIRWAY_BASE_CONFIGMAP; default %(default)s)")
    parser.add_argument("--base-key", default=_env("BASE_KEY", defaults.base_key),
                        help="its key (FAIRWAY_BASE_KEY; default %(default)s)")
    parser.add_argument("--output-configmap", default=_env("OUTPUT_CONFIGMAP",
                                                           defaults.output_configmap),
                        help="ConfigMap to write the picker config to "
                             "(FAIRWAY_OUTPUT_CONFIGMAP; default %(default)s)")
    parser.add_argument("--output-key", default=_env("OUTPUT_KEY", defaults.output_key),
                        help="its key (FAIRWAY_OUTPUT_KEY; default %(default)s)")
    parser.add_argument("--admin-address", default=_env("ADMIN_ADDRESS"),
                        help="host:port of the picker's admin API; unset: no live figures in "
                             "status (FAIRWAY_ADMIN_ADDRESS)")
    parser.add_argument("--admin-token-file", type=Path, default=_env("ADMIN_TOKEN_FILE"),
                        help="a file with the picker admin API's bearer token (the chart's "
                             "Secret, mounted; FAIRWAY_ADMIN_TOKEN_FILE)")
    parser.add_argument("--status-interval", default=_env("STATUS_INTERVAL", "10s"),
                        help="how often the live figures are read, e.g. 10s "
                             "(FAIRWAY_STATUS_INTERVAL; default %(default)s)")
    # Dry-run TenantPolicies (fairway.dev/dry-run: "true"): how much of the picker's recent
    # traffic one replays, and for how long (fairway_operator.whatif).
    parser.add_argument("--whatif-minutes", type=float,
                        default=float(_env("WHATIF_MINUTES", str(defaults.whatif_minutes))),
                        help="a dry run replays the picker's last this many minutes "
                             "(FAIRWAY_WHATIF_MINUTES; default %(default)g)")
    parser.add_argument("--whatif-max-records", type=int,
                        default=int(_env("WHATIF_MAX_RECORDS",
                                         str(defaults.whatif_max_records))),
                        help="... at most this many requests, the latest "
                             "(FAIRWAY_WHATIF_MAX_RECORDS; default %(default)d)")
    parser.add_argument("--whatif-timeout", type=float,
                        default=float(_env("WHATIF_TIMEOUT", str(defaults.whatif_timeout))),
                        help="seconds one dry run's replay may take "
                             "(FAIRWAY_WHATIF_TIMEOUT; default %(default)g)")
    parser.add_argument("--whatif-min-requests", type=int,
                        default=int(_env("WHATIF_MIN_REQUESTS",
                                         str(defaults.whatif_min_requests))),
                        help="fewer requests in the window: no prediction, the status says "
                             "so (FAIRWAY_WHATIF_MIN_REQUESTS; default %(default)d)")
    parser.add_argument("--whatif-min-seconds", type=float,
                        default=float(_env("WHATIF_MIN_SECONDS",
                                           str(defaults.whatif_min_seconds))),
                        help="arrivals spanning less: no prediction either "
                             "(FAIRWAY_WHATIF_MIN_SECONDS; default %(default)g)")
    parser.add_argument("--liveness", default=_env("LIVENESS"),
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz "
                             "(FAIRWAY_LIVENESS)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        default=_env("VERBOSE", "") in ("1", "true", "yes"),
                        help="debug logging (FAIRWAY_VERBOSE=true)")
    args = parser.parse_args(argv)

    if not args.pool:
        parser.error("--pool (or FAIRWAY_POOL) is required")
    namespaces = args.namespaces or [n for n in (_env("NAMESPACES") or "").split(",") if n]
    if not namespaces and not args.all_namespaces and os.environ.get("POD_NAMESPACE"):
        namespaces = [os.environ["POD_NAMESPACE"]]
    if not namespaces and not args.all_namespaces:
        parser.error("give --namespace (or FAIRWAY_NAMESPACES, or POD_NAMESPACE), or "
                     "--all-namespaces")
    if namespaces and args.all_namespaces:
        parser.error("--namespace and --all-namespaces exclude each other")
    try:
        interval = parse_duration(args.status_interval, "--status-interval")
        settings = Settings(
            pool=args.pool, namespaces=tuple(dict.fromkeys(namespaces)),
            base_configmap=args.base_configmap, base_key=args.base_key,
            output_configmap=args.output_configmap, output_key=args.output_key,
            admin_address=args.admin_address or None,
            admin_token_file=Path(args.admin_token_file) if args.admin_token_file else None,
            status_interval=interval, whatif_minutes=args.whatif_minutes,
            whatif_max_records=args.whatif_max_records, whatif_timeout=args.whatif_timeout,
            whatif_min_requests=args.whatif_min_requests,
            whatif_min_seconds=args.whatif_min_seconds)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here so that --help works fast and without a cluster.
    import kopf
    import kubernetes.client
    import kubernetes.config

    from fairway_operator.handlers import build_registry, kopf_settings
    from fairway_operator.kube import Kube

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    kube = Kube(kubernetes.client.Configuration.get_default_copy(), settings.kube_timeout)
    registry = build_registry(settings, kube)
    asyncio.run(kopf.operator(
        registry=registry, settings=kopf_settings(settings), standalone=True,
        clusterwide=not settings.namespaces, namespaces=list(settings.namespaces),
        liveness_endpoint=args.liveness))
    return 0


if __name__ == "__main__":
    sys.exit(main())
