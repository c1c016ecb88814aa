"""Threads a test left running: the rule tests/conftest.py applies after every test, here so that it
can be tested itself (tests/test_thread_check.py)."""

from __future__ import annotations

import threading
import time

#: Threads swarmd names for its own workers (stage compute "stage0_0", auxiliary "stage0-aux_0",
#: the gossip view's "gossip-view_0"): checked even when a library marks them daemon threads.
SWARMD_THREADS = ("stage", "gossip-view")
#: How long a test's own threads get to end after its teardown: a pool shut down without waiting ends
#: its idle threads within milliseconds; one still running by then was left behind.
THREAD_GRACE_S = 2.0


def left_running(before: set[threading.Thread], grace_s: float = THREAD_GRACE_S) -> list[threading.Thread]:
    """Threads started since `before` that still run after up to `grace_s` spent joining them:
    non-daemon threads (they keep the process from exiting) and swarmd's named workers."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()
                and (not t.daemon or t.name.startswith(SWARMD_THREADS))]
        if not left or time.monotonic() >= deadline:
            return left
        left[0].join(deadline - time.monotonic())
