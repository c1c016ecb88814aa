#!/bin/sh
# Host tools the suite uses beyond the venv, installed before pytest runs (a test never installs
# anything): `systemd-analyze` for tests/daemon/test_systemd_units.py. As root on a Debian-like
# machine without it, this installs it; otherwise it says so, and those tests skip saying why.
set -eu

command -v systemd-analyze >/dev/null && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "test-deps: installing systemd (for systemd-analyze)"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q systemd
else
    echo "test-deps: systemd-analyze is missing (not root or no apt-get): the unit tests skip" >&2
fi
