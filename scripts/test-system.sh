#!/bin/sh
# The real-systemd tests (tests/system): swarmd's units inside systemd-nspawn containers.
# Sets a fresh Debian machine up by itself (root): the host tools, the cached container image
# (debootstrap + dependency venv, minutes the first time, seconds afterwards), then pytest.
# The image lives in $SWARMD_TEST_CACHE (default /var/cache/swarmd-test); see docs/testing-system.md.
set -eu

cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "test-system: must run as root (it mounts overlays, makes cgroups and network namespaces)" >&2
    exit 2
fi

if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q systemd-container debootstrap
fi

[ -x .venv/bin/python ] || make .venv/.installed

cache="${SWARMD_TEST_CACHE:-/var/cache/swarmd-test}"
mkdir -p "$cache"
# One run at a time on the host, whatever its cache: containers, namespaces and cgroups have fixed names.
lock=/run/lock/swarmd-test-system.lock
mkdir -p /run/lock
exec 9>"$lock"
if ! flock -n 9; then
    echo "test-system: another run holds $lock" >&2
    exit 1
fi

.venv/bin/python tests/system/nspawn.py prepare
export SWARMD_SYSTEM_TESTS=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/system "$@"
