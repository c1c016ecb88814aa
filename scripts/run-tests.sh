#!/bin/sh
# `make test`: the whole suite in two phases, so it fits the 2-core machine's 12 minutes.
#
# 1. Every test not marked `serial`, on $TEST_WORKERS pytest-xdist workers (default 2), a test
#    file's tests kept together on one worker (`--dist loadfile`: module fixtures are built once).
#    Most multi-daemon tests spend their time waiting (timeouts, round trips, DHT refreshes), so
#    two at once take little longer than one.
# 2. The tests marked `serial`, one at a time: those whose assertion compares speeds measured in
#    the run (a CPU quota's effect, a rejoin within a short run), which a second worker's load
#    would skew.
#
# Both phases always run; the exit status is the first failing phase's. Each lists its slowest
# tests. The base temp folder is short so every Unix socket path under a test's tmp_path (a
# worker's subfolder included) stays within AF_UNIX's 107 bytes; it is removed when both pass.
set -u
PYTEST="${PYTEST:-.venv/bin/python -m pytest -q -p no:cacheprovider}"
WORKERS="${TEST_WORKERS:-2}"
BASE="$(mktemp -d /tmp/st.XXXXXX)"

echo "== tests: phase 1 of 2: everything not marked serial, on $WORKERS workers"
$PYTEST -n "$WORKERS" --dist loadfile -m "not serial" --basetemp="$BASE/p" --durations=10 "$@" tests
first=$?
echo "== tests: phase 2 of 2: the tests marked serial, one at a time"
$PYTEST -m serial --basetemp="$BASE/s" --durations=10 "$@" tests
second=$?

if [ "$first" -ne 0 ]; then
    echo "== tests: phase 1 failed (pytest exit status $first); temp files kept in $BASE" >&2
    exit "$first"
fi
if [ "$second" -ne 0 ]; then
    echo "== tests: phase 2 failed (pytest exit status $second); temp files kept in $BASE" >&2
    exit "$second"
fi
rm -rf "$BASE"
