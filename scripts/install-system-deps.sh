#!/usr/bin/env bash
# System packages the tests need beyond .venv, installed with apt (Debian/Ubuntu), run by
# `make setup`. Idempotent and quiet: does nothing when the tools are already there.
#
#   prometheus, promtool  Debian package `prometheus` (2.42 on Debian 12), for
#                         tests/integration/test_observability.py. apt does not start the
#                         service; the test starts its own Prometheus on 127.0.0.1.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

fail() {
    echo "install-system-deps: $*" >&2
    exit 1
}

command -v apt-get >/dev/null 2>&1 ||
    fail "promtool is missing and apt-get is not available: install Prometheus 2.x" \
         "(prometheus and promtool on PATH) another way"

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        fail "promtool is missing; installing the Debian package prometheus needs root:" \
             "run 'apt-get install -y --no-install-recommends prometheus' as root"
    fi
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
install() {
    ${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends prometheus >>"$log" 2>&1
}

echo "install-system-deps: installing prometheus (apt)"
# Try with the package lists at hand first; refresh them only when that fails.
if ! install; then
    if ! ${as_root[@]+"${as_root[@]}"} apt-get update -q >>"$log" 2>&1 || ! install; then
        cat "$log" >&2
        fail "apt-get could not install prometheus (output above)"
    fi
fi

command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 ||
    fail "the prometheus package installed, but prometheus/promtool are not on PATH"
