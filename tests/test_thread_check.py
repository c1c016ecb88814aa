"""The rule tests/conftest.py applies after every test: which threads count as left running."""

from __future__ import annotations

import threading

from threads import left_running


def started(name: str, daemon: bool) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, args=(10,), name=name, daemon=daemon)
    thread.start()
    return thread, stop


def test_a_non_daemon_thread_and_a_swarmd_worker_are_left_running_a_library_daemon_thread_is_not():
    before = set(threading.enumerate())
    threads = [started("leaked", False), started("stage3_0", True), started("library", True)]
    try:
        assert sorted(t.name for t in left_running(before, grace_s=0.05)) == ["leaked", "stage3_0"]
    finally:
        for thread, stop in threads:
            stop.set()
            thread.join()


def test_a_thread_ending_within_the_grace_is_waited_for_not_reported():
    before = set(threading.enumerate())
    thread, stop = started("ending", False)
    threading.Timer(0.05, stop.set).start()
    assert left_running(before, grace_s=5) == []
    assert not thread.is_alive()
