"""Real `swarmd` processes for the daemon tests (tests/_support/daemons.py), always killed at the end."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
from daemons import Spawner, run_swarmctl

# Below the ephemeral range: an OS-assigned port can be taken by an outgoing connection before the
# daemon that was told it binds it.
from swarmd.swarmproc import free_port


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture(scope="module")
def spawn_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    """Like `spawn`, for daemons shared by the tests of one module."""
    spawner = Spawner(tmp_path_factory.mktemp("daemons"))
    try:
        yield spawner
    finally:
        spawner.close()


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture
def swarmctl() -> Callable[..., subprocess.CompletedProcess[str]]:
    """swarmctl(*args, env=..., prefix=("setpriv", ...)) runs the console script, output captured."""
    return run_swarmctl
