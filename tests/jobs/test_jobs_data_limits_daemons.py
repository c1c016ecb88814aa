"""A submission's data globs against a real daemon: the daemon's `jobs.data_max_files` bounds what
one pattern may match, and the walk runs off the event loop, so a daemon busy expanding a large
pattern still answers its control socket."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from swarmd.client import Client, ControlError

pytestmark = pytest.mark.slow

#: Entries of the tree the slow walk looks at: enough for a walk of seconds on a loaded 2-core box
#: (300k entries let 24 status calls through where the test asks for 3; 150k halve the walk and
#: the tree's making and removal).
TREE_DIRS, TREE_FILES = 150, 1000


def spec(name: str, pattern: str) -> dict:
    return {
        "name": name, "seed": 1, "steps": 2,
        "model": {"arch": "transformer-lm", "d_model": 32, "n_heads": 2, "layers_per_stage": 1, "vocab": 256},
        "data": {"files": [pattern], "seq_len": 16},
        "batch": {"global_samples": 4, "microbatch_samples": 2},
        "optim": {"name": "sgd", "lr": 0.05, "schedule": "constant"},
        "pipeline": {"stages": 2},
    }


@pytest.fixture(scope="module")
def daemon(swarm):
    return swarm.start("globs", env={"SWARMD_JOBS_DATA_MAX_FILES": "3", "SWARMD_JOBS_DATA_MAX_ENTRIES": "1000000"})


def test_a_pattern_matching_more_files_than_the_daemon_allows_is_refused(daemon, swarm_root: Path) -> None:
    corpus = swarm_root / "five"
    corpus.mkdir(mode=0o755)
    for i in range(5):
        (corpus / f"{i}.txt").write_text("some text\n" * 50)
    with pytest.raises(ControlError) as refused:
        daemon.client.submit(spec("five", str(corpus / "*.txt")), trainers=0)
    print(refused.value)
    assert refused.value.code == "bad_request"
    assert refused.value.message.startswith("data.files: ") and "more than 3 files (jobs.data_max_files)" in refused.value.message
    for extra in ("3.txt", "4.txt"):
        (corpus / extra).unlink()
    assert daemon.client.submit(spec("three", str(corpus / "*.txt")), trainers=0)["name"] == "three"


def test_the_control_socket_answers_while_a_submission_walks_a_large_tree(daemon, swarm_root: Path) -> None:
    """A pattern that looks at every entry of a 150k-entry tree and matches none. With the walk on
    the event loop, no status call could be answered until the submission's refusal; here several
    are answered while it is still walking."""
    tree = swarm_root / "tree"
    for d in range(TREE_DIRS):
        sub = tree / f"d{d:03}"
        sub.mkdir(parents=True)
        for f in range(TREE_FILES):
            os.mknod(sub / f"f{f}")

    async def scenario() -> tuple[int, str]:
        async with Client(daemon.socket, timeout=120) as submitter, Client(daemon.socket, timeout=30) as watcher:
            walk = asyncio.create_task(submitter.submit(spec("walk", str(tree / "**" / "*.none")), trainers=0))
            answered, refusal = 0, "accepted"
            try:
                while not walk.done():
                    await watcher.status()
                    if not walk.done():
                        answered += 1
                    await asyncio.sleep(0.02)
            finally:
                try:
                    await walk
                except ControlError as exc:
                    refusal = str(exc)
        return answered, refusal

    answered, refusal = asyncio.run(scenario())
    print(f"status calls answered during the walk: {answered}; then: {refusal}")
    assert refusal.startswith("bad_request: data.files: ") and "matches no files" in refusal
    assert answered >= 3
