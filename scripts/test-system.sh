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

# A mirror that answers badly once (a half-synced index, a dropped connection) is common enough
# that one retry of each apt step separates a flaky network from a real failure.
apt_retry() {
    "$@" || { echo "test-system: '$*' failed; retrying once in 10 s" >&2; sleep 10; "$@"; }
}

if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null || ! command -v ip >/dev/null; then
    apt_retry apt-get update -q
    apt_retry env DEBIAN_FRONTEND=noninteractive apt-get install -y -q systemd-container debootstrap iproute2
fi
for tool in systemd-nspawn debootstrap ip nsenter flock; do
    if ! command -v "$tool" >/dev/null; then
        echo "test-system: '$tool' is still missing after installing the host packages" >&2
        exit 2
    fi
done

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
# pytest's status passes through: 5 (nothing collected) fails the run like a failed test does.
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/system "$@"
