#!/usr/bin/env bash
# System packages the tests need beyond .venv, installed with apt (Debian/Ubuntu), run by
# `make setup`. Idempotent and quiet: does nothing when the tools are already there.
#
#   prometheus, promtool  Debian package `prometheus` (2.42 on Debian 12), for
#                         tests/integration/test_observability.py.
#   redis-server          Debian package `redis-server` (7.0 on Debian 12), for the shared state
#                         backend's tests (tests/integration/test_redis_state.py and others).
#   etcd                  Debian package `etcd-server` (3.4), the store of the real API server
#                         the cluster tests start (scripts/cluster.py, tests/cluster/).
#
# apt does not start any of these services here; each test starts its own on 127.0.0.1 and stops it.
set -euo pipefail

# command the package provides -> package
declare -A wanted=([promtool]=prometheus [prometheus]=prometheus [redis-server]=redis-server
                   [etcd]=etcd-server)
missing=()
for command in "${!wanted[@]}"; do
    command -v "$command" >/dev/null 2>&1 || missing+=("${wanted[$command]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)

fail() {
    echo "install-system-deps: $*" >&2
    exit 1
}

command -v apt-get >/dev/null 2>&1 ||
    fail "${packages[*]} missing and apt-get is not available: install them another way"

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        fail "installing the Debian packages ${packages[*]} needs root:" \
             "run 'apt-get install -y --no-install-recommends ${packages[*]}' as root"
    fi
fi

# Another apt (a second checkout's setup, unattended-upgrades at boot) may hold the dpkg lock:
# wait for it rather than fail (apt >= 1.9.11, Debian 11 and later).
apt_wait=(-o DPkg::Lock::Timeout=600)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
install() {
    # policy-rc.d: a package's post-install must not start its service (nothing may listen
    # beyond what a test starts).
    ${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 \
        apt-get "${apt_wait[@]}" install -y -q --no-install-recommends "${packages[@]}" >>"$log" 2>&1
}

echo "install-system-deps: installing ${packages[*]} (apt)"
# Try with the package lists at hand first; refresh them only when that fails.
if ! install; then
    if ! ${as_root[@]+"${as_root[@]}"} apt-get "${apt_wait[@]}" update -q >>"$log" 2>&1 || ! install; then
        cat "$log" >&2
        fail "apt-get could not install ${packages[*]} (output above)"
    fi
fi

for command in "${!wanted[@]}"; do
    command -v "$command" >/dev/null 2>&1 ||
        fail "the packages installed, but $command is not on PATH"
done
