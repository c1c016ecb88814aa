"""The rule tests/conftest.py enforces: a test that starts a process running swarmd code is `slow`."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_an_unmarked_test_starting_python_fails_before_the_process_starts():
    with pytest.raises(AssertionError, match="starts a process .* but is not marked slow"):
        subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=False)
    with pytest.raises(AssertionError, match="not marked slow"):
        subprocess.run(["setpriv", "--reuid=nobody", "swarmctl", "status"], check=False)


def test_a_library_helper_that_is_not_swarmd_code_may_run():
    assert subprocess.run(["true"], check=False).returncode == 0


@pytest.mark.slow
def test_a_slow_test_may_start_python():
    assert subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=False).returncode == 3
