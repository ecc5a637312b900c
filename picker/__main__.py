"""``python -m picker serve --config FILE``: run the fairway Endpoint Picker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from picker.errors import ConfigError
from picker.server import RunnerFailed, ServeSettings, serve
from picker.tls import CLIENT_AUTH_MODES
from picker.workers import CONNECTION_AGE, run_workers, workers_problem

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    """A Go-style boolean flag value (``--secure-serving=false``, as upstream spells it)."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the Endpoint Picker (ext_proc gRPC)")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="picker config YAML (watched)")
    source.add_argument("--config-map", metavar="NAMESPACE/NAME",
                        help="a ConfigMap whose picker.yaml is the config, watched through the "
                             "Kubernetes API")
    run.add_argument("--pool", metavar="NAMESPACE/NAME",
                     help="InferencePool whose ready pods are the endpoints")
    run.add_argument("--lease", metavar="NAMESPACE/NAME",
                     help="leader election on this Lease: only the leader serves")
    run.add_argument("--kube-server", metavar="URL",
                     help="Kubernetes API URL (default: in-cluster, else kubeconfig)")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--grpc-port", type=int, default=9002,
                     help="ext_proc (TLS unless --secure-serving=false) and its gRPC health")
    run.add_argument("--grpc-health-port", type=int, default=9003,
                     help="gRPC health, plaintext: liveness, readiness, the ext_proc service")
    run.add_argument("--metrics-port", type=int, default=9090)
    run.add_argument("--admin-port", type=int, default=9004,
                     help="read-only admin API, fairway.v1.Admin (0: any free port)")
    run.add_argument("--secure-serving", type=_bool, nargs="?", const=True, default=True,
                     metavar="BOOL",
                     help="serve ext_proc over TLS (default true; --secure-serving=false: "
                          "plaintext)")
    run.add_argument("--cert-path", type=Path, metavar="DIR",
                     help="tls.crt and tls.key for ext_proc (a mounted TLS Secret), reloaded "
                          "when they change; default: self-signed at start")
    run.add_argument("--client-ca", type=Path, metavar="FILE",
                     help="PEM CA certificates: ext_proc clients (the gateway) must present a "
                          "certificate they signed (mTLS); reloaded when the file changes")
    run.add_argument("--client-name", action="append", default=[], metavar="NAME",
                     help="with --client-ca: the client certificate must carry this name (a SAN "
                          "or its CN); repeat for several")
    run.add_argument("--client-auth", choices=CLIENT_AUTH_MODES,
                     help="who may speak ext_proc: mtls (the default with --client-ca), none "
                          "(the default without: no client certificate, and while "
                          "tenancy.mode is header every stream is refused, since a tenant "
                          "header is believed only from an authenticated gateway), "
                          "trust-network (development: tenant headers believed from anyone "
                          "who reaches the port)")
    run.add_argument("--admin-token-file", type=Path, metavar="FILE",
                     help="a file (mounted Secret) with the bearer token every admin API call "
                          "must send; needed on an address beyond loopback")
    run.add_argument("--metrics-token-file", type=Path, metavar="FILE",
                     help="a file (mounted Secret) with the bearer token a scrape of /metrics "
                          "must send (the page names every tenant)")
    run.add_argument("--admin-auth", choices=("token", "none"),
                     help="none: serve the admin API without a token on a non-loopback "
                          "--host (whoever reaches it lists every tenant)")
    run.add_argument("--identity", metavar="NAME",
                     help="this replica's name (Lease holder, self-signed certificate); "
                          "default $POD_NAME")
    run.add_argument("--grace", type=float, default=130.0,
                     help="seconds running requests get to finish on SIGTERM (default 130)")
    run.add_argument("--workers", type=int, default=1, metavar="N",
                     help="serve over N processes sharing the ext_proc port (SO_REUSEPORT), "
                          "one per core; needs state.backend redis (default 1)")
    run.add_argument("--connection-age", type=float, default=CONNECTION_AGE, metavar="SECONDS",
                     help="with --workers: a worker asks a gateway connection to be dialled "
                          "again after this long, so connections spread over the workers "
                          f"(default {CONNECTION_AGE:g})")
    run.add_argument("--log-level", default="INFO")
    run.add_argument("--trace", type=Path, metavar="FILE",
                     help="write the picker's view of its endpoints to FILE, a JSON line every "
                          "5 ms (benchmarks; off by default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1:
        parser.error("--workers must be 1 or more")
    if args.trace is not None and args.workers > 1:
        parser.error("--trace needs --workers 1 (one process writes the file)")
    try:
        settings = ServeSettings(
            config_path=args.config, host=args.host, grpc_port=args.grpc_port,
            grpc_health_port=args.grpc_health_port, metrics_port=args.metrics_port,
            admin_port=args.admin_port, secure_serving=args.secure_serving,
            cert_path=args.cert_path, client_ca=args.client_ca,
            client_names=tuple(args.client_name), client_auth=args.client_auth,
            admin_token_file=args.admin_token_file, admin_auth=args.admin_auth,
            metrics_token_file=args.metrics_token_file,
            grace=args.grace, config_map=args.config_map,
            pool=args.pool, lease=args.lease, identity=args.identity,
            kube_server=args.kube_server, trace=args.trace)
        problem = settings.exposure_problem()
    except ValueError as exc:
        parser.error(str(exc))
    if problem:
        parser.error(problem)
    problem = workers_problem(settings, args.workers, args.connection_age) \
        if args.workers > 1 else None
    if problem:
        parser.error(problem)
    try:
        if args.workers > 1:
            asyncio.run(run_workers(settings, args.workers, args.log_level.upper(),
                                    connection_age=args.connection_age))
        else:
            asyncio.run(serve(settings))
    except ConfigError as exc:
        print(f"{args.config or args.config_map}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a malformed namespace/name
        print(f"picker: {exc}", file=sys.stderr)
        return 2
    except RunnerFailed as exc:  # logged with its traceback as it happened
        print(f"picker: stopped: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # a port in use, an address not available
        print(f"picker: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
